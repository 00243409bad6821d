"""One copy of the weights per node: a node's other ranks build the policy (and its KL reference) on
the meta device and get rank 0's weights after FSDP2 sharding (agentopsd.training.strategies.prepare_policy,
fill_from_rank0), in 2-process torchrun runs on CPU (gloo) under a watchdog.

Each run builds the model twice, the plain way (every rank reads the weights) and with
``meta_on_other_ranks=true``, shards both as ``trainer=fsdp`` does (bf16 weights on disk, bf16-mixed
precision: float32 master weights), and checks on every rank that the two agree bit for bit:
parameters and buffers (rotary ``inv_freq`` is outside the state dict), of the policy and of the
reference, tied weights still tied, the generation config, then logits of a forward on unequal data
per rank and the parameters after an optimizer step on it (FSDP2 computes with the filled shards).
A training run of a 3B experiment with the meta build ends with exit 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.test_distributed import run_watched
from tests.test_train import metrics_rows

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent('''
    import datetime, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from agentopsd.models.loading import load_policy
    from agentopsd.training.strategies import frozen_copy
    from agentopsd.training.strategies import prepare_policy

    folder, case = sys.argv[1], sys.argv[2]
    LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]} if "lora" in case else None
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))  # a lost rank fails in 30 s
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))

    def build(meta):
        torch.manual_seed(0)  # as train.py seeds every rank: LoRA's random initialisation, the same on every rank
        model, _ = load_policy(folder, dtype="bfloat16", lora=LORA, meta_on_other_ranks=meta)
        ref = frozen_copy(model)
        on_meta = [any(t.is_meta for t in m.parameters()) for m in (model, ref)]
        assert on_meta == [meta and rank == 1] * 2, (rank, meta, on_meta)
        prepare_policy(model, ref, "bf16-mixed", mesh)
        return model, ref

    def whole(module):
        """Every parameter (gathered whole) and buffer of this rank's module, and whether weights are tied."""
        out = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in module.named_parameters()}
        out.update((f"buffer {n}", b) for n, b in module.named_buffers())
        base = module.get_base_model() if hasattr(module, "get_base_model") else module
        tied = base.get_output_embeddings().weight is base.get_input_embeddings().weight
        return {k: v.detach().clone() for k, v in out.items()}, tied

    def train_step(model, ref):
        """A forward of the reference, then of the policy with a backward and AdamW step, on this rank's own
        data (rank 1 has more and longer rows), and the policy's logits after the step."""
        gen = torch.Generator().manual_seed(100 + rank)
        ids = torch.randint(0, model.config.vocab_size, (2 + rank, 5 + 3 * rank), generator=gen)
        with torch.no_grad():
            ref_logits = ref(input_ids=ids).logits
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).mean().backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            after = model(input_ids=ids).logits
        return {"ref logits": ref_logits, "logits": logits.detach(), "logits after step": after}

    def record(meta):
        model, ref = build(meta)
        rec = {"policy": whole(model), "reference": whole(ref), "generation": model.generation_config.to_dict(),
               "training": [m.training for m in model.modules()]}
        rec["left on meta"] = [n for m in (model, ref) for n, t in [*m.named_parameters(), *m.named_buffers()] if t.is_meta]
        rec["forward"] = train_step(model, ref)
        rec["policy after step"] = whole(model)
        return rec

    def same_bits(a, b):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.contiguous().flatten().view(torch.uint8), b.contiguous().flatten().view(torch.uint8))

    def compare(what, plain, meta):
        if isinstance(plain, torch.Tensor):
            assert same_bits(plain, meta), f"rank {rank}: {what} differs from the plain build's"
        elif isinstance(plain, dict):
            assert plain.keys() == meta.keys(), f"rank {rank}: {what}: {sorted(plain.keys() ^ meta.keys())}"
            for k in plain:
                compare(f"{what} / {k}", plain[k], meta[k])
        elif isinstance(plain, tuple):
            for i, (p, m) in enumerate(zip(plain, meta)):
                compare(f"{what} [{i}]", p, m)
        else:
            assert plain == meta, f"rank {rank}: {what}: plain {plain!r}, meta {meta!r}"

    plain = record(meta=False)
    meta = record(meta=True)
    assert meta["left on meta"] == [], meta["left on meta"]
    compare(case, plain, meta)
    assert plain["policy"][1] == case.startswith("tied"), "the model folder's tie_word_embeddings"
    print(f"META-BUILD-OK rank {rank}: {len(plain['policy'][0])} policy tensors, {len(plain['reference'][0])} reference tensors", flush=True)
    from tests.torchrun_exit import leave
    leave()  # not a normal exit: see tests/torchrun_exit.py
