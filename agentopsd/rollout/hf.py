"""The transformers generation backend: our own sampling loop over a KV cache.

Why not ``model.generate``: the trainer needs log softmax(logits / T) of each chosen token over
the full vocabulary (before top-p), exact stop-string handling per sequence, and dropping finished
rows from the batch; a 40-line loop gives all three directly.

Prefill runs each distinct prompt once and a prefix shared by a group of prompts once (see
``PREFILL_CHUNK_TOKENS``). One decode step costs one batched forward of the rows still running;
finished rows are dropped in place (only the rows moved into their slots are copied). Per-token
Python work is O(batch) small tensor ops; stop strings are checked by decoding a short tail only for
rows whose new token could complete one (a per-vocabulary lookup table built once per tokenizer and
stop set). Tokens are drawn with one uniform per row through the row's cumulative distribution.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from agentopsd.rollout.base import Generation, SamplingConfig
from agentopsd.rollout.scoring import (
    MIN_SHARED_PREFIX,
    cache_kwarg,
    decoder_and_head,
    pack_by_length,
    shared_prefixes,
)
from agentopsd.training import distributed
from agentopsd.training.precision import copy_weights, half_copy

_REPLACEMENT = "\ufffd"  # what a lone byte of a multi-byte character decodes to


@dataclass
class _StopTable:
    """Which token ids can complete one of ``stops`` (checked by decoding a tail)."""

    stops: tuple[str, ...]
    could_complete: torch.Tensor  # [V] bool, CPU
    tail_tokens: int  # tokens to decode: enough to hold the longest stop string


class HFGenerator:
    """Batched sampling with a transformers causal LM (CPU or GPU).

    Prompts are left-padded into one batch; position ids count real tokens only, so each row sees
    exactly what it would see alone. ``synced_gpus=True`` (set whenever several ranks train) holds
    the rank invariant (:mod:`agentopsd.training.distributed`): FSDP gathers parameters inside every forward,
    so every rank runs the same number of prefill forwards (agreed, then padded with dummy ones) and
    of decode steps (until every rank is done), and a call with no prompts still takes part.
    """

    def __init__(self, model: nn.Module, tokenizer, *, synced_gpus: bool = False,
                 weights_dtype: torch.dtype | None = None) -> None:
        self.weights_dtype = weights_dtype
        """None: generate with the policy itself. A dtype: with a copy of it in that dtype (float32 master weights,
        a bf16 copy generating on a CPU with native bf16), refreshed by :meth:`sync_weights`."""
        self.model = model if weights_dtype is None else half_copy(model, weights_dtype)
        self.tokenizer = tokenizer
        self.synced_gpus = synced_gpus
        self._pieces: list[str] | None = None
        self._stop_tables: dict[tuple[str, ...], _StopTable] = {}

    @property
    def collective(self) -> bool:
        """Every call takes part in the other ranks' forwards (``synced_gpus``): ranks must call it in step."""
        return self.synced_gpus

    def sync_weights(self, model: nn.Module) -> None:
        """Generate with ``model``'s weights from now on: the object itself, or, with ``weights_dtype``, its weights
        copied into the generation copy (before each rollout, as a vLLM engine is synced)."""
        if self.weights_dtype is None:
            self.model = model
        else:
            copy_weights(self.model, model)

    def score(self, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
              sampling: SamplingConfig) -> list[tuple[float, ...]]:
        """The engine's prompt log-probs: each continuation's tokens after its prompt, under the weights generating
        now, at ``sampling.scoring_temperature`` (the scale of :attr:`Generation.logprobs`). One rank's own call:
        not under ``synced_gpus``, whose forwards other ranks would have to join."""
        if self.synced_gpus:
            raise RuntimeError("HFGenerator.score runs one rank's forwards alone: not with synced_gpus (FSDP)")
        from agentopsd.rollout.scoring import continuation_logprobs

        return continuation_logprobs(self.model, prompts, continuations, pad_id=self._pad_id(),
                                     temperature=sampling.scoring_temperature)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[Generation]:
        """One batched call for all prompts; one :class:`Generation` per prompt, in order."""
        if not prompts:
            if self._lockstep():  # other ranks may be generating: take part with a placeholder prompt
                self.generate([[self._pad_id()]], sampling)
            return []
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                tokens, logprobs, reasons = self._run(model, prompts, sampling)
        finally:
            model.train(was_training)
        out = []
        for toks, lps, reason in zip(tokens, logprobs, reasons):
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            out.append(Generation(tuple(toks), tuple(lps), text, reason))
        return out

    # ----------------------------------------------------------------------------------------
    def _run(
        self, model: nn.Module, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        device = _model_device(model)
        batch, max_new = len(prompts), sampling.max_new_tokens
        lengths = torch.tensor([len(p) for p in prompts])
        width = int(lengths.max())
        input_ids, mask = _left_pad(prompts, width, max_new, self._pad_id())
        input_ids, mask = input_ids.to(device), mask.to(device)
        position_ids = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
        # a sharded (FSDP2) model gathers its root's parameters only when called whole, one process or many
        whole = self.synced_gpus or _is_sharded(model)
        last_logits = _last_logits_fn(model, whole=whole)
        prepared = _takes_prepared_mask(model) and not whole
        cache = _new_cache(model, capacity=width + max_new)
        in_place = _preallocated_layers(cache)
        can_shrink = in_place or hasattr(cache, "batch_select_indices")
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=device).manual_seed(sampling.seed)

        def forward(ids: torch.Tensor, attn, pos: torch.Tensor, into=None) -> torch.Tensor:
            return last_logits(ids, attn, pos, cache if into is None else into)

        plan = _prefill_plan(prompts, PREFILL_CHUNK_TOKENS) if in_place else None
        chunked = plan is not None and not plan.is_one_padded_batch(batch)
        # the rank invariant: how many prefill forwards this call makes depends on its prompts
        forwards = len(plan.prefix_chunks) + len(plan.chunks) if chunked else 1
        for _ in range(self._agree(forwards, "rollout/prefill-forwards") - forwards):
            pad = torch.full((1, 1), self._pad_id(), dtype=torch.long, device=device)
            forward(pad, torch.ones_like(pad), torch.zeros_like(pad), into=_new_cache(model, capacity=1))
        if chunked:
            logits = _prefill_in_chunks(model, forward, plan, cache, width, self._pad_id(), device)
        else:  # nothing to save (e.g. one prompt): prefill straight into the cache, no copies
            logits = forward(input_ids, mask[:, :width], position_ids)
        if prepared:  # decode steps pass views of this bool mask: no conversion, no copy per step
            mask = mask.bool()
        padded = not bool(mask[:, :width].all())
        stop_table = self._stop_table(sampling.stop_strings, logits.shape[-1])
        eos_ids = torch.tensor(self._eos_ids(model), dtype=torch.long)

        out_tokens = torch.zeros(batch, max_new, dtype=torch.long)
        out_logps = torch.zeros(batch, max_new)
        n_generated = torch.zeros(batch, dtype=torch.long)
        reasons = ["length"] * batch
        rows = torch.arange(batch)  # cache row -> prompt index
        alive = torch.ones(batch, dtype=torch.bool)  # False for a kept-only-for-sync row
        next_pos = lengths.to(device)
        for step in range(max_new):
            token, logp = _choose(logits, sampling, generator)
            token_cpu, logp_cpu = token.cpu(), logp.cpu()
            live_rows = rows[alive]
            out_tokens[live_rows, step] = token_cpu[alive]
            out_logps[live_rows, step] = logp_cpu[alive]
            n_generated[live_rows] = step + 1
            alive &= ~self._finished(token_cpu, alive, rows, out_tokens[:, : step + 1], eos_ids, stop_table, reasons)
            local_done = not bool(alive.any())
            if step == max_new - 1 or self._all_done(local_done):
                break
            keep = alive.clone()
            if local_done:
                keep[0] = True  # synced_gpus: one dummy row keeps this rank's forwards going
            if can_shrink and _worth_shrinking(int((~keep).sum()), keep.numel(), max_new - step - 1, in_place):
                if in_place:
                    idx, holes, movers = _compaction(keep)
                    holes, movers = holes.to(device), movers.to(device)  # once, not once per layer
                    for layer in cache.layers:
                        layer.keep_first(len(idx), holes, movers)
                    idx_dev = idx.to(device)
                else:
                    idx = keep.nonzero().flatten()
                    idx_dev = idx.to(device)
                    cache.batch_select_indices(idx_dev)
                rows, alive, token = rows[idx], alive[idx], token[idx_dev]
                mask, next_pos = mask[idx_dev], next_pos[idx_dev]
                padded = not bool(mask[:, :width].all())
            mask[:, width + step] = 1
            attn = mask[:, : width + step + 1]
            if prepared:
                attn = _decode_mask(attn, padded)
            logits = forward(token[:, None], attn, next_pos[:, None])
            next_pos = next_pos + 1
        counts = n_generated.tolist()
        tokens = [out_tokens[i, :n].tolist() for i, n in enumerate(counts)]
        logps = [out_logps[i, :n].tolist() for i, n in enumerate(counts)]
        return tokens, logps, reasons

    def _finished(
        self,
        token: torch.Tensor,
        alive: torch.Tensor,
        rows: torch.Tensor,
        generated: torch.Tensor,
        eos_ids: torch.Tensor,
        stop_table: _StopTable | None,
        reasons: list[str],
    ) -> torch.Tensor:
        """[b] bool: live cache rows whose newest token is an eos or completes a stop string.

        token/alive/rows are per cache row; generated [B, steps] and reasons are per prompt.
        """
        finished = alive & torch.isin(token, eos_ids)
        for r in finished.nonzero().flatten().tolist():
            reasons[int(rows[r])] = "eos"
        if stop_table is None:
            return finished
        candidates = alive & ~finished & stop_table.could_complete[token]
        for r in candidates.nonzero().flatten().tolist():
            i = int(rows[r])
            if self._ends_in_stop(generated[i], stop_table):
                finished[r] = True
                reasons[i] = "stop"
        return finished

    def _lockstep(self) -> bool:
        return self.synced_gpus and distributed.is_distributed()

    def _agree(self, count: int, what: str) -> int:
        return distributed.agree(count, what) if self._lockstep() else count

    def _all_done(self, local_done: bool) -> bool:
        """Stop decoding? Under lockstep only when every rank is done (one agreement per step)."""
        if not self._lockstep():
            return local_done
        return not distributed.any_rank(not local_done, "rollout/decode-step")

    def _pad_id(self) -> int:
        for tid in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id):
            if tid is not None:
                return int(tid)
        return 0  # padding is masked out: any valid id works

    def _eos_ids(self, model: nn.Module) -> list[int]:
        """The tokenizer's eos plus the model's generation-config eos ids (Qwen2.5 lists two)."""
        ids: list[int] = []
        if self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        config = getattr(model, "generation_config", None)
        extra = getattr(config, "eos_token_id", None) if config is not None else None
        if extra is not None:
            ids.extend(int(e) for e in (extra if isinstance(extra, (list, tuple)) else [extra]))
        return sorted(set(ids))

    # ----------------------------------------------------------------------------------------
    def _stop_table(self, stops: tuple[str, ...], vocab: int) -> _StopTable | None:
        stops = tuple(s for s in stops if s)
        if not stops:
            return None
        table = self._stop_tables.get(stops)
        if table is None or table.could_complete.numel() < vocab:
            pieces = self._token_pieces()
            finals = {s[-1] for s in stops}
            # A token can complete a stop only if its text holds the stop's last character, or, for
            # a non-ASCII stop, if it is a byte fragment of a multi-byte character (U+FFFD alone).
            fragments = not all(s.isascii() for s in stops)
            flags = [any(c in p for c in finals) or (fragments and _REPLACEMENT in p) for p in pieces]
            if any(c.isspace() for c in finals):  # SentencePiece drops a lone token's leading space
                flags = [True] * len(flags)
            flags += [True] * max(0, vocab - len(flags))  # ids the tokenizer does not know
            longest = max(len(s.encode("utf-8")) for s in stops)
            table = _StopTable(stops, torch.tensor(flags, dtype=torch.bool), longest + 1)
            self._stop_tables[stops] = table
        return table

    def _token_pieces(self) -> list[str]:
        if self._pieces is None:
            ids = [[i] for i in range(len(self.tokenizer))]
            backend = getattr(self.tokenizer, "backend_tokenizer", None)  # fast tokenizers: ~15x quicker
            if backend is not None:
                self._pieces = backend.decode_batch(ids, skip_special_tokens=False)
            else:
                self._pieces = self.tokenizer.batch_decode(ids, skip_special_tokens=False)
        return self._pieces

    def _ends_in_stop(self, generated: torch.Tensor, table: _StopTable) -> bool:
        # Earlier steps found no stop, so any occurrence now overlaps the newest token: a tail of
        # `tail_tokens` tokens (each at least one byte) is enough to see it.
        tail = self.tokenizer.decode(generated[-table.tail_tokens :].tolist(), skip_special_tokens=False)
        return any(s in tail for s in table.stops)


