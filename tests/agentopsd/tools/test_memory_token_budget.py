"""agentopsd/tools/memory.py: under a token budget (``optim.max_tokens_per_micro_batch``) a micro-batch's activations are
the budget's tokens, whatever ``optim.micro_batch_size`` says (the trainer then packs rows by tokens and leaves it
unused). The paper experiments' budget is exactly ``micro_batch_size x sequence`` (10,240 = 4 x 2,560), so these
plans use budgets that differ from it."""

from __future__ import annotations

import pytest

from agentopsd.tools import memory
from agentopsd.tools.memory import compose_config, plan_memory

BASE = ["+experiment=webshop_7b", "trainer.devices=8", "trainer.precision=bf16-mixed"]
SEQ = 2048 + 512  # env.max_prompt_tokens + rollout.max_new_tokens of webshop_7b


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch):
    # the plan must not depend on the machine the tests run on
    monkeypatch.setattr(memory, "_cuda_device_count", lambda: 1)
    monkeypatch.setattr(memory, "_cuda_available", lambda: False)


def plan(budget: int, rows: int = 4, *more: str):
    return plan_memory(compose_config([*BASE, f"optim.max_tokens_per_micro_batch={budget}", f"optim.micro_batch_size={rows}",
                                       *more]), gpu_memory_gib=80)


@pytest.mark.parametrize("checkpointing", ["false", "true"])
def test_activations_follow_the_token_budget_not_micro_batch_size(checkpointing):
    ckpt = f"model.gradient_checkpointing={checkpointing}"
    assert plan(0, 4, ckpt).sequence_tokens == SEQ
    by_rows = {rows: plan(0, rows, ckpt).activations for rows in (1, 2, 4)}
    assert by_rows[2] == 2 * by_rows[1] and by_rows[4] == 4 * by_rows[1]  # without a budget: rows x sequence
    # a budget of k sequences holds what k rows do, whatever micro_batch_size is set to
    for budget_rows, rows in ((2, 4), (4, 1), (1, 4)):
        got = plan(budget_rows * SEQ, rows, ckpt).activations
        assert got == by_rows[budget_rows], (
            f"activations under a {budget_rows * SEQ}-token budget with micro_batch_size={rows}: {got / memory.GIB:.2f} GiB, "
            f"expected {by_rows[budget_rows] / memory.GIB:.2f} GiB (the budget's {budget_rows} x {SEQ} tokens), "
            f"{by_rows.get(rows, 0) / memory.GIB:.2f} GiB would be micro_batch_size x sequence")
    # and in proportion to the budget between those points
    assert plan(3 * SEQ, 4, ckpt).activations == 3 * by_rows[1]


def test_a_budget_below_one_sequence_still_holds_the_longest_row():
    """A row longer than the budget goes alone: the plan counts one whole sequence, not less."""
    one_row = plan(0, 1).activations
    assert plan(SEQ // 2, 4).activations == one_row
    assert plan(SEQ // 2, 4).micro_batch_size == 1
