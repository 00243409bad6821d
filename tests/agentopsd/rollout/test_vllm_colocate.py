"""The colocated vLLM engine against a fake ``vllm`` module: arguments and environment on a simulated
rank 3 of 8, the streamed weight sync (order, dtype, tied weights, memory), the skipped first sync,
and sleep mode's order (wake weights, load, wake KV cache) with weights really updated after a wake.

The real engine is checked in test_vllm_backend.py (one process) and by scripts/vllm_colocate_check.py
(two processes, vLLM CPU build); sleep mode has no CPU implementation in vLLM, so only this fake
checks it here (scripts/gpu_check.sh checks it on a GPU).
"""

from __future__ import annotations

import gc
import logging
import sys
import types
import weakref

import pytest
import torch
from torch import nn

from agentopsd.rollout import vllm_backend
from agentopsd.rollout.base import SamplingConfig
from agentopsd.rollout.vllm_backend import VLLMGenerator, iter_full_weights
from tests.fakes.fake_engine import fake_vllm_modules


class FakeModel:
    """The engine's model: weights by name; ``load_weights`` consumes an iterator like vLLM's."""

    def __init__(self, events: list) -> None:
        self.events = events
        self.weights: dict[str, torch.Tensor] = {}

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            self.events.append(("load", name, tensor.dtype))
            self.weights[name] = tensor.clone()


class FakeLLM:
    """Records its arguments and the environment at construction; sleeps and wakes like vLLM."""

    instances: list[FakeLLM] = []
    sleep_available = False

    def __init__(self, **kwargs) -> None:
        import os

        self.kwargs = kwargs
        self.environ = dict(os.environ)
        self.events: list = []
        self.model = FakeModel(self.events)
        self.model.weights = {"w": torch.zeros(2)}  # what it "loaded from model_path"
        runner = types.SimpleNamespace(model=self.model)
        worker = types.SimpleNamespace(model_runner=runner)
        executor = types.SimpleNamespace(driver_worker=worker)
        self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(engine_core=types.SimpleNamespace(model_executor=executor)))
        self.awake = {"weights": True, "kv_cache": True}
        FakeLLM.instances.append(self)

    def sleep(self, level: int = 1) -> None:
        self.events.append(("sleep", level))
        self.awake = {"weights": False, "kv_cache": False}
        self.model.weights = {n: torch.full_like(t, float("nan")) for n, t in self.model.weights.items()}  # dropped

    def wake_up(self, tags=None) -> None:
        self.events.append(("wake_up", tuple(tags or ())))
        for tag in tags or ("weights", "kv_cache"):
            self.awake[tag] = True

    def reset_prefix_cache(self) -> None:
        self.events.append(("reset_prefix_cache",))

    def generate(self, inputs, params, use_tqdm=False):
        assert all(self.awake.values()), f"generate while asleep: {self.awake}"
        value = float(self.model.weights["w"].sum())
        self.events.append(("generate", len(inputs)))
        out = []
        for prompt in inputs:
            token = int(value) if value == value else -1  # nan: stale weights
            step = {token: types.SimpleNamespace(logprob=-0.5)}
            completion = types.SimpleNamespace(token_ids=[token], logprobs=[step], finish_reason="length", stop_reason=None,
                                               prompt=prompt)
            out.append(types.SimpleNamespace(outputs=[completion]))
        return out


@pytest.fixture
def fake_vllm(monkeypatch):
    """A ``vllm`` package with what the backend touches."""
    FakeLLM.instances = []
    FakeLLM.sleep_available = False
    modules = fake_vllm_modules(FakeLLM, sleep_available=lambda: FakeLLM.sleep_available)
    mod = modules["vllm"]
    for name, m in modules.items():
        monkeypatch.setitem(sys.modules, name, m)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "VLLM_ENABLE_V1_MULTIPROCESSING", "PYTORCH_CUDA_ALLOC_CONF",
                "VLLM_ALLOW_INSECURE_SERIALIZATION"):
        monkeypatch.setenv(var, "x")  # recorded: what the generator sets is undone after the test
        monkeypatch.delenv(var)
    monkeypatch.setattr(vllm_backend, "resolve_model_path", lambda p: f"/models/{p}")
    return mod


