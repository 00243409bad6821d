"""No-grad scoring forwards that compute a prompt prefix shared by several rows only once.

The teacher view puts the skill block right after the task, so every turn of every copy of a task
starts with the same long prefix (system prompt, task, skills); only the recent history, the
current observation and the action differ. Scoring those rows one full forward each recomputes
that prefix per turn. Here each shared prefix runs once, its keys and values are copied to the
rows that share it, and only the rest of each row runs on top.

A row's hidden states depend only on its own tokens (positions count from its first token,
padding is masked out), so the result equals the plain forward up to float rounding.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import Tensor, nn

MIN_SHARED_PREFIX = 16
"""A prefix shorter than this is recomputed per row: sharing costs a forward and cache copies."""


def shared_prefixes(rows: list[tuple[int, ...]], min_shared: int = MIN_SHARED_PREFIX) -> list[tuple[list[int], int]]:
    """Groups of rows and the prefix length each group shares; every row is in exactly one group.

    The partition saves the most tokens, sum over groups of (n - 1) * shared. Each row keeps at
    least its last token outside the shared part. In lexicographic order the prefix common to a
    run of rows is the smallest common prefix of neighbours in it, and a best partition uses runs
    only, so a dynamic programme over the sorted rows finds it. Greedy merging is not enough:
    identical prompts (a no-history turn repeated by every copy) sharing all their ~1,000 tokens
    must not stop the rest of their task from sharing its ~900. Groups of one row share nothing.
    """
    n = len(rows)
    order = sorted(range(n), key=lambda r: rows[r])
    # link[i]: what order[i - 1] and order[i] can share (common prefix, each keeping a token)
    link = [0] * n
    for i in range(1, n):
        a, b = rows[order[i - 1]], rows[order[i]]
        limit = min(len(a), len(b)) - 1
        common = 0
        while common < limit and a[common] == b[common]:
            common += 1
        link[i] = common
    best = [0] * (n + 1)  # best[i]: tokens saved by a partition of the first i sorted rows
    cut = [0] * (n + 1)  # where the last group of that partition starts
    shared_of = [0] * (n + 1)
    for i in range(1, n + 1):
        best[i], cut[i], shared_of[i] = best[i - 1], i - 1, 0  # the i-th row alone
        shared = len(rows[order[i - 1]])
        for j in range(i - 2, -1, -1):  # the group order[j : i]
            shared = min(shared, link[j + 1])
            if shared < min_shared:
                break  # earlier starts only share less
            value = best[j] + (i - 1 - j) * shared
            if value > best[i]:
                best[i], cut[i], shared_of[i] = value, j, shared
    groups: list[tuple[list[int], int]] = []
    i = n
    while i > 0:
        groups.append(([order[k] for k in range(cut[i], i)], shared_of[i]))
        i = cut[i]
    return groups[::-1]


CHUNK_OVERHEAD_TOKENS = 128
"""What one more forward costs, in padded tokens (the per-call work of every layer, on CPU about
3 ms of a tiny model, ~80 tokens): the price :func:`pack_by_length` weighs against padding."""


def pack_by_length(
    items: list[int], parts: Sequence[tuple[int, int]], budget: int, overhead: int = CHUNK_OVERHEAD_TOKENS
) -> list[list[int]]:
    """Split ``items`` (sorted by their second part) into consecutive chunks, each padded to (max
    first + max second) tokens per row within ``budget`` tokens (a longer single row gets its own
    chunk), that run the fewest tokens: the rows' padded second parts plus ``overhead`` per chunk.

    Sorting by length keeps rows of similar length together: padding to the longest in a chunk
    then wastes little, where one padded batch pays every row up to the longest row of all. Filling
    each chunk to the budget in turn wasted 11% of a 64-row prefill in padding; the split here is
    the best one (a dynamic programme over where chunks end), at O(items x rows per chunk).
    """
    n = len(items)
    if n == 0:
        return [[]]
    best = [0] + [0] * n  # best[j]: fewest tokens to run items[:j]
    start = [0] * (n + 1)  # start[j]: where the last chunk of that best split begins
    for j in range(1, n + 1):
        tail = parts[items[j - 1]][1]  # sorted: the longest second part of any chunk ending here
        head, best[j], start[j] = 0, -1, j - 1
        for i in range(j - 1, -1, -1):  # the last chunk is items[i:j]
            head = max(head, parts[items[i]][0])
            if i < j - 1 and (j - i) * (head + tail) > budget:
                break  # longer chunks only grow: none fits
            cost = best[i] + (j - i) * tail + overhead
            if best[j] < 0 or cost < best[j]:
                best[j], start[j] = cost, i
    chunks: list[list[int]] = []
    j = n
    while j > 0:
        chunks.append(items[start[j] : j])
        j = start[j]
    return chunks[::-1]


def cache_kwarg(model: nn.Module) -> str:
    """The name of the KV-cache argument of this transformers version's forward."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x


