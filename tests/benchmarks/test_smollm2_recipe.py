"""benchmarks/smollm2_recipe.py --micro: every phase timed in float32 and in bf16 in one process, printed side by side
with their ratio. CI runs it on the tiny Qwen2 (``--model tiny``, seconds); the SmolLM2 figures are in
results/smollm2_speed."""

from __future__ import annotations

import json


def test_the_table_puts_both_precisions_side_by_side_with_bf16s_speed_up(smollm2_recipe_bench):
    seconds = {phase: {"float32": 1.2, "bfloat16": 0.4} for phase in smollm2_recipe_bench.MICRO_PHASES}
    seconds["update micro-batch"] = {"float32": 0.5, "bfloat16": 1.0}
    text = smollm2_recipe_bench.micro_table({"model": "smollm2", "threads": 1, "repeats": 3, "native_bf16_flags": ["avx512_bf16"],
                              "seconds": seconds})
    assert "native bf16 flags: avx512_bf16" in text
    assert "| rollout turn | 16 prompts, 8 new tokens, KV cache | 1.200 | 0.400 | 3.00x |" in text
    assert "| update micro-batch | 8 rows, forward + backward, LoRA | 0.500 | 1.000 | 0.50x |" in text  # slower: below 1
    assert len([line for line in text.splitlines() if line.startswith("| ") and "x |" in line]) == 4


def test_micro_runs_every_phase_both_ways_on_the_tiny_model(smollm2_recipe_bench, tmp_path, capsys):
    out = tmp_path / "micro.json"
    assert smollm2_recipe_bench.main(["--micro", "--model", "tiny", "--repeats", "1", "--json", str(out), "--report", str(tmp_path / "micro-table.txt")]) == 0
    figures = json.loads(out.read_text())
    assert figures["model"] == "tiny" and set(figures["seconds"]) == set(smollm2_recipe_bench.MICRO_PHASES)
    for phase, s in figures["seconds"].items():
        assert set(s) == {"float32", "bfloat16"} and min(s.values()) > 0, (phase, s)
    printed = capsys.readouterr().out
    assert "| phase | work | float32 s | bf16 s | bf16 speed-up (float32 s / bf16 s) |" in printed
    assert (tmp_path / "micro-table.txt").read_text().strip() in printed
