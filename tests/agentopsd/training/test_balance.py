"""Token balancing across ranks (agentopsd/training/balance.py): the pure assignment on hand-made costs, and
:func:`balance_rows` on unequal data per rank (other row counts, widths and lengths; one rank with no rows
at all) in a simulated 2-rank world (threads) and in 2 real gloo processes, under a timeout."""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agentopsd.training import balance
from agentopsd.training.balance import balance_rows, balanced_assignment, row_costs
from agentopsd.training.distributed import SimulatedWorld
from agentopsd.types import RolloutBatch

PAD = 3


# ------------------------------------------------------------------ the pure assignment


def _loads(costs, plan) -> list[float]:
    loads = [0.0] * len(costs)
    for cs, ds in zip(costs, plan):
        for c, d in zip(cs, ds):
            loads[d] += c
    return loads


def _check_plan(costs, plan) -> list[float]:
    """One destination per row, each a rank; the busiest rank within the largest row of the mean."""
    world = len(costs)
    assert [len(p) for p in plan] == [len(c) for c in costs]
    assert all(0 <= d < world for p in plan for d in p)
    loads = _loads(costs, plan)
    assert sum(loads) == pytest.approx(sum(map(sum, costs)))  # no row lost or counted twice
    largest = max((c for cs in costs for c in cs), default=0.0)
    assert max(loads) <= sum(loads) / world + largest + 1e-6, (loads, largest)
    assert max(loads) <= max(_loads(costs, [[r] * len(c) for r, c in enumerate(costs)])) + 1e-6  # never worse
    return loads


def test_twice_the_tokens_on_one_rank_moves_a_quarter_of_them():
    costs = [[100.0] * 8, [100.0] * 4]
    plan = balanced_assignment(costs)
    assert _check_plan(costs, plan) == [600.0, 600.0]
    assert plan[1] == [1] * 4 and plan[0].count(1) == 2  # the fewest moves: two rows of rank 0, none of rank 1


def test_a_rank_with_no_rows_gets_half():
    costs = [[5.0, 9.0, 3.0, 7.0, 1.0, 6.0], []]
    plan = balanced_assignment(costs)
    loads = _check_plan(costs, plan)
    assert loads == [16.0, 15.0]


def test_balanced_ranks_move_nothing():
    costs = [[10.0, 20.0, 30.0], [31.0, 29.0], [60.0]]
    assert balanced_assignment(costs) == [[0, 0, 0], [1, 1], [2]]
    # four equal rows on three ranks: the busiest holds two whatever moves, so nothing does
    assert balanced_assignment([[10.0, 10.0], [10.0, 10.0], []]) == [[0, 0], [1, 1], []]
    # unbalanced by less than any move can fix: nothing moves either
    assert balanced_assignment([[50.0, 50.0], [90.0]]) == [[0, 0], [1]]