def _worth_shrinking(finished_rows: int, rows: int, steps_left: int, in_place: bool = False) -> bool:
    """Drop finished rows from the cache now, or keep stepping them (their outputs are ignored)?

    A finished row kept wastes 1/rows of a decode step per step. Dropping rows from transformers'
    own cache copies the whole cache, about what one decode step's attention reads (decode at a
    large batch is bound by reading the cache): worth it once the waste adds up to a step
    (shrinking after every finished row cost ~9% of a 64-row, 64-token rollout on CPU). Our
    preallocated cache drops rows in place (:func:`_compaction`), copying at most the finished
    rows' worth of cache: worth it whenever another step follows.
    """
    if finished_rows <= 0 or steps_left <= 0:
        return False
    return in_place or finished_rows * steps_left >= rows


def _compaction(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop rows in place: ``(order, holes, movers)`` for the kept rows ``keep`` [B] bool.

    The n kept rows end up as rows 0..n-1: a kept row already there stays, and each hole there (a
    dropped row) is filled by a kept row from past n, so only those rows' caches move. ``order[j]``
    is the old row now at j; ``holes`` and ``movers`` are the positions written and read (disjoint).
    """
    n = int(keep.sum())
    order = torch.arange(n)
    holes = (~keep[:n]).nonzero().flatten()
    movers = keep[n:].nonzero().flatten() + n
    order[holes] = movers
    return order, holes, movers


def _choose(
    logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row and its log-prob under softmax(logits / scoring_temperature).

    logits: [B, V] float32. Returns token [B] long, logprob [B] float32. Top-p only restricts
    which tokens can be drawn; the reported log-prob is of the full distribution.
    """
    logp_all = torch.log_softmax(logits / sampling.scoring_temperature, dim=-1)
    if sampling.greedy:
        token = logp_all.argmax(dim=-1)
    else:
        probs = logp_all.exp()
        if sampling.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Drop a token when the mass before it already reaches top_p (the first always stays).
            sorted_probs[(sorted_probs.cumsum(-1) - sorted_probs) >= sampling.top_p] = 0.0
            token = order.gather(-1, _draw(sorted_probs, generator)[:, None]).squeeze(-1)
        else:
            token = _draw(probs, generator)
    return token, logp_all.gather(-1, token[:, None]).squeeze(-1)


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of ``weights`` [B, V] (>= 0, not normalized), drawn with probability
    proportional to its weight: one uniform per row through the row's cumulative sum.

    ``torch.multinomial`` draws an exponential variate per vocabulary entry instead: on CPU at 64
    rows x 512 ids that was 1.1 ms, a tenth of a decode step, against 0.1 ms here.
    """
    cdf = weights.double().cumsum(-1)  # float64: the last bins keep their width at any vocab size
    u = torch.rand(weights.shape[0], 1, dtype=cdf.dtype, device=cdf.device, generator=generator)
    # The first bin whose upper edge is above u: a zero-weight bin has no width, so it is never drawn.
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=weights.shape[-1] - 1)
    drawn_zero = weights.gather(-1, index) <= 0  # u * total rounded up to the total itself: rare
    if bool(drawn_zero.any()):
        last = weights.shape[-1] - 1 - (weights.flip(-1) > 0).int().argmax(-1, keepdim=True)
        index = torch.where(drawn_zero, last, index)  # the row's last positive bin
    return index.squeeze(-1)


# Prefill is compute-bound: its cost follows the number of padded tokens it runs, not the batch size
# (tiny policy on one CPU core: ~0.11 ms per token at batch 1 and at batch 64 alike). One left-padded
# prefill of the whole batch pays for every row's padding up to the longest prompt, once per copy of
# a repeated prompt (a task's G copies open with the same one), and once per row for a prefix that
# rows share (the G copies keep the system prompt, the task and early observations in common). So
# each distinct prompt is run once; a prefix shared by a group of prompts is run once and its
# keys/values are reused by the group; rows run in length-sorted chunks of at most this many padded
# tokens (which also bounds activation memory), split where padding plus per-forward cost is least
# (see agentopsd.rollout.scoring.pack_by_length), and the results are copied into the shared,
# left-padded cache: decoding then sees exactly the layout a single prefill would have made.
PREFILL_CHUNK_TOKENS = 8192


@dataclass
class _PrefillPlan:
    """Distinct prompts, the prefixes groups of them share, and the chunks to run."""

    distinct: list[tuple[int, ...]]
    rows: list[list[int]]  # distinct index -> the batch rows holding that prompt
    group: list[int]  # distinct index -> index into ``prefixes``, or -1 (nothing shared)
    prefixes: list[tuple[int, ...]]
    prefix_chunks: list[list[int]]  # indices into ``prefixes``
    chunks: list[list[int]]  # indices into ``distinct``: the part after the shared prefix

    def is_one_padded_batch(self, batch: int) -> bool:
        """True when the plan is a single left-padded prefill of every row (nothing repeated or shared)."""
        return len(self.chunks) == 1 and not self.prefixes and len(self.distinct) == batch

    def shared(self, u: int) -> int:
        return len(self.prefixes[self.group[u]]) if self.group[u] >= 0 else 0


def _prefill_plan(prompts: Sequence[Sequence[int]], budget: int, min_shared: int = MIN_SHARED_PREFIX) -> _PrefillPlan:
    index: dict[tuple[int, ...], int] = {}
    rows: list[list[int]] = []
    for r, p in enumerate(prompts):
        u = index.setdefault(tuple(p), len(index))
        if u == len(rows):
            rows.append([])
        rows[u].append(r)
    distinct = list(index)  # dicts keep insertion order: position == distinct index
    group = [-1] * len(distinct)
    prefixes: list[tuple[int, ...]] = []
    for members, shared in shared_prefixes(distinct, min_shared):
        if shared:
            for u in members:
                group[u] = len(prefixes)
            prefixes.append(distinct[members[0]][:shared])
    prefix_parts = [(0, len(p)) for p in prefixes]
    prefix_chunks = pack_by_length(sorted(range(len(prefixes)), key=lambda g: len(prefixes[g])), prefix_parts, budget)
    plan = _PrefillPlan(distinct, rows, group, prefixes, prefix_chunks if prefixes else [], [])
    parts = [(plan.shared(u), len(distinct[u]) - plan.shared(u)) for u in range(len(distinct))]
    plan.chunks = pack_by_length(sorted(range(len(distinct)), key=lambda u: parts[u][1]), parts, budget)
    return plan


def _prefill_in_chunks(
    model: nn.Module, forward, plan: _PrefillPlan, cache, width: int, pad_id: int, device: torch.device
) -> torch.Tensor:
    """Fill ``cache`` (preallocated layers) with every prompt left-padded to ``width``; last logits [B, V].

    A row's keys/values depend only on its own tokens (position ids count real tokens, padding is
    masked), so computing them in a chunk, or on top of a prefix computed once, gives the same row.
    """
    batch = sum(len(r) for r in plan.rows)
    prefix_kv: list[tuple] = [()] * len(plan.prefixes)  # group -> (chunk cache, its row, its width)
    for chunk in plan.prefix_chunks:
        sub = [plan.prefixes[g] for g in chunk]
        w = max(len(p) for p in sub)
        ids, attn = _left_pad(sub, w, 0, pad_id)
        ids, attn = ids.to(device), attn.to(device)
        part = _new_cache(model, capacity=w)
        forward(ids, attn, (attn.cumsum(-1) - 1).clamp(min=0), into=part)
        for j, g in enumerate(chunk):
            prefix_kv[g] = (part, j, w)
    logits: torch.Tensor | None = None
    for chunk in plan.chunks:
        shared = [plan.shared(u) for u in chunk]
        own = [plan.distinct[u][s:] for u, s in zip(chunk, shared)]
        head, tail = max(shared), max(len(o) for o in own)
        part = _new_cache(model, capacity=head + tail)
        for g in sorted({plan.group[u] for u in chunk if plan.group[u] >= 0}):
            local = torch.tensor([j for j, u in enumerate(chunk) if plan.group[u] == g], device=device)
            src, row, w = prefix_kv[g]
            n = len(plan.prefixes[g])
            for layer, piece in zip(part.layers, src.layers):
                keys, values = piece.keys[row : row + 1, :, w - n :], piece.values[row : row + 1, :, w - n :]
                layer.write_rows(local, head - n, keys, values, batch=len(chunk))
        ids, own_mask = _left_pad(own, tail, 0, pad_id)
        shared_t = torch.tensor(shared)
        head_mask = (torch.arange(head)[None, :] >= head - shared_t[:, None]).long()
        attn = torch.cat([head_mask, own_mask], dim=1).to(device)
        pos = (shared_t[:, None] + own_mask.cumsum(-1) - 1).clamp(min=0).to(device)
        out = forward(ids.to(device), attn, pos, into=part)
        if logits is None:
            logits = out.new_empty(batch, out.shape[-1])
        # Copy rows into the final cache, packed against its right edge: one indexed copy per
        # (shared, own) length pair, since those fix where a row's tokens sit on both sides.
        by_shape: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        for j, (u, s, o) in enumerate(zip(chunk, shared, own)):
            src_rows, dst_rows = by_shape.setdefault((s, len(o)), ([], []))
            src_rows += [j] * len(plan.rows[u])
            dst_rows += plan.rows[u]
        for (s, o), (src_rows, dst_rows) in by_shape.items():
            src_t, dst_t = torch.tensor(src_rows, device=device), torch.tensor(dst_rows, device=device)
            logits[dst_t] = out[src_t]
            for layer, piece in zip(cache.layers, part.layers):
                # own tokens first: the first write into the cache must end at `width` (see write_rows)
                keys, values = piece.keys[src_t, :, head + tail - o :], piece.values[src_t, :, head + tail - o :]
                layer.write_rows(dst_t, width - o, keys, values, batch=batch)
                if s:
                    keys, values = piece.keys[src_t, :, head - s : head], piece.values[src_t, :, head - s : head]
                    layer.write_rows(dst_t, width - s - o, keys, values, batch=batch)
    assert logits is not None
    return logits


def _preallocated_layers(cache) -> bool:
    layers = getattr(cache, "layers", None)
    return bool(layers) and _PREALLOCATED is not None and all(isinstance(layer, _PREALLOCATED) for layer in layers)


def _left_pad(
    prompts: Sequence[Sequence[int]], width: int, max_new: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, width] left-padded, attention mask [B, width + max_new] (prompt part set)."""
    ids = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) + [0] * max_new for p in prompts]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are FSDP2 shards (DTensors)."""
    return any(type(p).__name__ == "DTensor" for p in itertools.islice(model.parameters(), 1))


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (whose forward takes **kwargs)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _forward_kwarg_names(model: nn.Module) -> tuple[str, str | None]:
    """(cache argument, logits-to-keep argument) of this transformers version's forward."""
    base = _base_model(model)
    params = inspect.signature(base.forward).parameters
    keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
    return cache_kwarg(base), keep_kw


