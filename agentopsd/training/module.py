"""The LightningModule: owns the policy, its two prompt views, rollouts and the update.

Data flow of one iteration: the loader yields a TaskBatch; in
``on_after_batch_transfer`` (right before the callbacks' ``on_train_batch_start``) the
current weights roll out and, when the algorithm needs it, the teacher view scores the same
action tokens; the CreditCallback writes the advantages; ``training_step`` runs PPO epochs
with manual optimization.

Adding a forward or a backward? Read the rank invariant at the top of ``agentopsd/training/distributed.py``
first: under FSDP every forward is a collective, so its count must not depend on this rank's data
(agree the count with ``distributed.padded``/``exchange`` and pad with dummy passes of the same code).
"""

from __future__ import annotations

import contextlib
import logging
import time

import lightning as L
import torch
from torch import Tensor, nn

from agentopsd.config import (
    EnvConfig,
    EvalConfig,
    OptimConfig,
    RolloutConfig,
    advantage_scaling_overrides,
    resolve_teacher_scoring,
)
from agentopsd.credit.algorithms import Algorithm
from agentopsd.rollout import factory
from agentopsd.rollout.collector import Collector
from agentopsd.rollout.scoring import (
    Scorer,
    effective_tis_cap,
    engine_gap_metrics,
    teacher_scored_trajectories,
    warn_on_logprob_gap,
)
from agentopsd.rollout.source import LockstepRollouts, Placement, WorkerSettings, make_rollout_source
from agentopsd.run.folders import reopen_finished_epoch
from agentopsd.run.rng_state import capture, restore
from agentopsd.training.data import TaskBatch, collate_trajectories
from agentopsd.training.distributed import kill_launched_ranks, rank_and_world, reduce_metrics, shard_items
from agentopsd.training.evaluation import eval_task_list, pooled_metrics
from agentopsd.training.objective import check_settings, micro_batch_loss, signal_rows
from agentopsd.training.offload import offload_optimizer_states, restore_optimizer_states
from agentopsd.training.oom import out_of_memory_ends_the_job
from agentopsd.training.precision import FLOAT32_PLAN, WeightPlan, compute_in_half, plan_for_config
from agentopsd.training.preemption import Preempted, RolloutStopped, StopRequest
from agentopsd.training.step_log import log_step
from agentopsd.training.strategies import frozen_copy, place_reference, prepare_policy
from agentopsd.training.update import SHARED_TERMS, Seams, adamw_with_schedule, metric_rule, ppo_update
from agentopsd.types import RolloutBatch, TaskSpec

