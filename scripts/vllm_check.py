"""Check the vLLM rollout backend against transformers, for real, on a tiny Qwen2 (CPU is enough).

Run with the python of the vLLM venv (``bash scripts/build_vllm_cpu_env.sh`` builds it)::

    .venv-vllm/bin/python scripts/vllm_check.py [--json-out FILE] [--no-collector]

What it checks, on the tiny policy built the project way (``agentopsd.models.tiny.tiny_policy``) and saved
with ``save_pretrained``:

(a) a batch of sampled turns (collector-like ``SamplingConfig``: stop strings, temperature 1, seed)
    completes: token ids and text non-empty, finish reasons valid, stop/eos reasons consistent;
(b) vLLM's per-token log-probs equal log_softmax(logits / T) of a transformers forward over
    prompt + generated tokens, within ``--tolerance`` (both in float32);
(c) after optimizer steps on the training model, ``sync_weights`` changes what vLLM generates
    (greedy tokens and log-probs), and the new output matches the updated model: same greedy
    tokens as the transformers backend and log-probs within the tolerance;
(d) optionally the project's ``Collector`` plays a few BabyAI turns with the vLLM backend.

Prints one JSON summary on stdout (last line) and exits 1 when a check fails.
The engine starts worker processes: everything runs under the ``__main__`` guard (spawn-safe).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agentopsd.run.process_env import set_vllm_defaults  # noqa: E402  (imports neither torch nor vllm)

set_vllm_defaults()

ENV_ID = "agentopsd/BabyAI-GoToLocal-v0"
VALID_REASONS = {"stop", "eos", "length"}


def build_policy(workdir: Path, env_id: str) -> tuple[Any, Any, Path]:
    """The tiny policy and tokenizer the project way, saved where vLLM can load them."""
    import agentopsd.envs  # noqa: F401  (registers the agentopsd/* ids)
    from agentopsd.models.tiny import tiny_policy

    model, tokenizer = tiny_policy(env_id, skills="babyai", text_episodes=10, cache_dir=str(workdir / "tokenizers"))
    path = workdir / "policy"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model.float().eval(), tokenizer, path


def env_prompts(env_id: str, tokenizer: Any, n: int) -> tuple[Any, list[list[int]]]:
    """First-turn prompts of ``n`` train tasks, through the project's PromptBuilder."""
    import gymnasium as gym

    from agentopsd.rollout.prompts import PromptBuilder

    builder = PromptBuilder(tokenizer=tokenizer)
    env = gym.make(env_id, split="train", disable_env_checker=True)
    prompts = []
    try:
        for i in range(n):
            obs, info = env.reset(seed=i)
            prompts.append(builder.build(info["task"], [], obs, info.get("admissible_actions")))
    finally:
        env.close()
    return builder, prompts