def _last_logits_fn(model: nn.Module, whole: bool = False):
    """``f(ids, attention_mask, position_ids, cache) -> [B, V]`` float32 logits of each row's last position.

    The decoder and the LM head are called apart, as the trainer's scoring calls them: the causal-LM
    wrapper around them costs a fixed time per call (output records, argument checks). With the
    decode mask handed over (:func:`_decode_mask`) a decode step of the quickstart's model took
    0.42-0.44 ms instead of 0.48 at batch 1 and 1.57-1.71 ms instead of 1.77-1.90 at 64 (one thread).
    ``whole`` (or a model without the split) calls the whole model: a sharded root gathers its own
    parameters (embeddings, head) only when called itself.
    """
    parts = None if whole else decoder_and_head(model)
    if parts is None:
        cache_kw, keep_kw = _forward_kwarg_names(model)

        def whole_model(ids: torch.Tensor, attn, pos: torch.Tensor, cache) -> torch.Tensor:
            kwargs = {cache_kw: cache, "use_cache": True}
            if keep_kw:
                kwargs[keep_kw] = 1  # only the last position's logits: [B, 1, V], not [B, L, V]
            return model(input_ids=ids, attention_mask=attn, position_ids=pos, **kwargs).logits[:, -1, :].float()

        return whole_model
    decoder, head = parts
    cache_kw = cache_kwarg(decoder)

    def decoder_then_head(ids: torch.Tensor, attn, pos: torch.Tensor, cache) -> torch.Tensor:
        hidden = decoder(input_ids=ids, attention_mask=attn, position_ids=pos, **{cache_kw: cache}, use_cache=True)
        # [B, 1, H] in, as the whole model's head sees it, made contiguous: a strided slice makes matmul broadcast the
        # head's weight to [B, H, V] and run a batched matmul (in bf16 a 0.9 GB copy at B=16 and SmolLM2's 49,152 tokens)
        return head(hidden.last_hidden_state[:, -1:].contiguous())[:, -1].float()

    return decoder_then_head


