"""The LightningModule: owns the policy, its two prompt views, rollouts and the update.

Data flow of one iteration: the loader yields a TaskBatch; in
``on_after_batch_transfer`` (right before the callbacks' ``on_train_batch_start``) the
current weights roll out and, when the algorithm needs it, the teacher view scores the same
action tokens; the CreditCallback writes the advantages; ``training_step`` runs PPO epochs
with manual optimization.

Adding a forward or a backward? Read the rank invariant at the top of ``agentopsd/distributed.py``
first: under FSDP every forward is a collective, so its count must not depend on this rank's data
(agree the count with ``distributed.padded``/``exchange`` and pad with dummy passes of the same code).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import sys
import time

import lightning as L
import torch
from torch import Tensor, nn

from agentopsd import distributed
from agentopsd.balance import balance_rows
from agentopsd.config import (
    EnvConfig,
    EvalConfig,
    OptimConfig,
    RolloutConfig,
    advantage_scaling_overrides,
    resolve_teacher_scoring,
)
from agentopsd.credit.algorithms import Algorithm
from agentopsd.data import TaskBatch, collate_trajectories
from agentopsd.distributed import rank_and_world, reduce_metrics, shard_groups, shard_items
from agentopsd.evaluation import eval_task_list, pooled_metrics
from agentopsd.objective import micro_batch_loss, signal_rows
from agentopsd.offload import offload_optimizer_states, restore_optimizer_states
from agentopsd.oom import out_of_memory_ends_the_job
from agentopsd.preemption import Preempted, RolloutStopped, StopRequest
from agentopsd.rng_state import capture, restore
from agentopsd.rollout import factory
from agentopsd.rollout.async_rollout import AsyncRollout, RolloutWorkerError, WorkerSpec, rank_tasks
from agentopsd.rollout.collector import Collector
from agentopsd.rollout.scoring import (
    Scorer,
    effective_tis_cap,
    engine_gap_metrics,
    sharing_order,
    warn_on_logprob_gap,
)
from agentopsd.rollout.staleness import check_staleness, spanning_share, staleness_metrics
from agentopsd.runs import reopen_finished_epoch
from agentopsd.strategies import prepare_policy
from agentopsd.types import RolloutBatch, TaskSpec

log = logging.getLogger(__name__)


_SUMMED = ("rollout/format_errors", "rollout/invalid_actions", "rollout/faults", "rollout/trajectories",
           "rollout/trajectories_used", "rollout/history_trimmed", "rollout/skill_trimmed")
_SHARED_TERMS = ("pg_loss", "kl_loss", "distill_loss", "entropy")
"""Loss terms normalised by the whole mini-batch's count over every rank (each rank holds a share)."""


def _metric_rule(key: str) -> str:
    """How a metric combines over ranks (:func:`agentopsd.distributed.reduce_metrics`)."""
    if key in _SUMMED or key.endswith("tokens_per_s"):
        return "sum"  # counts of the whole batch; throughput of the whole job
    if key.endswith("_seconds") or key.endswith("_max") or key in ("loss/first_ratio_dev", "perf/peak_memory_gib"):
        return "max"  # the slowest rank sets the pace; the worst rank's deviation
    return "mean"


def frozen_copy(model: nn.Module) -> nn.Module:
    """The KL reference: a frozen copy of the policy as built. A policy built on the meta device
    (``model.meta_on_other_ranks``) gives a meta copy (no memory); :func:`agentopsd.strategies.prepare_policy`
    then fills it from rank 0's policy weights."""
    return copy.deepcopy(model).requires_grad_(False).eval()


