"""agentopsd.training.offload: AdamW's states leave the device and come back exactly, plain tensors and FSDP2 DTensors alike."""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch

from agentopsd.training.offload import offload_optimizer_states, restore_optimizer_states, state_bytes
from tests.agentopsd.models.test_meta_build import torchrun_watched


def _model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()


def test_states_move_to_new_storage_and_round_trip_exactly() -> None:
    model, opt = _model_and_optimizer()
    assert offload_optimizer_states(opt) == 0  # before the first step AdamW has no states: nothing to move
    _step(model, opt, 1)
    before = {(id(p), k): v for p, s in opt.state.items() for k, v in s.items()}
    expected = sum(p.numel() * 4 * 2 for p in model.parameters())  # exp_avg + exp_avg_sq, float32
    assert state_bytes(opt) == expected
    assert offload_optimizer_states(opt, pin_memory=False) == expected
    for p, s in opt.state.items():
        for k, v in s.items():
            old = before[(id(p), k)]
            if k == "step":  # the 0-dim step counter stays where AdamW keeps it
                assert v is old
                continue
            assert v.device.type == "cpu" and v.untyped_storage().data_ptr() != old.untyped_storage().data_ptr()  # a copy
            assert torch.equal(v, old)
    # to the meta device: every state tensor really goes where it is told (and keeps its shape)
    meta_model, meta_opt = _model_and_optimizer()
    _step(meta_model, meta_opt, 1)
    assert restore_optimizer_states(meta_opt, "meta") == expected
    assert all(v.device.type == "meta" for s in meta_opt.state.values() for k, v in s.items() if k != "step")
    # back: the states are the originals bit for bit, and the next step is the step without the round trip
    assert restore_optimizer_states(opt, torch.device("cpu")) == expected
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, before[(id(p), k)])
    control, control_opt = _model_and_optimizer()
    _step(control, control_opt, 1)
    _step(model, opt, 2)
    _step(control, control_opt, 2)
    for a, b in zip(model.parameters(), control.parameters(), strict=True):
        assert torch.equal(a, b)


FSDP_SCRIPT = textwrap.dedent('''
    import datetime, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from agentopsd.training.offload import offload_optimizer_states, restore_optimizer_states, state_bytes

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 6))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def step(model, opt, seed):
        rows = 3 + 4 * rank  # unequal data per rank
        x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed + 100 * rank))
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    model, opt = build()
    control, control_opt = build()
    for m, o in ((model, opt), (control, control_opt)):
        step(m, o, 1)
    states = [(k, v) for s in opt.state.values() for k, v in s.items() if k != "step"]
    assert states and all(isinstance(v, DTensor) for _, v in states)
    snapshot = [(k, v.placements, v.shape, v.to_local().clone(), v.to_local().untyped_storage().data_ptr()) for k, v in states]
    moved = offload_optimizer_states(opt, pin_memory=False)
    assert moved == state_bytes(opt) > 0
    after = [(k, v) for s in opt.state.values() for k, v in s.items() if k != "step"]
    for (k, placements, shape, local, ptr), (k2, v) in zip(snapshot, after, strict=True):
        assert k == k2 and isinstance(v, DTensor) and v.placements == placements and v.shape == shape
        assert v.to_local().untyped_storage().data_ptr() != ptr and torch.equal(v.to_local(), local)
    assert restore_optimizer_states(opt, "cpu") == moved
    for (k, placements, shape, local, _), v in zip(snapshot, [v for s in opt.state.values() for k, v in s.items() if k != "step"], strict=True):
        assert isinstance(v, DTensor) and v.placements == placements and torch.equal(v.to_local(), local)
    for m, o in ((model, opt), (control, control_opt)):
        step(m, o, 2)
    for a, b in zip(model.parameters(), control.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local())
    print(f"OFFLOAD-OK rank {rank}: {len(states)} DTensor states, {moved} bytes", flush=True)
    from tests.torchrun_exit import leave
    leave()  # not a normal exit: see tests/torchrun_exit.py
''')


def test_fsdp2_dtensor_states_keep_their_placements_and_round_trip_on_two_processes(tmp_path: Path) -> None:
    """2 gloo processes, fully_shard-ed layers, unequal rows per rank: each rank's shards move, keep their
    placements and come back bit for bit; the next step equals a control run's."""
    script = tmp_path / "offload_fsdp.py"
    script.write_text(FSDP_SCRIPT)
    out = torchrun_watched(script, timeout=180)
    assert out.count("OFFLOAD-OK") == 2, out
