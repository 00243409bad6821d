#!/usr/bin/env bash
# GPU check: train.py itself (Lightning, FSDP2 on one GPU, vLLM with CUDA) for 2 iterations of the
# paper's ALFWorld and WebShop setups with a randomly initialised Qwen2 of Qwen2.5-0.5B's shape (no
# download); prints one table: rollout, teacher-scoring and update tokens/s, peak GPU memory, time
# per iteration (rollout / teacher / update), vLLM's log-prob agreement with the training forward.
#   bash scripts/gpu_check.sh                  # one CUDA GPU, pip install -e '.[vllm,alfworld]'
#   bash scripts/gpu_check.sh --gpus 2         # two GPUs: an engine per rank; sync seconds, memory with/without sleep
#   bash scripts/gpu_check.sh --dry-run        # anywhere: build the model folders, print the commands
#   bash scripts/gpu_check.sh --help           # sizes, timeout, which environments
# Without CUDA it stops in seconds and says why.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
dry=0
for arg in "$@"; do
  case "$arg" in --dry-run|-h|--help) dry=1 ;; esac
done
if [[ "${GPU_CHECK_DRY:-0}" != "1" && "$dry" == "0" ]] && ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_check: no CUDA device visible: nvidia-smi not found (no NVIDIA driver on this machine). This check needs one NVIDIA GPU (H200-class) and a CUDA torch; nothing was run" >&2
  exit 2
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
