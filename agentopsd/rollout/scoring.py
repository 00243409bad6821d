"""Scoring forwards: the policy's log-probs and logits at the action tokens.

:class:`Scorer` is what the LightningModule calls (the rollout's no-grad scoring of each view, the
update's gradient forward, the dummy passes on placeholder rows); below it, the forwards that
compute a prompt prefix shared by several rows only once.

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
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from agentopsd.config import OptimConfig, RolloutConfig
from agentopsd.credit.losses import token_entropy, token_logprobs, truncated_is_weights
from agentopsd.training.distributed import padded
from agentopsd.types import RolloutBatch

log = logging.getLogger(__name__)

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


def whole_model_action_logits(model: nn.Module, ids: Tensor, attn: Tensor, source: Tensor) -> Tensor:
    """Logits at the ``source`` positions ``[n, V]`` (row-major) from a call of the whole model.

    A sharded model must be called whole (its root gathers embeddings and head only then), which
    would run the LM head at every position: for 4 rows x 2,560 tokens of Qwen2.5-7B that is 6 GB of
    logits and gradients where the action positions need 1.2 GB. transformers' ``logits_to_keep``
    with a boolean mask runs the head at the marked positions only. Versions before it (those vLLM
    pins) get the same from a pre-hook on the head that hands it the marked positions' hidden states
    (running the head everywhere made a one-iteration CPU rehearsal take over 25 min).
    """
    form = _logits_to_keep_form(model)
    if form == "mask":
        return model(input_ids=ids, attention_mask=attn, logits_to_keep=source).logits
    head = model.get_output_embeddings() if form == "hook" else None
    if head is None:
        return model(input_ids=ids, attention_mask=attn).logits[source]
    handle = head.register_forward_pre_hook(lambda module, args: (args[0][source], *args[1:]))
    try:
        logits = model(input_ids=ids, attention_mask=attn).logits
    finally:
        handle.remove()
    if logits.shape[:-1] != (int(source.sum()),):  # a model that reshapes its head's output
        raise RuntimeError(f"{type(model).__name__}: the LM head's pre-hook gave logits {tuple(logits.shape)}; "
                           "upgrade transformers (>=5.20: logits_to_keep takes a boolean mask)")
    return logits


def _chunk_scores(head: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor, temperature: float,
                  entropy: bool) -> Tensor:
    """``[c, 2]`` float32: each position's log-prob of its target and (with ``entropy``, else 0) its entropy,
    from ``head(hidden) / temperature``: the unchunked path's :func:`token_logprobs` and :func:`token_entropy`."""
    logits = head(hidden) / temperature
    lp = token_logprobs(logits, targets)
    ent = token_entropy(logits) if entropy else torch.zeros_like(lp)
    return torch.stack([lp, ent], dim=-1)


def chunked_scores(head: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor, temperature: float, *,
                   entropy: bool, chunk: int, trainable: bool = True) -> tuple[Tensor, Tensor]:
    """Log-probs of ``targets`` and entropies ``[n]`` (float32) of ``head(hidden) / temperature``, with the LM
    head and its float32 log-softmax run over ``chunk`` positions at a time (``optim.logits_chunk_tokens``).

    The unchunked path holds about 24 bytes per logit at once (the float32 copies the log-softmax and the
    entropy keep for backward, then their gradients): at 10,240 positions of a 151,936 vocabulary that is
    35 GiB. Here the logits of one chunk exist at a time, forward and backward: with gradient each chunk
    runs under activation checkpointing, which keeps only its hidden states and recomputes its logits in
    the backward, one chunk after the other. The values and gradients are the unchunked ones up to float
    rounding. ``trainable=False`` (the head's weights take no gradient, e.g. a frozen reference) still
    checkpoints when ``hidden`` needs a gradient.
    """
    if chunk <= 0:
        raise ValueError(f"optim.logits_chunk_tokens must be > 0 to chunk (0 = off), got {chunk}")
    grad = torch.is_grad_enabled() and (hidden.requires_grad or trainable)
    pieces = []
    for k in range(0, max(hidden.shape[0], 1), chunk):
        h, t = hidden[k : k + chunk], targets[k : k + chunk]
        if grad:  # recomputed in backward: only this chunk's logits are ever alive
            pieces.append(checkpoint(_chunk_scores, head, h, t, temperature, entropy, use_reentrant=False,
                                     preserve_rng_state=False))
        else:
            pieces.append(_chunk_scores(head, h, t, temperature, entropy))
    scores = torch.cat(pieces)
    return scores[:, 0], scores[:, 1]


