"""One PPO update on fixed rows, under 1 process or 2 (DDP or FSDP2, gloo): writes each rank's reduced
gradient, loss and updated weights, so a test can compare them (tests/test_distributed_numbers.py).

    python tests/distributed_update_probe.py OUT_DIR {single,ddp,fsdp,fsdp-deferred}[+skip|+skip-recompute]

The 7 rows (unequal prompt and action lengths, advantages of both signs) are split unequally in the
2-process runs: rank 0 holds 5 rows (3 micro-batches of 2), rank 1 holds 2 (1 micro-batch, then dummy
passes); under DDP the update first balances the ranks' tokens (``optim.balance_tokens``: rows move between
them), under FSDP2 it does not (the deferred-reduction count needs the dummy passes); the entropy bonus and the
KL penalty are on. With ``+skip``: no KL or entropy (``optim.skip_zero_advantage`` refuses them), rows 2, 5
and 6 hold advantage 0 and skip the update's forward, so rank 1 of a 2-process FSDP2 run has no row to run.
With ``+skip-recompute`` as with ``+skip``, but the rows arrive with behaviour log-probs 0.1 off the trainer's (a
bf16 generator's) and the update recomputes the old ones for its nonzero-advantage rows first (the deferred
recompute of ``AgentRLModule.defers_recompute``): rank 1 of an FSDP2 run then joins that forward with no row.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# run as a script, its own folder (tests/) comes first on sys.path, where tests/agentopsd/ (the tests'
# mirror of the package) would shadow the package itself: the repository root takes its place
sys.path[0] = str(Path(__file__).resolve().parents[1])

import lightning as L  # noqa: E402
import torch  # noqa: E402

from agentopsd.config import EnvConfig, EvalConfig, OptimConfig, RolloutConfig  # noqa: E402
from agentopsd.credit.algorithms import Algorithm  # noqa: E402
from agentopsd.training.data import TaskDataModule  # noqa: E402
from agentopsd.training.distributed import rank_and_world  # noqa: E402
from agentopsd.training.module import AgentRLModule  # noqa: E402
from agentopsd.types import RolloutBatch  # noqa: E402

ENV = "agentopsd/BabyAI-GoToLocal-v0"
ROWS = {1: [list(range(7))], 2: [[0, 1, 2, 3, 4], [5, 6]]}
LENGTHS = [(9, 3), (14, 2), (6, 4), (11, 3), (8, 1), (16, 2), (5, 3)]  # (prompt, action) tokens per row
ADVANTAGES = [1.0, -0.5, 0.8, -1.2, 0.3, 1.5, -0.7]
ZERO_ROWS = (2, 5, 6)
"""Rows whose advantage is 0 in the ``+skip`` modes."""


def fixed_rows(rows: list[int], vocab: int, device: torch.device, zero: tuple[int, ...] = ()) -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    all_ids = [torch.randint(3, vocab, (p + a,), generator=gen) for p, a in LENGTHS]
    width = max(p + a for p, a in LENGTHS)
    m = len(rows)
    ids = torch.zeros(m, width, dtype=torch.long)
    attn = torch.zeros(m, width, dtype=torch.long)
    amask = torch.zeros(m, width, dtype=torch.bool)
    adv = torch.zeros(m, width)
    for r, i in enumerate(rows):
        p, a = LENGTHS[i]
        ids[r, : p + a], attn[r, : p + a], amask[r, p : p + a] = all_ids[i], 1, True
        adv[r, p : p + a] = 0.0 if i in zero else ADVANTAGES[i]
    zeros_m = torch.zeros(m)
    rb = RolloutBatch(
        input_ids=ids, attention_mask=attn, action_mask=amask, old_logprobs=torch.zeros(m, width),
        teacher_input_ids=ids, teacher_attention_mask=attn, teacher_action_mask=amask,
        turn_traj=torch.arange(m), turn_index=torch.zeros(m, dtype=torch.long), turn_valid=torch.ones(m, dtype=torch.bool),
        turn_penalties=zeros_m, turn_state=torch.arange(m), success=zeros_m, rewards=zeros_m,
        group_ids=torch.arange(m), seq_advantages=zeros_m, num_turns=torch.ones(m, dtype=torch.long),
    ).to(device)
    rb.advantages = adv.to(device)
    return rb


class FixedRowsModule(AgentRLModule):
    """The module with its rollout replaced by fixed rows (the update path is the real one)."""

    def __init__(self, out: Path, *args, recompute: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.out, self.recompute = out, recompute

    def rollout(self, batch):
        rank, world = rank_and_world()
        rb = fixed_rows(ROWS[world][rank], self.model.config.vocab_size, self.device,
                        ZERO_ROWS if self.optim_cfg.skip_zero_advantage else ())
        with torch.no_grad():
            rb.old_logprobs = self.action_logprobs(rb, "student")
            rb.ref_logprobs = self.action_logprobs(rb, "student", model=self.ref_model) - 0.05 * rb.action_mask
        if self.recompute:  # the update must put the trainer's log-probs back before its first step
            rb.old_logprobs = rb.old_logprobs - 0.1 * rb.action_mask
            self._recompute_pending = (rb, None)
        return rb

    def _optimizer_step(self, opt, sched, stats_log) -> None:
        rank, _ = rank_and_world()
        (self.out / f"reductions-rank{rank}.txt").write_text(str(REDUCTIONS["n"] - self.reductions_before))
        grads = {n: _full(p.grad) for n, p in self.model.named_parameters() if p.grad is not None}
        if rank == 0:
            torch.save(grads, self.out / "grads.pt")
        super()._optimizer_step(opt, sched, stats_log)

    def update(self, batch, batch_idx):
        self.reductions_before = REDUCTIONS["n"]
        metrics, loss = super().update(batch, batch_idx)
        if rank_and_world()[0] == 0:
            torch.save({k: v for k, v in metrics.items() if k.startswith(("loss/", "rollout/logprob_diff"))}, self.out / "metrics.pt")
        return metrics, loss

    def on_train_end(self) -> None:
        rank, _ = rank_and_world()
        weights = {n: _full(p.data) for n, p in self.model.named_parameters()}
        torch.save(weights, self.out / f"weights-rank{rank}.pt")


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a collective: every rank calls it in the same order)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone().cpu()


REDUCTIONS = {"n": 0}
"""Reduce-scatters and all-reduces this process issued (the update's gradient reductions are counted between
its start and the optimizer step)."""


def count_reductions() -> None:
    import torch.distributed as dist

    for name in ("reduce_scatter_tensor", "reduce_scatter_single", "all_reduce"):
        real = getattr(dist, name)

        def counted(*args, _real=real, **kwargs):
            REDUCTIONS["n"] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)


def main(out: Path, mode: str) -> None:
    from agentopsd.models.tiny import tiny_policy

    mode, _, extra = mode.partition("+")
    skip = extra in ("skip", "skip-recompute")

    count_reductions()
    torch.manual_seed(0)
    model, tokenizer = tiny_policy(ENV, vocab_size=300, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                   text_episodes=4, cache_dir=str(out / "tok"))
    algo = Algorithm() if skip else Algorithm(kl_coef=0.05, entropy_coef=0.01)
    module = FixedRowsModule(
        out, model, tokenizer, recompute=extra == "skip-recompute", algorithm=algo, env=EnvConfig(id=ENV), rollout=RolloutConfig(),
        optim=OptimConfig(lr=1e-3, ppo_epochs=1, num_mini_batches=1, micro_batch_size=2,
                          defer_grad_reduction=mode == "fsdp-deferred", balance_tokens=mode == "ddp", skip_zero_advantage=skip),
        evaluation=EvalConfig(num_tasks=1), num_iterations=1,
    )
    strategy = {"single": "auto", "ddp": "ddp"}.get(mode)
    if mode.startswith("fsdp"):
        from agentopsd.training.strategies import FSDP2Strategy

        strategy = FSDP2Strategy()
    trainer = L.Trainer(accelerator="cpu", devices=1 if mode == "single" else 2, strategy=strategy, precision="32-true", max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=TaskDataModule(ENV, tasks_per_batch=2, group_size=1, num_iterations=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