class AgentRLModule(L.LightningModule):
    """GRPO-family RL of a causal LM agent in a Gymnasium text environment."""

    @classmethod
    def from_config(cls, cfg, model: nn.Module, tokenizer: object, *, model_path: str | None = None,
                    **algorithm_overrides) -> AgentRLModule:
        """The module a composed run config describes (``train.py`` and ``agentopsd-eval`` build it here): the
        ``algorithm``, ``env``, ``rollout``, ``optim`` and ``evaluation`` groups instantiated, ``algorithm_overrides``
        applied to the algorithm."""
        from hydra.utils import instantiate

        # optim.scale_by_std: the group scaling the run asks for, whichever algorithm is swapped in
        scaling = advantage_scaling_overrides(cfg.algorithm, cfg.optim.get("scale_by_std"))
        return cls(
            model,
            tokenizer,
            algorithm=instantiate(cfg.algorithm, **{**scaling, **algorithm_overrides}),
            env=instantiate(cfg.env),
            rollout=instantiate(cfg.rollout),
            optim=instantiate(cfg.optim),
            evaluation=instantiate(cfg.evaluation),
            num_iterations=cfg.num_iterations,
            seed=cfg.seed,
            model_path=model_path,
            # a warm start changed the weights: a vLLM engine loading model.path must be synced before it generates
            weights_as_loaded=not cfg.get("warm_start"),
        )

    def __init__(
        self,
        model: nn.Module,
        tokenizer: object,
        algorithm: Algorithm,
        env: EnvConfig,
        rollout: RolloutConfig,
        optim: OptimConfig,
        evaluation: EvalConfig,
        num_iterations: int,
        seed: int = 0,
        model_path: str | None = None,
        weights_as_loaded: bool = True,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model, self.tokenizer = model, tokenizer
        self.algorithm, self.env_cfg, self.rollout_cfg = algorithm, env, rollout
        self.optim_cfg, self.eval_cfg = optim, evaluation
        self.num_iterations, self.seed, self.model_path = num_iterations, seed, model_path
        self.weights_as_loaded = weights_as_loaded
        """The policy holds the weights of ``model_path`` as loaded (no warm start changed them): a vLLM engine
        loading that folder needs no sync before the first update."""
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.prompts = factory.prompt_builder(tokenizer, env)
        self.skill_bank = factory.skill_bank(env)
        if algorithm.needs_teacher and self.skill_bank is None:
            raise ValueError(f"algorithm {algorithm.name} needs a teacher view: set env.skills to a SkillBank name")
        distils = algorithm.needs_teacher_logits or algorithm.distill_coef > 0
        if rollout.teacher_scoring == "worker" and distils:
            raise ValueError(f"algorithm {algorithm.name} distils the teacher view into its loss, which needs that view "
                             "scored at the update: set rollout.teacher_scoring=trainer (or auto)")
        if optim.skip_zero_advantage and (distils or algorithm.kl_coef > 0 or algorithm.entropy_coef > 0):
            raise ValueError(f"optim.skip_zero_advantage needs a loss that is 0 where the advantage is, but algorithm {algorithm.name} "
                             "has a KL penalty, an entropy bonus or a distillation term: set optim.skip_zero_advantage=false")
        self.teacher_scoring = resolve_teacher_scoring(rollout.teacher_scoring, rollout.max_staleness, rollout.backend, distils)
        """Where the teacher view is scored in this run (``rollout.teacher_scoring`` with ``auto`` resolved)."""
        # the rollout's sampling and the evaluation's (greedy unless rollout.eval_temperature > 0)
        self.sampling, self.eval_sampling = factory.sampling_configs(rollout, self.prompts.stop_strings)
        # A frozen copy of the initial policy, only when the KL penalty is on (it doubles memory). Not a
        # registered submodule: it is not part of the state dict, so no checkpoint carries it; a resumed
        # run rebuilds it from the weights the module is built from (model.path, or the warm start).
        ref = frozen_copy(model) if algorithm.kl_coef > 0 else None
        object.__setattr__(self, "ref_model", ref)
        self._collector: Collector | None = None
        self._producer: AsyncRollout | None = None
        """The rollout worker under ``rollout.max_staleness`` > 0 (started at the first training rollout)."""
        self._sharded = False
        """True once configure_model applied FSDP2: forwards become collectives."""
        self._states_offloaded = False
        """AdamW's states are in host memory (``optim.offload_optimizer``, while the engine generates)."""
        self.phase_seconds: dict[str, float] = {}
        self.rollout_metrics: dict[str, float] = {}
        self.first_ratio_dev: float = float("nan")
        """max |ratio - 1| on the first mini-batch of the last iteration (0 when on-policy)."""
        self.eval_history: list[dict[str, float]] = []
        self.iteration = 0
        """Index of the iteration being trained (set by its rollout)."""
        self.iterations_done = 0
        """Completed iterations (updates made)."""
        self.stop_request = StopRequest()
        """Set by a signal handler (agentopsd.callbacks.preemption): rollouts and evaluations stop between turns."""

    # ------------------------------------------------------------------ sharding

    def configure_model(self) -> None:
        """Float32 master weights where the precision asks for them, then FSDP2 under
        ``ModelParallelStrategy`` (``trainer=fsdp``): :func:`agentopsd.strategies.prepare_policy`."""
        from lightning.pytorch.strategies import ModelParallelStrategy

        if self._trainer is None:
            return
        fsdp = not self._sharded and isinstance(self.trainer.strategy, ModelParallelStrategy)
        mesh = self.device_mesh["data_parallel"] if fsdp else None
        self._sharded = prepare_policy(self.model, self.ref_model, str(self.trainer.precision), mesh, sharded=self._sharded)

    # ------------------------------------------------------------------ rollout

    @property
    def collector(self) -> Collector:
        """The rollout's collector, built on first use (:mod:`agentopsd.rollout.factory`)."""
        if self._collector is None:
            generator = factory.make_generator(self.model, self.tokenizer, self.env_cfg, self.rollout_cfg, seed=self.seed,
                                               model_path=self.model_path, iterations_done=self.iterations_done,
                                               weights_as_loaded=self.weights_as_loaded)
            self._collector = factory.make_collector(self.env_cfg, generator, self.prompts, self.sampling,
                                                     skill_bank=self.skill_bank, seed=self.seed,
                                                     stop_requested=lambda: self.stop_request.requested,
                                                     overlap_waves=self.rollout_cfg.overlap_waves)
        return self._collector

    def on_after_batch_transfer(self, batch: object, dataloader_idx: int) -> object:
        # Runs right before the callbacks' on_train_batch_start: the rollout uses the weights
        # of this very step (on-policy), and the credit callback sees its result.
        if isinstance(batch, TaskBatch) and self.trainer.training:
            return self.rollout(batch)
        return batch

    def rollout(self, batch: TaskBatch) -> RolloutBatch:
        was_training = self.model.training
        self.model.eval()
        try:
            with self._phase("rollout"):
                if self.asynchronous:
                    trajectories, metrics, t_rollout = self._collect_ahead(batch)
                else:
                    trajectories, metrics, t_rollout = self._collect_lockstep(batch)
            rb = collate_trajectories(trajectories, self.pad_id).to(self.device)
            t0 = time.perf_counter()
            with self._phase("scoring"), torch.no_grad(), self._compute_precision():
                # under a mixed precision the behaviour log-probs are the training forward's, in the update's precision
                scored, backend_gap = self.scorer.score_rollout(
                    rb, recompute_old=self.recompute_old_logprobs, with_teacher=self.algorithm.needs_teacher,
                    tis_cap=self.tis_cap)
                if self.ref_model is not None:
                    self._place_reference()
                    rb.ref_logprobs = self.action_logprobs(rb, "student", model=self.ref_model)
                    scored += float(rb.attention_mask.sum())
            t_teacher = time.perf_counter() - t0
            if self.stop_request.agreed():  # before the update, the longest phase: abandon now
                raise Preempted(self.stop_request.signal_name, batch.iteration, update_done=False)
        finally:
            self._restore_optimizer_states()  # a stopped rollout's checkpoint holds them where the update does
            self.model.train(was_training)
        self.iteration = batch.iteration
        self.phase_seconds = {"rollout": t_rollout, "teacher": t_teacher}
        # faulted trajectories are left out of the update: this says how many were used
        metrics["rollout/trajectories_used"] = float(rb.num_trajectories)
        metrics["perf/teacher_tokens_per_s"] = scored / max(t_teacher, 1e-9)
        metrics.update(engine_gap_metrics(backend_gap, rb, self.tis_cap or 0.0, self._row_staleness(trajectories, batch.iteration)))
        # every rank's episodes count: rates weighted by trajectories, counts and throughputs summed
        self.rollout_metrics = reduce_metrics(metrics, "rollout/metrics", weight=len(trajectories), rule=_metric_rule)
        # asynchronous: the fresh turns' gap alone (a stale turn's is mostly the weights' drift, which the TIS corrects)
        warn_on_logprob_gap(self.rollout_metrics.get("rollout/logprob_diff_mean"), self.optim_cfg.logprob_diff_warning,
                            self.iteration, tis_on=self.tis_active)
        return rb

    def _row_staleness(self, trajectories: list, iteration: int) -> Tensor | None:
        """Per row of the collated batch (the turns of the unfaulted trajectories, in order), the updates between its
        generating weights and this update; None in lockstep, where every row is fresh."""
        if not self.asynchronous:
            return None
        return torch.tensor([iteration - turn.policy_version for t in trajectories if t.fault is None and t.turns
                             for turn in t.turns], dtype=torch.long)

    def _collect_lockstep(self, batch: TaskBatch) -> tuple[list, dict[str, float], float]:
        """This rank's episodes of ``batch``, played now with the current weights: trajectories, metrics, seconds."""
        collector = self.collector
        self._offload_optimizer_states()
        factory.engine_sync(collector.generator, self.model, self.iterations_done)
        rank, world = rank_and_world()
        tasks = batch.tasks
        if world > 1:  # each rank plays whole groups of its own
            tasks = tuple(tasks[i] for i in shard_groups([t.group_id for t in tasks], rank, world))
        t0 = time.perf_counter()
        collector.policy_version = self.iterations_done
        try:
            trajectories = collector.collect(tasks, with_teacher=self.algorithm.needs_teacher)
        except RolloutStopped:
            raise Preempted(self.stop_request.signal_name or "SIGTERM", batch.iteration, update_done=False) from None
        factory.engine_sleep(collector.generator)
        self._restore_optimizer_states()
        return trajectories, factory.rollout_metrics(trajectories, collector), time.perf_counter() - t0

    @property
    def asynchronous(self) -> bool:
        """Rollouts come from a worker running ahead of the update (``rollout.max_staleness`` > 0)."""
        return self.rollout_cfg.max_staleness > 0

    def _collect_ahead(self, batch: TaskBatch) -> tuple[list, dict[str, float], float]:
        """This rank's episodes of ``batch`` from the rollout worker (played while earlier updates ran, by weights
        at most ``rollout.max_staleness`` versions old): trajectories, metrics, and the seconds waited for them."""
        producer = self._start_producer(batch.iteration)
        t0 = time.perf_counter()
        try:
            got = producer.next_batch(batch.iteration, lambda: self.stop_request.requested)
        except RolloutWorkerError as err:
            self._worker_failed(err)
        if got is None:  # the worker abandoned it for this rank's stop: every rank stops here (a collective)
            self.stop_request.agreed()
            raise Preempted(self.stop_request.signal_name or "SIGTERM", batch.iteration, update_done=False)
        trajectories, metrics = got
        rank, world = rank_and_world()
        expected = rank_tasks(batch.tasks, rank, world)
        if tuple(t.task for t in trajectories) != expected:  # no task lost or repeated between loader and worker
            raise RuntimeError(f"iteration {batch.iteration}: the rollout worker played other tasks than the loader's")
        versions = [turn.policy_version for t in trajectories for turn in t.turns]
        k = self.rollout_cfg.max_staleness
        check_staleness(batch.iteration, versions, k)
        metrics = dict(metrics)
        metrics.update(staleness_metrics(batch.iteration, versions, k))
        metrics["rollout/episodes_spanning_update"] = spanning_share(
            [[turn.policy_version for turn in t.turns] for t in trajectories])
        return trajectories, metrics, time.perf_counter() - t0

    def _start_producer(self, iteration: int) -> AsyncRollout:
        """The rollout worker, started at the first training rollout from the current weights."""
        if self._producer is not None:
            return self._producer
        if self._sharded:
            raise ValueError("rollout.max_staleness > 0 needs whole weights to hand to the rollout worker: use "
                             "trainer=ddp (or one process), or rollout.max_staleness=0 under trainer=fsdp")
        stream = self.trainer.train_dataloader
        if not hasattr(stream, "task_function"):
            raise TypeError("rollout.max_staleness > 0 needs the task stream (agentopsd.data.TaskDataModule) as the "
                            "training loader: the worker plays iterations ahead of it")
        import gymnasium as gym

        rank, world = rank_and_world()
        spec = WorkerSpec(tokenizer=self.tokenizer, env=self.env_cfg, seed=self.seed, rank=rank,
                          rollout=dataclasses.replace(self.rollout_cfg, teacher_scoring=self.teacher_scoring),
                          world=world, with_teacher=self.algorithm.needs_teacher, task_fn=stream.task_function(),
                          start=iteration, end=self.num_iterations, max_staleness=self.rollout_cfg.max_staleness,
                          threads=self.rollout_cfg.worker_threads, parent_pid=os.getpid(), env_spec=gym.spec(self.env_cfg.id),
                          device=str(self.device),  # a GPU rank's worker generates on that rank's GPU
                          # rollout.backend=vllm: the worker runs its own engine on model.path; the evaluation keeps its
                          # lockstep collector here, so this process builds a second engine when it evaluates
                          model_path=self.model_path, weights_as_loaded=self.weights_as_loaded)
        self._producer = AsyncRollout(spec, self.model)
        return self._producer

    def _worker_failed(self, err: RolloutWorkerError):
        """A failed rollout worker ends the job with one line: alone by raising it; under several processes at once
        (the other ranks would wait in their next collective until the process group times out)."""
        rank, world = rank_and_world()
        if world > 1:
            print(f"error: {err}", file=sys.stderr, flush=True)
            self._stop_other_ranks()
            os._exit(1)
        raise err

    @property
    def mixed_precision(self) -> bool:
        """The update computes under autocast (``bf16-mixed``, ``16-mixed``) with float32 weights."""
        return self._trainer is not None and "mixed" in str(self.trainer.precision)

    @property
    def recompute_old_logprobs(self) -> bool:
        """The behaviour log-probs are re-scored by the training forward: when the settings ask for it, and always
        under a mixed precision, where the generator's incremental float32 (or autocast) decode is not the
        update's autocast forward and the first ratio would start away from 1."""
        # stale turns: the ratio is taken against the proximal policy, the weights at the start of this update
        return self.rollout_cfg.recompute_old_logprobs or self.mixed_precision or self.asynchronous

    def _compute_precision(self):
        """The precision the update's forwards run in (Lightning's autocast for a mixed precision): the old
        log-probs must come from the same numerics, else the on-policy ratio is not 1."""
        if self._trainer is None:
            return contextlib.nullcontext()
        return self.trainer.precision_plugin.forward_context()

    def _offload_optimizer_states(self) -> None:
        """``optim.offload_optimizer``: AdamW's states to host memory while the engine generates (they are only
        read at the update's optimizer steps); back right after the engine sleeps, so the scoring, the update and
        every checkpoint find them where they live."""
        if not self.optim_cfg.offload_optimizer or self._trainer is None or self._states_offloaded:
            return
        offload_optimizer_states(self._optimizer())
        self._states_offloaded = True

    def _restore_optimizer_states(self) -> None:
        if self._states_offloaded:
            restore_optimizer_states(self._optimizer(), self.device)
            self._states_offloaded = False

    def _optimizer(self) -> torch.optim.Optimizer:
        opt = self.optimizers()
        return opt.optimizer if hasattr(opt, "optimizer") else opt

    def _phase(self, name: str):
        """A phase whose out-of-memory error ends the job with one line (:mod:`agentopsd.oom`)."""
        return out_of_memory_ends_the_job(name, self._stop_other_ranks)

    def _stop_other_ranks(self) -> None:
        """Rank 0 of Lightning's own launcher started the other ranks: kill them before this process exits."""
        import signal

        launcher = getattr(self.trainer.strategy, "launcher", None) if self._trainer is not None else None
        if launcher is not None and getattr(launcher, "procs", None) and hasattr(launcher, "kill"):
            launcher.kill(signal.SIGKILL)

    @property
    def tis_cap(self) -> float | None:
        """The truncated importance weight's cap when it applies, else None
        (:func:`agentopsd.rollout.scoring.effective_tis_cap`): the engine/trainer mismatch, or stale turns."""
        return effective_tis_cap(self.optim_cfg, self.rollout_cfg)

    @property
    def tis_active(self) -> bool:
        return self.tis_cap is not None

    def _place_reference(self) -> None:
        """The frozen reference on the policy's device and dtype (it is not a registered submodule, so
        Lightning does not move it); under FSDP2 ``fully_shard`` placed it already."""
        if self._sharded or self.ref_model is None:
            return
        p = next(self.model.parameters(), None)
        q = next(self.ref_model.parameters(), None)
        if p is not None and q is not None and (q.device != p.device or q.dtype != p.dtype):
            self.ref_model.to(device=p.device, dtype=p.dtype)

    # ------------------------------------------------------------------ scoring

    @property
    def scorer(self) -> Scorer:
        """The forwards at the action tokens under the current policy and settings (built per use: cheap)."""
        cfg = self.optim_cfg
        return Scorer(self.model, self.pad_id, self.sampling.scoring_temperature, cfg.micro_batch_size,
                      cfg.max_tokens_per_micro_batch, self.device, sharded=self._sharded,
                      logits_chunk_tokens=cfg.logits_chunk_tokens)

    def action_logprobs(
        self, batch: RolloutBatch, view: str, rows: Tensor | None = None, *, grad: bool = False, model: nn.Module | None = None
    ) -> Tensor:
        """log pi(a_k,t | view) at the student's action positions, ``[m, L]`` (0 elsewhere): :meth:`Scorer.action_logprobs`."""
        return self.scorer.action_logprobs(batch, view, rows, grad=grad, model=model)

    # ------------------------------------------------------------------ update

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> Tensor:
        metrics, loss = self.update(batch, batch_idx)
        self.iterations_done = self.iteration + 1
        if self._producer is not None:  # the worker's turns from now on play the updated weights
            try:
                self._producer.publish(self.model, self.iterations_done)
            except RolloutWorkerError as err:  # a transfer that hung: every rank ends, none waits in a collective
                self._worker_failed(err)
        shown = {k: v for k, v in metrics.items() if k in ("rollout/success", "rollout/turns")}
        # "step": the loggers' x axis is completed iterations (not optimizer steps), as in the evaluation rows
        self.log_dict({k: v for k, v in metrics.items() if k not in shown} | {"step": float(self.iterations_done)}, on_step=True,
                      batch_size=batch.num_trajectories)
        # the rich progress bar shows the rollout: success and turns per episode
        self.log_dict(shown, on_step=True, prog_bar=True, batch_size=batch.num_trajectories)
        return loss

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        # Lightning calls this after every callback's batch-end hook: the iteration's checkpoint,
        # rollout shard and evaluation are done, so a signalled run stops with the iteration kept.
        if self.stop_request.agreed():
            raise Preempted(self.stop_request.signal_name, self.iteration, update_done=True)

    def update(self, batch: RolloutBatch, batch_idx: int) -> tuple[dict[str, float], Tensor]:
        """PPO epochs over mini-batches of one rollout batch; returns the metrics and the mean loss
        (:meth:`_update`; an out-of-memory error in it ends the job with one line)."""
        with self._phase("update"):
            return self._update(batch, batch_idx)

    def _update(self, batch: RolloutBatch, batch_idx: int) -> tuple[dict[str, float], Tensor]:
        """PPO epochs over mini-batches of one rollout batch; returns the metrics and the mean loss.

        Several ranks: each mini-batch's loss is normalised by the token (or row) count of that
        mini-batch over *every* rank and scaled by the world size, so that the gradient reduction's
        average over ranks gives exactly the gradient of one process holding all the rows.
        """
        if batch.advantages is None:
            raise RuntimeError("the batch has no advantages: add agentopsd.callbacks.credit.CreditCallback to the Trainer's callbacks")
        t0 = time.perf_counter()
        opt = self.optimizers()
        sched = self.lr_schedulers()
        algo, cfg = self.algorithm, self.optim_cfg
        self._restore_optimizer_states()  # where an interrupted rollout left them on the host
        _, world = rank_and_world()
        if world > 1 and cfg.balance_tokens:
            # every rank about the same tokens: each mini-batch runs as many micro-batches as the busiest rank
            # (the loss is normalised over every rank, so the gradient does not depend on where a row lives)
            batch = balance_rows(batch, "update/balance", teacher_weight=1.0 if algo.needs_teacher_logits else 0.0,
                                 pad_id=self.pad_id)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + batch_idx)
        stats_log: dict[str, list[float]] = {}
        losses = []
        first = True
        self.first_ratio_dev = 0.0 if cfg.skip_zero_advantage else self.first_ratio_dev  # a first mini-batch may run no row
        skipped = 0
        for _ in range(cfg.ppo_epochs):
            perm = torch.randperm(batch.num_rows, generator=gen).to(self.device)
            # tensor_split always gives num_mini_batches pieces, so every rank steps the optimizer alike
            for mb in torch.tensor_split(perm, cfg.num_mini_batches):
                opt.zero_grad(set_to_none=True)
                local = float(batch.action_mask[mb].sum()) if algo.aggregation == "token-mean" else float(len(mb))
                if cfg.skip_zero_advantage:  # after the count: the skipped rows' tokens stay in the normaliser
                    kept = mb[signal_rows(batch.advantages[mb], batch.action_mask[mb])]
                    skipped += len(mb) - len(kept)
                    mb = kept
                # rows sharing a prompt prefix side by side, so a micro-batch runs each shared prefix once
                # (gradient accumulation: the split does not change the summed gradient)
                # (a token budget then orders them by length, a stable sort that keeps equal lengths side by side)
                micros = self.scorer.micro_batches(mb[sharing_order(batch.input_ids[mb], batch.attention_mask[mb])], batch.attention_mask)
                # one agreement per mini-batch: its micro-batch count (a backward each: DDP all-reduces,
                # FSDP gathers and reduce-scatters) and its token count over every rank
                counts = distributed.exchange([len(micros), local], "update/micro-batches") if world > 1 else [[len(micros), local]]
                normalizer = max(1.0, sum(c[1] for c in counts))
                micros += [None] * (int(max(c[0] for c in counts)) - len(micros))
                minibatch_loss = 0.0
                for i, micro in enumerate(micros):
                    # every rank runs the same count of micro-batches, so "the last" is the same pass on every rank
                    self._gradient_sync(last=i == len(micros) - 1)
                    if micro is None:  # a dummy pass through the same code, contributing nothing
                        dummy, rows = self.scorer.placeholder_batch(with_reference=algo.kl_coef > 0)
                        self.manual_backward(self._micro_loss(dummy, rows, normalizer, None)[0] * 0.0)
                        continue
                    loss, ratio_dev = self._micro_loss(batch, micro, normalizer, stats_log)
                    if first:  # max |ratio - 1| over the first mini-batch: 0 when the data is on-policy
                        self.first_ratio_dev = ratio_dev if micro is micros[0] else max(self.first_ratio_dev, ratio_dev)
                    self.manual_backward(loss * world)
                    losses.append(float(loss.detach()) * world)
                    minibatch_loss += float(loss.detach()) * world
                # the mini-batch's whole loss (each rank holds a share: their mean over ranks is the sum)
                stats_log.setdefault("total", []).append(minibatch_loss)
                first = False
                self._optimizer_step(opt, sched, stats_log)
        metrics = {f"loss/{k}": sum(v) / len(v) for k, v in stats_log.items()}
        metrics["loss/first_ratio_dev"] = self.first_ratio_dev
        if cfg.skip_zero_advantage:  # the share of rows (over the PPO epochs) that ran no forward: advantage 0
            metrics["update/zero_advantage_share"] = skipped / max(1, batch.num_rows * cfg.ppo_epochs)
        metrics["rollout/iteration"] = float(self.iteration + 1)  # numbered like every log: iterations completed by this update
        metrics["loss/lr"] = float(opt.param_groups[0]["lr"])
        self.phase_seconds["update"] = time.perf_counter() - t0
        metrics.update({f"perf/{k}_seconds": v for k, v in self.phase_seconds.items()})
        metrics["perf/update_tokens_per_s"] = float(batch.attention_mask.sum()) * cfg.ppo_epochs / max(self.phase_seconds["update"], 1e-9)
        if self.device.type == "cuda":  # rollout, scoring and update so far (vLLM's engine not included)
            metrics["perf/peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        metrics = reduce_metrics(metrics, "update/metrics", rule=_metric_rule)
        metrics.update(self.rollout_metrics)
        return metrics, torch.tensor(sum(losses) / max(len(losses), 1))

    def _gradient_sync(self, last: bool) -> None:
        """Under FSDP2 with ``optim.defer_grad_reduction``, the next backward reduce-scatters its gradients only
        when it is the mini-batch's ``last``: the others accumulate unsharded gradients on each rank."""
        if self._sharded and self.optim_cfg.defer_grad_reduction and hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(last)

    def _micro_loss(self, batch: RolloutBatch, rows: Tensor, normalizer: float,
                    stats_log: dict[str, list[float]] | None) -> tuple[Tensor, float]:
        """Every loss term of one micro-batch (:func:`agentopsd.objective.micro_batch_loss`); the terms' values go
        to ``stats_log``, each rank's share of a mini-batch-wide term scaled to the whole (see :meth:`update`)."""
        loss, stats, ratio_dev = micro_batch_loss(self.algorithm, self.optim_cfg, self.scorer, batch, rows, normalizer)
        if stats_log is not None:
            world = rank_and_world()[1]
            for k, v in stats.items():
                stats_log.setdefault(k, []).append(float(v) * (world if k in _SHARED_TERMS else 1))
        return loss, ratio_dev

    def _optimizer_step(self, opt, sched, stats_log: dict[str, list[float]]) -> None:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.optim_cfg.grad_clip) if params else torch.tensor(0.0)
        if not torch.isfinite(norm):
            # a non-finite gradient would write NaN into the weights: skip this update
            log.warning("non-finite gradient norm (%s) at iteration %d: update skipped", float(norm), self.iteration)
            opt.zero_grad(set_to_none=True)
            stats_log.setdefault("skipped_steps", []).append(1.0)
            return
        stats_log.setdefault("grad_norm", []).append(float(norm))
        opt.step()
        sched.step()

    def configure_optimizers(self):
        cfg = self.optim_cfg
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        total = max(1, self.num_iterations * cfg.ppo_epochs * cfg.num_mini_batches)

        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda step: cfg.lr_factor(step, total)), "interval": "step"}}

    # ------------------------------------------------------------------ evaluation

    def eval_tasks(self) -> list[TaskSpec]:
        return eval_task_list(self.env_cfg.id, self.env_cfg.kwargs, self.eval_cfg.num_tasks)

    def evaluate(self) -> dict[str, float]:
        """Success on the fixed evaluation list, with no skill text in any prompt."""
        was_training = self.model.training
        self.model.eval()
        try:
            collector = self.collector
            with self._phase("evaluation"):
                collector.policy_version = self.iterations_done
                self._offload_optimizer_states()
                factory.engine_sync(collector.generator, self.model, self.iterations_done)
                try:
                    rank, world = rank_and_world()
                    # disjoint shards of the fixed list, one per rank (the collector keeps ranks in step)
                    tasks = shard_items(self.eval_tasks(), rank, world)
                    trajectories = collector.collect(tasks, with_teacher=False, sampling=self.eval_sampling)
                    sampled = []
                    if self.eval_cfg.sampled_copies:
                        copies = [t for t in tasks for _ in range(self.eval_cfg.sampled_copies)]
                        devices = [self.device.index or 0] if self.device.type == "cuda" else []
                        with torch.random.fork_rng(devices=devices):  # a fixed stream that leaves the training's untouched
                            torch.manual_seed(len(copies) + 1_000_003 * rank)
                            sampled = collector.collect(copies, with_teacher=False, sampling=self.sampling)
                    factory.engine_sleep(collector.generator)
                except RolloutStopped:  # the evaluation is dropped; training state is whole
                    raise Preempted(self.stop_request.signal_name or "SIGTERM", self.iterations_done, update_done=True) from None
        finally:
            self._restore_optimizer_states()
            self.model.train(was_training)
        metrics = pooled_metrics(trajectories, sampled)  # every rank's episodes: the same metrics on every rank
        metrics["eval/iteration"] = float(self.iterations_done)  # 0 before training
        self.eval_history.append(metrics)
        return metrics

    def teardown(self, stage: str) -> None:
        if self._producer is not None:
            self._producer.close()
            self._producer = None
        if self._collector is not None:
            self._collector.close()
            self._collector = None

    # ------------------------------------------------------------------ checkpoint extras

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["agentopsd"] = {
            "rng": capture(),
            "eval_history": self.eval_history,
            "iteration": self.iteration,
            "iterations_done": self.iterations_done,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("state_dict")
        if isinstance(state, dict):  # checkpoints written before the reference left the state dict
            for key in [k for k in state if k.startswith("ref_model.")]:
                del state[key]
        extra = checkpoint.get("agentopsd")
        if not extra:
            return
        restore(extra["rng"])
        self.eval_history = list(extra.get("eval_history", []))
        self.iteration = int(extra.get("iteration", 0))
        self.iterations_done = int(extra.get("iterations_done", 0))
        reopen_finished_epoch(checkpoint, self.iterations_done, self.num_iterations)
