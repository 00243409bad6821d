"""RolloutShardWriter: sampled trajectories with per-turn credit, as webdataset shards."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import webdataset as wds

from agentopsd.types import RolloutBatch


def trajectory_records(batch: RolloutBatch, max_samples: int, iteration: int) -> list[dict]:
    """JSON-ready records: each turn's action, observation, B_k, dB_k, w_k, advantage and token gaps.

    ``iteration``: the iteration's number, counted like every log (iterations completed by its update).
    A trajectory whose teacher view was not scored (``RolloutBatch.teacher_scored``) is marked ``teacher_scored:
    false`` and logs no gaps, beliefs, revisions, multipliers or evidence: it had no evidence to measure.
    """
    credit = batch.credit
    turn_adv = batch.turn_advantages
    gaps = None
    if batch.teacher_logprobs is not None and batch.student_logprobs is not None:
        # each action token's gap delta_t (teacher view minus student view): the per-token credit rules need them
        gaps = (batch.teacher_logprobs.float() - batch.student_logprobs.float()).cpu()
        action = batch.action_mask.bool().cpu()
    scored = None if batch.teacher_scored is None else batch.teacher_scored.tolist()
    records = []
    row = 0
    for i, traj in enumerate(batch.trajectories):
        # a trajectory whose teacher view was not scored (A_seq = 0) has no evidence to log, and credit from none
        measured = scored is None or scored[i]
        turns = []
        for turn in traj.turns:
            entry = {"k": turn.index, "action": turn.parsed_action or turn.action_text, "observation": turn.observation, "reward": turn.reward, "valid": turn.valid,
                     "informed": turn.teacher_prompt_ids != turn.prompt_ids,  # the teacher view held a skill block on this turn
                     "policy_version": turn.policy_version}  # the weights that generated it (updates done before them)
            if turn_adv is not None and turn_adv.ndim == 1:
                entry["advantage"] = float(turn_adv[row])
            if gaps is not None and i < max_samples and measured:
                entry["gaps"] = gaps[row][action[row]].tolist()
            if credit and measured and credit["turn_mask"].shape[1] > turn.index and not credit.get("token_level", False):
                for name in ("beliefs", "revisions", "multipliers", "evidence"):
                    if credit[name].shape[1] > turn.index:
                        entry[name[:-1] if name.endswith("s") else name] = float(credit[name][i, turn.index])
            turns.append(entry)
            row += 1
        if i < max_samples:
            records.append({
                "iteration": iteration, "env": traj.task.env_id, "task_index": traj.task.task_index, "group": traj.task.group_id,
                "success": traj.success, "score": traj.score, "task_type": traj.task_type, "skill": traj.skill_text,
                "seq_advantage": float(batch.seq_advantages[i]), "turns": turns,
            })
            if not measured:
                records[-1]["teacher_scored"] = False
    return records


def write_shard(path: Path, records: list[dict]) -> None:
    """One tar shard, written to a temporary name and renamed (never left truncated)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with wds.TarWriter(str(tmp)) as sink:
        for n, rec in enumerate(records):
            sink.write({"__key__": f"{rec['iteration']:06d}_{n:04d}", "json": json.dumps(rec).encode()})
    os.replace(tmp, path)


class RolloutShardWriter(L.Callback):
    def __init__(self, dirpath: str, every_n_iterations: int = 1, max_samples: int = 16) -> None:
        self.dirpath = Path(dirpath)
        self.every_n_iterations = every_n_iterations
        self.max_samples = max_samples

    def on_train_start(self, trainer, pl_module) -> None:
        # a process killed mid-write leaves only a temporary file behind: remove it
        if trainer.is_global_zero and self.dirpath.is_dir():
            for stale in self.dirpath.glob(".rollouts-*.tmp*"):
                stale.unlink()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not isinstance(batch, RolloutBatch) or not trainer.is_global_zero:
            return
        # numbered like every log line, CSV row and figure: iteration n is the n-th (1, 2, ...); the first
        # iteration is always written, then every n-th after it
        number = pl_module.iteration + 1
        if (number - 1) % self.every_n_iterations == 0:
            write_shard(self.dirpath / f"rollouts-{number:06d}.tar", trajectory_records(batch, self.max_samples, number))