@pytest.fixture
def rank_3_of_8(monkeypatch):
    """torch.distributed says rank 3 of 8 (as under Lightning's launcher, which sets LOCAL_RANK, not RANK)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")


def _tok():
    return types.SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))


def test_rank_3_of_8_gets_its_own_in_process_engine_and_seed(fake_vllm, rank_3_of_8):
    gen = VLLMGenerator("qwen", _tok(), gpu_memory_utilization=0.4, dtype="bfloat16", max_num_seqs=16,
                        max_model_len=2560, seed=42)
    (llm,) = FakeLLM.instances
    kw = llm.kwargs
    assert kw["distributed_executor_backend"] == "external_launcher"
    assert kw["seed"] == 45 and gen.engine_seed == 45  # seed + global rank
    assert kw["max_num_seqs"] == 16 and kw["max_model_len"] == 2560
    assert kw["tensor_parallel_size"] == 1 and kw["gpu_memory_utilization"] == 0.4 and kw["dtype"] == "bfloat16"
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["model"] == "/models/qwen"
    assert "enable_sleep_mode" not in kw  # the fake platform (like CPU) has none
    env = llm.environ
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("3", "3", "8")
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert gen._in_process_worker() is not None  # the sync reaches the model in this process


def test_local_rank_is_the_current_cuda_device(fake_vllm, rank_3_of_8, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)  # rank 3 of node 0 could sit anywhere
    monkeypatch.setenv("LOCAL_RANK", "0")
    VLLMGenerator("qwen", _tok())
    assert FakeLLM.instances[0].environ["LOCAL_RANK"] == "5"


def test_tensor_parallel_pairs_share_a_seed_and_generate_together(fake_vllm, rank_3_of_8, monkeypatch):
    monkeypatch.setattr(vllm_backend, "_tensor_parallel_group", lambda size: "tp-group")
    gathered = []

    def gather(value, group, size):
        gathered.append((value, group, size))
        return [[[7, 7], [8]], value]  # rank 2's two prompts, then rank 3's

    monkeypatch.setattr(vllm_backend, "_gather_in_group", gather)
    gen = VLLMGenerator("qwen", _tok(), tensor_parallel_size=2, seed=10)
    assert FakeLLM.instances[0].kwargs["tensor_parallel_size"] == 2
    assert gen.engine_seed == 11  # ranks 2 and 3 form group 1
    out = gen.generate([[1, 2, 3]], SamplingConfig(max_new_tokens=4))
    assert len(out) == 1 and FakeLLM.instances[0].events[-1] == ("generate", 3)
    assert gen.generate([], SamplingConfig(max_new_tokens=4)) == []  # still gathers: the other rank may have prompts
    assert len(gathered) == 2 and gathered[1][0] == []
    with pytest.raises(ValueError, match="divide the world size"):
        VLLMGenerator("qwen", _tok(), tensor_parallel_size=3)


def test_one_process_without_a_group_still_runs_in_process(fake_vllm):
    VLLMGenerator("qwen", _tok(), seed=3)
    llm = FakeLLM.instances[0]
    assert "distributed_executor_backend" not in llm.kwargs and llm.kwargs["seed"] == 3
    assert llm.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "RANK" not in llm.environ
    VLLMGenerator("qwen", _tok(), colocate=False)  # vLLM's own engine process, on request
    assert FakeLLM.instances[1].environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


# ------------------------------------------------------------------------------------------ the sync


class Policy(nn.Module):
    """Tied embedding and head (as Qwen2.5 up to 3B), float32 master weights."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


def test_stream_is_bf16_in_state_dict_order_tied_weights_under_both_names():
    model = Policy()
    items = list(iter_full_weights(model))
    names = [n for n, _ in items]
    assert names == list(model.state_dict()) and names[-1] == "head.weight"
    assert all(t.dtype == torch.bfloat16 for _, t in items)
    assert torch.equal(items[0][1], model.embed.weight.detach().to(torch.bfloat16))
    assert [t.dtype for _, t in iter_full_weights(model, None)] == [torch.float32] * len(names)


def test_at_most_two_full_tensors_are_alive_while_streaming():
    model = Policy()
    refs: list[weakref.ref] = []
    most = 0
    for _name, tensor in iter_full_weights(model):
        refs.append(weakref.ref(tensor))
        del tensor  # a consumer that copies into its own buffer and lets go, as load_weights does
        gc.collect()
        most = max(most, sum(r() is not None for r in refs))
    assert len(refs) == 10 and most <= 2
    hold: list[torch.Tensor] = []
    for _name, tensor in iter_full_weights(model):  # the old path's list(...) would hold every one
        hold.append(tensor)
    assert len(hold) == 10


