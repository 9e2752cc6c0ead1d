#!/usr/bin/env bash
# The GPU checks in few long commands, for a machine with a CUDA device whose python3 already has a
# CUDA build of torch, triton, transformers, peft and pytest (and no package registry).
#
#   bash scripts/gpu_session.sh build     # build slimfit._C in place (C++ + CUDA), print `slimfit env`
#   bash scripts/gpu_session.sh test      # build, then the GPU tests and every test parametrized over cuda
#   bash scripts/gpu_session.sh kernels   # build, then python -m bench.kernels --device cuda
#   bash scripts/gpu_session.sh e2e       # build, then python -m bench.e2e --device cuda (BERT-base, ViT-B/16, batch 128)
#
# Results and logs go to $RESULTS (default: $OUT when set, else bench/results). The build is in place
# (slimfit/_C*.so, build/: both git-ignored), so a later stage on the same machine only relinks.
# Environment: PYTHON (default python3), TORCH_CUDA_ARCH_LIST (default 9.0), MAX_JOBS (default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
stage="${1:-}"
PY="${PYTHON:-python3}"
RESULTS="${RESULTS:-${OUT:-bench/results}}"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"

case "$stage" in build|test|kernels|e2e) ;; *)
  echo "usage: bash scripts/gpu_session.sh build|test|kernels|e2e" >&2; exit 2 ;;
esac
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu_session.sh: $PY's torch sees no CUDA device; run this on the GPU machine" >&2; exit 1; }

if ! TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
     "$PY" setup.py build_ext --inplace >"$RESULTS/gpu_build.log" 2>&1; then
  tail -40 "$RESULTS/gpu_build.log"; echo "gpu_session.sh: the build failed (log: $RESULTS/gpu_build.log)" >&2; exit 1
fi
grep -E "^slimfit:" "$RESULTS/gpu_build.log" || true
"$PY" -m slimfit.cli env | tee "$RESULTS/gpu_env.txt"

case "$stage" in
  test)
    # -m "gpu or not gpu": the GPU-only tests and every test whose device fixture now includes cuda.
    "$PY" -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/kernels tests/autograd \
      2>&1 | tee "$RESULTS/gpu_pytest.log" | tail -25 ;;
  kernels)
    "$PY" -m bench.kernels --device cuda --out-dir "$RESULTS" 2>&1 | tee "$RESULTS/gpu_kernels.log" ;;
  e2e)
    "$PY" -m bench.e2e --device cuda --repeats 5 --out-dir "$RESULTS" 2>&1 | tee "$RESULTS/gpu_e2e.log" ;;
esac