log = logging.getLogger(__name__)


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
            weight_plan=plan_for_config(cfg),  # model.dtype: bf16 storage where the CPU has it, frozen weights as loaded on a GPU
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
        weight_plan: WeightPlan = FLOAT32_PLAN,
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
        self.weight_plan = weight_plan
        """bf16 frozen weights or a bf16 generation copy (:mod:`agentopsd.training.precision`), or one float32 policy."""
        if weight_plan.frozen_half:
            compute_in_half(model)  # train.py did so before the warm start; a module built by other code needs it too
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.prompts = factory.prompt_builder(tokenizer, env)
        self.skill_bank = factory.skill_bank(env)
        distils = check_settings(algorithm, rollout, optim, has_skills=self.skill_bank is not None)
        self.teacher_scoring = resolve_teacher_scoring(rollout.teacher_scoring, rollout.max_staleness, rollout.backend, distils)
        """Where the teacher view is scored in this run (``rollout.teacher_scoring`` with ``auto`` resolved)."""
        # the rollout's sampling and the evaluation's (greedy unless rollout.eval_temperature > 0)
        self.sampling, self.eval_sampling = factory.sampling_configs(rollout, self.prompts.stop_strings)
        # A frozen copy of the initial policy, only when the KL penalty is on (it doubles memory). Not a
        # registered submodule: it is not part of the state dict, so no checkpoint carries it; a resumed
        # run rebuilds it from the weights the module is built from (model.path, or the warm start).
        ref = frozen_copy(model) if algorithm.kl_coef > 0 else None
        object.__setattr__(self, "ref_model", ref)
        self._rollouts: LockstepRollouts | None = None
        self._sharded = False
        """True once configure_model applied FSDP2: forwards become collectives."""
        self._states_offloaded = False
        """AdamW's states are in host memory (``optim.offload_optimizer``, while the engine generates)."""
        self.phase_seconds: dict[str, float] = {}
        self.rollout_metrics: dict[str, float] = {}
        self._recompute_pending: tuple[RolloutBatch, Tensor | None] | None = None
        """The batch (and its rows' staleness) whose behaviour log-probs the update recomputes (:meth:`defers_recompute`)."""
        self.first_ratio_dev: float = float("nan")
        """max |ratio - 1| on the first mini-batch of the last iteration (0 when on-policy)."""
        self.eval_history: list[dict[str, float]] = []
        self.iteration = 0
        """Index of the iteration being trained (set by its rollout)."""
        self.iterations_done = 0
        """Completed iterations (updates made)."""
        self.stop_request = StopRequest()
        """Set by a signal handler (agentopsd.callbacks.preemption): rollouts and evaluations stop between turns."""
        self.step_metrics: dict[str, float] = {}
        """What the last update logged (its ``step``: completed iterations), for a stop that skips Lightning's logging."""
        self._logged_keys: tuple[set[str], set[str]] = (set(), set())
        """The keys :meth:`training_step` logged so far (metrics, progress bar): absent later, they log NaN (:func:`log_step`)."""

    # ------------------------------------------------------------------ sharding

    def configure_model(self) -> None:
        """Float32 master weights where the precision asks for them, then FSDP2 under
        ``ModelParallelStrategy`` (``trainer=fsdp``): :func:`agentopsd.training.strategies.prepare_policy`."""
        from lightning.pytorch.strategies import ModelParallelStrategy

        if self._trainer is None:
            return
        fsdp = not self._sharded and isinstance(self.trainer.strategy, ModelParallelStrategy)
        mesh = self.device_mesh["data_parallel"] if fsdp else None
        plan = self.weight_plan
        self._sharded = prepare_policy(self.model, self.ref_model, str(self.trainer.precision), mesh, sharded=self._sharded,
                                       frozen_half=plan.frozen_half or plan.frozen_as_loaded)

    # ------------------------------------------------------------------ rollout

    @property
    def rollouts(self) -> LockstepRollouts:
        """Where this run's episodes come from (:mod:`agentopsd.rollout.source`), built on first use."""
        if self._rollouts is None:
            def build_collector() -> Collector:
                generator = factory.make_generator(self.model, self.tokenizer, self.env_cfg, self.rollout_cfg, seed=self.seed,
                                                   model_path=self.model_path, iterations_done=self.iterations_done,
                                                   weights_as_loaded=self.weights_as_loaded,
                                                   generation_dtype=self.weight_plan.generation_dtype)
                return factory.make_collector(self.env_cfg, generator, self.prompts, self.sampling, skill_bank=self.skill_bank,
                                              seed=self.seed, stop_requested=lambda: self.stop_request.requested,
                                              overlap_waves=self.rollout_cfg.overlap_waves)

            settings = WorkerSettings(self.tokenizer, self.env_cfg, self.rollout_cfg, self.seed, self.num_iterations,
                                      self.model_path, self.weights_as_loaded, self.weight_plan.generation_dtype)
            self._rollouts = make_rollout_source(
                build_collector, settings, with_teacher=self.algorithm.needs_teacher, teacher_scoring=self.teacher_scoring,
                stop_request=self.stop_request, stop_other_ranks=self._stop_other_ranks,
                release_memory=self._offload_optimizer_states, restore_memory=self._restore_optimizer_states)
        return self._rollouts

    @property
    def collector(self) -> Collector:
        """The lockstep collector (the evaluation's; the training rollout's unless a worker plays ahead)."""
        return self.rollouts.collector

    def _placement(self) -> Placement:
        loader = self.trainer.train_dataloader if self._trainer is not None else None
        # the processes of one node: Lightning's own launcher sets no LOCAL_WORLD_SIZE on several nodes
        per_node = self.trainer.num_devices if self._trainer is not None else None
        return Placement(self.model, self.iterations_done, self.device, self._sharded, loader, per_node)

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
                got = self.rollouts.collect(batch.tasks, batch.iteration, self._placement())
            trajectories, metrics = got.trajectories, got.metrics
            rb = collate_trajectories(trajectories, self.pad_id).to(self.device)
            t0 = time.perf_counter()
            with self._phase("scoring"), torch.no_grad(), self._compute_precision():
                teacher_model = factory.generation_copy(self.rollouts.built_collector)
                deferred = self.defers_recompute(rb, teacher_model)
                rb.teacher_scored = self.teacher_scored(rb)
                # under a mixed precision the behaviour log-probs are the training forward's, in the update's precision
                scored, backend_gap = self.scorer.score_rollout(
                    rb, recompute_old=self.recompute_old_logprobs and not deferred, with_teacher=self.algorithm.needs_teacher,
                    tis_cap=self.tis_cap, teacher_model=teacher_model,
                    teacher_rows=None if rb.teacher_scored is None else rb.teacher_scored[rb.turn_traj])
                self._recompute_pending = (rb, got.row_staleness) if deferred else None
                if self.ref_model is not None:
                    if not self._sharded:  # under FSDP2 fully_shard placed it already
                        place_reference(self.ref_model, self.model, keep_half=self.weight_plan.frozen_as_loaded)
                    rb.ref_logprobs = self.action_logprobs(rb, "student", model=self.ref_model)
                    scored += float(rb.attention_mask.sum())
            t_teacher = time.perf_counter() - t0
            if self.stop_request.agreed():  # before the update, the longest phase: abandon now
                raise Preempted(self.stop_request.signal_name, batch.iteration, update_done=False)
        finally:
            self._restore_optimizer_states()  # a stopped rollout's checkpoint holds them where the update does
            self.model.train(was_training)
        self.iteration = batch.iteration
        self.phase_seconds = {"rollout": got.seconds, "teacher": t_teacher}
        # faulted trajectories are left out of the update: this says how many were used
        metrics["rollout/trajectories_used"] = float(rb.num_trajectories)
        metrics["perf/teacher_tokens_per_s"] = scored / max(t_teacher, 1e-9)
        if rb.teacher_scored is not None:  # the share of trajectories whose teacher forward was skipped: A_seq = 0
            metrics["rollout/teacher_skipped_share"] = float((~rb.teacher_scored).float().mean())
        metrics.update(engine_gap_metrics(backend_gap, rb, self.tis_cap or 0.0, got.row_staleness))
        # every rank's episodes count: rates weighted by trajectories, counts and throughputs summed
        self.rollout_metrics = reduce_metrics(metrics, "rollout/metrics", weight=len(trajectories), rule=metric_rule)
        # asynchronous: the fresh turns' gap alone (a stale turn's is mostly the weights' drift, which the TIS corrects)
        warn_on_logprob_gap(self.rollout_metrics.get("rollout/logprob_diff_mean"), self.optim_cfg.logprob_diff_warning,
                            self.iteration, tis_on=self.tis_active)
        return rb

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
        # bf16 weights generated (agentopsd.training.precision): the behaviour log-probs are not the update's numerics either
        return (self.rollout_cfg.recompute_old_logprobs or self.mixed_precision or self.rollouts.off_policy
                or self.weight_plan.half_rollout)

    def teacher_scored(self, rb: RolloutBatch) -> Tensor | None:
        """``[B]`` bool, the trajectories whose teacher view is scored, or None for all: with
        ``rollout.teacher_skip_zero_advantage`` and an algorithm whose credit only scales the sequence advantage, the
        trajectories with A_seq != 0 (:func:`agentopsd.rollout.scoring.teacher_scored_trajectories`). Not where the
        rollout worker scored the view already (``rollout.teacher_scoring=worker``): nothing is left to save."""
        algo = self.algorithm
        if not (self.rollout_cfg.teacher_skip_zero_advantage and algo.needs_teacher and algo.teacher_scales_advantage) \
                or rb.engine_teacher_logprobs is not None:
            return None
        return teacher_scored_trajectories(rb.seq_advantages)

    def defers_recompute(self, rb: RolloutBatch, teacher_model: nn.Module | None) -> bool:
        """The behaviour log-probs are recomputed at the start of the update, for the rows it trains on only,
        instead of for every row at scoring: with ``optim.skip_zero_advantage`` a row whose advantage is 0 never
        reads them (its loss is 0 whatever its ratio), and late in a run most rows are such rows (every copy of a
        task won, or every one lost). The weights have not moved in between, so the numbers are the same.
        Not where the credit reads the recomputed log-probs as the teacher gap's student side: a teacher view
        scored by the trainer's own forward is compared with them, not with the generator's."""
        if not (self.recompute_old_logprobs and self.optim_cfg.skip_zero_advantage):
            return False
        return not self.algorithm.needs_teacher or teacher_model is not None or rb.engine_teacher_logprobs is not None

    def _recompute_for_update(self, batch: RolloutBatch) -> dict[str, float]:
        """The deferred recompute (:meth:`defers_recompute`) of ``batch``, once, before its first optimizer step:
        the rows with a nonzero advantage re-scored as scoring would have; returns the gap and TIS metrics over them."""
        pending, self._recompute_pending = self._recompute_pending, None
        if pending is None or pending[0] is not batch:
            return {}
        rows = signal_rows(batch.advantages, batch.action_mask)
        was_training = self.model.training
        self.model.eval()  # as at scoring
        try:
            with torch.no_grad(), self._compute_precision():
                gap = self.scorer.recompute_behaviour(batch, rows, self.tis_cap)
        finally:
            self.model.train(was_training)
        metrics = engine_gap_metrics(gap, batch, self.tis_cap or 0.0, pending[1], rows=rows)
        metrics = reduce_metrics(metrics, "update/recompute-metrics", weight=float(len(rows)), rule=metric_rule)
        warn_on_logprob_gap(metrics.get("rollout/logprob_diff_mean"), self.optim_cfg.logprob_diff_warning,
                            self.iteration, tis_on=self.tis_active)
        return metrics

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
        """A phase whose out-of-memory error ends the job with one line (:mod:`agentopsd.training.oom`)."""
        return out_of_memory_ends_the_job(name, self._stop_other_ranks)

    def _stop_other_ranks(self) -> None:
        """Rank 0 of Lightning's own launcher started the other ranks: kill them before this process exits."""
        kill_launched_ranks(self.trainer.strategy if self._trainer is not None else None)

    @property
    def tis_cap(self) -> float | None:
        """The truncated importance weight's cap when it applies, else None
        (:func:`agentopsd.rollout.scoring.effective_tis_cap`): the engine/trainer mismatch, or stale turns."""
        return effective_tis_cap(self.optim_cfg, self.rollout_cfg, half_rollout=self.weight_plan.half_rollout)

    @property
    def tis_active(self) -> bool:
        return self.tis_cap is not None

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
        self.rollouts.publish(self.model, self.iterations_done)  # a worker's turns from now on play the updated weights
        shown = {k: v for k, v in metrics.items() if k in ("rollout/success", "rollout/turns")}
        # "step": the loggers' x axis is completed iterations (not optimizer steps), as in the evaluation rows
        # a key this iteration did not measure logs NaN, not the last iteration's value (agentopsd.training.step_log)
        logged = log_step(self, {k: v for k, v in metrics.items() if k not in shown} | {"step": float(self.iterations_done)},
                          self._logged_keys[0], batch_size=batch.num_trajectories)
        # the rich progress bar shows the rollout: success and turns per episode
        logged |= log_step(self, shown, self._logged_keys[1], prog_bar=True, batch_size=batch.num_trajectories)
        # Lightning hands these to the loggers only after every batch-end hook; a stop raised in one of those
        # hooks (callbacks.preemption) writes them itself, or the iteration it keeps would have no row
        self.step_metrics = logged
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
        """PPO epochs over mini-batches of one rollout batch (:func:`agentopsd.training.update.ppo_update`); returns the metrics
        and the mean loss."""
        if batch.advantages is None:
            raise RuntimeError("the batch has no advantages: add agentopsd.callbacks.credit.CreditCallback to the Trainer's callbacks")
        t0 = time.perf_counter()
        opt, sched, cfg = self.optimizers(), self.lr_schedulers(), self.optim_cfg
        self._restore_optimizer_states()  # where an interrupted rollout left them on the host
        self.rollout_metrics.update(self._recompute_for_update(batch))
        seams = Seams(self.manual_backward, self._micro_loss, self._optimizer_step, self._gradient_sync)
        done = ppo_update(batch, algo=self.algorithm, cfg=cfg, scorer=self.scorer, opt=opt, sched=sched, seams=seams,
                          seed=self.seed, batch_idx=batch_idx, device=self.device, pad_id=self.pad_id,
                          first_ratio_dev=self.first_ratio_dev)
        self.first_ratio_dev, stats_log, losses = done.first_ratio_dev, done.stats, done.losses
        metrics = {f"loss/{k}": sum(v) / len(v) for k, v in stats_log.items()}
        metrics["loss/first_ratio_dev"] = self.first_ratio_dev
        if cfg.skip_zero_advantage:  # the share of rows (over the PPO epochs) that ran no forward: advantage 0
            metrics["update/zero_advantage_share"] = done.skipped_rows / max(1, batch.num_rows * cfg.ppo_epochs)
        metrics["rollout/iteration"] = float(self.iteration + 1)  # numbered like every log: iterations completed by this update
        metrics["loss/lr"] = float(opt.param_groups[0]["lr"])
        self.phase_seconds["update"] = time.perf_counter() - t0
        metrics.update({f"perf/{k}_seconds": v for k, v in self.phase_seconds.items()})
        metrics["perf/update_tokens_per_s"] = float(batch.attention_mask.sum()) * cfg.ppo_epochs / max(self.phase_seconds["update"], 1e-9)
        if self.device.type == "cuda":  # rollout, scoring and update so far (vLLM's engine not included)
            metrics["perf/peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        metrics = reduce_metrics(metrics, "update/metrics", rule=metric_rule)
        metrics.update(self.rollout_metrics)
        return metrics, torch.tensor(sum(losses) / max(len(losses), 1))

    def _gradient_sync(self, last: bool) -> None:
        """Under FSDP2 with ``optim.defer_grad_reduction``, the next backward reduce-scatters its gradients only
        when it is the mini-batch's ``last``: the others accumulate unsharded gradients on each rank."""
        if self._sharded and self.optim_cfg.defer_grad_reduction and hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(last)

    def _micro_loss(self, batch: RolloutBatch, rows: Tensor, normalizer: float,
                    stats_log: dict[str, list[float]] | None) -> tuple[Tensor, float]:
        """Every loss term of one micro-batch (:func:`agentopsd.training.objective.micro_batch_loss`); the terms' values go
        to ``stats_log``, each rank's share of a mini-batch-wide term scaled to the whole (see :meth:`update`)."""
        loss, stats, ratio_dev = micro_batch_loss(self.algorithm, self.optim_cfg, self.scorer, batch, rows, normalizer)
        if stats_log is not None:
            world = rank_and_world()[1]
            for k, v in stats.items():
                stats_log.setdefault(k, []).append(float(v) * (world if k in SHARED_TERMS else 1))
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
        return adamw_with_schedule(self.model, self.optim_cfg, self.num_iterations)

    # ------------------------------------------------------------------ evaluation

    def eval_tasks(self) -> list[TaskSpec]:
        return eval_task_list(self.env_cfg.id, self.env_cfg.kwargs, self.eval_cfg.num_tasks)

    def evaluate(self) -> dict[str, float]:
        """Success on the fixed evaluation list, with no skill text in any prompt."""
        was_training = self.model.training
        self.model.eval()
        try:
            with self._phase("evaluation"):
                rank, world = rank_and_world()
                tasks = shard_items(self.eval_tasks(), rank, world)  # disjoint shards of the fixed list, one per rank
                try:
                    trajectories, sampled = self.rollouts.evaluate(tasks, self._placement(), self.eval_sampling,
                                                                   sampled_copies=self.eval_cfg.sampled_copies,
                                                                   sampled_with=self.sampling)
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
        if self._rollouts is not None:
            self._rollouts.close()
            self._rollouts = None

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
