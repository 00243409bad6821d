#!/usr/bin/env bash
# Build the virtualenv in which benchmarks/peer_trl.py runs TRL's GRPOTrainer beside this project.
#
# TRL pulls in datasets, accelerate, pandas and a newer pyarrow that the project does not need; they
# stay out of .venv. The peer venv holds the project too (editable, with its dependencies), on the
# same torch and the same transformers as .venv, so that both trainers run in one process on the
# same kernels and the only difference measured is the trainer.
#
#   bash scripts/build_trl_env.sh              # builds .venv-trl (skips if already built)
#   AGENTOPSD_TRL_VENV=/tmp/vt bash scripts/build_trl_env.sh
#   AGENTOPSD_TRL_REBUILD=1 bash scripts/build_trl_env.sh   # start over
#
# Then: .venv-trl/bin/python benchmarks/peer_trl.py
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${AGENTOPSD_TRL_VENV:-$ROOT/.venv-trl}"
PYTHON="${PYTHON:-python3}"
# TRL's release when this was written; its own pins (transformers>=4.56.2, accelerate, datasets)
# do not clash with the project's, the extra packages are what keeps it out of .venv.
TRL_SPEC="trl==1.16.0"
TORCH_SPEC="torch==2.13.0"
# The transformers and peft of .venv when there is one: generation, attention and LoRA code paths then match
# (peft: `--model smollm2` trains LoRA adapters on both sides; the project's lora extra, peft>=0.12, otherwise).
TRANSFORMERS_SPEC="transformers"
PEFT_SPEC="peft>=0.12"
if [[ -x "$ROOT/.venv/bin/python" ]]; then
    version="$("$ROOT/.venv/bin/python" -c 'import transformers; print(transformers.__version__)' 2>/dev/null || true)"
    [[ -n "$version" ]] && TRANSFORMERS_SPEC="transformers==$version"
    version="$("$ROOT/.venv/bin/python" -c 'import peft; print(peft.__version__)' 2>/dev/null || true)"
    [[ -n "$version" ]] && PEFT_SPEC="peft==$version"
fi
STAMP="$VENV/.agentopsd-trl-built"
STAMP_TEXT="$TORCH_SPEC $TRL_SPEC $TRANSFORMERS_SPEC $PEFT_SPEC"

if [[ "${AGENTOPSD_TRL_REBUILD:-0}" == "1" ]]; then
    rm -rf "$VENV"
fi
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_TEXT" ]]; then
    echo "TRL venv already built at $VENV (AGENTOPSD_TRL_REBUILD=1 to rebuild)"
    exit 0
fi

start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
# torch first, pinned, so that resolving trl never pulls a CUDA build.
"${PIP[@]}" install -q "$TORCH_SPEC"
"${PIP[@]}" install -q -c "$ROOT/constraints-cpu.txt" -e "$ROOT" "$TRL_SPEC" "$TRANSFORMERS_SPEC" "$PEFT_SPEC"
"$VENV/bin/python" - <<'EOF'
import peft, torch, transformers, trl
assert not torch.cuda.is_available() or "+cpu" in torch.__version__, torch.__version__
print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, peft {peft.__version__}")
EOF
echo "$STAMP_TEXT" > "$STAMP"
echo "built $VENV in $(( $(date +%s) - start )) s"
