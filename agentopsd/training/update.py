"""One iteration's PPO update, read top to bottom: epochs over mini-batches, micro-batches, optimizer steps.

The LightningModule hands in its seams (the backward, one micro-batch's loss, the optimizer step, the
gradient-sync switch), so that Lightning's manual optimization, DDP and FSDP2 stay in the module while the loop
itself is one function.

Several ranks: each mini-batch's loss is normalised by the token (or row) count of that mini-batch over *every*
rank and scaled by the world size, so that the gradient reduction's average over ranks gives exactly the
gradient of one process holding all the rows. Every rank runs the same count of micro-batches per mini-batch
(padded with dummy passes of the same code): the rank invariant of :mod:`agentopsd.training.distributed`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from agentopsd.config import OptimConfig
from agentopsd.credit.algorithms import Algorithm
from agentopsd.rollout.scoring import Scorer, sharing_order
from agentopsd.training import distributed
from agentopsd.training.balance import balance_rows
from agentopsd.training.distributed import rank_and_world
from agentopsd.training.objective import signal_rows
from agentopsd.types import RolloutBatch

SUMMED = ("rollout/format_errors", "rollout/invalid_actions", "rollout/faults", "rollout/trajectories",
          "rollout/trajectories_used", "rollout/history_trimmed", "rollout/skill_trimmed")
SHARED_TERMS = ("pg_loss", "kl_loss", "distill_loss", "entropy")
"""Loss terms normalised by the whole mini-batch's count over every rank (each rank holds a share)."""


def metric_rule(key: str) -> str:
    """How a metric combines over ranks (:func:`agentopsd.training.distributed.reduce_metrics`)."""
    if key in SUMMED or key.endswith("tokens_per_s"):
        return "sum"  # counts of the whole batch; throughput of the whole job
    if key.endswith("_seconds") or key.endswith("_max") or key in ("loss/first_ratio_dev", "perf/peak_memory_gib"):
        return "max"  # the slowest rank sets the pace; the worst rank's deviation
    return "mean"


@dataclass
class Seams:
    """What the loop calls back into (the module's methods: tests and probes wrap them)."""

    backward: Callable[[Tensor], None]
    micro_loss: Callable[..., tuple[Tensor, float]]
    """(batch, rows, normalizer, stats_log or None) -> (loss, max |ratio - 1|)."""
    optimizer_step: Callable[[object, object, dict[str, list[float]]], None]
    gradient_sync: Callable[[bool], None]


@dataclass
class UpdateResult:
    stats: dict[str, list[float]]
    """Each loss term's values over the micro-batches (``total``: per mini-batch)."""
    losses: list[float]
    first_ratio_dev: float
    """max |ratio - 1| over the first mini-batch (0 when the data is on-policy)."""
    skipped_rows: int


def ppo_update(batch: RolloutBatch, *, algo: Algorithm, cfg: OptimConfig, scorer: Scorer, opt, sched, seams: Seams,
               seed: int, batch_idx: int, device: torch.device, pad_id: int, first_ratio_dev: float) -> UpdateResult:
    """PPO epochs over mini-batches of one rollout batch (advantages set). ``first_ratio_dev``: the value to keep
    when no row of the first mini-batch runs a forward."""
    _, world = rank_and_world()
    if world > 1 and cfg.balance_tokens:
        # every rank about the same tokens: each mini-batch runs as many micro-batches as the busiest rank
        # (the loss is normalised over every rank, so the gradient does not depend on where a row lives)
        batch = balance_rows(batch, "update/balance", teacher_weight=1.0 if algo.needs_teacher_logits else 0.0,
                             pad_id=pad_id)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + batch_idx)
    stats_log: dict[str, list[float]] = {}
    losses: list[float] = []
    first = True
    first_ratio_dev = 0.0 if cfg.skip_zero_advantage else first_ratio_dev  # a first mini-batch may run no row
    skipped = 0
    for _ in range(cfg.ppo_epochs):
        perm = torch.randperm(batch.num_rows, generator=gen).to(device)
        # tensor_split always gives num_mini_batches pieces, so every rank steps the optimizer alike
        for mb in torch.tensor_split(perm, cfg.num_mini_batches):
            opt.zero_grad(set_to_none=True)
            local = float(batch.action_mask[mb].sum()) if algo.aggregation == "token-mean" else float(len(mb))
            if cfg.skip_zero_advantage:  # after the count: the skipped rows' tokens stay in the normaliser
                kept = mb[signal_rows(batch.advantages[mb], batch.action_mask[mb])]
                skipped += len(mb) - len(kept)
                mb = kept
            # rows sharing a prompt prefix side by side, so a micro-batch runs each shared prefix once
            # (gradient accumulation: the split does not change the summed gradient)
            # (a token budget then orders them by length, a stable sort that keeps equal lengths side by side)
            micros = scorer.micro_batches(mb[sharing_order(batch.input_ids[mb], batch.attention_mask[mb])], batch.attention_mask)
            # one agreement per mini-batch: its micro-batch count (a backward each: DDP all-reduces,
            # FSDP gathers and reduce-scatters) and its token count over every rank
            counts = distributed.exchange([len(micros), local], "update/micro-batches") if world > 1 else [[len(micros), local]]
            normalizer = max(1.0, sum(c[1] for c in counts))
            micros += [None] * (int(max(c[0] for c in counts)) - len(micros))
            minibatch_loss = 0.0
            for i, micro in enumerate(micros):
                # every rank runs the same count of micro-batches, so "the last" is the same pass on every rank
                seams.gradient_sync(i == len(micros) - 1)
                if micro is None:  # a dummy pass through the same code, contributing nothing
                    dummy, rows = scorer.placeholder_batch(with_reference=algo.kl_coef > 0)
                    seams.backward(seams.micro_loss(dummy, rows, normalizer, None)[0] * 0.0)
                    continue
                loss, ratio_dev = seams.micro_loss(batch, micro, normalizer, stats_log)
                if first:  # max |ratio - 1| over the first mini-batch: 0 when the data is on-policy
                    first_ratio_dev = ratio_dev if micro is micros[0] else max(first_ratio_dev, ratio_dev)
                seams.backward(loss * world)
                losses.append(float(loss.detach()) * world)
                minibatch_loss += float(loss.detach()) * world
            # the mini-batch's whole loss (each rank holds a share: their mean over ranks is the sum)
            stats_log.setdefault("total", []).append(minibatch_loss)
            first = False
            seams.optimizer_step(opt, sched, stats_log)
    return UpdateResult(stats_log, losses, first_ratio_dev, skipped)


def adamw_with_schedule(model: torch.nn.Module, cfg: OptimConfig, num_iterations: int) -> dict:
    """AdamW over the trainable parameters and its per-step learning-rate schedule (``optim.lr_factor``), in the form
    Lightning's ``configure_optimizers`` returns."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    total = max(1, num_iterations * cfg.ppo_epochs * cfg.num_mini_batches)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: cfg.lr_factor(step, total))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