def token_slices(lengths: Sequence[int], budget: int) -> list[slice]:
    """Consecutive row slices of at most ``budget`` tokens each (a longer row gets its own slice)."""
    slices: list[slice] = []
    start = total = 0
    for r, n in enumerate(lengths):
        if r > start and total + n > budget:
            slices.append(slice(start, r))
            start, total = r, 0
        total += n
    if start < len(lengths):
        slices.append(slice(start, len(lengths)))
    return slices


SCORING_ROWS_TOKENS = 65536
"""Real tokens of the rows one no-grad scoring call takes (its prefixes run in one forward; its
rows' own parts in chunks of ``SCORING_CHUNK_TOKENS``)."""

SCORING_HEAD_POSITIONS = 2048
"""Positions the LM head scores at once: 2,048 x a 151k vocabulary is 1.2 GB of float32 logits."""

SCORING_CHUNK_TOKENS = 16384
"""Padded tokens (shared part plus own part, per row) of one forward over rows' own parts."""


def sharing_order(ids: Tensor, attn: Tensor) -> Tensor:
    """Row indices ``[B]`` in the lexicographic order of the rows' tokens (right-padded rows): rows that
    share a prompt prefix (the G copies of a task, the turns of a task under its skill block) end
    up next to each other, so micro-batches cut from this order hold whole sharing groups."""
    rows = [tuple(ids[r, :n].tolist()) for r, n in enumerate(attn.sum(1).tolist())]
    return torch.tensor(sorted(range(len(rows)), key=rows.__getitem__), dtype=torch.long, device=ids.device)


def checkpointing(decoder: nn.Module) -> bool:
    """True when a forward of ``decoder`` now would drop its KV cache: transformers turns the cache off
    in layers that checkpoint activations (training mode, gradient on), and :func:`hidden_at` needs it."""
    return decoder.training and torch.is_grad_enabled() and any(getattr(m, "gradient_checkpointing", False) is True
                                                                  for m in decoder.modules())


