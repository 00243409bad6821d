"""Typed settings the LightningModule takes (Hydra builds them with ``_target_``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EnvConfig:
    """Which environment and how turns are rendered and scored."""

    id: str
    """Registered Gymnasium id, e.g. ``agentopsd/BabyAI-GoToLocal-v0``."""
    skills: str | None = None
    """SkillBank name (``agentopsd/rollout/skills/<name>.json``) for the teacher view; None = no skills."""
    skill_max_general: int | None = None
    """Keep only the first N general skills in the teacher view (None = all): short contexts, small models."""
    system_prompt: str | None = None
    """Replaces the default system prompt of agentopsd.rollout.prompts.PromptBuilder."""
    max_turns: int = 50
    """Turn limit of an episode (the paper: 50 ALFWorld, 15 WebShop, 4 Search)."""
    invalid_penalty: float = 0.1
    """Subtracted from the advantage of each turn whose output did not parse or whose action was
    invalid, on that turn's tokens only (0 = off). Never part of the outcome reward."""
    reward: str = "success"
    """The outcome reward R behind A_seq: ``success`` (the success bit, the paper's) or ``score``
    (the environment's graded score, e.g. WebShop's; logged as rollout/score either way)."""
    output_format: str = "action"
    """``action``, ``think_action`` or ``search_r1`` (see agentopsd.rollout.prompts.FORMATS)."""
    history_window: int = 2
    """Past (observation, action) pairs shown in the prompt."""
    max_prompt_tokens: int = 1024
    show_admissible: bool = True
    num_threads: int = 0
    """Threads stepping environments (0 = inline: cheap envs lose to thread overhead)."""
    kwargs: dict = field(default_factory=dict)
    """Extra constructor arguments of the environment."""
    fault_rate: float = 0.0
    """Inject environment faults at this rate (reliability tests only)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1, got {self.max_turns}")
        if self.invalid_penalty < 0:
            raise ValueError(f"env.invalid_penalty must be >= 0, got {self.invalid_penalty}")
        if self.reward not in ("success", "score"):
            raise ValueError(f"env.reward must be 'success' (the paper's success bit) or 'score', got {self.reward!r}")


@dataclass(frozen=True)
class RolloutConfig:
    """How actions are sampled during training and evaluation."""

    backend: str = "hf"
    """``hf`` (transformers) or ``vllm``."""
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    eval_temperature: float = 0.0
    """0 = greedy evaluation (the paper evaluates at 0.4 or greedy)."""
    recompute_old_logprobs: bool = False
    """Score the behaviour log-probs with the training forward (needed when the backend's numerics differ, e.g. vLLM)."""
    vllm: dict = field(default_factory=dict)
    """Engine arguments of the vLLM backend."""
    malformed_rate: float = 0.0
    """Replace this share of generations with garbage text (reliability tests only)."""
    overlap_waves: int = 1
    """Split each turn's episodes into this many waves, one generate call each, so that a wave's environment
    steps run in ``env.num_threads``'s thread pool while the next wave generates (pipelined across turns).
    Same turns as serial for the same generations; only timing differs. 1 = off (one call per turn); serial
    anyway when env.num_threads < 2 or the env sets ``thread_safe_step = False`` (ALFWorld)."""

    def __post_init__(self) -> None:
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"rollout.backend must be 'hf' or 'vllm', got {self.backend!r}")
        check_overlap_waves(self.overlap_waves)


def check_overlap_waves(waves: object) -> None:
    """A count of generate calls per turn: an int >= 1 (a bool is refused: ``true`` would read as 1, i.e. off)."""
    if isinstance(waves, bool) or not isinstance(waves, int) or waves < 1:
        raise ValueError(f"rollout.overlap_waves must be an integer >= 1 (1 = off, 2 = two waves), got {waves!r}")


