"""agentopsd.rollout.scoring: shared prompt prefixes computed once give the plain forward's hidden states."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from agentopsd.rollout.scoring import checkpointing, hidden_at, pack_by_length, shared_prefixes, sharing_order


def test_prefix_groups_share_only_where_it_saves_tokens():
    a, b, c = (1,) * 30 + (2,), (1,) * 30 + (3, 4), (1,) * 10 + (5,)
    groups = shared_prefixes([a, b, c], min_shared=16)
    assert sorted((sorted(m), s) for m, s in groups) == [([0, 1], 30), ([2], 0)]  # alone: nothing shared
    # a third member sharing only 20 of the pair's 30 tokens saves 2 * 20 >= 30: it joins
    d = (1,) * 20 + (6,)
    assert sorted((sorted(m), s) for m, s in shared_prefixes([a, b, d], 16)) == [([0, 1, 2], 20)]
    # 10 tokens in common < 16: each row alone; identical rows share all but their last token
    assert sorted((sorted(m), s) for m, s in shared_prefixes([c, c], 16)) == [([0], 0), ([1], 0)]
    assert shared_prefixes([a, a], 16) == [([0, 1], 30)]


def test_identical_prompts_do_not_keep_the_rest_of_their_task_from_sharing():
    base = tuple(range(3, 48))  # 45 tokens: system prompt, task, skills
    same = [base + (50, 51, 52, 53, 54)] * 5  # the same no-history turn, five times
    other = [base + (60 + i, 61, 62, 63, 64) for i in range(5)]
    groups = shared_prefixes(same + other, min_shared=16)
    assert [(sorted(m), s) for m, s in groups] == [(list(range(10)), 45)]  # 9 * 45 > 4 * 49 + 4 * 45


def _saved(rows, groups) -> int:
    return sum((len(m) - 1) * s for m, s in groups)


def _best_over_all_partitions(rows, min_shared) -> int:
    def common(members):
        limit = min(len(rows[r]) for r in members) - 1
        n = 0
        while n < limit and len({rows[r][n] for r in members}) == 1:
            n += 1
        return n if n >= min_shared else 0

    def partitions(items):
        if not items:
            yield []
            return
        head, rest = items[0], items[1:]
        for part in partitions(rest):
            yield [[head], *part]
            for i in range(len(part)):
                yield part[:i] + [[head, *part[i]]] + part[i + 1 :]

    return max(sum((len(g) - 1) * common(g) for g in p if len(g) > 1) for p in partitions(list(range(len(rows)))))


@pytest.mark.parametrize("seed", range(12))
def test_prefix_groups_save_as_much_as_the_best_of_all_partitions(seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(6):  # few symbols and short rows: many partial overlaps
        n = int(torch.randint(1, 9, (1,), generator=g))
        rows.append(tuple(torch.randint(0, 2, (n,), generator=g).tolist()))
    for min_shared in (1, 3):
        groups = shared_prefixes(rows, min_shared)
        assert sorted(r for m, _ in groups for r in m) == list(range(len(rows)))
        for m, s in groups:  # what a group claims to share, it shares
            assert all(rows[r][:s] == rows[m[0]][:s] and len(rows[r]) > s for r in m)
        assert _saved(rows, groups) == _best_over_all_partitions(rows, min_shared)


@pytest.fixture(scope="module")
def decoder():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    model = Qwen2ForCausalLM(cfg).eval()
    return model.get_decoder()


def _batch(rows: list[list[int]], actions: list[int]):
    """Right-padded ids/mask, and the positions predicting each row's last ``actions[r]`` tokens."""
    width = max(len(r) for r in rows) + 2
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    source = torch.zeros_like(ids, dtype=torch.bool)
    for i, (r, n) in enumerate(zip(rows, actions)):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        source[i, len(r) - n - 1 : len(r) - 1] = True
    return ids, attn, source


