#!/usr/bin/env bash
# The GPU checks in few long commands, for a machine with a CUDA device whose python3 already has a
# CUDA build of torch, triton, transformers, peft and pytest (and no package registry).
#
#   bash scripts/gpu_session.sh build     # build slimfit._C in place (C++ + CUDA), print `slimfit env`
#   bash scripts/gpu_session.sh test      # build, then the GPU tests and every test parametrized over cuda
#   bash scripts/gpu_session.sh kernels   # build, then python -m bench.kernels --device cuda
#   bash scripts/gpu_session.sh e2e       # build, then python -m bench.e2e --device cuda (BERT-base, ViT-B/16, batch 128)
#   bash scripts/gpu_session.sh all       # one lease: build, e2e, frontier (SmolLM2 seq 2048), kernels, tests, the
#                                         # held Adam step (bench.held_adam_step --device cuda), each
#                                         # stage under its own time limit; everything also packed into
#                                         # $RESULTS/gpu_results.tgz after every stage (a stopped run keeps it)
#
# Results and logs go to $RESULTS (default: $OUT when set, else bench/results). The build is in place
# (slimfit/_C*.so, build/: both git-ignored), so a later stage on the same machine only relinks.
# Environment: PYTHON (default python3), TORCH_CUDA_ARCH_LIST (default 9.0), MAX_JOBS (default nproc),
# SLIMFIT_CXX (the C++ compiler of the build; default /usr/bin/gcc and g++ where they exist, whatever CC/CXX
# say: on the lent H200 the image's compiler, /opt/gcc/bin/g++, built an extension whose every TORCH_CHECK
# error killed the process with a segmentation fault, and the system g++ one raised them as RuntimeErrors,
# as did that extension with the system libstdc++ preloaded; `all` checks it first; gpu_native_diag.sh).
# `all` reads: STAGES (default "tests e2e frontier kernels held_adam"), HELD_ADAM_MODELS, TEST_PATHS, TEST_K, KERNEL_OPS
# (bench.kernels --ops), FRONTIER_CASES, FRONTIER_METHODS, FRONTIER_DTYPES, the budgets below.
set -euo pipefail
cd "$(dirname "$0")/.."
stage="${1:-}"
PY="${PYTHON:-python3}"
RESULTS="${RESULTS:-${OUT:-bench/results}}"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"

case "$stage" in build|test|kernels|e2e|all) ;; *)
  echo "usage: bash scripts/gpu_session.sh build|test|kernels|e2e|all" >&2; exit 2 ;;
esac
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu_session.sh: $PY's torch sees no CUDA device; run this on the GPU machine" >&2; exit 1; }

# The H200 image sets CXX to /opt/gcc/bin/g++ (its build log named it while /usr/bin/g++ existed): the system
# compiler wins unless SLIMFIT_CXX names one.
if [ -n "${SLIMFIT_CXX:-}" ]; then export CXX="$SLIMFIT_CXX"
elif [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
if ! TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" timeout "${BUILD:-150}" \
     "$PY" setup.py build_ext --inplace >"$RESULTS/gpu_build.log" 2>&1; then
  tail -40 "$RESULTS/gpu_build.log"; echo "gpu_session.sh: the build failed (log: $RESULTS/gpu_build.log)" >&2
  [ "$stage" = all ] || exit 1  # all: go on with the Triton kernels alone, the lease is short
fi
grep -E "^slimfit:" "$RESULTS/gpu_build.log" || true
{ "$PY" -m slimfit.cli env; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; \
  "$PY" -c "import torch, triton, transformers; print(torch.__version__, torch.version.cuda, triton.__version__, \
transformers.__version__)"; } 2>&1 | tee "$RESULTS/gpu_env.txt" || true

case "$stage" in
  test)
    # -m "gpu or not gpu": the GPU-only tests and every test whose device fixture now includes cuda.
    "$PY" -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/kernels tests/autograd \
      2>&1 | tee "$RESULTS/gpu_pytest.log" | tail -25 ;;
  kernels)
    "$PY" -m bench.kernels --device cuda --out-dir "$RESULTS" 2>&1 | tee "$RESULTS/gpu_kernels.log" ;;
  e2e)
    "$PY" -m bench.e2e --device cuda --repeats 5 --out-dir "$RESULTS" 2>&1 | tee "$RESULTS/gpu_e2e.log" ;;
  all)
    # Budgets in seconds (the lease is short: the most wanted numbers first): E2E, FRONTIER, KERNELS, TESTS.
    # PACK_DIR: where the packed results go (the device tool brings back few files: give it $OUT, RESULTS elsewhere)
    pack_dir="${PACK_DIR:-$RESULTS}"
    pack() { tar czf "$pack_dir/gpu_results.tgz.part" -C "$RESULTS" --exclude='gpu_results.tgz*' . \
               && mv "$pack_dir/gpu_results.tgz.part" "$pack_dir/gpu_results.tgz"; }
    run_stage() {  # name budget command...: the stage's output in $RESULTS/gpu_<name>.log, its exit status noted
      local name="$1" budget="$2"; shift 2
      local t0; t0=$(date +%s)
      echo "== $name (at most ${budget} s)"
      local rc=0
      timeout --kill-after=10 "$budget" "$@" >"$RESULTS/gpu_$name.log" 2>&1 || rc=$?
      echo "== $name: rc $rc in $(( $(date +%s) - t0 )) s" | tee -a "$RESULTS/gpu_stages.txt"
      pack
    }
    run_stage native_errors 30 "$PY" -c "
