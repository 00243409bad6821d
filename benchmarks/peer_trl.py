"""This project's trainer beside TRL's ``GRPOTrainer`` on the same work, in one run.

    bash scripts/build_trl_env.sh       # once: TRL in .venv-trl, with this project and .venv's transformers
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE .venv-trl/bin/python benchmarks/peer_trl.py --out results/peer_trl.md
    .venv-trl/bin/python benchmarks/peer_trl.py --check-setup   # only: do both sides get the same work?

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
    """The quickstart's tiny model."""

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

    @property
    def scoring(self) -> float:
        return max(self.wall - self.generation - self.update, 0.0)


def steady(runs: list[list[Phases]]) -> Phases:
    """The fastest run's mean over its iterations after the first (warm-up)."""
    means = []
    for run in runs:
        rest = run[1:]
        means.append(Phases(*(statistics.fmean(getattr(p, k) for p in rest) for k in ("wall", "generation", "update")),
                            tokens=round(statistics.fmean(p.tokens for p in rest))))
    return min(means, key=lambda p: p.wall)


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
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[CreditCallback(log_stats=False), clock])
    stream = TaskStream(module.env_cfg.id, BabyAIEnv(level=LEVEL).num_tasks, setup.tasks_per_iteration,
                        setup.group_size, setup.iterations, setup.seed)
    trainer.fit(module, train_dataloaders=stream)
    return clock.phases


class _LightningClock(L.Callback):
    """Iteration boundaries at each batch end; the update starts at ``on_train_batch_start``."""

    def __init__(self) -> None:
        self.phases: list[Phases] = []
        self._last = self._pre = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self._last = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._pre = time.perf_counter()  # after the rollout and the credit callback (listed first)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        stats = pl_module.collector.stats
        self.phases.append(Phases(now - self._last, stats.generate_seconds, now - self._pre, stats.generated_tokens))
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
    return {"generation": 0.0, "score": 0.0, "tokens": 0}


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
            phases.append(Phases(now - Clock.last, timers["generation"], now - Clock.last - timers["score"], timers["tokens"]))
            timers.update(_new_timers())
            Clock.last = now

    trainer = trl_trainer(setup, model, tokenizer, multi_turn=multi_turn, callbacks=[Clock()], timers=timers)
    _time_method(trainer, "_generate_single_turn", timers, "generation", count_tokens=True)
    _time_method(trainer, "_generate_and_score_completions", timers, "score")
    trainer.train()
    return phases


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


def _time_method(obj: object, name: str, timers: dict, key: str, count_tokens: bool = False) -> None:
    """Wrap ``obj.name`` so that its seconds (and generated tokens) add up in ``timers``."""
    inner = getattr(obj, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
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
                    feedback = tok.apply_chat_template([{"role": "user", "content": obs}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=False)
                    completion[i] += list(feedback)
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
    if not (gen.do_sample and not gen.top_k):
        problems.append(f"TRL samples with do_sample={gen.do_sample}, top_k={gen.top_k}: the project samples the full softmax")
    return problems


# ------------------------------------------------------------------------------------------ main


def compare(setup: PeerSetup, rounds: int, multi_turn: int = 0) -> tuple[Phases, Phases]:
    """Both sides, alternating for ``rounds`` rounds; each side's fastest steady-state round."""
    from agentopsd.models.tiny import tiny_policy

    model, tokenizer = tiny_policy(EPISODE_ID, skills="babyai", **setup.model)
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
                     rows: int, multi_turns: int) -> str:
    """The results document: what ran, where, and both lines' tables, from the measured phases alone."""
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
                  phase_row("TRL GRPO", theirs, rows, "")]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=3, help="per run; the first is warm-up")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--multi-turn-turns", type=int, default=6, help="turn limit of the multi-turn line (0 = off)")
    parser.add_argument("--multi-turn-rounds", type=int, default=2, help="rounds of the multi-turn line (slow on the TRL side)")
    parser.add_argument("--check-setup", action="store_true", help="only check that both sides get the same work, then exit")
    parser.add_argument("--out", default=None, help="also write the tables as a markdown file (e.g. results/peer_trl.md)")
    args = parser.parse_args()
    try:
        import trl
    except ImportError:
        raise SystemExit(TRL_MISSING) from None
    import transformers

    torch.set_num_threads(1)  # one thread per side; the sides take turns
    setup = PeerSetup(iterations=args.iterations, max_new_tokens=args.max_new_tokens)
    if args.check_setup:
        from agentopsd.models.tiny import tiny_policy

        problems = setup_problems(setup, *tiny_policy(EPISODE_ID, skills="babyai", **setup.model))
        print("\n".join(problems) if problems else "SAME WORK: prompts, order and settings agree")
        raise SystemExit(1 if problems else 0)
    header = (f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}; "
              f"{setup.tasks_per_iteration} tasks x {setup.group_size} completions, {setup.max_new_tokens} new tokens, "
              f"micro-batch {setup.micro_batch_size}, best of {args.rounds} alternating rounds of {setup.iterations} iterations")
    print(header)
    ours, theirs = compare(setup, args.rounds)
    single, multi = (ours, theirs), None
    print("single turn (one BabyAI decision):")
    print(line("agentopsd", ours, setup.rows))
    print(line("TRL GRPO", theirs, setup.rows))
    print(f"  iteration throughput agentopsd / TRL: {theirs.wall / ours.wall:.2f}x (target >= 2x); "
          f"by phase: generation {theirs.generation / max(ours.generation, 1e-9):.2f}x, "
          f"scoring {theirs.scoring / max(ours.scoring, 1e-9):.2f}x, update {theirs.update / max(ours.update, 1e-9):.2f}x")
    if args.multi_turn_turns:
        ours, theirs = compare(setup, args.multi_turn_rounds, multi_turn=args.multi_turn_turns)
        print(f"multi turn ({EPISODE_ID}, at most {args.multi_turn_turns} turns; TRL through its rollout_func):")
        print(line("agentopsd", ours, setup.rows))
        print(line("TRL GRPO", theirs, setup.rows))
        print(f"  iteration throughput agentopsd / TRL: {theirs.wall / ours.wall:.2f}x; per generated token: "
              f"{(theirs.wall / max(theirs.tokens, 1)) / (ours.wall / max(ours.tokens, 1)):.2f}x")
        multi = (ours, theirs)
    if args.out:
        command = "OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE .venv-trl/bin/python benchmarks/peer_trl.py " + " ".join(sys.argv[1:])
        with open(args.out, "w") as f:
            f.write(results_markdown(command.strip(), header, single, multi, setup.rows, args.multi_turn_turns))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
