"""CreditCallback: turn-level credit for any Lightning RL code.

Plug it into a Trainer whose batches carry teacher/student log-probs of the generated
tokens, turn ids, GRPO sequence advantages, success bits and group ids. Before each
``training_step`` it writes per-token ``advantages`` (and ``turn_advantages``) into the
batch and logs ``credit/`` statistics.

Fields read (a dict or an object with item access; see :mod:`agentopsd.credit.algorithms`):

* row layout: ``teacher_logprobs``, ``student_logprobs`` ``[M,L]``, ``action_mask`` ``[M,L]``,
  ``turn_traj`` ``[M]``, ``turn_index`` ``[M]``;
* or token layout: ``teacher_logprobs``, ``student_logprobs``, ``token_turn`` ``[B,T]`` (-1 off actions);
* always: ``seq_advantages`` ``[B]``, ``success`` ``[B]`` (0/1), ``group_ids`` ``[B]``.

Fields written: ``advantages`` (shaped like the log-probs), ``turn_advantages``, ``credit``.

    trainer = L.Trainer(callbacks=[CreditCallback(AgentOPSD())])
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import lightning as L
import torch
from torch import Tensor

from agentopsd.credit.algorithms import Algorithm
from agentopsd.training.distributed import reduce_metrics
from agentopsd.training.step_log import log_step


def credit_statistics(credit: Mapping[str, Tensor], success: Tensor, band: float,
                      scored: Tensor | None = None) -> dict[str, float]:
    """``credit/`` metrics: mean |dB|, share of multipliers at the band edges, evidence spread,
    and the correlation of e_k with the outcome (does the teacher's evidence predict success?).
    GiGPO's credit gives the share of turns in a shared step group and the spread of A_step.
    ``scored`` (``[B]`` bool): the trajectories whose teacher view was scored (``RolloutBatch.teacher_scored``);
    the statistics cover those only, the others' evidence being 0 by omission, not by measurement."""
    mask = credit["turn_mask"]
    if scored is not None:
        mask = mask & scored.to(mask.device)[:, None]
    if not bool(mask.any()):
        return {}
    if "step_groups" in credit:
        groups = credit["step_groups"][mask]
        sizes = torch.bincount(groups)[groups]
        return {
            "credit/step_group_shared": float((sizes > 1).float().mean()),
            "credit/step_advantage_std": float(credit["step_advantages"][mask].std(unbiased=False)),
        }
    rev, w, e = credit["revisions"][mask], credit["multipliers"][mask], credit["evidence"][mask]
    outcome = success.to(e.dtype)[:, None].expand_as(mask)[mask]
    stats = {
        "credit/mean_abs_revision": float(rev.abs().mean()),
        "credit/frac_at_band_edge": float(((w - 1).abs() >= band - 1e-6).float().mean()),
        "credit/evidence_mean": float(e.mean()),
        "credit/evidence_std": float(e.std(unbiased=False)),
        "credit/multiplier_std": float(w.std(unbiased=False)),
    }
    if e.numel() > 1 and float(e.std()) > 0 and float(outcome.std()) > 0:
        stats["credit/evidence_outcome_corr"] = float(torch.corrcoef(torch.stack([e.float(), outcome.float()]))[0, 1])
    return stats


class CreditCallback(L.Callback):
    """Writes advantages into each training batch before ``training_step``.

    ``algorithm`` defaults to the LightningModule's ``algorithm`` attribute, so one module
    can switch algorithms through config while this callback stays the same.
    """

    def __init__(self, algorithm: Algorithm | None = None, log_stats: bool = True) -> None:
        self.algorithm = algorithm
        self.log_stats = log_stats
        self.last_stats: dict[str, float] = {}
        self.seconds = 0.0
        self._logged_keys: set[str] = set()  # a statistic an iteration lacks logs NaN, not its last value

    def _algorithm(self, pl_module: L.LightningModule) -> Algorithm:
        algo = self.algorithm or getattr(pl_module, "algorithm", None)
        if algo is None:
            raise ValueError("CreditCallback needs an algorithm: pass CreditCallback(AgentOPSD()) or give the module an `algorithm`")
        return algo

    @staticmethod
    def training_iteration(trainer: L.Trainer, pl_module: L.LightningModule) -> int:
        """The iteration schedules (RLSD's lambda warm-down) count: the module's ``iteration`` (one per
        rollout batch) when it has one, else the trainer's step count."""
        iteration = getattr(pl_module, "iteration", None)
        return int(iteration) if isinstance(iteration, int) else int(trainer.global_step)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int) -> None:
        t0 = time.perf_counter()
        algo = self._algorithm(pl_module)
        step = self.training_iteration(trainer, pl_module)
        credit = algo.assign(batch, step)
        self.seconds = time.perf_counter() - t0
        stats = {"perf/credit_seconds": self.seconds}
        lam = algo.lambda_at(step) if hasattr(algo, "lambda_at") else getattr(algo, "mult_lambda", None)
        if lam is not None:
            stats["credit/lambda"] = float(lam)
        if credit:
            success = batch["success"] if isinstance(batch, Mapping) else batch.success
            scored = batch.get("teacher_scored") if isinstance(batch, Mapping) else getattr(batch, "teacher_scored", None)
            stats.update(credit_statistics(credit, success, getattr(algo, "mult_band", 0.2), scored))
        bs = int((batch["success"] if isinstance(batch, Mapping) else batch.success).shape[0])
        # every rank's trajectories count (one collective when several processes train; none otherwise)
        stats = reduce_metrics(stats, "credit/metrics", weight=bs, rule=lambda key: "max" if key.endswith("_seconds") else "mean")
        self.last_stats = stats
        if self.log_stats:
            log_step(pl_module, stats, self._logged_keys, batch_size=bs)
