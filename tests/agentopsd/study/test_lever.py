"""agentopsd/study/lever.py: how far a run's multipliers moved its turn advantages, from its rollout shards."""

from __future__ import annotations

import lzma

import pytest

from agentopsd.study.lever import lever, main, table


def _run(tmp_path, name: str, xz: bool) -> object:
    from agentopsd.callbacks.rollout_logging import write_shard

    run = tmp_path / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("algorithm: {name: oracle, mult_lambda: 0.5, mult_band: 0.2}\n")
    recs = [
        {"iteration": 1, "success": True, "seq_advantage": 0.7,
         "turns": [{"multiplier": 1.2, "evidence": 0.3}, {"multiplier": 0.9, "evidence": 0.0}, {"multiplier": 0.9, "evidence": -0.3}]},
        {"iteration": 1, "success": False, "seq_advantage": -0.7, "turns": [{"multiplier": 0.8, "evidence": 0.3}, {"multiplier": 1.2, "evidence": -5.0}]},
        {"iteration": 1, "success": False, "seq_advantage": 0.0, "turns": [{"multiplier": 0.8, "evidence": 0.3}]},  # A = 0: left out
    ]
    write_shard(run / "rollouts" / "rollouts-000001.tar", recs)
    if xz:
        shard = run / "rollouts" / "rollouts-000001.tar"
        shard.with_name(shard.name + ".xz").write_bytes(lzma.compress(shard.read_bytes()))
        shard.unlink()
    return run


@pytest.mark.parametrize("xz", [False, True])
def test_the_lever_of_a_run_from_plain_or_compressed_shards(tmp_path, xz) -> None:
    row = lever(_run(tmp_path, "r", xz))
    assert row["turns"] == 5 and row["mean |w-1|"] == pytest.approx((0.2 + 0.1 + 0.1 + 0.2 + 0.2) / 5)
    assert row["at band edge"] == pytest.approx(3 / 5) and row["mean |At/A-1|"] == pytest.approx(0.5 * 0.16)
    assert row["w (won, e>0)"] == (pytest.approx(1.2), 1) and row["w (lost, e<0)"] == (pytest.approx(1.2), 1)
    assert "| r | 0.5 | 0.2 | 5 |" in table([row])


def test_the_command_line_writes_the_table(tmp_path, capsys) -> None:
    out = tmp_path / "lever.md"
    main([str(_run(tmp_path, "a", False)), str(_run(tmp_path, "b", True)), "--out", str(out)])
    assert out.read_text() == capsys.readouterr().out and out.read_text().count("\n") == 4