@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_random_costs_balance_within_the_largest_row(world):
    rng = random.Random(world)
    for _ in range(200):
        costs = [[float(rng.randint(1, 2000)) for _ in range(rng.choice([0, 1, 3, 10, 25]))] for _ in range(world)]
        units = [[rng.randint(0, max(1, len(c) // 3)) for _ in c] for c in costs]
        _check_plan(costs, balanced_assignment(costs))
        _check_plan(costs, balanced_assignment(costs, units))


def test_deterministic():
    rng = random.Random(0)
    costs = [[float(rng.randint(1, 50)) for _ in range(n)] for n in (30, 5, 0, 12)]
    units = [[i // 4 for i in range(len(c))] for c in costs]
    first = balanced_assignment(costs, units)
    assert balanced_assignment([tuple(c) for c in costs], [tuple(u) for u in units]) == first
    assert balanced_assignment(costs, units) == first


def test_trajectories_move_whole_when_the_balance_allows():
    # rank 0: four trajectories of two 10-token turns; rank 1 none: two trajectories move, whole
    costs = [[10.0] * 8, []]
    units = [[0, 0, 1, 1, 2, 2, 3, 3], []]
    plan = balanced_assignment(costs, units)
    assert _check_plan(costs, plan) == [40.0, 40.0]
    for u in range(4):
        assert len({d for d, uu in zip(plan[0], units[0]) if uu == u}) == 1, plan


def test_a_trajectory_too_long_to_keep_whole_is_split():
    # three 30-token trajectories on rank 0: whole, the best is 60/30 (mean 45 + 10 < 60): rows balance 50/40
    costs = [[10.0] * 9, []]
    units = [[0, 0, 0, 1, 1, 1, 2, 2, 2], []]
    assert _check_plan(costs, balanced_assignment(costs, units)) in ([50.0, 40.0], [40.0, 50.0])


def test_bad_costs_are_a_clear_error():
    with pytest.raises(ValueError, match="finite and >= 0"):
        balanced_assignment([[1.0, float("nan")], []])
    with pytest.raises(ValueError, match="one id per row"):
        balanced_assignment([[1.0, 2.0], []], [[0], []])


# ------------------------------------------------------------------ batches of unequal data


def make_batch(rank: int, turns: list[list[tuple[int, int, int]]], *, extras: bool = True) -> RolloutBatch:
    """A batch of ``turns[t]`` = the (prompt, action, teacher prompt) lengths of trajectory ``t``'s turns.

    Every value names its row: tokens ``uid * 100 + position`` (uid = rank * 1000 + row), log-probs and
    advantages likewise, so a row that arrives can be compared position by position with the one sent."""
    rows = [(t, k, lens) for t, traj in enumerate(turns) for k, lens in enumerate(traj)]
    m = len(rows)
    width = max((p + a for _, _, (p, a, _) in rows), default=1)
    t_width = max((tp + a for _, _, (_, a, tp) in rows), default=1)
    ids = torch.full((m, width), PAD, dtype=torch.long)
    attn = torch.zeros((m, width), dtype=torch.long)
    amask = torch.zeros((m, width), dtype=torch.bool)
    t_ids = torch.full((m, t_width), PAD, dtype=torch.long)
    t_attn = torch.zeros((m, t_width), dtype=torch.long)
    t_amask = torch.zeros((m, t_width), dtype=torch.bool)
    old = torch.zeros((m, width))
    for r, (_, _, (p, a, tp)) in enumerate(rows):
        uid = rank * 1000 + r
        ids[r, : p + a] = uid * 100 + torch.arange(p + a) + 10
        attn[r, : p + a] = 1
        amask[r, p : p + a] = True
        t_ids[r, : tp + a] = uid * 100 + torch.arange(tp + a) + 50
        t_attn[r, : tp + a] = 1
        t_amask[r, tp : tp + a] = True
        old[r, p : p + a] = -(uid + torch.arange(a) / 100)
    b = len(turns)
    uids = torch.tensor([rank * 1000 + r for r in range(m)], dtype=torch.long)
    return RolloutBatch(
        input_ids=ids, attention_mask=attn, action_mask=amask, old_logprobs=old,
        teacher_input_ids=t_ids, teacher_attention_mask=t_attn, teacher_action_mask=t_amask,
        turn_traj=torch.tensor([t for t, _, _ in rows], dtype=torch.long),
        turn_index=uids,  # the row's name
        turn_valid=torch.tensor([r % 3 != 0 for r in range(m)], dtype=torch.bool),
        turn_penalties=uids.float() / 7,
        turn_state=torch.tensor([k for _, k, _ in rows], dtype=torch.long),  # equal ids: the k-th turns of this rank
        success=torch.tensor([float((rank + t) % 2) for t in range(b)]),
        rewards=torch.tensor([rank + t / 10 for t in range(b)]),
        group_ids=torch.tensor([rank * 10 + t // 2 for t in range(b)], dtype=torch.long),
        seq_advantages=torch.tensor([rank - t / 3 for t in range(b)]),
        num_turns=torch.tensor([len(traj) for traj in turns], dtype=torch.long),
        trajectories=(),
        student_logprobs=old.clone() if extras else None,
        teacher_logprobs=old * 2 if extras else None,
        ref_logprobs=old * 3 if extras else None,
        is_weights=amask.float() * 0.5 if extras else None,
        turn_advantages=uids.float() / 11 if extras else None,
        advantages=amask.float() * (uids.float()[:, None] + 1),
        credit={"B_k": torch.ones(m)},
    )


def _rows(batch: RolloutBatch, rank: int) -> dict[int, dict]:
    """Each row of ``batch`` by its name: every per-row field (padding cut off), its trajectory's fields and its
    state's name (source rank, state id) where ``rank`` is the batch's source."""
    out = {}
    for i in range(batch.num_rows):
        n, nt = int(batch.attention_mask[i].sum()), int(batch.teacher_attention_mask[i].sum())
        row = {}
        for name in balance.ROW_MATRICES:
            value = getattr(batch, name)
            if value is not None:
                cut = nt if name.startswith("teacher_") and name != "teacher_logprobs" else n
                row[name] = value[i, :cut].tolist()
                fill = PAD if name in balance.PAD_WITH_ID else 0
                assert (value[i, cut:] == fill).all(), f"{name} of row {int(batch.turn_index[i])} is not padded with {fill}"
        for name in balance.ROW_VECTORS:
            value = getattr(batch, name)
            if value is not None and name not in ("turn_traj", "turn_state"):
                row[name] = value[i].item()
        t = int(batch.turn_traj[i])
        row["trajectory"] = tuple(getattr(batch, name)[t].item() for name in balance.TRAJECTORY_FIELDS)
        out[int(batch.turn_index[i])] = row
    return out


def _state_names(batch: RolloutBatch) -> dict[int, int]:
    return {int(u): int(s) for u, s in zip(batch.turn_index, batch.turn_state)}


def check_balanced(before: list[RolloutBatch], after: list[RolloutBatch], teacher_weight: float = 0.0) -> list[float]:
    """Every row arrives exactly once with all its tensors and its trajectory's fields; tokens balanced."""
    sent = {}
    for r, b in enumerate(before):
        sent.update(_rows(b, r))
    arrived: dict[int, dict] = {}
    for r, b in enumerate(after):
        got = _rows(b, r)
        assert not set(got) & set(arrived), f"rows {sorted(set(got) & set(arrived))} arrived twice"
        arrived.update(got)
        assert b.trajectories == () and b.credit == {}
        # equal state ids mean the same (source rank, state) and nothing else
        names = {u: (u // 1000, int(before[u // 1000].turn_state[u % 1000])) for u in _state_names(b)}
        ids = _state_names(b)
        for u in ids:
            for v in ids:
                assert (ids[u] == ids[v]) == (names[u] == names[v]), (u, v)
    assert sorted(arrived) == sorted(sent), "rows lost or invented"
    # the turns of one trajectory (shared prompt prefixes) stay together where the balance allows: here it does
    home = {(u // 1000, int(before[u // 1000].turn_traj[u % 1000])) for u in sent}
    lands = {(u // 1000, int(before[u // 1000].turn_traj[u % 1000]), r) for r, b in enumerate(after) for u in _state_names(b)}
    assert len(lands) == len(home), "a trajectory was split although whole trajectories balance"
    for uid in sent:
        assert arrived[uid] == sent[uid], f"row {uid} changed on the way"
    costs = [row_costs(b, teacher_weight) for b in before]
    loads = [sum(row_costs(b, teacher_weight)) for b in after]
    largest = max((c for cs in costs for c in cs), default=0.0)
    assert max(loads) <= sum(loads) / len(loads) + largest + 1e-6, loads
    return loads


CASES = {
    # rank 0: 5 trajectories of 1-3 turns, long prompts; rank 1: 2 short ones (other widths, other counts)
    "unequal": [
        [[(30, 4, 40), (41, 3, 52), (50, 6, 60)], [(28, 5, 35)], [(33, 2, 45), (40, 4, 47)], [(60, 7, 70)], [(25, 3, 30)]],
        [[(12, 4, 20), (18, 2, 22)], [(9, 3, 15)]],
    ],
    # rank 1 holds no rows at all (every episode faulted)
    "empty_rank": [
        [[(20, 4, 25), (30, 2, 33)], [(21, 5, 26)], [(40, 3, 45)], [(18, 2, 20), (26, 2, 29), (33, 4, 36)]],
        [],
    ],
}


def _simulate(batches: list[RolloutBatch], **kw) -> tuple[list[RolloutBatch], SimulatedWorld]:
    world = SimulatedWorld(len(batches), timeout=30)
    out = world.run(lambda r: balance_rows(batches[r], "update/balance", pad_id=PAD, **kw), join_timeout=60)
    errors = {r: "".join(traceback.format_exception(e, limit=-3)) for r, e in out.items() if isinstance(e, BaseException)}
    if errors:
        raise AssertionError(f"ranks failed: {errors}")
    return [out[r] for r in range(len(batches))], world


def _clone(batch: RolloutBatch) -> RolloutBatch:
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).clone() for f in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, f.name), torch.Tensor)})


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("teacher_weight", [0.0, 1.0])
def test_balance_rows_in_a_simulated_world(case, teacher_weight):
    batches = [make_batch(r, turns) for r, turns in enumerate(CASES[case])]
    copies = [_clone(b) for b in batches]
    after, world = _simulate(batches, teacher_weight=teacher_weight)
    loads = check_balanced(batches, after, teacher_weight)
    before = [sum(row_costs(b, teacher_weight)) for b in batches]
    assert max(loads) < max(before)  # the busiest rank got lighter
    assert world.logs[0] == world.logs[1] == [("gather", "update/balance/costs"), ("gather", "update/balance/rows")]
    for b, c in zip(batches, copies):  # the batch passed in is left as it was
        assert _rows(b, 0) == _rows(c, 0) and b.credit and b.num_rows == c.num_rows


def test_balanced_ranks_issue_one_collective_and_keep_their_batch():
    turns = [[(10, 2, 12)], [(10, 2, 12)]]
    batches = [make_batch(r, [turns[r]]) for r in (0, 1)]
    after, world = _simulate(batches)
    assert after[0] is batches[0] and after[1] is batches[1]
    assert world.logs[0] == world.logs[1] == [("gather", "update/balance/costs")]


def test_optional_fields_left_none_stay_none():
    batches = [make_batch(r, turns, extras=False) for r, turns in enumerate(CASES["unequal"])]
    after, _ = _simulate(batches)
    check_balanced(batches, after)
    assert all(b.ref_logprobs is None and b.turn_advantages is None for b in after)


def test_one_process_returns_the_batch_itself():
    batch = make_batch(0, CASES["unequal"][0])
    assert balance_rows(batch, "update/balance") is batch


def test_every_field_of_the_batch_is_classified(monkeypatch):
    known = balance.ROW_MATRICES + balance.ROW_VECTORS + balance.TRAJECTORY_FIELDS + balance.DROPPED_FIELDS
    assert sorted(known) == sorted(f.name for f in dataclasses.fields(RolloutBatch))
    batch = make_batch(0, CASES["unequal"][0])
    balance.check_fields(batch)
    monkeypatch.setattr(balance, "ROW_VECTORS", tuple(n for n in balance.ROW_VECTORS if n != "turn_valid"))
    with pytest.raises(TypeError, match="turn_valid"):
        balance.check_fields(batch)


def test_a_field_set_on_one_rank_only_is_a_clear_error():
    batches = [make_batch(0, CASES["unequal"][0]), make_batch(1, CASES["unequal"][1], extras=False)]
    with pytest.raises(AssertionError, match="set on some ranks and None on others"):
        _simulate(batches)


def test_the_teacher_view_counts_when_asked():
    batch = make_batch(0, [[(10, 2, 30)]])
    assert row_costs(batch) == [12.0] and row_costs(batch, 1.0) == [44.0] and row_costs(batch, 0.5) == [28.0]


# ------------------------------------------------------------------ two gloo processes


def _gloo_worker(rank: int, init_file: str, case: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))  # a rank left waiting fails in 30 s
    try:
        out = balance_rows(make_batch(rank, CASES[case][rank]), "update/balance", pad_id=PAD)
        results[rank] = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
@pytest.mark.parametrize("case", sorted(CASES))
def test_balance_rows_with_two_gloo_processes(tmp_path, case):
    results = mp.get_context("fork").Manager().dict()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ctx = mp.start_processes(_gloo_worker, args=(str(tmp_path / "init"), case, results), nprocs=2, join=False,
                             start_method="fork")
    deadline = time.monotonic() + 90
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail("the 2 gloo processes are still running after 90 s")
    after = [RolloutBatch(**results[r]) for r in (0, 1)]
    before = [make_batch(r, CASES[case][r]) for r in (0, 1)]
    loads = check_balanced(before, after)
    assert max(loads) < max(sum(row_costs(b)) for b in before)


# ------------------------------------------------------------------ the update on a balanced batch


def test_the_update_gradient_does_not_depend_on_where_rows_live(tiny_walk_policy):
    """Two simulated ranks roll out unequal batches (rank 0 plays twice the tasks); grpo_opsd with the KL and the
    entropy on reads every per-row field (teacher view and logits, reference, advantages). The loss of all rows,
    normalised over both ranks as the update does, gives the same summed gradient before and after balancing,
    and the update runs on the balanced batches with both ranks in step."""
    from agentopsd.training import distributed
    from agentopsd.training.objective import micro_batch_loss
    from tests.agentopsd.training.test_rank_invariant import (
        ALGORITHM_FILES,
        _algorithm,
        _module,
        _same,
        _tasks,
    )

    algo = _algorithm(next(p for p in ALGORITHM_FILES if p.stem == "grpo_opsd"))
    world = SimulatedWorld(2, timeout=60)
    grads: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    tokens: dict[tuple[str, int], float] = {}

    def gradient(module, b: RolloutBatch) -> dict[str, torch.Tensor]:
        local = float(b.action_mask.sum()) if algo.aggregation == "token-mean" else float(b.num_rows)
        normalizer = sum(v[0] for v in distributed.exchange([local], "test/normalizer"))
        module.model.zero_grad(set_to_none=True)
        if b.num_rows:
            rows = torch.arange(b.num_rows)
            micro_batch_loss(algo, module.optim_cfg, module.scorer, b, rows, normalizer)[0].backward()
        return {n: p.grad.clone() for n, p in module.model.named_parameters() if p.grad is not None}

    def rank(r: int) -> None:
        module = _module(tiny_walk_policy, algo, r)
        torch.manual_seed(r)
        batch = module.rollout(_tasks(r))
        module.algorithm.assign(batch, 0)
        balanced = balance_rows(batch, "update/balance", teacher_weight=1.0, pad_id=module.pad_id)
        for name, b in (("as dealt", batch), ("balanced", balanced)):
            grads[(name, r)] = gradient(module, b)
            tokens[(name, r)] = sum(row_costs(b, 1.0))
        module.update(balanced, 0)

    errors = {r: e for r, e in world.run(rank, join_timeout=180).items() if isinstance(e, BaseException)}
    assert not errors, errors
    _same(world)
    assert ("gather", "update/balance/rows") in world.logs[0]  # rows did move
    dealt, balanced = [tokens[("as dealt", r)] for r in (0, 1)], [tokens[("balanced", r)] for r in (0, 1)]
    assert max(balanced) < max(dealt) and sum(balanced) == sum(dealt)
    for name in grads[("as dealt", 0)]:
        total = {how: sum(grads[(how, r)][name] for r in (0, 1) if name in grads[(how, r)]) for how in ("as dealt", "balanced")}
        torch.testing.assert_close(total["balanced"], total["as dealt"], rtol=1e-4, atol=1e-6, msg=name)
