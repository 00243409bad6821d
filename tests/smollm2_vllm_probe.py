"""The vLLM CPU engine on the prepared SmolLM2-135M-Instruct folder: its turns and per-token log-probs, as JSON.

Run with the python of the vLLM venv (``bash scripts/build_vllm_cpu_env.sh`` builds it)::

    .venv-vllm/bin/python tests/smollm2_vllm_probe.py FOLDER OUT.json

It builds first-turn BabyAI prompts with the folder's own tokenizer and chat template (the project's
``PromptBuilder``), starts ``VLLMGenerator`` on the folder in float32 and writes every prompt, generated token
and vLLM log-prob (sampled at temperature 1 with the turn's stop strings, then greedy), with the timings.
The comparison with the trainer's forward runs in the project's own venv
(``tests/agentopsd/test_pretrained_paths.py``), since the vLLM venv pins another transformers.
Everything runs under the ``__main__`` guard: the engine starts worker processes (spawn-safe).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agentopsd.run.process_env import set_vllm_defaults  # noqa: E402  (imports neither torch nor vllm)

set_vllm_defaults()

ENV_ID = "agentopsd/BabyAI-GoToLocal-v0"
ROWS = 6


def main(folder: str, out_path: str) -> int:
    import gymnasium as gym
    import vllm
    from transformers import AutoTokenizer

    import agentopsd.envs  # noqa: F401  (registers the agentopsd/* ids)
    from agentopsd.rollout.base import SamplingConfig
    from agentopsd.rollout.prompts import PromptBuilder
    from agentopsd.rollout.vllm_backend import VLLMGenerator

    tokenizer = AutoTokenizer.from_pretrained(folder)
    builder = PromptBuilder(tokenizer=tokenizer)
    env = gym.make(ENV_ID, split="train", disable_env_checker=True)
    prompts = []
    for i in range(ROWS):
        obs, info = env.reset(seed=i)
        prompts.append(builder.build(info["task"], [], obs, info.get("admissible_actions")))
    env.close()
    summary: dict = {"vllm": vllm.__version__, "prompt_tokens": [len(p) for p in prompts], "prompts": prompts}
    t0 = time.perf_counter()
    generator = VLLMGenerator(folder, tokenizer, dtype="float32", max_model_len=2048, seed=0, enforce_eager=True,
                              max_num_seqs=16, colocate=False)
    summary["engine_start_s"] = round(time.perf_counter() - t0, 1)
    try:
        for kind, sampling in {
            "sampled": SamplingConfig(max_new_tokens=24, temperature=1.0, stop_strings=builder.stop_strings, seed=7),
            "greedy": SamplingConfig(max_new_tokens=24, greedy=True, stop_strings=builder.stop_strings),
        }.items():
            t0 = time.perf_counter()
            gens = generator.generate(prompts, sampling)
            summary[kind] = {"seconds": round(time.perf_counter() - t0, 2), "temperature": sampling.scoring_temperature,
                             "rows": [{"token_ids": list(g.token_ids), "logprobs": list(g.logprobs), "text": g.text,
                                       "finish_reason": g.finish_reason} for g in gens]}
    finally:
        generator.close()
    Path(out_path).write_text(json.dumps(summary))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("prompts", "sampled", "greedy")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