@dataclass(frozen=True)
class OptimConfig:
    """The update: PPO epochs over mini-batches, micro-batches for memory."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up."""
    schedule: str = "constant"
    """``constant`` or ``cosine`` (to ``min_lr_ratio`` * lr) after warm-up."""
    min_lr_ratio: float = 0.1
    ppo_epochs: int = 1
    num_mini_batches: int = 1
    """Optimizer steps per PPO epoch: the rollout batch is split into this many mini-batches."""
    micro_batch_size: int = 16
    """Rows per forward/backward (gradient accumulation inside a mini-batch)."""
    max_tokens_per_micro_batch: int = 0
    """When > 0, micro-batches are cut by tokens instead of rows: the rows are ordered by length and
    each micro-batch takes rows while ``rows x longest row`` (its padded size) stays within this
    budget (a longer row goes alone); ``micro_batch_size`` is then unused. It also sizes the
    sharded scoring passes (reference, teacher, old log-probs). 0 = ``micro_batch_size`` rows."""
    grad_clip: float = 1.0
    clip_ratio_c: float = 0.0
    """Dual-clip (verl's ``clip_ratio_c``): for a negative advantage the per-token loss is at most
    ``-A * clip_ratio_c``, so a token whose ratio exploded cannot dominate. Must be > 1; 0 = off
    (the public AgentOPSD runs: 3)."""
    kl_clamp: float = 0.0
    """Clamp each token's k3 KL value to ``[-kl_clamp, kl_clamp]`` (verl's ``low_var_kl``: 10); 0 = off."""
    tis_cap: float = 0.0
    """Truncated importance sampling for the engine/trainer mismatch: each token's loss is weighted
    by ``min(exp(log pi_trainer_old - log pi_engine), tis_cap)`` (verl's ``tis_imp_ratio_cap``, 2 in
    its recipes). Needs ``rollout.recompute_old_logprobs``; off on the transformers backend, whose
    behaviour log-probs are the trainer's. 0 = off."""
    logprob_diff_warning: float = 0.05
    """Warn when the mean |engine - trainer| log-prob difference of a rollout passes this (0 = never)."""
    logits_chunk_tokens: int = 0
    """When > 0, the LM head and its float32 log-softmax (log-probs, entropy) run over this many action positions
    at a time, forward and backward (checkpointed per chunk), instead of all of a micro-batch's at once: about
    24 bytes per logit, 35 GiB at 10,240 positions of a 151,936 vocabulary, become one chunk's (2.3 GiB at
    1,024). Same values and gradients. Not for algorithms that keep the full logits (``grpo_opsd``). 0 = off."""
    offload_optimizer: bool = False
    """Keep AdamW's states in host memory outside the update (verl's ``optimizer_offload``): moved out after
    each update and back before the next (``agentopsd.offload``), so vLLM's share (rollout, evaluation) and the
    states never sit on the GPU together. Costs two host/device copies of the states per iteration (pinned)."""
    defer_grad_reduction: bool = False
    """Under FSDP2 (``trainer=fsdp``), reduce-scatter the gradients once per mini-batch, at its last micro-batch,
    instead of after every micro-batch: fewer collectives, but each rank holds the unsharded gradients of every
    layer meanwhile (the whole model's, in float32): for small models, or many micro-batches. No effect elsewhere."""
    balance_tokens: bool = True
    """Under several processes, move rows between ranks before the update so that every rank holds about the same
    tokens (:mod:`agentopsd.balance`; trajectories kept whole where that balances): the update runs as many
    micro-batches on every rank as on the busiest one. The gradient does not depend on where a row lives; which
    rows share a mini-batch does. Costs one or two gathers per update. No effect on one process."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.ppo_epochs < 1 or self.num_mini_batches < 1 or self.micro_batch_size < 1:
            raise ValueError("optim.ppo_epochs, optim.num_mini_batches and optim.micro_batch_size must be >= 1")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"optim.schedule must be 'constant' or 'cosine', got {self.schedule!r}")
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError(f"optim.max_tokens_per_micro_batch must be >= 0 (0 = rows), got {self.max_tokens_per_micro_batch}")
        if self.clip_ratio_c and self.clip_ratio_c <= 1:
            raise ValueError(f"optim.clip_ratio_c must be > 1 (verl uses 3) or 0 (off), got {self.clip_ratio_c}")
        if self.kl_clamp < 0 or self.tis_cap < 0 or self.logprob_diff_warning < 0:
            raise ValueError("optim.kl_clamp, optim.tis_cap and optim.logprob_diff_warning must be >= 0 (0 = off)")
        if self.logits_chunk_tokens < 0:
            raise ValueError(f"optim.logits_chunk_tokens must be >= 0 (0 = off, e.g. 1024), got {self.logits_chunk_tokens}")
        if self.tis_cap and self.tis_cap < 1:
            raise ValueError(f"optim.tis_cap must be >= 1 (verl's recipes use 2) or 0 (off), got {self.tis_cap}")

    def lr_factor(self, step: int, total_steps: int) -> float:
        """The learning rate's multiplier at optimizer step ``step`` of ``total_steps``: a linear warm-up over
        ``warmup_steps``, then constant, or a half cosine from 1 down to ``min_lr_ratio`` at the last step."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class EvalConfig:
    """The fixed evaluation list and how often it runs."""

    num_tasks: int | None = 50
    """How many tasks of the environment's eval split (always the first ones: the same every run);
    None = the whole list. More than the list holds is an error (train.py checks it before any work)."""
    every_n_iterations: int = 0
    """0 = only before training and at the end."""
    before_training: bool = True
    """Evaluate the initial weights too (off when many runs share one warm start already evaluated)."""
    at_end: bool = True
    """Evaluate the trained weights (off for a run that only measures its starting weights)."""
    max_turns: int | None = None
    """Defaults to env.max_turns."""
    sampled_copies: int = 0
    """Also play each task this many times at the rollout's sampling temperature (``eval/sampled/...``):
    a smooth success rate where greedy success of a small policy jumps between 0 and 100%. Its
    random stream is seeded from the task list alone, so it never moves the training's. 0 = off."""

    def __post_init__(self) -> None:
        if self.num_tasks is not None and self.num_tasks < 1:
            raise ValueError(f"evaluation.num_tasks must be >= 1 or null (the whole list), got {self.num_tasks}")
        if self.sampled_copies < 0:
            raise ValueError(f"evaluation.sampled_copies must be >= 0 (0 = greedy only), got {self.sampled_copies}")