''')


def torchrun_watched(script: Path, *args: str, timeout: int) -> str:
    """``torchrun --nproc-per-node 2 script args`` in its own process group; past ``timeout`` every
    process prints its Python stack (SIGABRT with PYTHONFAULTHANDLER) and the test fails with them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script), *args]
    proc = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"torchrun still running after {timeout} s; stacks:\n{err[-8000:]}")
    ranks = "\n".join(line for line in err.splitlines() if line.startswith("[rank"))  # the processes' tracebacks
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{ranks[-6000:] or err[-6000:]}"
    return out


def save_qwen_shaped(folder: Path, *, tied: bool, vocab_size: int | None = None, hidden_size: int = 32) -> Path:
    """A random Qwen2.5-architecture model saved like a hub download: bf16 weights, Qwen2.5's tokenizer,
    a generation config with Qwen2.5-Instruct's two eos ids and sampling defaults."""
    import transformers

    from tests.agentopsd.rollout.test_prompts import _qwen_tokenizer

    tokenizer = _qwen_tokenizer()
    vocab_size = vocab_size or 96
    # Qwen2.5's ids where the vocabulary has them (a smaller one only serves forwards of random ids)
    eos, pad = (tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id) if vocab_size > 151_645 else (vocab_size - 1, vocab_size - 2)
    config = transformers.Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=2 * hidden_size, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=tied, eos_token_id=eos, pad_token_id=pad, bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    generation.update(eos_token_id=[eos, pad], do_sample=True, top_k=20,
                      top_p=0.8, temperature=0.7, repetition_penalty=1.05)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["untied", "tied", "tied+lora"])
def test_meta_build_equals_plain_build_on_every_rank(case, tmp_path):
    folder = save_qwen_shaped(tmp_path / "model", tied=case.startswith("tied"))
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    out = torchrun_watched(script, str(folder), case, timeout=240)
    assert out.count("META-BUILD-OK") == 2, out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_3b_experiment_trains_with_the_meta_build(tmp_path):
    """webshop_3b (FSDP2, bf16-mixed, KL reference, gradient checkpointing) on 2 processes with
    ``model.meta_on_other_ranks=true`` and tied embeddings (as Qwen2.5-3B), one short iteration."""
    folder = save_qwen_shaped(tmp_path / "model", tied=True, vocab_size=151_669, hidden_size=64)
    out = tmp_path / "run"
    proc = run_watched(
        "experiment=webshop_3b", f"model.path={folder}", f"output_dir={out}", "model.meta_on_other_ranks=true",
        "trainer.accelerator=cpu", "trainer.devices=2", "trainer.enable_progress_bar=false", "trainer.strategy.timeout.seconds=120",
        "rollout.backend=hf", "rollout.max_new_tokens=24", "env.max_turns=2", "num_iterations=1", "data.tasks_per_batch=2",
        "data.group_size=2", "evaluation.num_tasks=1", "evaluation.before_training=false", timeout=1000,
    )
    assert "local rank 1: policy" in proc.stdout + proc.stderr  # rank 1 built on the meta device
    assert "eval success:" in proc.stdout
    assert any(r.get("rollout/trajectories") for r in metrics_rows(out))
