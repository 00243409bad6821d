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

import torch
from torch import Tensor, nn

MIN_SHARED_PREFIX = 16
"""A prefix shorter than this is recomputed per row: sharing costs a forward and cache copies."""


def shared_prefixes(rows: list[tuple[int, ...]], min_shared: int = MIN_SHARED_PREFIX) -> list[tuple[list[int], int]]:
    """Groups of rows and the prefix length each group shares; every row is in exactly one group.

    Each row keeps at least its last token outside the shared part. In lexicographic order a
    group's common prefix is the smallest common prefix of neighbours, so one pass suffices; a row
    joins the current group while that does not lower the tokens saved ((n - 1) * shared). Groups
    of one row share nothing (length 0).
    """
    order = sorted(range(len(rows)), key=lambda r: rows[r])
    groups: list[tuple[list[int], int]] = []
    members, shared = [order[0]], len(rows[order[0]]) - 1
    for prev, r in zip(order, order[1:]):
        common = 0
        for x, y in zip(rows[prev], rows[r]):
            if x != y:
                break
            common += 1
        joined = min(shared, common, len(rows[r]) - 1)
        n = len(members)
        if joined >= min_shared and joined * n >= shared * (n - 1):
            members.append(r)
            shared = joined
        else:
            groups.append((members, shared))
            members, shared = [r], len(rows[r]) - 1
    groups.append((members, shared))
    return [(m, s if len(m) > 1 and s >= min_shared else 0) for m, s in groups]


def cache_kwarg(model: nn.Module) -> str:
    """The name of the KV-cache argument of this transformers version's forward."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x


def hidden_at(decoder: nn.Module, ids: Tensor, attn: Tensor, source: Tensor, min_shared: int = MIN_SHARED_PREFIX) -> Tensor:
    """Last hidden states at the ``source`` positions of right-padded rows, ``[source.sum(), hidden]``
    in row-major order: what ``decoder(ids, attn).last_hidden_state[source]`` returns, with every
    prefix shared by two or more rows computed once. Run it without gradient."""
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
    if not prefixes:
        return decoder(input_ids=ids, attention_mask=attn).last_hidden_state[source]
    device = ids.device
    cache_kw = cache_kwarg(decoder)
    # 1. every shared prefix once, right-padded: slot j of a prefix holds its token j
    head = max(len(p) for p in prefixes)
    p_ids = torch.zeros(len(prefixes), head, dtype=ids.dtype, device=device)
    p_mask = torch.zeros(len(prefixes), head, dtype=attn.dtype, device=device)
    for g, p in enumerate(prefixes):
        p_ids[g, : len(p)] = torch.tensor(p, dtype=ids.dtype, device=device)
        p_mask[g, : len(p)] = 1
    out = decoder(input_ids=p_ids, attention_mask=p_mask, use_cache=True)
    prefix_cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
    # 2. each row's copy of its prefix (rows sharing nothing get masked-out slots)
    from transformers import DynamicCache

    pick = torch.tensor(group_of, device=device)
    rows_cache = DynamicCache()
    for layer_idx, layer in enumerate(prefix_cache.layers):
        rows_cache.update(layer.keys[pick], layer.values[pick], layer_idx)
    shared_t = torch.tensor(shared, device=device)
    head_mask = (torch.arange(head, device=device)[None, :] < shared_t[:, None]).to(attn.dtype)
    # 3. the rest of every row on top, positions continuing after its own prefix
    tail = max(int(lengths[r]) - shared[r] for r in range(batch))
    t_ids = torch.zeros(batch, tail, dtype=ids.dtype, device=device)
    t_mask = torch.zeros(batch, tail, dtype=attn.dtype, device=device)
    t_source = torch.zeros(batch, tail, dtype=torch.bool, device=device)
    for r in range(batch):
        n = int(lengths[r]) - shared[r]
        t_ids[r, :n] = ids[r, shared[r] : shared[r] + n]
        t_mask[r, :n] = 1
        t_source[r, :n] = source[r, shared[r] : shared[r] + n]
    positions = shared_t[:, None] + torch.arange(tail, device=device)[None, :]
    hidden = decoder(input_ids=t_ids, attention_mask=torch.cat([head_mask, t_mask], dim=1), position_ids=positions,
                     use_cache=False, **{cache_kw: rows_cache}).last_hidden_state
    return hidden[t_source]
