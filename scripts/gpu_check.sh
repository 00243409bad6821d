#!/usr/bin/env bash
# GPU check with assertions that fail (scripts/gpu_check.py says what it runs and asserts):
#   bash scripts/gpu_check.sh                        # a GPU node with the project installed (vLLM or not)
#   bash scripts/gpu_check.sh --wheels .gpu_wheels   # a bare GPU machine: the wheels scripts/gpu_prepare.sh fetched
#   bash scripts/gpu_check.sh --rehearse-on-cpu      # anywhere: the same on CPU (2 gloo processes), with controls
#   bash scripts/gpu_check.sh --dry-run              # anywhere: build the model folder, print the commands
# Without CUDA (and without --rehearse-on-cpu or --dry-run) it stops in seconds and says why.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"  # a bare machine may have python3 only
args=() wheels="" cpu=0 dry=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) wheels="${2:?--wheels needs a folder}"; shift 2; continue ;;
    --wheels=*) wheels="${1#--wheels=}" ;;
    --rehearse-on-cpu) cpu=1; args+=("$1") ;;
    --dry-run|-h|--help) dry=1; args+=("$1") ;;
    *) args+=("$1") ;;
  esac
  shift
done
if [[ -n "$wheels" ]]; then
  # The lent machine has no network: the pure-Python wheels prepared elsewhere go into a folder of their
  # own (never over the machine's torch or transformers), on the path of this run only. PYTHONPATH comes
  # before the machine's site-packages, so only the wheels whose package the machine lacks go in (its own
  # protobuf and tensorboardX win: scripts/carried_wheels.py).
  shopt -s nullglob
  files=("$wheels"/*.whl)
  if [[ ${#files[@]} -eq 0 ]]; then
    echo "gpu_check: no wheels in $wheels: run bash scripts/gpu_prepare.sh on a machine with network and carry the folder" >&2
    exit 2
  fi
  mapfile -t missing < <("$PYTHON" scripts/carried_wheels.py "${files[@]}")
  target="$(cd "$wheels" && pwd)/site"
  wanted="$(printf '%s\n' ${missing[@]+"${missing[@]}"})"
  if [[ ! -f "$target/.installed" || "$(cat "$target/.installed")" != "$wanted" ]]; then
    rm -rf "$target" && mkdir -p "$target"  # a folder installed for another machine may hold what this one has
    if [[ ${#missing[@]} -gt 0 ]] && "$PYTHON" -m pip --version >/dev/null 2>&1; then
      "$PYTHON" -m pip install --quiet --no-deps --no-index --target "$target" "${missing[@]}" >&2
    else  # no pip: a wheel is a zip archive laid out as site-packages
      for f in ${missing[@]+"${missing[@]}"}; do "$PYTHON" -m zipfile -e "$f" "$target"; done
    fi
    printf '%s' "$wanted" > "$target/.installed"
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}:$target"
fi
if [[ "${GPU_CHECK_DRY:-0}" != "1" && "$dry" == "0" && "$cpu" == "0" ]] && ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_check: no CUDA device visible: nvidia-smi not found (no NVIDIA driver on this machine). This check needs one NVIDIA GPU and a CUDA torch; nothing was run (on CPU: bash scripts/gpu_check.sh --rehearse-on-cpu)" >&2
  exit 2
fi
if [[ "$cpu" == "1" ]]; then export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"; fi
exec "$PYTHON" scripts/gpu_check.py ${args[@]+"${args[@]}"}
