#!/usr/bin/env bash
# Compile check of the CUDA kernels (csrc/cuda/*.cu) against the CUDA build of torch, for
# sm_90, on a machine without a GPU. CI runs it in a step of its own so that a .cu that
# does not compile never lands.
#
#   1. a venv with torch==2.14.1 (the CUDA 13.0 build; pip takes it from local disk, ~5 GB),
#      created if missing, reused if present;
#   2. the whole extension slimfit._C (C++ CPU part + CUDA part) built from a copy of the
#      sources in a temporary folder (the work tree gets no build/ and no .so);
#   3. the .so must hold an sm_90 cubin (+ compute_90 PTX) with the quantize/dequantize
#      kernels (cuobjdump; without it, the fatbin is read directly);
#   4. loading it must register slimfit::quantize / slimfit::dequantize for the CUDA key.
# Any failure exits non-zero.
#
# Environment:
#   SLIMFIT_CUDA_VENV           venv to use or create (default: <repo>/.venv-cuda)
#   SLIMFIT_CUDA_TORCH_VERSION  torch version of that venv (default: 2.14.1)
#   TORCH_CUDA_ARCH_LIST        archs to compile (default: 9.0; setup.py adds PTX for the newest)
#   CUDA_HOME                   CUDA toolkit (default: the one nvcc on PATH reports, /usr/local/cuda)
#   MAX_JOBS                    parallel compile jobs (default: 2)
#   SLIMFIT_KEEP_BUILD=1        keep the temporary build folder (its path is printed)
#   SLIMFIT_CUDA_CHECK_OPTIONAL=1  exit 0 with a notice when no CUDA toolkit is installed
set -euo pipefail

cd "$(dirname "$0")/.."
REPO="$(pwd)"
T0=$(date +%s)
say() { echo "[check_cuda_build +$(( $(date +%s) - T0 ))s] $*"; }
fail() { echo "[check_cuda_build] FAILED: $*" >&2; exit 1; }

VENV="${SLIMFIT_CUDA_VENV:-$REPO/.venv-cuda}"
TORCH_VERSION="${SLIMFIT_CUDA_TORCH_VERSION:-2.14.1}"
ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
JOBS="${MAX_JOBS:-2}"
# The sm number of every arch listed ("8.0;9.0+PTX" -> "80 90"), to look for in the .so.
SMS="$(echo "$ARCH_LIST" | tr ';, ' '\n\n\n' | sed -n 's/^\([0-9][0-9]*\)\.\([0-9]\)[af]\{0,1\}\(+PTX\)\{0,1\}$/\1\2/p' | sort -u | tr '\n' ' ')"
[ -n "$SMS" ] || fail "TORCH_CUDA_ARCH_LIST='$ARCH_LIST': give numeric archs such as 9.0 or '8.0;9.0'"