def _takes_prepared_mask(model: nn.Module) -> bool:
    """Whether a decode step can hand the decoder its attention mask ready-made (see :func:`_decode_mask`).

    Only for PyTorch's SDPA attention, where the mask is a bool tensor, and only when every layer
    attends to the full context (a sliding-window layer needs a mask of its own); transformers
    versions before these masks (no ``layer_types`` in the config) build theirs as before.
    """
    config = getattr(_base_model(model), "config", None)
    layer_types = getattr(config, "layer_types", None)
    return (getattr(config, "_attn_implementation", None) == "sdpa" and bool(layer_types)
            and set(layer_types) == {"full_attention"})


def _decode_mask(attn: torch.Tensor, padded: bool) -> dict[str, torch.Tensor | None]:
    """The 4-D mask of a one-token decode step, as transformers' ``create_causal_mask`` would make it.

    attn: [B, L] bool, positions each row sees. One new token sees every earlier position, so the
    mask is the padding mask itself, [B, 1, 1, L] (a view: nothing copied), or None when nothing is
    padded (SDPA then runs without a mask). ``create_causal_mask`` derives the same from the 2-D
    mask at every step, a fixed ~0.02-0.07 ms; passing the same mask keeps every output bit-identical.
    """
    return {"full_attention": attn[:, None, None, :] if padded else None}