def hidden_at(
    decoder: nn.Module, ids: Tensor, attn: Tensor, source: Tensor,
    min_shared: int = MIN_SHARED_PREFIX, budget: int = SCORING_CHUNK_TOKENS,
) -> Tensor:
    """Last hidden states at the ``source`` positions of right-padded rows, ``[source.sum(), hidden]``
    in row-major order: what ``decoder(ids, attn).last_hidden_state[source]`` returns, with every
    prefix shared by two or more rows computed once. Differentiable: with gradient on, a shared
    prefix's gradient is the sum over the rows that read it, as in the plain forward (not under
    activation checkpointing, which drops the cache: see :func:`checkpointing`).

    The rows' own parts run in chunks of similar length (see :func:`pack_by_length`): a row that
    shares little would otherwise pad every other row's short remainder to its full length, and
    no forward runs more than ``budget`` padded tokens, whatever the number of rows.
    """
    batch = ids.shape[0]
    lengths = attn.sum(1).tolist()
    has_source = source.any(1)
    first = torch.where(has_source, source.float().argmax(1), attn.sum(1)).tolist()
    # the shared part must end before the first position whose hidden state is wanted
    heads = [tuple(ids[r, : min(int(first[r]), int(lengths[r]) - 1) + 1].tolist()) for r in range(batch)]
    groups = shared_prefixes(heads, min_shared)
    shared = [0] * batch
    group_of = [0] * batch
    prefixes: list[tuple[int, ...]] = []
    for members, s in groups:
        if s:
            for r in members:
                shared[r], group_of[r] = s, len(prefixes)
            prefixes.append(heads[members[0]][:s])
    device = ids.device
    cache_kw = cache_kwarg(decoder)
    prefix_cache = None
    if prefixes:  # 1. every shared prefix once, right-padded: slot j of a prefix holds its token j
        head = max(len(p) for p in prefixes)
        p_ids = torch.zeros(len(prefixes), head, dtype=ids.dtype, device=device)
        p_mask = torch.zeros(len(prefixes), head, dtype=attn.dtype, device=device)
        for g, p in enumerate(prefixes):
            p_ids[g, : len(p)] = torch.tensor(p, dtype=ids.dtype, device=device)
            p_mask[g, : len(p)] = 1
        out = decoder(input_ids=p_ids, attention_mask=p_mask, use_cache=True)
        prefix_cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
        if prefix_cache is None:  # rows would run without their prefix: wrong states, silently
            raise RuntimeError("the decoder returned no KV cache for the shared prefixes (activation checkpointing "
                               "in training mode turns it off): call hidden_at without gradient or in eval mode")
    # 2. each row's own part on top of its prefix, positions continuing after it, in chunks
    from transformers import DynamicCache

    counts = source.sum(1).tolist()
    offsets = [0] * batch
    for r in range(1, batch):
        offsets[r] = offsets[r - 1] + int(counts[r - 1])
    result: Tensor | None = None
    parts = [(shared[r], int(lengths[r]) - shared[r]) for r in range(batch)]
    for chunk in pack_by_length(sorted(range(batch), key=lambda r: parts[r][1]), parts, budget):
        c_head = max(shared[r] for r in chunk)
        tail = max(parts[r][1] for r in chunk)
        if tail == 0:
            continue  # empty rows: nothing to run, nothing scored
        # one gather per chunk: row r's own tokens start at shared[r]; slots past its end are padding
        c_rows = torch.tensor(chunk, device=device)
        c_shared = torch.tensor([shared[r] for r in chunk], device=device)
        positions = c_shared[:, None] + torch.arange(tail, device=device)[None, :]
        t_valid = positions < torch.tensor([int(lengths[r]) for r in chunk], device=device)[:, None]
        at = positions.clamp(max=ids.shape[1] - 1)
        t_ids = torch.where(t_valid, ids[c_rows[:, None], at], 0)
        t_mask = t_valid.to(attn.dtype)
        t_source = source[c_rows[:, None], at] & t_valid
        kwargs = {}
        if c_head and prefix_cache is not None:  # the chunk's rows' prefixes (rows sharing nothing get masked-out slots)
            pick = torch.tensor([group_of[r] for r in chunk], device=device)
            rows_cache = DynamicCache()
            for layer_idx, layer in enumerate(prefix_cache.layers):
                rows_cache.update(layer.keys[pick, :, :c_head], layer.values[pick, :, :c_head], layer_idx)
            head_mask = (torch.arange(c_head, device=device)[None, :] < c_shared[:, None]).to(attn.dtype)
            t_mask = torch.cat([head_mask, t_mask], dim=1)
            kwargs[cache_kw] = rows_cache
        hidden = decoder(input_ids=t_ids, attention_mask=t_mask, position_ids=positions, use_cache=False, **kwargs)
        hidden = hidden.last_hidden_state[t_source]
        if result is None:
            result = hidden.new_empty(sum(int(c) for c in counts), hidden.shape[-1])
        dst = [offsets[r] + k for r in chunk for k in range(int(counts[r]))]
        result[torch.tensor(dst, dtype=torch.long, device=device)] = hidden
    if result is None:  # every row empty: nothing ran, nothing is scored
        weight = next(decoder.parameters())
        return torch.zeros(0, decoder.config.hidden_size, dtype=weight.dtype, device=device)
    return result


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """The decoder and LM head to call apart (the head then runs only where it is needed: the trainer's scoring,
    the HF generator's decode steps), or None where the model offers no such split."""
    decoder = getattr(model, "get_decoder", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    return (decoder, head) if decoder is not None and head is not None else None