def reference_logprobs(model: Any, prompt: list[int], tokens: tuple[int, ...], temperature: float) -> list[float]:
    """log_softmax(logits / T) of ``tokens`` from one full transformers forward (no cache)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt) + list(tokens)])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


def max_logprob_diff(model: Any, prompts: list[list[int]], gens: list[Any], temperature: float) -> float:
    worst = 0.0
    for prompt, gen in zip(prompts, gens):
        ref = reference_logprobs(model, prompt, gen.token_ids, temperature)
        worst = max([worst] + [abs(a - b) for a, b in zip(ref, gen.logprobs)])
    return worst


def completion_problems(gens: list[Any], tokenizer: Any, stops: tuple[str, ...], max_new: int) -> list[str]:
    """Why each generation is malformed (empty list = all fine)."""
    problems = []
    eos = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    for i, g in enumerate(gens):
        if not g.token_ids or len(g.logprobs) != len(g.token_ids):
            problems.append(f"gen {i}: {len(g.token_ids)} tokens, {len(g.logprobs)} logprobs")
        if g.finish_reason not in VALID_REASONS:
            problems.append(f"gen {i}: finish reason {g.finish_reason!r}")
        if g.finish_reason == "stop" and not any(g.text.endswith(s) for s in stops):
            problems.append(f"gen {i}: reason stop but text {g.text[-30:]!r} ends in no stop string")
        if g.finish_reason == "eos" and g.token_ids and g.token_ids[-1] not in eos:
            problems.append(f"gen {i}: reason eos but last token {g.token_ids[-1]}")
        if g.finish_reason == "length" and len(g.token_ids) != max_new:
            problems.append(f"gen {i}: reason length after {len(g.token_ids)} < {max_new} tokens")
        if any(not (lp <= 0.0) for lp in g.logprobs):
            problems.append(f"gen {i}: log-prob > 0 or nan")
    if not any(g.text.strip() for g in gens):
        problems.append("every generation decodes to empty text")
    return problems


def train_towards(model: Any, tokenizer: Any, prompts: list[list[int]], target: str, steps: int, lr: float) -> list[float]:
    """Adam on -log p(target | prompt): real optimizer steps that visibly move greedy outputs."""
    import torch

    ids = tokenizer.encode(target, add_special_tokens=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.zeros(())
        for prompt in prompts:
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0]
            logp = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
            loss = loss - logp.gather(-1, torch.tensor(ids)[:, None]).mean() / len(prompts)
        loss.backward()
        optimizer.step()
        losses.append(round(loss.item(), 4))
    model.eval()
    return losses


def throughput(vllm_gen: Any, hf_gen: Any, prompts: list[list[int]], batch: int = 16, new: int = 64) -> dict[str, Any]:
    """Generated tokens per second (prefill included) of both backends on the same batch."""
    from agentopsd.rollout.base import SamplingConfig

    bulk = [prompts[i % len(prompts)] for i in range(batch)]
    sampling = SamplingConfig(max_new_tokens=new, temperature=1.0, stop_strings=(), seed=11)
    result: dict[str, Any] = {"batch": batch, "max_new_tokens": new, "prompt_tokens": sum(map(len, bulk))}
    for name, gen in (("vllm", vllm_gen), ("hf", hf_gen)):
        t0 = time.perf_counter()
        tokens = sum(len(g.token_ids) for g in gen.generate(bulk, sampling))
        result[f"{name}_tokens_per_s"] = round(tokens / (time.perf_counter() - t0), 1)
    return result


def run_collector(env_id: str, generator: Any, builder: Any, sampling: Any, turns: int) -> dict[str, Any]:
    from agentopsd.rollout.collector import Collector
    from agentopsd.types import TaskSpec

    collector = Collector(env_id, generator, builder, sampling, max_turns=turns)
    tasks = [TaskSpec(env_id, "train", task_index=i // 2, seed=i // 2, group_id=i // 2) for i in range(4)]
    t0 = time.perf_counter()
    try:
        trajectories = collector.collect(tasks, with_teacher=False)
    finally:
        collector.close()
    ok = all(
        t.turns and all(len(turn.action_ids) == len(turn.behaviour_logprobs) > 0 for turn in t.turns) for t in trajectories
    )
    return {
        "ok": bool(ok),
        "seconds": round(time.perf_counter() - t0, 2),
        "trajectories": len(trajectories),
        "turns": collector.stats.turns,
        "generated_tokens": collector.stats.generated_tokens,
        "format_errors": collector.stats.format_errors,
    }


def check(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Runs every check, recording numbers and failures in ``out`` as it goes."""
    import torch

    from agentopsd.rollout.vllm_backend import VLLMGenerator

    torch.manual_seed(0)
    workdir = Path(args.workdir)
    t0 = time.perf_counter()
    model, tokenizer, path = build_policy(workdir, args.env_id)
    out["build_policy_s"] = round(time.perf_counter() - t0, 2)
    builder, prompts = env_prompts(args.env_id, tokenizer, args.batch)
    out["model"] = {"parameters": sum(p.numel() for p in model.parameters()), "vocab": len(tokenizer),
                    "prompt_tokens": [len(p) for p in prompts]}

    t0 = time.perf_counter()
    generator = VLLMGenerator(str(path), tokenizer, dtype="float32", max_model_len=2048, seed=0,
                              enforce_eager=True, max_num_seqs=max(16, args.batch), colocate=args.in_process)
    out["engine_start_s"] = round(time.perf_counter() - t0, 2)
    try:
        run_checks(args, out, generator, model, tokenizer, builder, prompts)
    finally:
        generator.close()


