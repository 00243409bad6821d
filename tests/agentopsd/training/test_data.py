"""Task stream determinism and state, and collation of trajectories."""

from __future__ import annotations

import torch

from agentopsd.training.data import TaskStream, collate_trajectories, sample_tasks
from agentopsd.types import TaskSpec, Trajectory, Turn


def test_sample_tasks_is_a_pure_function_of_seed_and_iteration():
    a = sample_tasks("x", 100, 4, 3, iteration=5, seed=1)
    assert a == sample_tasks("x", 100, 4, 3, iteration=5, seed=1)
    assert a != sample_tasks("x", 100, 4, 3, iteration=6, seed=1)
    assert len(a) == 12
    for g in range(4):  # G copies share the task and the env seed, and one group id
        copies = a[3 * g : 3 * g + 3]
        assert len({(t.task_index, t.seed, t.group_id) for t in copies}) == 1
    assert len({t.group_id for t in a}) == 4


def test_task_stream_state_round_trip():
    s = TaskStream("x", 10, 2, 2, num_iterations=5, seed=0)
    it = iter(s)
    first = [next(it) for _ in range(3)]
    state = s.state_dict()
    resumed = TaskStream("x", 10, 2, 2, num_iterations=5, seed=0)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert [b.iteration for b in first] == [0, 1, 2] and [b.iteration for b in rest] == [3, 4]
    assert rest[0] == next(it)
    assert len(s) == 5


def _traj(group: int, success: bool, turns: int, fault: str | None = None) -> Trajectory:
    spec = TaskSpec("x", "train", 0, 0, group)
    ts = tuple(
        Turn(k, (1, 2, 3), (1, 9, 2, 3), (5, 6), (-0.5, -0.25), "<action>a</action>", "a", "obs", float(success and k == turns - 1), True,
             penalty=0.0, state=f"state {k}")
        for k in range(turns)
    )
    return Trajectory(spec, ts, success, float(success), "t", turns, "skill", fault, False, reward=float(success))


def test_collate_rows_masks_and_faults():
    trajs = [_traj(0, True, 2), _traj(0, False, 3), _traj(0, False, 1, fault="step: RuntimeError: boom"), _traj(1, True, 1), _traj(1, True, 2)]
    b = collate_trajectories(trajs, pad_id=0)
    assert b.num_trajectories == 4 and b.num_rows == 2 + 3 + 1 + 2  # the faulted one is left out
    assert b.turn_traj.tolist() == [0, 0, 1, 1, 1, 2, 3, 3] and b.turn_index.tolist() == [0, 1, 0, 1, 2, 0, 0, 1]
    assert b.input_ids[0, :5].tolist() == [1, 2, 3, 5, 6] and b.action_mask[0].tolist() == [False, False, False, True, True]
    assert b.teacher_input_ids[0, :6].tolist() == [1, 9, 2, 3, 5, 6]
    assert torch.equal(b.teacher_input_ids[b.teacher_action_mask], b.input_ids[b.action_mask])
    assert b.old_logprobs[0, 3:5].tolist() == [-0.5, -0.25]
    # group 0 keeps its two healthy members: +/- equal advantages; group 1 is all-success: 0
    assert b.seq_advantages[0] > 0 > b.seq_advantages[1] and b.seq_advantages[2:].tolist() == [0.0, 0.0]