def test_first_sync_is_skipped_when_the_engine_loaded_the_same_weights(fake_vllm):
    gen = VLLMGenerator("qwen", _tok(), loaded_step=0)
    llm = FakeLLM.instances[0]
    model = nn.Module()
    model.w = nn.Parameter(torch.tensor([1.0, 2.0]))
    gen.sync_weights(model, step=0)
    assert not [e for e in llm.events if e[0] == "load"] and gen.synced_bytes == 0
    gen.sync_weights(model, step=1)  # after an update
    assert ("load", "w", torch.bfloat16) in llm.events and gen.synced_bytes == 4
    n = len(llm.events)
    gen.sync_weights(model, step=1)  # evaluation right after the rollout's sync: same weights
    assert len(llm.events) == n
    gen.sync_weights(model)  # no step: always
    assert len(llm.events) > n
    unknown = VLLMGenerator("qwen", _tok())  # loaded_step None (a resumed run): even step 0 syncs
    unknown.sync_weights(model, step=0)
    assert [e[0] for e in FakeLLM.instances[1].events] == ["load", "reset_prefix_cache"]


# ------------------------------------------------------------------------------------------ sleep mode


def test_sleep_mode_off_with_one_log_line_where_the_platform_has_none(fake_vllm, caplog):
    with caplog.at_level(logging.INFO, logger="agentopsd.rollout.vllm_backend"):
        gen = VLLMGenerator("qwen", _tok())
    assert not gen.sleep_mode and "enable_sleep_mode" not in FakeLLM.instances[0].kwargs
    assert len([r for r in caplog.records if "sleep mode: off" in r.getMessage()]) == 1
    gen.sleep()  # a no-op
    assert not gen.asleep and not any(e[0] == "sleep" for e in FakeLLM.instances[0].events)


def test_sleep_mode_refuses_expandable_segments(fake_vllm, monkeypatch):
    FakeLLM.sleep_available = True
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert not VLLMGenerator("qwen", _tok()).sleep_mode


def test_wake_weights_then_sync_then_kv_cache_and_the_weights_are_the_new_ones(fake_vllm):
    FakeLLM.sleep_available = True
    gen = VLLMGenerator("qwen", _tok(), loaded_step=0)
    llm = FakeLLM.instances[0]
    assert llm.kwargs["enable_sleep_mode"] is True and gen.sleep_mode
    model = nn.Module()
    model.w = nn.Parameter(torch.tensor([1.0, 2.0]))
    sampling = SamplingConfig(max_new_tokens=1)
    gen.sync_weights(model, step=0)  # the loaded weights: skipped
    assert gen.generate([[1]], sampling)[0].token_ids == (0,)  # the engine's own (zeros)
    gen.sleep()
    assert llm.events[-1] == ("sleep", 2) and gen.asleep
    with pytest.raises(RuntimeError, match="asleep"):
        gen.generate([[1]], sampling)
    llm.events.clear()
    # the update did not change the weights (step still 0): after a level-2 sleep they must be loaded anyway
    gen.sync_weights(model, step=0)
    kinds = [e[0] if e[0] != "wake_up" else e for e in llm.events]
    assert kinds == [("wake_up", ("weights",)), "load", ("wake_up", ("kv_cache",)), "reset_prefix_cache"]
    assert gen.generate([[1]], sampling)[0].token_ids == (3,)  # 1 + 2: the model's weights, not the dropped ones
    with torch.no_grad():
        model.w.mul_(2)
    gen.sleep()
    gen.sync_weights(model, step=1)
    assert gen.generate([[1]], sampling)[0].token_ids == (6,)
    assert not gen.asleep and gen.engine_step == 1


def test_a_failed_load_leaves_the_weights_unknown(fake_vllm):
    gen = VLLMGenerator("qwen", _tok(), loaded_step=0)

    class Broken(nn.Module):
        def state_dict(self, *a, **k):
            raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError):
        gen.sync_weights(Broken(), step=1)
    assert gen.engine_step is None