def run_checks(args: argparse.Namespace, out: dict[str, Any], generator: Any, model: Any, tokenizer: Any,
               builder: Any, prompts: list[list[int]]) -> None:
    import torch
    import vllm

    from agentopsd.rollout.base import SamplingConfig
    from agentopsd.rollout.hf import HFGenerator

    fail = out["failures"].append
    out["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
    out["engine_in_process"] = generator._in_process_worker() is not None

    # (a) + (b): sampled turns, as the collector asks for them.
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=1.0,
                              stop_strings=builder.stop_strings, seed=7)
    generator.generate(prompts[:2], sampling)  # warm-up: first call pays one-off setup
    t0 = time.perf_counter()
    gens = generator.generate(prompts, sampling)
    seconds = time.perf_counter() - t0
    n_tokens = sum(len(g.token_ids) for g in gens)
    out["sampled"] = {"tokens": n_tokens, "seconds": round(seconds, 3), "tokens_per_s": round(n_tokens / seconds, 1),
                      "finish_reasons": sorted({g.finish_reason for g in gens}),
                      "example": gens[0].text[:120]}
    for problem in completion_problems(gens, tokenizer, builder.stop_strings, args.max_new_tokens):
        fail(f"(a) {problem}")
    again = generator.generate(prompts, sampling)
    if [g.token_ids for g in again] != [g.token_ids for g in gens]:
        fail("(a) the same seed gave different samples")
    diff = max_logprob_diff(model, prompts, gens, sampling.scoring_temperature)
    out["sampled"]["max_abs_logprob_diff"] = diff
    if not diff <= args.tolerance:
        fail(f"(b) sampled log-probs differ from transformers by {diff:.3g} > {args.tolerance}")
    hot = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=1.7, stop_strings=builder.stop_strings, seed=3)
    hot_diff = max_logprob_diff(model, prompts, generator.generate(prompts, hot), hot.temperature)
    out["sampled"]["max_abs_logprob_diff_t1.7"] = hot_diff
    if not hot_diff <= args.tolerance:
        fail(f"(b) log-probs at temperature 1.7 differ from transformers by {hot_diff:.3g} > {args.tolerance}")

    out["throughput"] = throughput(generator, HFGenerator(model, tokenizer), prompts)

    # (c): greedy turns before and after an optimizer step + sync_weights.
    greedy = SamplingConfig(max_new_tokens=args.max_new_tokens, greedy=True, stop_strings=builder.stop_strings)
    before = generator.generate(prompts, greedy)
    out["losses"] = train_towards(model, tokenizer, prompts[: args.batch // 2], args.target, args.train_steps, args.lr)
    stale = generator.generate(prompts, greedy)
    if [g.token_ids for g in stale] != [g.token_ids for g in before]:
        fail("(c) vLLM output changed before sync_weights was called")
    t0 = time.perf_counter()
    generator.sync_weights(model)
    out["sync_weights_s"] = round(time.perf_counter() - t0, 3)
    after = generator.generate(prompts, greedy)
    reference = HFGenerator(model, tokenizer).generate(prompts, greedy)
    changed = sum(a.token_ids != b.token_ids for a, b in zip(after, before))
    matches_hf = sum((a.token_ids, a.finish_reason) == (r.token_ids, r.finish_reason) for a, r in zip(after, reference))
    diff_after = max_logprob_diff(model, prompts, after, 1.0)
    stopped = sum(g.finish_reason == "stop" for g in after)
    out["sync"] = {"changed": changed, "matches_hf_greedy": matches_hf, "max_abs_logprob_diff": diff_after,
                   "finish_reasons": sorted({g.finish_reason for g in after}), "stopped_at_stop_string": stopped,
                   "example_before": before[0].text[:80], "example_after": after[0].text[:80]}
    if changed == 0:
        fail("(c) sync_weights did not change any greedy output")
    if matches_hf != len(prompts):
        fail(f"(c) after sync only {matches_hf}/{len(prompts)} greedy outputs equal the transformers backend's")
    if not diff_after <= args.tolerance:
        fail(f"(c) log-probs after sync differ from the updated model's by {diff_after:.3g} > {args.tolerance}")
    # The trained target ends in the stop string: vLLM's stop handling must now end some turns.
    for problem in completion_problems(after, tokenizer, builder.stop_strings, args.max_new_tokens):
        fail(f"(c) {problem}")
    if stopped == 0:
        fail("(c) no greedy turn ended at the stop string after training towards it")

    if args.collector:
        out["collector"] = run_collector(args.env_id, generator, builder, sampling, args.collector_turns)
        if not out["collector"]["ok"]:
            fail("(d) the collector produced an empty turn or mismatched log-probs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--env-id", default=ENV_ID)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="max |vLLM - transformers| per-token log-prob (both float32)")
    p.add_argument("--target", default="<action>go forward</action>", help="what the training steps teach")
    p.add_argument("--train-steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--in-process", action="store_true",
                   help="run the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): tests the other sync path")
    p.add_argument("--collector", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--collector-turns", type=int, default=2)
    p.add_argument("--workdir", default=None, help="where the policy is saved (default: a new temp dir)")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    t0 = time.perf_counter()
    summary: dict[str, Any] = {"tolerance": args.tolerance, "failures": []}
    try:
        with tempfile.TemporaryDirectory(prefix="agentopsd-vllm-") as tmp:
            args.workdir = args.workdir or tmp
            check(args, summary)
    except Exception as exc:  # report how far it got, as JSON, like any other failure
        traceback.print_exc()
        summary["failures"].append(f"crashed: {type(exc).__name__}: {exc}")
    summary["ok"] = not summary["failures"]
    summary["total_s"] = round(time.perf_counter() - t0, 2)
    text = json.dumps(summary, sort_keys=True)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    print(text, flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