def whole_model_action_scores(model: nn.Module, ids: Tensor, attn: Tensor, source: Tensor, targets: Tensor,
                              temperature: float, *, entropy: bool, chunk: int) -> tuple[Tensor, Tensor]:
    """:func:`chunked_scores` at the ``source`` positions from a call of the whole model (a sharded root gathers
    its embeddings and head only when called itself), with no full-vocabulary logits ever built.

    A pre-hook on the LM head takes the hidden states at ``source`` and hands the head no position at all; a
    forward hook then returns the chunked scores ``[n, 2]`` in place of the head's (empty) output, and the model
    passes them out as its ``logits``. The hook runs inside the root's forward, so a sharded head's weights
    are the gathered ones; checkpointed chunks recompute in the backward before the root reshards.
    """
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if head is None:
        raise RuntimeError(f"{type(model).__name__} has no output embeddings to chunk the LM head at: "
                           "set optim.logits_chunk_tokens=0")
    taken: list[Tensor] = []

    def select(module: nn.Module, args: tuple) -> tuple:
        taken.append(args[0][source])
        return (args[0][:, :0], *args[1:])

    def score(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        # module.forward: the head itself, without these hooks (a checkpointed chunk calls it again in backward)
        lp, ent = chunked_scores(module.forward, taken.pop(), targets, temperature, entropy=entropy, chunk=chunk)
        return torch.stack([lp, ent], dim=-1)

    handles = [head.register_forward_pre_hook(select), head.register_forward_hook(score)]
    try:
        scores = model(input_ids=ids, attention_mask=attn).logits
    finally:
        for handle in handles:
            handle.remove()
    if scores.shape != (int(source.sum()), 2):  # a model that reshapes or post-processes its head's output
        raise RuntimeError(f"{type(model).__name__}: the chunked LM head's scores came back as {tuple(scores.shape)}; "
                           "set optim.logits_chunk_tokens=0 for this model")
    return scores[:, 0], scores[:, 1]


def _logits_to_keep_form(model: nn.Module) -> str:
    """How the head can be limited to the action positions: ``mask`` (``logits_to_keep`` takes a boolean [B, T]
    mask), ``hook`` (a pre-hook on the output embeddings selects them) or ``none`` (the head runs everywhere)."""
    import transformers.modeling_utils as mu

    if hasattr(mu, "slice_logits_to_keep") and "logits_to_keep" in inspect.signature(model.forward).parameters:
        return "mask"  # the boolean-mask form arrived with slice_logits_to_keep
    return "hook" if callable(getattr(model, "get_output_embeddings", None)) else "none"


def token_budget_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Positions of ``lengths`` grouped into micro-batches of at most ``budget`` padded tokens.

    The rows are taken longest first (a stable sort: rows of equal length keep their given order, so
    rows sharing a prompt stay side by side); a micro-batch takes rows while ``rows x its longest
    row`` (what a right-padded forward holds) fits the budget. A row longer than the budget goes alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def views_differ(ids: Tensor, attn: Tensor, teacher_ids: Tensor, teacher_attn: Tensor) -> Tensor:
    """``[M]`` bool: rows whose teacher view holds other tokens than the student's (compared as token sequences,
    padding ignored). Where a skill bank has nothing for a turn (a skill scoped to the turns that face a key or a
    door) the two views are one context, so the teacher's log-probs are the student's and the evidence is exactly
    0: the teacher forward runs only on the rows that differ."""
    lengths, teacher_lengths = attn.sum(1), teacher_attn.sum(1)
    differ = lengths != teacher_lengths
    for row in (~differ).nonzero().flatten().tolist():
        differ[row] = not torch.equal(ids[row][attn[row].bool()], teacher_ids[row][teacher_attn[row].bool()])
    return differ


def teacher_scored_trajectories(seq_advantages: Tensor) -> Tensor:
    """``[B]`` bool: the trajectories whose teacher view an algorithm that only scales the sequence advantage
    (:attr:`agentopsd.credit.algorithms.Algorithm.teacher_scales_advantage`) needs: those with A_seq != 0. The
    others' advantage is ``0 * ((1 - lam) + lam * w) = 0`` whatever their evidence. Exactly 0: a group whose
    rewards are all equal centres to 0 exactly (:func:`agentopsd.credit.advantages.grpo_advantages`)."""
    return seq_advantages != 0


def _trimmed(ids: Tensor, attn: Tensor, amask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The rows cut to their longest real length, and ``source``: the positions whose hidden
    state predicts an action token (position j-1 predicts token j)."""
    width = int(attn.sum(1).max())
    ids, attn, amask = ids[:, :width], attn[:, :width], amask[:, :width]
    source = torch.zeros_like(amask)
    source[:, :-1] = amask[:, 1:]
    return ids, attn, amask, source


@dataclass
class Scorer:
    """The policy's forwards at the action tokens, as the LightningModule's settings make them.

    Built per use from the module's current state (``AgentRLModule.scorer``). ``sharded``: the
    policy is ``fully_shard``-ed, so every forward is a collective and the whole model is called
    (its root gathers embeddings and head only then); passes are then agreed over ranks and the
    missing ones run on placeholder rows through the same code (the rank invariant,
    :mod:`agentopsd.training.distributed`).
    """

    model: nn.Module
    pad_id: int
    temperature: float
    """The scoring temperature: logits are divided by it before the log-softmax."""
    micro_batch_size: int
    max_tokens_per_micro_batch: int
    device: torch.device
    sharded: bool = False
    logits_chunk_tokens: int = 0
    """``optim.logits_chunk_tokens``: > 0 runs the LM head and its log-softmax over this many positions at a time
    (:func:`chunked_scores`) wherever only log-probs and entropies are needed; 0 = all positions at once."""

    def micro_batches(self, rows: Tensor, attn: Tensor) -> list[Tensor]:
        """``rows`` (indices into ``attn``'s rows) cut into micro-batches: ``optim.micro_batch_size`` rows
        each in their order, or by ``optim.max_tokens_per_micro_batch`` padded tokens with the rows
        ordered by length (:func:`token_budget_groups`). The count is this rank's own: a sharded caller
        agrees it over ranks (``padded``/``exchange``) and fills the missing passes with dummies."""
        budget = self.max_tokens_per_micro_batch
        if budget <= 0:
            return [m for m in rows.split(self.micro_batch_size) if len(m)]
        lengths = attn[rows].sum(1).tolist()
        return [rows[torch.tensor(g, dtype=torch.long, device=rows.device)] for g in token_budget_groups(lengths, budget)]

    def decoder_and_head(self, model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
        """The decoder and LM head to call apart (the head then runs only where it is needed), or
        ``(None, None)`` where the whole model must be called: a sharded root gathers its own
        parameters (embeddings, head) only when called itself."""
        if self.sharded:
            return None, None
        return decoder_and_head(model) or (None, None)

    def action_logits(self, ids: Tensor, attn: Tensor, amask: Tensor, model: nn.Module | None = None) -> tuple[Tensor, Tensor]:
        """Logits predicting each action token, flattened row-major ``[n, V]``, and those tokens ``[n]``.

        Only the positions before action tokens go through the LM head: prompts are long and
        actions short, and a 151k-vocabulary head over every prompt position is what eats memory.
        """
        ids, attn, amask, source = _trimmed(ids, attn, amask)
        model = self.model if model is None else model
        decoder, head = self.decoder_and_head(model)
        if decoder is not None:
            # with gradient too, a prompt prefix shared by several rows (the G copies of a task) runs once:
            # in a 64-row single-turn batch that is 3x fewer tokens through forward and backward
            hidden = (decoder(input_ids=ids, attention_mask=attn).last_hidden_state[source] if checkpointing(decoder)
                      else hidden_at(decoder, ids, attn, source))
            logits = head(hidden)
        else:
            logits = whole_model_action_logits(model, ids, attn, source)
        return logits, ids[amask]

    def scored_logprobs(self, ids: Tensor, attn: Tensor, amask: Tensor, decoder: nn.Module, head: nn.Module) -> Tensor:
        """No-grad log-probs of the action tokens, row-major ``[n]``: shared prefixes run once, and the
        LM head runs over at most ``SCORING_HEAD_POSITIONS`` positions at a time (a 151k-vocabulary
        head over thousands of action tokens at once would need gigabytes)."""
        ids, attn, amask, source = _trimmed(ids, attn, amask)
        hidden = hidden_at(decoder, ids, attn, source)
        targets = ids[amask]
        step = self.logits_chunk_tokens or SCORING_HEAD_POSITIONS
        return torch.cat([
            token_logprobs(head(hidden[k : k + step]) / self.temperature, targets[k : k + step])
            for k in range(0, max(len(targets), 1), step)
        ])

    def action_logprobs(
        self, batch: RolloutBatch, view: str, rows: Tensor | None = None, *, grad: bool = False, model: nn.Module | None = None
    ) -> Tensor:
        """log pi(a_k,t | view) at the student's action positions, ``[m, L]`` (0 elsewhere).

        ``view`` is ``student`` (h_k) or ``teacher`` (h+_k, the skill-augmented context). The
        teacher view always runs without gradient: the gap is a stop-gradient signal.
        """
        if view not in ("student", "teacher"):
            raise ValueError(f"view must be 'student' or 'teacher', got {view!r}")
        rows = torch.arange(batch.num_rows, device=batch.input_ids.device) if rows is None else rows
        out = torch.zeros(batch.old_logprobs[rows].shape, device=batch.input_ids.device, dtype=torch.float32)
        student_mask = batch.action_mask[rows]
        if view == "student":
            ids, attn, amask = batch.input_ids[rows], batch.attention_mask[rows], student_mask
        else:
            ids, attn, amask = batch.teacher_input_ids[rows], batch.teacher_attention_mask[rows], batch.teacher_action_mask[rows]
        pieces = []
        with_grad = grad and view == "student"
        decoder, head = self.decoder_and_head(self.model if model is None else model)
        if not with_grad and decoder is not None:
            # Scoring only: rows per forward are set by tokens, not by optim.micro_batch_size (a
            # memory knob of the gradient path, 4 rows in the 3B/7B setups): the more rows one call
            # holds, the more of them share a prompt prefix that runs once.
            with torch.no_grad():
                for sl in token_slices(attn.sum(1).tolist(), SCORING_ROWS_TOKENS):
                    pieces.append(self.scored_logprobs(ids[sl], attn[sl], amask[sl], decoder, head))
            out[student_mask] = torch.cat(pieces) if pieces else out.new_zeros(0)
            return out
        micros = self.micro_batches(torch.arange(ids.shape[0], device=ids.device), attn)
        if self.sharded:  # every forward is a collective: ranks with fewer rows run dummy forwards
            micros = padded(micros, f"scoring/{view}-forwards")
        with torch.set_grad_enabled(with_grad):
            for idx in micros:
                if idx is None:
                    self.action_logits(*self.placeholder_rows(), model)
                    continue
                lp, _ = self.action_scores(ids[idx], attn[idx], amask[idx], model, entropy=False)
                # boolean indexing is row-major, so the two views' action tokens of a row line up one to one
                block = out[idx]
                block[student_mask[idx]] = lp
                out[idx] = block
        return out

    def score_rollout(self, rb: RolloutBatch, *, recompute_old: bool, with_teacher: bool,
                      tis_cap: float | None, teacher_model: nn.Module | None = None,
                      teacher_rows: Tensor | None = None) -> tuple[float, Tensor | None]:
        """A rollout batch's no-grad scores, written into ``rb``: the behaviour log-probs recomputed by the
        trainer's forward when ``recompute_old`` (with truncated importance weights capped at ``tis_cap`` when
        one is given), the student's, and the teacher view's when ``with_teacher``. Returns the tokens scored
        and, after a recompute, |generator - trainer| at each action token (else None).

        When the rollout engine scored the teacher view (``rb.engine_teacher_logprobs``, ``rollout.teacher_scoring=
        worker``), no teacher forward runs here: the evidence is that engine's teacher minus behaviour log-probs,
        two views scored by the same weights (the ones that generated each turn). ``teacher_model`` (the generator's
        bf16 copy, :func:`agentopsd.rollout.factory.generation_copy`) scores the teacher view here the same way:
        against the generator's own log-probs, so the gap compares two views of one set of weights.
        ``teacher_rows`` (``[M]`` bool): score the teacher view on these rows only (``rollout.teacher_skip_zero_advantage``);
        the others' teacher log-probs are the student's, a gap of 0, as on rows whose two views are one context."""
        scored, backend_gap = 0.0, None
        generated = rb.old_logprobs
        if recompute_old:
            backend_gap = self.recompute_behaviour(rb, None, tis_cap)
            scored += float(rb.attention_mask.sum())
        rb.student_logprobs = rb.old_logprobs
        if with_teacher and rb.engine_teacher_logprobs is not None:
            rb.student_logprobs, rb.teacher_logprobs = generated, rb.engine_teacher_logprobs
        elif with_teacher:
            if teacher_model is not None:
                rb.student_logprobs = generated
            rows = views_differ(rb.input_ids, rb.attention_mask, rb.teacher_input_ids, rb.teacher_attention_mask)
            if teacher_rows is not None:
                rows = rows & teacher_rows.to(rows.device)
            rows = rows.nonzero().flatten()
            # the same view scored by the same weights: the student's log-probs (those the gap is taken against)
            rb.teacher_logprobs = rb.student_logprobs.clone()
            if rows.numel() or self.sharded:  # a sharded forward is a collective: a rank with no rows still joins
                rb.teacher_logprobs[rows] = self.action_logprobs(rb, "teacher", rows, model=teacher_model)
            scored += float(rb.teacher_attention_mask[rows].sum())
        return scored, backend_gap

    def recompute_behaviour(self, rb: RolloutBatch, rows: Tensor | None, tis_cap: float | None) -> Tensor:
        """The behaviour log-probs of ``rows`` (every row when None) re-scored by the trainer's forward, no grad, in
        place in ``rb.old_logprobs``; the truncated importance weights from them when ``tis_cap`` is given (the other
        rows' weights 1). Returns |generator - trainer| at those rows' action tokens, row-major."""
        behaviour = rb.old_logprobs
        if rows is None:
            rb.old_logprobs = self.action_logprobs(rb, "student")
            mask = rb.action_mask
        else:
            rb.old_logprobs = behaviour.clone()
            rb.old_logprobs[rows] = self.action_logprobs(rb, "student", rows)
            mask = torch.zeros_like(rb.action_mask)
            mask[rows] = rb.action_mask[rows]
        if tis_cap is not None:
            # a row left as it was has old == behaviour there: weight 1
            rb.is_weights = truncated_is_weights(rb.old_logprobs, behaviour, tis_cap) * rb.action_mask
        # how far the generator's log-probs (vLLM kernels, a bf16 copy) are from the training forward's
        return (behaviour - rb.old_logprobs)[mask].abs()

    def logprobs_and_entropy(self, batch: RolloutBatch, rows: Tensor, *, entropy: bool,
                             keep_logits: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
        """Student log-probs (with gradient) and, when ``entropy``, the policy's entropy at the action positions,
        both ``[m, L]`` (0 elsewhere), from one forward; the logits ``[n, V]`` too when ``keep_logits``."""
        mask = batch.action_mask[rows]
        ids, attn = batch.input_ids[rows], batch.attention_mask[rows]
        lp = torch.zeros(mask.shape, device=ids.device, dtype=torch.float32)
        ent = torch.zeros(mask.shape, device=ids.device, dtype=torch.float32)
        if not keep_logits:  # log-probs and entropies only: the head may run in chunks
            lp[mask], token_ent = self.action_scores(ids, attn, mask, entropy=entropy)
            if entropy:
                ent[mask] = token_ent
            return lp, ent, None
        logits, targets = self.action_logits(ids, attn, mask)
        logits = logits / self.temperature
        lp[mask] = token_logprobs(logits, targets)
        if entropy:
            ent[mask] = token_entropy(logits)
        return lp, ent, logits

    def action_scores(self, ids: Tensor, attn: Tensor, amask: Tensor, model: nn.Module | None = None, *,
                      entropy: bool) -> tuple[Tensor, Tensor]:
        """Log-probs of the action tokens and (with ``entropy``, else zeros) the entropies there, row-major ``[n]``
        float32, at the scoring temperature: over all positions at once, or ``logits_chunk_tokens`` at a time."""
        model = self.model if model is None else model
        if self.logits_chunk_tokens <= 0:
            logits, targets = self.action_logits(ids, attn, amask, model)
            logits = logits / self.temperature
            lp = token_logprobs(logits, targets)
            return lp, token_entropy(logits) if entropy else torch.zeros_like(lp)
        ids, attn, amask, source = _trimmed(ids, attn, amask)
        targets = ids[amask]
        decoder, head = self.decoder_and_head(model)
        if decoder is None:
            return whole_model_action_scores(model, ids, attn, source, targets, self.temperature, entropy=entropy,
                                             chunk=self.logits_chunk_tokens)
        hidden = (decoder(input_ids=ids, attention_mask=attn).last_hidden_state[source] if checkpointing(decoder)
                  else hidden_at(decoder, ids, attn, source))
        trainable = any(p.requires_grad for p in head.parameters())
        return chunked_scores(head, hidden, targets, self.temperature, entropy=entropy, chunk=self.logits_chunk_tokens,
                              trainable=trainable)

    def teacher_logits(self, batch: RolloutBatch, rows: Tensor) -> Tensor:
        """The teacher view's logits at its action tokens ``[n, V]``, without gradient (row-major: they line up
        with the student's, one to one)."""
        with torch.no_grad():
            logits, _ = self.action_logits(batch.teacher_input_ids[rows], batch.teacher_attention_mask[rows],
                                           batch.teacher_action_mask[rows])
        return logits

    def placeholder_rows(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(ids, attention, action mask)`` of one 2-token row with one action token: what a dummy forward runs."""
        ids = torch.full((1, 2), int(self.pad_id), dtype=torch.long, device=self.device)
        amask = torch.tensor([[False, True]], device=self.device)
        return ids, torch.ones_like(ids), amask

    def placeholder_batch(self, with_reference: bool) -> tuple[RolloutBatch, Tensor]:
        """A one-row batch for dummy update passes (a rank may have no rows at all), and its row index."""
        ids, attn, amask = self.placeholder_rows()
        zeros = torch.zeros(ids.shape, device=self.device)
        one = torch.ones(1, device=self.device)
        rb = RolloutBatch(
            input_ids=ids, attention_mask=attn, action_mask=amask, old_logprobs=zeros,
            teacher_input_ids=ids, teacher_attention_mask=attn, teacher_action_mask=amask,
            turn_traj=one.long() * 0, turn_index=one.long() * 0, turn_valid=one.bool(), turn_penalties=one * 0,
            turn_state=one.long() * 0, success=one * 0, rewards=one * 0, group_ids=one.long() * 0, seq_advantages=one * 0,
            num_turns=one.long(), student_logprobs=zeros, teacher_logprobs=zeros,
            ref_logprobs=zeros if with_reference else None, advantages=zeros,
        )
        return rb, torch.zeros(1, dtype=torch.long, device=self.device)


def continuation_logprobs(model: nn.Module, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                          *, pad_id: int, temperature: float) -> list[tuple[float, ...]]:
    """log softmax(logits / ``temperature``) of each continuation's tokens after its prompt, no gradient: what an
    inference engine's prompt log-probs give, computed here by the scorer's forward (shared prompt prefixes run once,
    the LM head only where a continuation token is predicted). One tuple per row, as long as its continuation."""
    if len(prompts) != len(continuations):
        raise ValueError(f"{len(prompts)} prompts for {len(continuations)} continuations")
    if not prompts:
        return []
    device = next(model.parameters()).device
    width = max(len(p) + len(c) for p, c in zip(prompts, continuations))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    amask = torch.zeros_like(ids, dtype=torch.bool)
    for r, (p, c) in enumerate(zip(prompts, continuations)):
        ids[r, : len(p) + len(c)] = torch.tensor(list(p) + list(c), dtype=torch.long)
        attn[r, : len(p) + len(c)] = 1
        amask[r, len(p) : len(p) + len(c)] = True
    ids, attn, amask = ids.to(device), attn.to(device), amask.to(device)
    scorer = Scorer(model, pad_id, temperature, micro_batch_size=len(prompts), max_tokens_per_micro_batch=0, device=device)
    decoder, head = scorer.decoder_and_head(model)
    pieces = []
    with torch.no_grad():
        for sl in token_slices(attn.sum(1).tolist(), SCORING_ROWS_TOKENS):
            if decoder is not None:
                pieces.append(scorer.scored_logprobs(ids[sl], attn[sl], amask[sl], decoder, head).float())
            else:
                lp, _ = scorer.action_scores(ids[sl], attn[sl], amask[sl], model, entropy=False)
                pieces.append(lp.float())
    flat = torch.cat(pieces).cpu().tolist() if pieces else []
    out, k = [], 0
    for c in continuations:  # boolean indexing is row-major: each row's continuation tokens in order
        out.append(tuple(flat[k : k + len(c)]))
        k += len(c)
    return out


def engine_gap_metrics(backend_gap: Tensor | None, rb: RolloutBatch, tis_cap: float,
                       row_staleness: Tensor | None = None, rows: Tensor | None = None) -> dict[str, float]:
    """The generator's log-prob gap from the trainer's forward (:meth:`Scorer.score_rollout`) and the share of
    truncated importance weights at their cap; over ``rows`` only when given (a recompute of the rows the update
    trains on: ``backend_gap`` then covers those rows' action tokens).

    ``row_staleness`` ``[M]`` (updates between each row's generating weights and this update; asynchronous
    rollouts): the ``logprob_diff`` metrics, which :func:`warn_on_logprob_gap` reads as the engine's numerics,
    then cover the fresh rows only, since a stale row's gap is mostly the weights' drift, which the importance
    weights correct; that drift is ``rollout/logprob_diff_stale_mean``."""
    metrics = {}
    amask = rb.action_mask
    if rows is not None:
        amask = torch.zeros_like(amask)
        amask[rows] = rb.action_mask[rows]
    if backend_gap is not None and backend_gap.numel() and row_staleness is not None:
        # backend_gap is row-major over the action tokens: each token's row's staleness, in the same order
        token_staleness = row_staleness.to(amask.device)[:, None].expand_as(amask)[amask]
        stale = backend_gap[token_staleness > 0]
        if stale.numel():
            metrics["rollout/logprob_diff_stale_mean"] = float(stale.mean())
        backend_gap = backend_gap[token_staleness == 0]
    if backend_gap is not None and backend_gap.numel():
        metrics["rollout/logprob_diff_max"] = float(backend_gap.max())
        metrics["rollout/logprob_diff_mean"] = float(backend_gap.mean())
    if rb.is_weights is not None and amask.any():
        w = rb.is_weights[amask]
        metrics["rollout/tis_weight_mean"] = float(w.mean())
        metrics["rollout/tis_capped_frac"] = float((w >= tis_cap).float().mean())
    return metrics


STALENESS_TIS_CAP = 2.0
"""The truncated importance weight's cap under ``rollout.max_staleness > 0`` when ``optim.tis_cap`` is 0 (verl's
recipes use 2): stale turns must be corrected, so the weight cannot be left off there."""


def effective_tis_cap(optim: OptimConfig, rollout: RolloutConfig, *, half_rollout: bool = False) -> float | None:
    """The cap of the truncated importance weights ``min(exp(log pi_old - log pi_behaviour), cap)``, or None
    where they do not apply.

    Two cases apply. An engine other than the trainer's forward generated the tokens (a cap is set, the backend
    is not the transformers one, whose log-probs are the trainer's, or ``half_rollout``: the transformers one
    generated from bf16 weights, :attr:`agentopsd.training.precision.WeightPlan.half_rollout`, and the behaviour
    log-probs are recomputed, which the module forces then).
    Or ``rollout.max_staleness > 0``: the tokens came from weights up to k updates old, the old log-probs are
    the proximal policy's (the module forces the recompute), and the weight runs from behaviour to proximal
    (decoupled PPO), capped at ``optim.tis_cap``, or :data:`STALENESS_TIS_CAP` when that is 0.
    """
    if rollout.max_staleness > 0:
        return float(optim.tis_cap) if optim.tis_cap > 0 else STALENESS_TIS_CAP
    engine = rollout.backend != "hf" and rollout.recompute_old_logprobs
    if optim.tis_cap > 0 and (engine or half_rollout):
        return float(optim.tis_cap)
    return None


def tis_applies(optim: OptimConfig, rollout: RolloutConfig) -> bool:
    """Truncated importance sampling applies (:func:`effective_tis_cap` gives a cap)."""
    return effective_tis_cap(optim, rollout) is not None


def warn_on_logprob_gap(mean_gap: float | None, limit: float, iteration: int, *, tis_on: bool) -> None:
    """One warning when a rollout's mean |engine - trainer| log-prob difference passes ``limit`` (0 = never)."""
    if mean_gap is None or not limit or not mean_gap > limit:
        return
    log.warning(
        "iteration %d: mean |engine - trainer| log-prob difference %.4f exceeds optim.logprob_diff_warning=%g: the "
        "rollout engine's numerics (or a stale weight sync) part from the trainer's forward%s", iteration, mean_gap, limit,
        "" if tis_on else "; optim.tis_cap=2 corrects the update for it (truncated importance sampling)",
    )
