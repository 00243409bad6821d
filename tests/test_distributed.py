"""Two processes on CPU (gloo): DDP and FSDP2 run tiny experiments, checkpoint, and resume."""

from __future__ import annotations

import pytest

from tests.test_train import metrics_rows, run_train, shard_records


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_train_checkpoint_and_resume(strategy, tmp_path):
    out = tmp_path / strategy
    common = [
        "experiment=babyai_tiny", f"trainer={strategy}", "trainer.accelerator=cpu", "trainer.devices=2",
        "trainer.precision=32-true", "trainer.enable_progress_bar=false", f"output_dir={out}", "num_iterations=3",
        "evaluation.num_tasks=2",
    ]
    # 2 mini-batches per iteration: max_steps=4 stops after 2 of the 3 iterations
    run_train(*common, "+trainer.max_steps=4", timeout=1200)
    last = out / "checkpoints" / "last.ckpt"
    assert last.exists()
    if strategy == "fsdp":
        assert last.is_dir() and any(last.iterdir())  # a sharded (distributed) checkpoint
    run_train(*common, "ckpt_path=last", timeout=1200)
    assert list(shard_records(out)) == [f"rollouts-{i:06d}.tar" for i in (1, 2, 3)]  # numbered 1, 2, 3 like every log
    iterations = [int(float(r["rollout/iteration"])) for r in metrics_rows(out) if r.get("rollout/iteration")]
    assert iterations == [1, 2, 3]
