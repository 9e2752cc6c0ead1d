#!/usr/bin/env bash
# Which C++ compilers the GPU image has, and whether slimfit._C raises a C++ argument error as a Python
# exception (not a crash) with the C++ runtime of the compiler that built it preloaded.
#   bash scripts/gpu_native_diag.sh     (after scripts/gpu_session.sh build)
PY="${PYTHON:-python3}"
ls -la /usr/bin/g++* /usr/bin/gcc* /usr/bin/c++ 2>&1 | head
for cxx in /opt/gcc/bin/g++ /usr/bin/g++; do [ -x "$cxx" ] && echo "$cxx: $($cxx --version | head -1)"; done
so=$(ls slimfit/_C*.so 2>/dev/null | head -1)
[ -n "$so" ] && ldd "$so" | grep -E "stdc\+\+|gcc_s"
"$PY" -c "import torch, os; d=os.path.dirname(torch.__file__); print('torch lib:', d)"
code='import torch, slimfit.kernels
try:
    torch.ops.slimfit.quantize(torch.randn(64), 3, 32, False, 0)
except Exception as e:
    print("raised", type(e).__name__, str(e)[:100])'
"$PY" -c "$code"; echo "plain: rc $?"
lib=$(/opt/gcc/bin/g++ -print-file-name=libstdc++.so.6 2>/dev/null)
[ -f "$lib" ] && { LD_PRELOAD="$lib" "$PY" -c "$code"; echo "LD_PRELOAD=$lib: rc $?"; }