def _new_cache(model: nn.Module, capacity: int):
    """A KV cache; preallocated for ``capacity`` positions where this transformers version allows.

    transformers' DynamicCache grows by ``torch.cat`` each step, copying the whole cache: on CPU that
    was half of a decode step (batch 16, 200-token prompts). Layers are swapped only when the cache
    is built from plain ``DynamicLayer`` objects (transformers >= 4.56, no sliding window).
    """
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=_base_model(model).config)
    except TypeError:  # transformers < 4.56 builds its layers lazily and takes no config
        return DynamicCache()
    layer_cls = _preallocated_layer_class()
    layers = getattr(cache, "layers", None)
    if layer_cls is not None and layers and all(type(layer).__name__ == "DynamicLayer" for layer in layers):
        cache.layers = [layer_cls(capacity) for _ in layers]
    return cache


_PREALLOCATED: type | None = None


def _select_rows(buf: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
    """A new [len(rows), h, capacity, d] buffer holding positions :length of ``rows``."""
    out = buf.new_empty(len(rows), *buf.shape[1:])
    out[:, :, :length] = buf[rows, :, :length]
    return out


def _preallocated_layer_class() -> type | None:
    """A ``DynamicLayer`` writing into buffers of fixed capacity (built once, lazily)."""
    global _PREALLOCATED
    if _PREALLOCATED is not None:
        return _PREALLOCATED
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return None

    class PreallocatedLayer(DynamicLayer):
        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = capacity
            self.length = 0

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.device = key_states.device
            b, h, _, d_k = key_states.shape
            shape_v = (b, h, self.capacity, value_states.shape[-1])
            self.key_buf = key_states.new_empty(b, h, self.capacity, d_k)
            self.value_buf = value_states.new_empty(shape_v)
            self.length = 0
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]
            if self.length + n > self.capacity:
                raise RuntimeError(f"KV cache capacity {self.capacity} exceeded")
            self.key_buf[:, :, self.length : self.length + n] = key_states
            self.value_buf[:, :, self.length : self.length + n] = value_states
            self.length += n
            self._refresh_views()
            return self.keys, self.values

        def write_rows(self, rows: torch.Tensor, start: int, keys: torch.Tensor, values: torch.Tensor, batch: int) -> None:
            """Prefill by parts: keys/values [r, h, n, d] of cache rows ``rows`` at positions start..start+n.

            The first write must end where the prompt part of the cache ends: positions up to there
            are zeroed, later ones are filled by ``update`` before anything reads them.
            """
            if not self.is_initialized:
                self.device = keys.device
                b, h, d_k, d_v = batch, keys.shape[1], keys.shape[-1], values.shape[-1]
                self.key_buf = keys.new_empty(b, h, self.capacity, d_k)
                self.value_buf = values.new_empty(b, h, self.capacity, d_v)
                # zeros up to the end of the prompt part: padding slots are masked out, but attention
                # still multiplies their values by a zero weight, and stale memory may hold NaN
                self.key_buf[:, :, : start + keys.shape[-2]] = 0
                self.value_buf[:, :, : start + keys.shape[-2]] = 0
                self.length = 0
                self.is_initialized = True
            n = keys.shape[-2]
            if start + n > self.capacity:
                raise RuntimeError(f"KV cache capacity {self.capacity} exceeded")
            self.key_buf[rows, :, start : start + n] = keys
            self.value_buf[rows, :, start : start + n] = values
            self.length = max(self.length, start + n)
            self._refresh_views()

        def keep_first(self, n: int, holes: torch.Tensor, movers: torch.Tensor) -> None:
            """Rows ``movers`` (past n) fill rows ``holes`` (below n); then only the first n rows remain.

            The buffers become views of their first n rows: nothing else is copied.
            """
            if self.is_initialized:
                if len(holes):
                    self.key_buf[holes, :, : self.length] = self.key_buf[movers, :, : self.length]
                    self.value_buf[holes, :, : self.length] = self.value_buf[movers, :, : self.length]
                self.key_buf, self.value_buf = self.key_buf[:n], self.value_buf[:n]
                self._refresh_views()

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized:
                # copy the filled positions only: the rest is written before it is read
                self.key_buf = _select_rows(self.key_buf, indices, self.length)
                self.value_buf = _select_rows(self.value_buf, indices, self.length)
                self._refresh_views()

        def _refresh_views(self) -> None:
            self.keys = self.key_buf[:, :, : self.length]
            self.values = self.value_buf[:, :, : self.length]

    _PREALLOCATED = PreallocatedLayer
    return _PREALLOCATED