# ---------------------------------------------------------------- toolkit
NVCC=""
if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then NVCC="$CUDA_HOME/bin/nvcc"
elif command -v nvcc >/dev/null 2>&1; then NVCC="$(command -v nvcc)"
elif [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc
fi
if [ -z "$NVCC" ]; then
  if [ "${SLIMFIT_CUDA_CHECK_OPTIONAL:-0}" = "1" ]; then
    say "no CUDA toolkit (nvcc) on this machine; SLIMFIT_CUDA_CHECK_OPTIONAL=1, so skipping the check"
    exit 0
  fi
  fail "no CUDA toolkit found (nvcc not on PATH, CUDA_HOME unset, no /usr/local/cuda)"
fi
say "nvcc: $NVCC ($("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"

# ---------------------------------------------------------------- venv with the CUDA build of torch
if [ ! -x "$VENV/bin/python" ]; then
  say "creating venv $VENV"
  python3 -m venv "$VENV"
else
  say "reusing venv $VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
have_torch="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [ "${have_torch%%+*}" != "$TORCH_VERSION" ]; then
  say "installing torch==$TORCH_VERSION (the CUDA build, ~5 GB; a few minutes)"
  "${PIP[@]}" install -q "torch==$TORCH_VERSION"
fi
if ! "$PY" -c 'import ninja, setuptools, wheel, numpy' 2>/dev/null; then
  say "installing the build tools (setuptools, wheel, ninja, numpy)"
  "${PIP[@]}" install -q setuptools wheel ninja numpy
fi
TORCH_CUDA="$("$PY" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null)"
[ -n "$TORCH_CUDA" ] || fail "torch in $VENV is a CPU build ($("$PY" -c 'import torch; print(torch.__version__)')); the check needs a CUDA build"
say "torch $("$PY" -c 'import torch; print(torch.__version__)') (CUDA $TORCH_CUDA)"

# cuobjdump lists the cubins of the .so. The toolkit here has none; the pip package has it.
CUOBJDUMP=""
for c in "$(dirname "$NVCC")/cuobjdump" "${CUDA_HOME:-/usr/local/cuda}/bin/cuobjdump" "$(command -v cuobjdump || true)"; do
  if [ -n "$c" ] && [ -x "$c" ]; then CUOBJDUMP="$c"; break; fi
done
if [ -z "$CUOBJDUMP" ]; then
  find_pip_cuobjdump() { "$PY" - <<'EOF'
import glob, os, sys
for p in sys.path:
    for c in sorted(glob.glob(os.path.join(p, "nvidia", "*", "bin", "cuobjdump"))):
        if os.access(c, os.X_OK):
            print(c)
            raise SystemExit
EOF
  }
  CUOBJDUMP="$(find_pip_cuobjdump)"
  if [ -z "$CUOBJDUMP" ]; then
    major="${TORCH_CUDA%%.*}"
    say "installing cuobjdump (pip nvidia-cuda-cuobjdump, CUDA $major.x)"
    "${PIP[@]}" install -q "nvidia-cuda-cuobjdump>=$major,<$((major + 1))" 2>/dev/null \
      || say "could not install nvidia-cuda-cuobjdump; will read the fatbin directly"
    CUOBJDUMP="$(find_pip_cuobjdump)"
  fi
fi

# ---------------------------------------------------------------- build in a temporary folder
WORK="$(mktemp -d "${TMPDIR:-/tmp}/slimfit-cuda-build.XXXXXX")"
cleanup() {
  if [ "${SLIMFIT_KEEP_BUILD:-0}" = "1" ]; then echo "[check_cuda_build] build kept in $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
mkdir -p "$WORK/src"
files=(setup.py pyproject.toml csrc slimfit)
[ -f README.md ] && files+=(README.md)
tar -cf - --exclude='*.so' --exclude='__pycache__' --exclude='*.egg-info' "${files[@]}" | tar -xf - -C "$WORK/src"
ls "$WORK"/src/csrc/cuda/*.cu >/dev/null 2>&1 || fail "no CUDA sources in csrc/cuda/"
say "building slimfit._C in $WORK/src for TORCH_CUDA_ARCH_LIST=$ARCH_LIST (MAX_JOBS=$JOBS): $(cd "$WORK/src" && ls csrc/*.cpp csrc/cpu/*.cpp csrc/cuda/*.cu 2>/dev/null | tr '\n' ' ')"
LOG="$WORK/build.log"
set +e
(cd "$WORK/src" && unset SLIMFIT_SKIP_NATIVE SLIMFIT_SKIP_CUDA && \
  TORCH_CUDA_ARCH_LIST="$ARCH_LIST" MAX_JOBS="$JOBS" "$PY" setup.py build_ext --inplace) >"$LOG" 2>&1
rc=$?
set -e
grep '^slimfit:' "$LOG" | sed 's/^/    /' || true
if [ $rc -ne 0 ]; then
  echo "---- compiler errors (full log below) ----" >&2
  grep -E -B2 -A6 '(error|Error)[: ]' "$LOG" | head -150 >&2 || true
  echo "---- last lines of the build log ----" >&2
  tail -60 "$LOG" >&2
  fail "the build exited with status $rc"
fi
grep -q '^slimfit: compiling CUDA sources' "$LOG" || fail "setup.py built the CPU part only (see the 'slimfit:' lines above)"
for sm in $SMS; do
  grep -q -- "-gencode=arch=compute_$sm,code=sm_$sm" "$LOG" || fail "nvcc was not asked for sm_$sm"
done
SO="$(ls "$WORK"/src/slimfit/_C*.so 2>/dev/null | head -1)"
[ -n "$SO" ] || fail "no slimfit/_C*.so produced"
say "built $(basename "$SO") ($(du -h "$SO" | cut -f1))"

# ---------------------------------------------------------------- cubins in the .so
KERNELS="$WORK/kernels.txt"
if [ -n "$CUOBJDUMP" ]; then
  say "cuobjdump: $CUOBJDUMP"
  "$CUOBJDUMP" --list-elf "$SO" | sed 's/^/    /'
  "$CUOBJDUMP" --list-ptx "$SO" | sed 's/^/    /'
  for sm in $SMS; do
    "$CUOBJDUMP" --list-elf "$SO" | grep -q "\.sm_$sm\.cubin" || fail "no sm_$sm cubin in the .so"
  done
  "$CUOBJDUMP" --list-text "$SO" >"$KERNELS" || fail "cuobjdump --list-text failed"
else
  say "no cuobjdump: reading the .nv_fatbin section of the .so"
  "$PY" - "$SO" "$SMS" >"$KERNELS" <<'EOF' || fail "the fatbin check failed"
# Fatbin layout: header {u32 magic 0xBA55ED50, u16 version, u16 header size, u64 size},
# then entries {u16 kind (1 PTX, 2 ELF), u16, u32 header size, u64 payload size, ...,
# u32 sm arch at byte 28}. Cubins are stored uncompressed; kernel names are read from the
# cubins' symbol names (.text.<kernel> sections).
import re, struct, sys

so = open(sys.argv[1], "rb").read()
want = set(sys.argv[2].split())
shoff = struct.unpack_from("<Q", so, 0x28)[0]
shentsize, shnum, shstrndx = struct.unpack_from("<HHH", so, 0x3A)
secs = [struct.unpack_from("<IIQQQQ", so, shoff + i * shentsize) for i in range(shnum)]
stroff = secs[shstrndx][4]
name = lambda o: so[stroff + o: so.index(b"\0", stroff + o)].decode()
fat = [s for s in secs if name(s[0]) == ".nv_fatbin"]
if not fat:
    sys.exit("no .nv_fatbin section: no device code in the .so")
data = so[fat[0][4]: fat[0][4] + fat[0][5]]
elf_archs, ptx_archs, names = set(), set(), set()
pos = 0
while pos + 16 <= len(data):
    magic, _ver, hsz, size = struct.unpack_from("<IHHQ", data, pos)
    if magic != 0xBA55ED50:
        pos += 8
        continue
    e = pos + hsz
    while e < pos + hsz + size:
        kind, _, ehsz, psz = struct.unpack_from("<HHIQ", data, e)
        arch = struct.unpack_from("<I", data, e + 28)[0]
        payload = data[e + ehsz: e + ehsz + psz]
        if kind == 2:
            elf_archs.add(str(arch))
            if payload[:4] == b"\x7fELF":
                for m in re.finditer(rb"\.text\.([A-Za-z0-9_]+)", payload):
                    names.add(m.group(1).decode())
        elif kind == 1:
            ptx_archs.add(str(arch))
        e += ehsz + psz
    pos += hsz + size
print(f"# cubins for sm_{sorted(elf_archs)}, PTX for compute_{sorted(ptx_archs)}", file=sys.stderr)
missing = want - elf_archs
if missing:
    sys.exit(f"no cubin for sm_{sorted(missing)}")
for n in sorted(names):
    print(n)
EOF
fi
nq="$(grep -c 'quantize_kernel' "$KERNELS" || true)"
nd="$(grep -c 'dequantize_kernel' "$KERNELS" || true)"
nq=$(( nq - nd ))
say "device kernels in the .so: $nq quantize_kernel, $nd dequantize_kernel instantiations"
[ "$nq" -gt 0 ] && [ "$nd" -gt 0 ] || fail "the quantize/dequantize kernels are missing from the device code"

# ---------------------------------------------------------------- registrations
say "loading the .so: registrations of slimfit::quantize / dequantize for CUDA"
(cd "$WORK" && PYTHONPATH="$WORK/src" SLIMFIT_BACKEND=auto "$PY" - "$WORK/src" <<'EOF') || fail "the CUDA kernels are not registered"
import os, sys, warnings
warnings.simplefilter("ignore")
import torch
import slimfit.kernels as K

root = sys.argv[1]
assert os.path.realpath(K.__file__).startswith(os.path.realpath(root)), f"imported slimfit from {K.__file__}"
info = K.backend_info()
assert info["native_error"] is None, info["native_error"]
for op in ("quantize", "dequantize"):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"slimfit::{op}", "CUDA"), f"slimfit::{op}: no CUDA kernel"
    dump = torch._C._dispatch_dump(f"slimfit::{op}")
    line = next((l for l in dump.splitlines() if l.startswith("CUDA:")), "")
    assert "quantize.cu" in line, f"slimfit::{op}: the CUDA kernel is not the extension's: {line!r}"
    print("    " + line.split(" :: ")[0])
print(f"    cuda_extension_ops: {info['cuda_extension_ops']}")
EOF
SM_LIST="$(for sm in $SMS; do printf 'sm_%s ' "$sm"; done)"
say "OK: the CUDA sources compile for ${SM_LIST% } against torch $TORCH_VERSION and register their kernels ($(( $(date +%s) - T0 ))s)"
