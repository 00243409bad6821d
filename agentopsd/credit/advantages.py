"""Turn-level credit assignment: GRPO advantages and AgentOPSD belief revisions.

Pure torch: tensors in, tensors out, no Lightning, no config objects. Every function is
vectorized over the batch (no Python loop over trajectories) and works on any device.
Half-precision inputs are computed in float32; float64 inputs stay float64.

Notation (the paper's section 3):
    B trajectories, K turns (right-padded, ``turn_mask`` True on a prefix of each row),
    T tokens. ``e_k`` turn evidence, ``l0`` prior logit, ``c_k`` evidence accumulator,
    ``B_k`` belief, ``dB_k`` revision, ``w_k`` bounded multiplier, ``At_k`` turn advantage.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "MODES",
    "anchor_state_groups",
    "apply_turn_penalties",
    "belief_revisions",
    "decayed_cumsum",
    "discounted_turn_returns",
    "gigpo_advantages",
    "group_success_rate",
    "grpo_advantages",
    "lambda_at",
    "mix_advantages",
    "pack_turns",
    "reshape_advantages",
    "rlsd_token_advantages",
    "stepopsd_multipliers",
    "turn_evidence",
    "turn_multipliers",
    "unpack_turns",
]

MODES = ("belief", "raw_gap", "magnitude", "no_prior")
PRIOR_CLIP = 1e-4  # step 4: keeps logit(R-bar) finite for all-fail / all-success groups
STD_EPS = 1e-4  # step 8
_SCAN_CHUNK = 64  # decay-matrix block size of the accumulator scan


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (half inputs are upcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _check_band(band: float) -> None:
    # band = 1 would let the multiplier reach 0 and erase a turn's advantage
    if not 0.0 < band < 1.0:
        raise ValueError(f"band must be in (0, 1), got {band}")


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary integer group ids to 0..G-1."""
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, uniq.numel()


