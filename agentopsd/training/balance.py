"""Token balancing across ranks before the update.

Each rank plays whole groups of its own (:func:`agentopsd.training.distributed.shard_groups` deals them before the
rollout, when lengths are unknown), so one rank may end up with twice the tokens of another. In the
update every rank runs as many micro-batches as the busiest one (the rank invariant: the missing ones are
dummy passes), so the rank with the most tokens sets the pace. :func:`balance_rows` moves rows between
ranks so that every rank holds about the same number of tokens (verl balances sequence lengths across
data-parallel ranks the same way).

The gradient does not depend on where a row lives: the update normalises each mini-batch's loss by its
token (or row) count over every rank. What changes is which rows share a mini-batch (each rank cuts its
own rows into ``optim.num_mini_batches`` random pieces), as any other shuffle would.

* :func:`balanced_assignment`: pure, deterministic; which rank each row goes to.
* :func:`balance_rows`: the exchange under several processes (two collectives, the same on every rank
  whatever the data); one process returns the batch unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import torch
from torch import Tensor

from agentopsd.training.distributed import gather_objects, rank_and_world
from agentopsd.types import RolloutBatch

ROW_MATRICES = ("input_ids", "attention_mask", "action_mask", "old_logprobs", "teacher_input_ids",
                "teacher_attention_mask", "teacher_action_mask", "student_logprobs", "teacher_logprobs",
                "ref_logprobs", "is_weights", "advantages", "engine_teacher_logprobs")
"""Per-row ``[M, L]`` fields: moved with their row, padded to the receiving batch's width."""
ROW_VECTORS = ("turn_traj", "turn_index", "turn_valid", "turn_penalties", "turn_state", "turn_advantages")
"""Per-row ``[M]`` fields: moved with their row (``turn_traj`` and ``turn_state`` renumbered)."""
TRAJECTORY_FIELDS = ("success", "rewards", "group_ids", "seq_advantages", "num_turns")
"""Per-trajectory ``[B]`` fields: a balanced batch holds those of the trajectories its rows belong to."""
DROPPED_FIELDS = ("trajectories", "credit", "teacher_scored")
"""Records of the batch as played (Python trajectories, credit logs, which trajectories the teacher scored): empty in
a balanced batch."""
PAD_WITH_ID = ("input_ids", "teacher_input_ids")
"""Token fields padded with the pad id (every other field pads with 0 / False)."""


# ------------------------------------------------------------------ the assignment (pure)