import subprocess, sys
code = ('import torch, slimfit.kernels\\ntry:\\n    torch.ops.slimfit.quantize(torch.randn(64), 3, 32, False, 0)\\n'
        'except Exception as e:\\n    print(type(e).__name__, str(e)[:120])')
r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
print('native argument error in a child process: rc', r.returncode, r.stdout.strip(), r.stderr.strip()[-300:])
sys.exit(r.returncode)"
    cat "$RESULTS/gpu_native_errors.log"
    stages="${STAGES:-tests e2e frontier kernels held_adam}"   # which stages, in this order
    for stage_name in $stages; do case "$stage_name" in
      tests) run_stage tests "${TESTS:-140}" "$PY" -m pytest -q -p no:cacheprovider -n 12 --timeout 100 \
               -m "gpu or not slow" ${TEST_K:+-k "$TEST_K"} \
               ${TEST_PATHS:-tests/kernels tests/autograd tests/test_no_host_sync.py tests/test_step_memory.py tests/optim/test_optim_cuda.py tests/optim/test_chunked_step_cuda.py tests/patching/test_experts_cuda.py} ;;
      e2e) methods=sdpa,grad-ckpt,lora-r8,slimfit-exact,slimfit-paper,slimfit-aggressive,slimfit-paper+lora
           run_stage e2e "${E2E:-140}" "$PY" -m bench.e2e --device cuda --cuda-rep-ms 300 --methods "$methods" \
             --out-dir "$RESULTS" ;;
      frontier)
        peers=sdpa,grad-ckpt,lora-r8,lora-r8+ckpt,slimfit-exact,slimfit-paper,slimfit-aggressive
        for dtype in ${FRONTIER_DTYPES:-bf16 fp32}; do
          run_stage "frontier_$dtype" "${FRONTIER:-45}" "$PY" -m bench.frontier --device cuda --dtype "$dtype" \
            --cases "${FRONTIER_CASES:-smollm2-2048}" --cuda-rep-ms 300 --out "$RESULTS" \
            --methods "${FRONTIER_METHODS:-$peers,slimfit-paper+lora,slimfit-paper+lora+ckpt}"
        done ;;
      kernels) run_stage kernels "${KERNELS:-45}" "$PY" -m bench.kernels --device cuda --out-dir "$RESULTS" \
                 ${KERNEL_OPS:+--ops "$KERNEL_OPS"} ;;
      held_adam) run_stage held_adam "${HELD_ADAM:-60}" "$PY" -m bench.held_adam_step --device cuda \
                   --models "${HELD_ADAM_MODELS:-bert-base,smollm2-135m,qwen2.5-0.5b}" --out "$RESULTS" ;;
      *) echo "gpu_session.sh: unknown stage $stage_name (of: tests e2e frontier kernels held_adam)" >&2 ;;
    esac; done
    set +e  # the summary: whatever exists
    echo; tail -4 "$RESULTS/gpu_tests.log"; grep -E "^FAILED|^ERROR" "$RESULTS/gpu_tests.log" | head -30
    for f in "$RESULTS"/e2e_gpu.md "$RESULTS"/frontier_gpu.md "$RESULTS"/held_adam_step_gpu.md; do
      [ -f "$f" ] && cat "$f"; done
    tail -25 "$RESULTS/gpu_kernels.log"; cat "$RESULTS/gpu_stages.txt"; true ;;
esac