def test_hidden_states_equal_the_plain_forward(decoder):
    g = torch.Generator().manual_seed(1)
    skill_a = torch.randint(3, 64, (40,), generator=g).tolist()
    skill_b = torch.randint(3, 64, (25,), generator=g).tolist()
    rows, actions = [], []
    for prefix in (skill_a, skill_b):  # several turns per task: a shared prefix, then their own part
        for _ in range(3):
            own = torch.randint(3, 64, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
            rows.append(prefix + own)
            actions.append(min(3, len(own) - 1))
    rows.append(torch.randint(3, 64, (30,), generator=g).tolist())  # a row sharing nothing
    actions.append(4)
    rows.append(skill_a[:20] + [5, 6])  # shares fewer tokens with the skill_a group
    actions.append(1)
    ids, attn, source = _batch(rows, actions)
    with torch.no_grad():
        plain = decoder(input_ids=ids, attention_mask=attn).last_hidden_state[source]
        shared = hidden_at(decoder, ids, attn, source)
        chunked = hidden_at(decoder, ids, attn, source, budget=60)  # rows' own parts in several forwards
        alone = hidden_at(decoder, ids, attn, source, min_shared=10_000)  # nothing shared: chunks only
        alone_chunked = hidden_at(decoder, ids, attn, source, min_shared=10_000, budget=60)
    assert shared.shape == plain.shape
    torch.testing.assert_close(alone, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone_chunked, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked, plain, atol=1e-5, rtol=1e-5)


def test_rows_with_no_tokens_give_no_hidden_states(decoder):
    ids = torch.zeros(3, 5, dtype=torch.long)
    attn = torch.zeros(3, 5, dtype=torch.long)
    with torch.no_grad():
        out = hidden_at(decoder, ids, attn, torch.zeros(3, 5, dtype=torch.bool))
    assert out.shape == (0, decoder.config.hidden_size)


def test_the_shared_part_stops_before_the_first_scored_position(decoder):
    # identical prompts whose scored positions start early: the prefix must not swallow them
    prompt = list(range(3, 40))
    rows = [prompt, prompt, prompt[:30] + [7, 8, 9]]
    ids, attn, source = _batch(rows, [20, 20, 2])
    with torch.no_grad():
        plain = decoder(input_ids=ids, attention_mask=attn).last_hidden_state[source]
        torch.testing.assert_close(hidden_at(decoder, ids, attn, source), plain, atol=1e-5, rtol=1e-5)


def _chunk_tokens(chunks, parts, overhead):
    return sum(len(c) * max(parts[i][1] for i in c) + overhead for c in chunks)


def _fits(chunk, parts, budget):
    return len(chunk) == 1 or len(chunk) * (max(parts[i][0] for i in chunk) + max(parts[i][1] for i in chunk)) <= budget


@pytest.mark.parametrize("seed", range(10))
def test_length_chunks_are_the_cheapest_split_that_fits_the_budget(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    parts = [(rng.choice([0, 0, 5, 40]), rng.randint(1, 60)) for _ in range(n)]
    items = sorted(range(n), key=lambda i: parts[i][1])
    budget, overhead = rng.choice([60, 150, 400]), rng.choice([0, 10, 50])
    chunks = pack_by_length(items, parts, budget, overhead)
    assert [i for c in chunks for i in c] == items  # every item once, order kept
    assert all(_fits(c, parts, budget) for c in chunks)
    best = min(  # brute force: every way to cut the sorted items into consecutive chunks
        _chunk_tokens(split, parts, overhead)
        for cuts in itertools.product([False, True], repeat=n - 1)
        for split in [_split(items, cuts)]
        if all(_fits(c, parts, budget) for c in split)
    )
    assert _chunk_tokens(chunks, parts, overhead) == best


def _split(items, cuts):
    out, current = [], [items[0]]
    for item, cut in zip(items[1:], cuts):
        if cut:
            out.append(current)
            current = []
        current.append(item)
    return out + [current]


def test_length_chunks_pay_less_padding_than_filling_each_chunk_in_turn():
    # rows of 10..73 tokens, 2,656 in all: filling each chunk to the budget in turn makes chunks of
    # 27, 18, 14 and 5 rows that run 3,261 padded tokens (23% padding)
    parts = [(0, 10 + i) for i in range(64)]
    chunks = pack_by_length(list(range(64)), parts, budget=1024, overhead=16)
    padded = sum(len(c) * max(parts[i][1] for i in c) for c in chunks)
    assert padded + 16 * len(chunks) < 3261 + 16 * 4
    assert padded < 1.1 * 2656, padded
    assert pack_by_length([], [], 100) == [[]]


def test_gradients_through_shared_prefixes_equal_the_plain_forward(decoder):
    """The update runs shared prefixes once with gradient: each weight's gradient must be the plain
    forward's (a prefix read by G rows gets the sum of their gradients)."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 64, (30,), generator=g).tolist()
    rows = [prompt + torch.randint(3, 64, (int(n),), generator=g).tolist() for n in (4, 6, 5, 7)]
    rows.append(torch.randint(3, 64, (12,), generator=g).tolist())  # shares nothing
    ids, attn, source = _batch(rows, [3, 4, 4, 5, 6])
    weights = torch.randn(int(source.sum()), decoder.config.hidden_size, generator=g)
    grads = []
    for run in (lambda: decoder(input_ids=ids, attention_mask=attn).last_hidden_state[source],
                lambda: hidden_at(decoder, ids, attn, source)):
        decoder.zero_grad(set_to_none=True)
        (run() * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in decoder.named_parameters() if p.grad is not None})
    plain, shared = grads
    assert plain.keys() == shared.keys() and plain
    for name in plain:
        torch.testing.assert_close(shared[name], plain[name], atol=1e-5, rtol=1e-4, msg=name)


def test_sharing_order_puts_rows_of_one_prefix_side_by_side():
    a, b = [5, 6, 7, 8], [9, 9, 9]
    rows = [a + [1], b + [2, 2], a + [3], b + [4], a + [2]]
    width = max(map(len, rows)) + 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], attn[i, : len(r)] = torch.tensor(r), 1
    order = sharing_order(ids, attn).tolist()
    assert sorted(order) == list(range(len(rows)))
    assert order == [0, 4, 2, 1, 3]  # a's rows together, then b's; padding never decides



def test_activation_checkpointing_is_seen_and_a_missing_cache_is_an_error():
    """Under activation checkpointing transformers drops the KV cache in training: the shared path
    would run rows without their prefix, so the module must see it (and take the plain forward)."""
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    model = Qwen2ForCausalLM(cfg)
    model.gradient_checkpointing_enable()
    decoder = model.get_decoder().train()
    assert checkpointing(decoder)
    with torch.no_grad():
        assert not checkpointing(decoder)
    assert not checkpointing(decoder.eval())
    ids, attn, source = _batch([[5] * 20 + [6, 7], [5] * 20 + [8, 9, 10]], [1, 2])
    with pytest.raises(RuntimeError, match="no KV cache"):
        hidden_at(decoder.train(), ids, attn, source)


@pytest.fixture()
def policy():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).train()


def _rollout_batch(rows: list[list[int]], actions: list[int]):
    """A RolloutBatch whose rows are ``rows`` with their last ``actions[r]`` tokens as the action."""
    from agentopsd.rollout.scoring import Scorer

    ids, attn, source = _batch(rows, actions)
    amask = torch.zeros_like(source)
    amask[:, 1:] = source[:, :-1]
    rb, _ = Scorer(None, 0, 1.0, 1, 0, torch.device("cpu")).placeholder_batch(with_reference=False)
    rb.input_ids, rb.attention_mask, rb.action_mask = ids, attn, amask
    rb.old_logprobs = torch.zeros(ids.shape)
    return rb


@pytest.mark.parametrize("sharded", [False, True], ids=["decoder-and-head", "whole-model"])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_log_probs_and_entropy_equal_the_unchunked_path_with_gradients(policy, sharded, chunk):
    """optim.logits_chunk_tokens: the same log-probs, entropies and weight gradients as all positions at once, on
    the decoder + head path and on the whole-model call a sharded policy takes (the head hooked)."""
    from agentopsd.rollout.scoring import Scorer

    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 96, (20,), generator=g).tolist()
    rows = [prompt + torch.randint(3, 96, (int(n),), generator=g).tolist() for n in (5, 8, 3)]
    rows.append(torch.randint(3, 96, (9,), generator=g).tolist())
    rb = _rollout_batch(rows, [4, 7, 2, 5])
    idx = torch.arange(rb.num_rows)
    w_lp, w_ent = torch.randn(rb.action_mask.shape, generator=g), torch.randn(rb.action_mask.shape, generator=g)
    results = []
    for chunk_tokens in (0, chunk):
        policy.zero_grad(set_to_none=True)
        scorer = Scorer(policy, 0, 0.7, 2, 0, torch.device("cpu"), sharded=sharded, logits_chunk_tokens=chunk_tokens)
        lp, ent, logits = scorer.logprobs_and_entropy(rb, idx, entropy=True)
        assert logits is None
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        with torch.no_grad():
            scored = scorer.action_logprobs(rb, "student", grad=False)
        results.append((lp.detach(), ent.detach(), grads, scored))
    (lp0, ent0, grads0, scored0), (lp1, ent1, grads1, scored1) = results
    assert (lp0[~rb.action_mask] == 0).all() and (lp0[rb.action_mask] < 0).all() and (ent0[rb.action_mask] > 0).all()
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scored1, scored0, atol=1e-5, rtol=1e-5)
    assert grads0.keys() == grads1.keys() and "model.embed_tokens.weight" in grads0
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], atol=1e-5, rtol=1e-4, msg=name)


def test_chunked_head_holds_one_chunk_of_logits_forward_and_backward():
    """Checkpointed chunks: the peak of the head and log-softmax (forward and backward) is one chunk's logits,
    not all positions' (without the checkpoint the saved float32 copies of every chunk add up)."""
    from agentopsd.rollout.scoring import chunked_scores
    from agentopsd.tools.memory import measure_cpu_peak

    torch.manual_seed(0)
    positions, hidden_size, vocab = 512, 16, 8192
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(positions, hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (positions,))

    def peak(chunk: int) -> int:
        def step():
            lp, ent = chunked_scores(head, hidden, targets, 1.0, entropy=True, chunk=chunk)
            (lp.sum() + ent.sum()).backward()
        head.zero_grad(set_to_none=True)
        hidden.grad = None
        return measure_cpu_peak(step)[1]

    logit_bytes = positions * vocab * 4  # one float32 copy of all positions' logits: 16 MiB
    whole, chunked = peak(positions), peak(64)
    assert whole > 4 * logit_bytes  # the log-softmax's and entropy's float32 copies and their gradients
    # 64 of 512 positions: one chunk's copies, plus the head's weight gradient and the [n] outputs
    assert chunked < logit_bytes, (whole, chunked)


CHUNKED_FSDP_SCRIPT = """
import datetime, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen2Config, Qwen2ForCausalLM
from agentopsd.rollout.scoring import Scorer
from agentopsd.training.strategies import prepare_policy

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))  # a lost rank fails in 30 s
rank = dist.get_rank()
torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
model = Qwen2ForCausalLM(cfg).train()
assert prepare_policy(model, None, "32-true", init_device_mesh("cpu", (2,)))
g = torch.Generator().manual_seed(10 + rank)
lengths = [(12, 4), (20, 7), (9, 2)] if rank == 0 else [(15, 5), (30, 9), (11, 3), (25, 6), (8, 1)]  # unequal rows
width = max(n for n, _ in lengths)
scorer = Scorer(model, 0, 0.7, 2, 0, torch.device("cpu"), sharded=True)
rb, _ = scorer.placeholder_batch(with_reference=False)
rb.input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
rb.attention_mask = torch.zeros_like(rb.input_ids)
rb.action_mask = torch.zeros(rb.input_ids.shape, dtype=torch.bool)
for r, (n, a) in enumerate(lengths):
    rb.input_ids[r, :n] = torch.randint(3, 96, (n,), generator=g)
    rb.attention_mask[r, :n] = 1
    rb.action_mask[r, n - a : n] = True
w_lp, w_ent = torch.randn(rb.input_ids.shape, generator=g), torch.randn(rb.input_ids.shape, generator=g)
results = []
for chunk in (0, 3):
    model.zero_grad(set_to_none=True)
    scorer.logits_chunk_tokens = chunk
    lp, ent, _ = scorer.logprobs_and_entropy(rb, torch.arange(len(lengths)), entropy=True)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    results.append((lp.detach(), ent.detach(), grads))
(lp0, ent0, g0), (lp1, ent1, g1) = results
assert (lp0[rb.action_mask] < 0).all() and (ent0[rb.action_mask] > 0).all()
torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=1e-5)
torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=1e-5)
assert g0.keys() == g1.keys() and "model.embed_tokens.weight" in g0
for name in g0:
    torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4, msg=name)
print(f"CHUNKED-FSDP-OK rank {rank}: {int(rb.action_mask.sum())} positions, {len(g0)} gradients", flush=True)
from tests.torchrun_exit import leave
leave()  # not a normal exit: see tests/torchrun_exit.py
"""


def test_chunked_scores_under_fsdp2_equal_the_unchunked_on_two_processes(tmp_path):
    """2 gloo processes, the policy fully_shard-ed as the trainer shards it, unequal rows per rank: the chunked
    whole-model call (the LM head hooked inside the root's forward, chunks recomputed in the backward) gives
    the unchunked log-probs, entropies and reduced gradients."""
    from tests.agentopsd.models.test_meta_build import torchrun_watched

    script = tmp_path / "chunked_fsdp.py"
    script.write_text(CHUNKED_FSDP_SCRIPT)
    out = torchrun_watched(script, timeout=180)
    assert out.count("CHUNKED-FSDP-OK") == 2, out


def test_chunk_settings_are_checked():
    from agentopsd.config import OptimConfig
    from agentopsd.rollout.scoring import chunked_scores

    with pytest.raises(ValueError, match="logits_chunk_tokens must be >= 0"):
        OptimConfig(logits_chunk_tokens=-1)
    with pytest.raises(ValueError, match="must be > 0 to chunk"):
        chunked_scores(torch.nn.Linear(4, 8), torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), 1.0, entropy=False, chunk=0)


def test_the_teacher_forward_runs_only_where_the_views_differ(policy):
    """A turn the skill bank has nothing for has one context in both views: its teacher log-probs are the
    generator's own (the evidence exactly 0) and it costs no forward; a turn with a skill block is scored."""
    from agentopsd.rollout.scoring import Scorer, views_differ

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (12, 9, 15, 7)]
    actions = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (3, 4, 2, 3)]
    skill = torch.randint(3, 96, (6,), generator=g).tolist()
    teacher_prompts = [p[:2] + skill + p[2:] if r in (0, 2) else p for r, p in enumerate(prompts)]
    rb = _rollout_batch([p + a for p, a in zip(prompts, actions)], [len(a) for a in actions])
    t_ids, t_attn, t_source = _batch([p + a for p, a in zip(teacher_prompts, actions)], [len(a) for a in actions])
    rb.teacher_input_ids, rb.teacher_attention_mask = t_ids, t_attn
    rb.teacher_action_mask = torch.zeros_like(t_source)
    rb.teacher_action_mask[:, 1:] = t_source[:, :-1]
    assert views_differ(rb.input_ids, rb.attention_mask, t_ids, t_attn).tolist() == [True, False, True, False]
    generated = -torch.rand(rb.action_mask.shape, generator=g) * rb.action_mask  # the generator's own log-probs
    rb.old_logprobs = generated.clone()
    scorer = Scorer(policy.eval(), 0, 1.0, 2, 0, torch.device("cpu"))
    with torch.no_grad():
        full = scorer.action_logprobs(rb, "teacher", model=policy)
        scored, _ = scorer.score_rollout(rb, recompute_old=False, with_teacher=True, tis_cap=None, teacher_model=policy)
    assert torch.equal(rb.teacher_logprobs[[1, 3]], generated[[1, 3]])
    torch.testing.assert_close(rb.teacher_logprobs[[0, 2]], full[[0, 2]])
    assert scored == float(t_attn[[0, 2]].sum())