def balanced_assignment(costs: Sequence[Sequence[float]], units: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """The rank each row goes to: ``dest[r][i]`` for row ``i`` of rank ``r``, whose cost is ``costs[r][i]``.

    Guarantee: no rank's total exceeds the mean over ranks by more than the largest row's cost (the
    bound of greedy longest-processing-time), and the busiest rank is never busier than before.
    Deterministic: the same costs give the same plan on every rank.

    Few moves: each rank first keeps its largest rows while its total stays within the mean; only the
    rest goes to the least loaded ranks, largest first (ties stay home, then go to the lowest rank).
    ``units[r][i]``: rows of one rank with the same unit id (the turns of one trajectory, which share
    prompt prefixes) move together, unless keeping them together would break the guarantee above.
    """
    world = len(costs)
    if units is not None and [len(u) for u in units] != [len(c) for c in costs]:
        raise ValueError(f"units must give one id per row: rows per rank {[len(c) for c in costs]}, "
                         f"unit ids per rank {[len(u) for u in units]}")
    for r, row_costs in enumerate(costs):
        bad = [c for c in row_costs if not c >= 0 or c == float("inf")]
        if bad:
            raise ValueError(f"row costs must be finite and >= 0; rank {r} has {bad[:3]}")
    home = [[r] * len(c) for r, c in enumerate(costs)]
    if world <= 1:
        return home
    mean = sum(map(sum, costs)) / world
    largest_row = max((c for row_costs in costs for c in row_costs), default=0.0)
    tol = 1e-9 * max(1.0, mean)  # token counts are integers; the tolerance absorbs float sums of weighted costs
    plan = None
    if units is not None:
        plan = _place_units(costs, units)
        if max(_loads(costs, plan)) > mean + largest_row + tol:
            plan = None  # a trajectory too long to keep whole: balance single rows
    if plan is None:
        plan = _place_units(costs, [list(range(len(c))) for c in costs])
    # never worse than where the rows are (a plan only moves rows when it lowers the busiest rank)
    return plan if max(_loads(costs, plan)) < max(_loads(costs, home)) - tol else home


def _loads(costs: Sequence[Sequence[float]], plan: Sequence[Sequence[int]]) -> list[float]:
    loads = [0.0] * len(costs)
    for row_costs, dests in zip(costs, plan):
        for c, d in zip(row_costs, dests):
            loads[d] += c
    return loads


def _place_units(costs: Sequence[Sequence[float]], units: Sequence[Sequence[int]]) -> list[list[int]]:
    """Keep-then-greedy placement of whole units; the destination of every row."""
    world = len(costs)
    mean = sum(map(sum, costs)) / world
    tol = 1e-9 * max(1.0, mean)
    # unit costs per rank, in order of first appearance (deterministic)
    unit_cost: list[dict[int, float]] = []
    for row_costs, ids in zip(costs, units):
        acc: dict[int, float] = {}
        for c, u in zip(row_costs, ids):
            acc[int(u)] = acc.get(int(u), 0.0) + float(c)
        unit_cost.append(acc)
    loads = [0.0] * world
    where: list[dict[int, int]] = [{} for _ in range(world)]
    pool: list[tuple[float, int, int]] = []
    for r, acc in enumerate(unit_cost):
        # largest first: a rank keeps as many of its tokens as fit under the mean (fewest tokens move)
        for u in sorted(acc, key=lambda u: (-acc[u], u)):
            if loads[r] + acc[u] <= mean + tol:
                loads[r] += acc[u]
                where[r][u] = r
            else:
                pool.append((acc[u], r, u))
    # longest processing time first onto the least loaded rank: the last unit a rank takes arrives when it
    # is at most the mean, so no rank ends more than one unit above it
    for c, r, u in sorted(pool, key=lambda p: (-p[0], p[1], p[2])):
        d = min(range(world), key=lambda d: (loads[d], d != r, d))
        loads[d] += c
        where[r][u] = d
    return [[where[r][int(u)] for u in ids] for r, ids in enumerate(units)]


# ------------------------------------------------------------------ the exchange


def row_costs(batch: RolloutBatch, teacher_weight: float = 0.0) -> list[float]:
    """Each row's update cost: its tokens (``attention_mask`` sum), plus ``teacher_weight`` times the
    teacher view's where the update runs the teacher forward too (``needs_teacher_logits``)."""
    cost = batch.attention_mask.sum(1).double()
    if teacher_weight:
        cost = cost + teacher_weight * batch.teacher_attention_mask.sum(1).double()
    return cost.cpu().tolist()


def balance_rows(batch: RolloutBatch, what: str, *, teacher_weight: float = 0.0, pad_id: int = 0) -> RolloutBatch:
    """This rank's rows after balancing every rank's tokens (:func:`balanced_assignment`, trajectories
    kept whole where the balance allows); one process: ``batch`` itself. ``batch`` is never modified.

    Collectives: one gather of the row costs, and one gather of the moved rows (CPU tensors) unless the
    plan, which every rank computes alike from the same costs, moves nothing. So every rank issues the same
    collectives whatever its data (the rank invariant, :mod:`agentopsd.training.distributed`).

    The returned batch is valid for the update: every per-row field (:data:`ROW_MATRICES`,
    :data:`ROW_VECTORS`), padded with ``pad_id`` (token fields) or 0 to the widest row's width; the
    per-trajectory fields (:data:`TRAJECTORY_FIELDS`) of the trajectories its rows belong to (a trajectory
    split over ranks appears on each), indexed by the renumbered ``turn_traj``; ``turn_state`` renumbered
    so that equal ids still mean identical states. ``trajectories`` and ``credit`` are empty: read and log
    them from the batch passed in.
    """
    rank, world = rank_and_world()
    if world <= 1:
        return batch
    check_fields(batch)
    costs = row_costs(batch, teacher_weight)
    everyone = gather_objects((costs, batch.turn_traj.cpu().tolist()), f"{what}/costs")
    plan = balanced_assignment([c for c, _ in everyone], [u for _, u in everyone])
    if all(d == r for r, dests in enumerate(plan) for d in dests):
        return batch  # the same answer on every rank: none enters the second collective
    dest = torch.tensor(plan[rank], dtype=torch.long)
    outgoing = {d: _take(batch, torch.nonzero(dest == d).flatten(), torch.device("cpu"))
                for d in range(world) if d != rank}
    incoming = gather_objects(outgoing, f"{what}/rows")
    device = batch.input_ids.device
    kept = _take(batch, torch.nonzero(dest == rank).flatten(), device)
    # rows in order of their source rank, so the batch is the same whichever rank builds it
    parts = [kept if src == rank else incoming[src][rank] for src in range(world)]
    return _concat(parts, device, pad_id)


def check_fields(batch: RolloutBatch) -> None:
    """Every field of ``batch`` is one :func:`balance_rows` knows how to move (a new field must be listed)."""
    known = set(ROW_MATRICES + ROW_VECTORS + TRAJECTORY_FIELDS + DROPPED_FIELDS)
    unknown = [f.name for f in fields(batch) if f.name not in known]
    if unknown:
        raise TypeError(f"agentopsd.training.balance does not know how to move RolloutBatch field(s) {unknown}: "
                        "list them in ROW_MATRICES, ROW_VECTORS or TRAJECTORY_FIELDS of agentopsd/training/balance.py")
    rows = batch.num_rows
    for name in ROW_MATRICES + ROW_VECTORS:
        value = getattr(batch, name)
        if value is not None and int(value.shape[0]) != rows:
            raise ValueError(f"RolloutBatch.{name} has {int(value.shape[0])} rows, the batch {rows}: cannot move its rows")


def _take(batch: RolloutBatch, rows: Tensor, device: torch.device) -> dict[str, Any]:
    """``rows`` of ``batch`` with the trajectories they belong to (``turn_traj`` renumbered into those), on
    ``device``."""
    rows = rows.to(batch.input_ids.device)
    part: dict[str, Any] = {}
    for name in ROW_MATRICES + ROW_VECTORS:
        value = getattr(batch, name)
        part[name] = None if value is None else value.index_select(0, rows).to(device)
    traj = torch.unique(part["turn_traj"].to(batch.success.device))  # sorted
    for name in TRAJECTORY_FIELDS:
        part[name] = getattr(batch, name).index_select(0, traj).to(device)
    part["turn_traj"] = torch.searchsorted(traj.to(device), part["turn_traj"])
    return part


def _concat(parts: Sequence[dict[str, Any]], device: torch.device, pad_id: int) -> RolloutBatch:
    """One batch of the ``parts`` (:func:`_take`'s), in their order."""
    values: dict[str, Any] = {}
    for name in ROW_MATRICES + ROW_VECTORS + TRAJECTORY_FIELDS:
        pieces = [p[name] for p in parts]
        if all(v is None for v in pieces):
            values[name] = None
            continue
        if any(v is None for v in pieces):
            raise ValueError(f"RolloutBatch.{name} is set on some ranks and None on others: the ranks must run the "
                             "same algorithm and settings")
        pieces = [v.to(device) for v in pieces]
        if name in ROW_MATRICES:
            width = max(int(v.shape[1]) for v in pieces)
            fill = pad_id if name in PAD_WITH_ID else 0
            pieces = [_pad(v, width, fill) for v in pieces]
        values[name] = torch.cat(pieces)
    # trajectory and state ids are per part: shift each part's past the previous parts'
    traj_shift, state_shift = [], []
    n_traj = n_state = 0
    for p in parts:
        traj_shift.append(torch.full_like(p["turn_traj"], n_traj).to(device))
        state_shift.append(torch.full_like(p["turn_state"], n_state).to(device))
        n_traj += int(p["success"].shape[0])
        n_state += int(p["turn_state"].max()) + 1 if p["turn_state"].numel() else 0
    values["turn_traj"] = values["turn_traj"] + torch.cat(traj_shift)
    values["turn_state"] = values["turn_state"] + torch.cat(state_shift)
    return RolloutBatch(**values, trajectories=(), credit={})


def _pad(value: Tensor, width: int, fill: int) -> Tensor:
    if int(value.shape[1]) == width:
        return value
    out = value.new_full((value.shape[0], width, *value.shape[2:]), fill)
    out[:, : value.shape[1]] = value
    return out