def grpo_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6, *, scale_by_std: bool = True) -> Tensor:
    """GRPO sequence advantages ``A_i = (R_i - mean_g R) / (std_g R + eps)``. Shapes ``[N] -> [N]``.

    ``std_g`` is the unbiased (Bessel-corrected) sample std of the group, as in the GRPO
    reference implementations. A group whose rewards are all equal gets 0 for every member,
    and so does a group of one (its std is undefined; it carries no relative signal).
    ``scale_by_std=False`` keeps only the centring, ``R_i - mean_g R`` (GiGPO's ``mean_norm``).
    """
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must be 1-D of one length, got {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    dtype = _compute_dtype(rewards)
    r = rewards.to(dtype)
    idx, g = _group_index(group_ids)
    count = torch.zeros(g, dtype=dtype, device=r.device).index_add_(0, idx, torch.ones_like(r))
    mean = torch.zeros(g, dtype=dtype, device=r.device).index_add_(0, idx, r) / count
    centered = r - mean[idx]
    sq = torch.zeros(g, dtype=dtype, device=r.device).index_add_(0, idx, centered * centered)
    std = torch.sqrt(sq / (count - 1).clamp_min(1))
    if not scale_by_std:
        return torch.where(count[idx] > 1, centered, torch.zeros_like(centered))
    # an all-equal group has centered == 0 and std == 0: 0, not 0/0, even with eps = 0
    adv = torch.where(centered == 0, torch.zeros_like(centered), centered / (std[idx] + eps))
    return torch.where(count[idx] > 1, adv, torch.zeros_like(adv))


def group_success_rate(success: Tensor, group_ids: Tensor) -> Tensor:
    """Each trajectory's group mean of its success bits (the prior R-bar). Shapes ``[N] -> [N]``.

    Takes the success bits, never a shaped reward: averaging 0/10 rewards saturates the prior.
    """
    if success.ndim != 1 or group_ids.shape != success.shape:
        raise ValueError(f"success and group_ids must be 1-D of one length, got {tuple(success.shape)} and {tuple(group_ids.shape)}")
    s = success.to(_compute_dtype(success))
    if bool(((s != 0) & (s != 1)).any()):
        raise ValueError("success must hold 0/1 bits; pass info['won'], not a shaped reward")
    idx, g = _group_index(group_ids)
    count = torch.zeros(g, dtype=s.dtype, device=s.device).index_add_(0, idx, torch.ones_like(s))
    total = torch.zeros(g, dtype=s.dtype, device=s.device).index_add_(0, idx, s)
    return (total / count)[idx]


def turn_evidence(teacher_logprobs: Tensor, student_logprobs: Tensor, token_turn: Tensor, num_turns: int) -> Tensor:
    """Turn evidence ``e_k = sum_t delta_{k,t}`` (step 3). ``[B,T], [B,T], [B,T] -> [B,K]``.

    ``delta`` is the teacher-minus-student log-prob gap of each generated token, detached
    (the gap is a stop-gradient signal). ``token_turn`` is the turn index of each token and
    -1 for tokens that are not generated action tokens (prompt, padding); indices at or
    beyond ``num_turns`` are rejected rather than silently dropped.
    """
    if teacher_logprobs.shape != student_logprobs.shape or token_turn.shape != teacher_logprobs.shape:
        raise ValueError(
            "teacher_logprobs, student_logprobs and token_turn must share one [B, T] shape, got "
            f"{tuple(teacher_logprobs.shape)}, {tuple(student_logprobs.shape)}, {tuple(token_turn.shape)}"
        )
    if teacher_logprobs.ndim != 2:
        raise ValueError(f"expected [B, T] tensors, got {teacher_logprobs.ndim}-D")
    if token_turn.numel() and int(token_turn.max()) >= num_turns:
        raise ValueError(f"token_turn holds turn {int(token_turn.max())} but num_turns={num_turns}")
    dtype = _compute_dtype(teacher_logprobs, student_logprobs)
    delta = (teacher_logprobs.detach().to(dtype) - student_logprobs.detach().to(dtype))
    valid = token_turn >= 0
    delta = torch.where(valid, delta, torch.zeros_like(delta))
    out = torch.zeros(delta.shape[0], num_turns + 1, dtype=dtype, device=delta.device)
    # invalid tokens go to a spill column K that is cut off below
    index = torch.where(valid, token_turn, torch.full_like(token_turn, num_turns)).long()
    out.scatter_add_(1, index, delta)
    return out[:, :num_turns]


def decayed_cumsum(values: Tensor, gamma: float) -> Tensor:
    """``c_k = gamma * c_{k-1} + x_k`` with ``c_0 = 0``, along the last dim. ``[B,K] -> [B,K]``.

    Computed blockwise: inside a block of C steps, ``c = x @ D^T + gamma^(1..C) * carry`` with
    ``D[k, j] = gamma^(k-j)`` for ``j <= k``. Every factor is at most 1, so no power of
    ``1/gamma`` ever appears (the one-line cumsum trick overflows for long rows), and the
    Python loop runs over K/C blocks, never over trajectories.
    """
    _check_range("gamma", gamma, 0.0, 1.0)
    b, k = values.shape
    c = min(_SCAN_CHUNK, max(k, 1))
    steps = torch.arange(c, device=values.device, dtype=values.dtype)
    diff = steps[:, None] - steps[None, :]
    decay = torch.where(diff >= 0, torch.full_like(diff, gamma) ** diff.clamp_min(0), torch.zeros_like(diff))
    carry_scale = torch.full((c,), gamma, device=values.device, dtype=values.dtype) ** (steps + 1)
    out = torch.empty_like(values)
    carry = values.new_zeros(b)
    for start in range(0, k, c):
        block = values[:, start : start + c]
        n = block.shape[1]
        acc = block @ decay[:n, :n].T + carry[:, None] * carry_scale[:n]
        out[:, start : start + n] = acc
        carry = acc[:, -1]
    return out


def _check_turn_inputs(turn_gaps: Tensor, turn_mask: Tensor, success_prior: Tensor) -> None:
    if turn_gaps.ndim != 2 or turn_mask.shape != turn_gaps.shape:
        raise ValueError(f"turn_gaps and turn_mask must share one [B, K] shape, got {tuple(turn_gaps.shape)} and {tuple(turn_mask.shape)}")
    if success_prior.shape != turn_gaps.shape[:1]:
        raise ValueError(f"success_prior must be [B]={turn_gaps.shape[0]}, got {tuple(success_prior.shape)}")
    if turn_mask.dtype != torch.bool:
        raise ValueError(f"turn_mask must be a bool tensor, got {turn_mask.dtype}")
    if turn_mask.shape[1] > 1 and bool((turn_mask[:, 1:] & ~turn_mask[:, :-1]).any()):
        raise ValueError("turn_mask must be True on a prefix of each row (right-padded turns); use pack_turns")


def belief_revisions(
    turn_gaps: Tensor, turn_mask: Tensor, success_prior: Tensor, gamma: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Beliefs ``B_k`` and revisions ``dB_k`` (steps 4-6). ``[B,K], [B,K], [B] -> ([B,K], [B,K])``.

    ``l0 = logit(clip(R-bar, 1e-4, 1-1e-4))``, ``c_k = gamma c_{k-1} + e_k``,
    ``B_k = sigmoid(l0 + c_k)``, ``dB_k = B_k - B_{k-1}`` with ``B_0 = sigmoid(l0)``.
    Padded turns get 0 in both outputs; their gaps are ignored.
    """
    _check_turn_inputs(turn_gaps, turn_mask, success_prior)
    dtype = _compute_dtype(turn_gaps, success_prior)
    gaps = torch.where(turn_mask, turn_gaps.detach().to(dtype), torch.zeros((), dtype=dtype, device=turn_gaps.device))
    prior = success_prior.detach().to(dtype).clamp(PRIOR_CLIP, 1 - PRIOR_CLIP)
    l0 = torch.logit(prior)
    acc = decayed_cumsum(gaps, gamma)
    beliefs = torch.sigmoid(l0[:, None] + acc)
    previous = torch.cat([torch.sigmoid(l0)[:, None], beliefs[:, :-1]], dim=1)
    zero = torch.zeros((), dtype=dtype, device=gaps.device)
    return torch.where(turn_mask, beliefs, zero), torch.where(turn_mask, beliefs - previous, zero)


def _standardize_rows(q: Tensor, mask: Tensor) -> Tensor:
    """``(q - mean) / (std + 1e-4)`` over each row's valid entries, population std (step 8)."""
    m = mask.to(q.dtype)
    count = m.sum(dim=1, keepdim=True).clamp_min(1)
    mean = (q * m).sum(dim=1, keepdim=True) / count
    centered = (q - mean) * m
    std = torch.sqrt((centered * centered).sum(dim=1, keepdim=True) / count)
    return centered / (std + STD_EPS)


def turn_multipliers(
    seq_advantages: Tensor,
    turn_gaps: Tensor,
    turn_mask: Tensor,
    success_prior: Tensor,
    *,
    gamma: float = 0.95,
    band: float = 0.2,
    mode: str = "belief",
) -> tuple[Tensor, Tensor, Tensor]:
    """Beliefs ``B_k``, revisions ``dB_k`` and bounded multipliers ``w_k`` (steps 4-9), all ``[B,K]``.

    The multiplier is 1 on padded turns. :func:`reshape_advantages` mixes ``w`` with ``lam``;
    the credit callback logs all three.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    _check_band(band)
    if seq_advantages.shape != turn_gaps.shape[:1]:
        raise ValueError(f"seq_advantages must be [B]={turn_gaps.shape[0]}, got {tuple(seq_advantages.shape)}")
    dtype = _compute_dtype(seq_advantages, turn_gaps, success_prior)
    adv = seq_advantages.detach().to(dtype)
    prior = success_prior.to(dtype)
    if mode == "no_prior":
        prior = torch.full_like(prior, 0.5)  # logit(0.5) = 0
    beliefs, revisions = belief_revisions(turn_gaps.to(dtype), turn_mask, prior, gamma=gamma)
    sign = torch.sign(adv)[:, None]
    zero = torch.zeros((), dtype=dtype, device=adv.device)
    if mode == "raw_gap":
        q = sign * torch.where(turn_mask, turn_gaps.detach().to(dtype), zero)  # step 7 without the accumulator
    elif mode == "magnitude":
        q = revisions.abs()  # step 7 without the outcome sign
    else:
        q = sign * revisions  # step 7: q_k = sign(A_seq) * dB_k
    z = _standardize_rows(q, turn_mask)  # step 8
    w = (1 + band * z).clamp(1 - band, 1 + band)  # step 9
    return beliefs, revisions, torch.where(turn_mask, w, torch.ones((), dtype=dtype, device=adv.device))


def reshape_advantages(
    seq_advantages: Tensor,
    turn_gaps: Tensor,
    turn_mask: Tensor,
    success_prior: Tensor,
    *,
    gamma: float = 0.95,
    lam: float = 0.5,
    band: float = 0.2,
    mode: str = "belief",
) -> Tensor:
    """Turn advantages ``At_k`` (steps 5-10). ``[B], [B,K], [B,K], [B] -> [B,K]``, 0 on padded turns.

    Modes (the paper's section 3.3 ablations):
      ``belief``    q_k = sign(A) * dB_k (the method);
      ``raw_gap``   q_k = sign(A) * e_k (no accumulator);
      ``magnitude`` q_k = |dB_k| (no outcome sign);
      ``no_prior``  as ``belief`` with l0 = 0.
    Per-token accumulation is this function applied to token-level gaps (K = tokens).

    Guarantees: lam = 0 returns A exactly; w in [1-b, 1+b] so sign(At) = sign(A); A = 0 gives 0;
    a single valid turn has z = 0 so w = 1.
    """
    _check_range("lam", lam, 0.0, 1.0)
    _, _, w = turn_multipliers(seq_advantages, turn_gaps, turn_mask, success_prior, gamma=gamma, band=band, mode=mode)
    turn_adv = mix_advantages(seq_advantages, w, lam)  # step 10
    return torch.where(turn_mask, turn_adv, torch.zeros((), dtype=w.dtype, device=w.device))


def rlsd_token_advantages(
    seq_advantages: Tensor,
    teacher_logprobs: Tensor,
    student_logprobs: Tensor,
    token_mask: Tensor,
    *,
    lam: float = 0.5,
    band: float = 0.2,
) -> Tensor:
    """RLSD baseline: ``w_t = clip(exp(sign(A) * delta_t), 1-b, 1+b)``, ``A_t = A((1-lam) + lam w_t)``.

    ``[B], [B,T], [B,T], [B,T] -> [B,T]``, 0 where ``token_mask`` is False.
    """
    _check_range("lam", lam, 0.0, 1.0)
    _check_band(band)
    if teacher_logprobs.shape != student_logprobs.shape or token_mask.shape != teacher_logprobs.shape:
        raise ValueError("teacher_logprobs, student_logprobs and token_mask must share one [B, T] shape")
    if seq_advantages.shape != teacher_logprobs.shape[:1]:
        raise ValueError(f"seq_advantages must be [B]={teacher_logprobs.shape[0]}, got {tuple(seq_advantages.shape)}")
    dtype = _compute_dtype(seq_advantages, teacher_logprobs, student_logprobs)
    adv = seq_advantages.detach().to(dtype)
    delta = teacher_logprobs.detach().to(dtype) - student_logprobs.detach().to(dtype)
    # the band clips anyway; clamping the exponent first keeps exp finite for any gap
    w = torch.exp((torch.sign(adv)[:, None] * delta).clamp(-30.0, 30.0)).clamp(1 - band, 1 + band)
    out = mix_advantages(adv, w, lam)
    return torch.where(token_mask.bool(), out, torch.zeros((), dtype=dtype, device=adv.device))


def stepopsd_multipliers(seq_advantages: Tensor, turn_mean_gaps: Tensor, turn_mask: Tensor, *, band: float = 0.2) -> Tensor:
    """StepOPSD baseline: ``w_k = clip(exp(sign(A) * mean_t delta_{k,t}), 1-b, 1+b)``. ``[B], [B,K], [B,K] -> [B,K]``.

    Each turn is scored by its own mean gap: no accumulator, no prior (the contrast the paper
    draws with AgentOPSD). 1 on padded turns; mix with :func:`mix_advantages`.
    """
    _check_band(band)
    if turn_mean_gaps.ndim != 2 or turn_mask.shape != turn_mean_gaps.shape:
        raise ValueError(f"turn_mean_gaps and turn_mask must share one [B, K] shape, got {tuple(turn_mean_gaps.shape)} and {tuple(turn_mask.shape)}")
    if seq_advantages.shape != turn_mean_gaps.shape[:1]:
        raise ValueError(f"seq_advantages must be [B]={turn_mean_gaps.shape[0]}, got {tuple(seq_advantages.shape)}")
    dtype = _compute_dtype(seq_advantages, turn_mean_gaps)
    sign = torch.sign(seq_advantages.detach().to(dtype))[:, None]
    w = torch.exp((sign * turn_mean_gaps.detach().to(dtype)).clamp(-30.0, 30.0)).clamp(1 - band, 1 + band)
    return torch.where(turn_mask, w, torch.ones((), dtype=dtype, device=w.device))


def applied_multiplier(multipliers, lam: float):
    """What the mixing rule multiplies A by: ``(1 - lam) + lam * w``, for a tensor or a plain float ``w``
    (the run report draws it per turn)."""
    return (1 - lam) + lam * multipliers


def mix_advantages(seq_advantages: Tensor, multipliers: Tensor, lam: float) -> Tensor:
    """Step 10, the one mixing rule of every multiplier method: ``A * ((1 - lam) + lam * w)``.

    ``seq_advantages`` ``[B]``, ``multipliers`` ``[B, ...]`` (per turn or per token) -> the shape of
    ``multipliers``. AgentOPSD (and its ablations), RLSD and StepOPSD all mix through here, so the
    rule the spec tests check is the rule the trainer runs. lam = 0 returns A exactly; with
    w in [1-b, 1+b] the sign of A is kept; A = 0 gives 0.
    """
    _check_range("lam", lam, 0.0, 1.0)
    if multipliers.shape[:1] != seq_advantages.shape:
        raise ValueError(f"multipliers must be [B={seq_advantages.shape[0]}, ...], got {tuple(multipliers.shape)}")
    adv = seq_advantages.detach().to(multipliers.dtype).reshape(-1, *([1] * (multipliers.ndim - 1)))
    return adv * applied_multiplier(multipliers, lam)


def lambda_at(lam: float, step: int, warmdown_steps: int = 0) -> float:
    """lam at training iteration ``step``: constant when ``warmdown_steps`` is 0, else decayed linearly
    to 0 over ``warmdown_steps`` iterations (RLSD's public runs: 100), after which the method is GRPO."""
    _check_range("lam", lam, 0.0, 1.0)
    if warmdown_steps < 0 or step < 0:
        raise ValueError(f"warmdown_steps and step must be >= 0, got {warmdown_steps} and {step}")
    return lam if warmdown_steps == 0 else lam * max(0.0, 1.0 - step / warmdown_steps)


def discounted_turn_returns(outcome: Tensor, turn_mask: Tensor, gamma: float = 0.95) -> Tensor:
    """Each turn's discounted return when the only reward is the outcome after the last turn (GiGPO Eq. 5).

    ``R_k = gamma^(K_i - 1 - k) * R_i``. ``[B], [B,K] -> [B,K]``, 0 on padded turns.
    """
    _check_range("gamma", gamma, 0.0, 1.0)
    if turn_mask.ndim != 2 or outcome.shape != turn_mask.shape[:1]:
        raise ValueError(f"outcome must be [B] and turn_mask [B, K], got {tuple(outcome.shape)} and {tuple(turn_mask.shape)}")
    dtype = _compute_dtype(outcome)
    steps_left = turn_mask.sum(1, keepdim=True) - 1 - torch.arange(turn_mask.shape[1], device=turn_mask.device)[None]
    discount = torch.full((), gamma, dtype=dtype, device=turn_mask.device) ** steps_left.clamp_min(0).to(dtype)
    return torch.where(turn_mask, discount * outcome.detach().to(dtype)[:, None], torch.zeros((), dtype=dtype, device=turn_mask.device))


def anchor_state_groups(group_ids: Tensor, turn_states: Tensor, turn_mask: Tensor) -> Tensor:
    """GiGPO's step groups (Eq. 6): turns of one episode group whose environment state is identical.

    ``group_ids`` ``[B]``, ``turn_states`` ``[B,K]`` (an integer id per distinct state text) ->
    ``[B,K]`` step-group ids, -1 on padded turns.
    """
    if turn_states.shape != turn_mask.shape or group_ids.shape != turn_states.shape[:1]:
        raise ValueError("group_ids must be [B] and turn_states, turn_mask one [B, K] shape")
    pairs = torch.stack([group_ids[:, None].expand_as(turn_states)[turn_mask], turn_states[turn_mask]], dim=1)
    out = torch.full(turn_states.shape, -1, dtype=torch.long, device=turn_states.device)
    if pairs.numel():
        out[turn_mask] = torch.unique(pairs, dim=0, return_inverse=True)[1]
    return out


def gigpo_advantages(
    episode_advantages: Tensor,
    turn_returns: Tensor,
    step_groups: Tensor,
    turn_mask: Tensor,
    *,
    omega: float = 1.0,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """GiGPO (Eq. 7-8): ``A_k = A_episode + omega * A_step_k``, returns ``(A, A_step)``, both ``[B,K]``.

    ``A_step_k`` normalises the turn's discounted return within its step group exactly as GRPO
    normalises rewards within a task group (:func:`grpo_advantages`): a state that only one
    turn reached gets 0, so does a step group whose returns are all equal. 0 on padded turns.
    """
    if turn_returns.shape != turn_mask.shape or step_groups.shape != turn_mask.shape:
        raise ValueError("turn_returns, step_groups and turn_mask must share one [B, K] shape")
    if episode_advantages.shape != turn_mask.shape[:1]:
        raise ValueError(f"episode_advantages must be [B]={turn_mask.shape[0]}, got {tuple(episode_advantages.shape)}")
    dtype = _compute_dtype(episode_advantages, turn_returns)
    step = torch.zeros(turn_mask.shape, dtype=dtype, device=turn_mask.device)
    step[turn_mask] = grpo_advantages(turn_returns[turn_mask].to(dtype), step_groups[turn_mask], eps, scale_by_std=scale_by_std)
    total = episode_advantages.detach().to(dtype)[:, None] + omega * step
    return torch.where(turn_mask, total, torch.zeros((), dtype=dtype, device=total.device)), step


def apply_turn_penalties(advantages: Tensor, penalties: Tensor, token_mask: Tensor) -> Tensor:
    """Charge each shaping penalty to the tokens of the turn that earned it: ``A_t - p`` there, A elsewhere.

    ``advantages`` ``[N,L]``; ``penalties`` ``[N]`` (one per turn row) or ``[N,L]`` (per token);
    ``token_mask`` ``[N,L]``. A penalty never touches another turn, and a group whose copies all
    succeeded (or all failed) stays at A = 0 except on the offending turns.
    """
    if token_mask.shape != advantages.shape:
        raise ValueError(f"token_mask must match advantages {tuple(advantages.shape)}, got {tuple(token_mask.shape)}")
    pen = penalties[:, None] if penalties.ndim == 1 else penalties
    if pen.shape[0] != advantages.shape[0]:
        raise ValueError(f"penalties must have {advantages.shape[0]} rows, got {tuple(penalties.shape)}")
    return advantages - pen.detach().to(advantages.dtype) * token_mask.to(advantages.dtype)


def pack_turns(
    values: Tensor,
    traj_index: Tensor,
    turn_index: Tensor,
    num_trajectories: int | None = None,
    num_turns: int | None = None,
    fill: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """One-row-per-turn ``[M]`` (with ``(trajectory, turn)`` indices) to padded ``[B,K]`` plus mask.

    Raises on duplicate ``(trajectory, turn)`` pairs: a silent overwrite would lose a turn.
    """
    if values.ndim != 1 or traj_index.shape != values.shape or turn_index.shape != values.shape:
        raise ValueError("values, traj_index and turn_index must be 1-D of one length")
    if values.numel() and (int(traj_index.min()) < 0 or int(turn_index.min()) < 0):
        raise ValueError("traj_index and turn_index must be non-negative")
    b = int(traj_index.max()) + 1 if values.numel() else 0
    k = int(turn_index.max()) + 1 if values.numel() else 0
    b = b if num_trajectories is None else num_trajectories
    k = k if num_turns is None else num_turns
    if values.numel() and (int(traj_index.max()) >= b or int(turn_index.max()) >= k):
        raise ValueError(f"indices exceed the requested shape [{b}, {k}]")
    padded = torch.full((b, k), fill, dtype=values.dtype, device=values.device)
    mask = torch.zeros((b, k), dtype=torch.bool, device=values.device)
    padded[traj_index, turn_index] = values
    mask[traj_index, turn_index] = True
    if int(mask.sum()) != values.numel():
        raise ValueError("duplicate (trajectory, turn) pairs in pack_turns")
    return padded, mask


def unpack_turns(padded: Tensor, traj_index: Tensor, turn_index: Tensor) -> Tensor:
    """Padded ``[B,K]`` back to one row per turn ``[M]`` (the inverse of :func:`pack_turns`)."""
    if padded.ndim != 2:
        raise ValueError(f"padded must be [B, K], got {padded.ndim}-D")
    return padded[traj_index, turn_index]
