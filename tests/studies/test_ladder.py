"""studies/ladder.py: the statistics and tables of the powered comparison (synthetic rows, no training),
and one tiny grid end to end (slow)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.studies.loader import load_study

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ladder():
    return load_study("ladder")


def test_slope_is_exact_on_a_line_and_nan_without_two_rungs(ladder) -> None:
    assert ladder.slope([20.0, 30.0, 40.0], [0.9, 0.7, 0.5]) == pytest.approx(-0.02)
    assert ladder.slope([20.0, 20.0], [0.1, 0.2]) != ladder.slope([20.0, 20.0], [0.1, 0.2])


def test_bootstrap_intervals_of_success_rates_stay_inside_0_and_1(ladder) -> None:
    import statistics

    vals = [0.0, 0.0, 1.0, 0.02, 0.98, 0.5, 0.0, 1.0, 0.01, 0.99]
    p, lo, hi = ladder.bootstrap(statistics.fmean, vals)
    assert 0.0 <= lo < p < hi <= 1.0
    p, lo, hi = ladder.bootstrap(statistics.fmean, [0.3])  # one seed: no interval
    assert p == 0.3 and lo != lo


def test_t_interval_matches_the_textbook_and_is_wider_than_the_bootstrap_at_four_seeds(ladder) -> None:
    import statistics

    mean, lo, hi = ladder.t_interval([1.0, 2.0, 3.0, 4.0, 5.0])  # se = 0.7071, t(4) = 2.7764
    assert mean == 3.0 and lo == pytest.approx(3 - 2.7764 * 0.70711, abs=1e-4) and hi == pytest.approx(3 + 2.7764 * 0.70711, abs=1e-4)
    # textbook quantiles (two-sided 95%, 99%, and 1 - 0.05/14 for a Bonferroni family of 14)
    for coverage, df, t in ((0.95, 1, 12.7062), (0.95, 2, 4.3027), (0.95, 9, 2.2622), (0.95, 31, 2.0395), (0.95, 120, 1.9799),
                            (0.99, 9, 3.2498), (0.99, 10, 3.1693), (1 - 0.05 / 14, 9, 3.9088)):
        assert ladder.t_quantile(coverage, df) == pytest.approx(t, abs=2e-4)
    assert ladder.t_interval([1.0, 2.0, 3.0, 4.0, 5.0], coverage=0.99)[1] == pytest.approx(3 - 4.6041 * 0.70711, abs=1e-3)
    with pytest.raises(ValueError, match="coverage"):
        ladder.t_quantile(1.0, 9)
    four = [0.355, 0.176, 0.035, 0.328]
    _, blo, bhi = ladder.bootstrap(statistics.fmean, four)
    _, tlo, thi = ladder.t_interval(four)
    assert tlo < blo and thi > bhi
    assert ladder.t_interval([0.2])[1] != ladder.t_interval([0.2])[1]  # one pair: no interval
    # a difference of two rates lies in [-1, 1]: two far-apart pairs give a t interval past it, cut to it
    assert ladder.t_interval([0.297, 0.023], bounds=(-1.0, 1.0))[1:] == (-1.0, 1.0)


def _rows(effect: float) -> list[dict]:
    """10 seeds x 2 rungs x {grpo, agentopsd}; agentopsd = grpo + effect at every seed (plus seed noise shared by both)."""
    rows = []
    for seed in range(10):
        for level, base in (("KeyDoorBoxS5", 0.6), ("KeyDoorBoxS9", 0.3)):
            noise = 0.05 * ((seed * 7) % 5 - 2)
            for method, extra in (("grpo", 0.0), ("agentopsd", effect)):
                rows.append({"level": level, "method": method, "seed": seed, "iterations": 16, "commit": "abc",
                             "greedy_before": 0.0, "sampled_before": 0.1, "greedy_after": base + noise + extra,
                             "sampled_after": base + noise + extra, "wall_s": 1.0, "resumed": 0})
    return rows


def test_paired_difference_and_slope_tables(ladder) -> None:
    horizon = {"KeyDoorBoxS5": 20.0, "KeyDoorBoxS9": 35.0}
    text = ladder.build_tables(_rows(0.1), horizon, "python studies/ladder.py")
    lines = text.splitlines()
    # the paired difference is exactly +10 points at every seed: its interval collapses onto 10.0
    diff = next(line for line in lines if line.startswith("| agentopsd |") and "10.0 [10.0, 10.0]" in line)
    assert diff.count("(10)") == 2
    # GRPO's slope: (30 - 60) / 15 = -2 points per turn
    grpo = next(line for line in lines if line.startswith("| grpo |"))
    assert "-2.00" in grpo
    assert "| warm start |" in text and "Paired difference to GRPO" in text


def test_runs_from_different_warm_starts_are_not_paired(ladder) -> None:
    rows = _rows(0.1)
    for r in rows:  # every run records its warm start's digest; seed 3's AgentOPSD ran from a warm start made again
        r["warm"] = "w3b" if (r["seed"], r["method"]) == (3, "agentopsd") else f"w{r['seed']}"
    text = ladder.build_tables(rows, {"KeyDoorBoxS5": 20.0, "KeyDoorBoxS9": 35.0}, "cmd")
    diff = next(line for line in text.splitlines() if line.startswith("| agentopsd |") and "10.0 [10.0, 10.0]" in line)
    assert diff.count("(9)") == 2  # the mismatched seed drops out of both rungs' pairs
    legacy = [{**r, "warm": ""} if r["method"] == "grpo" else r for r in rows]  # digest not recorded: no pair
    assert not ladder.paired(legacy[0], legacy[1]) and ladder.paired({"warm": ""}, {})


def test_the_ceiling_contrasts_isolate_the_evidence_and_the_lever_with_a_family_wise_interval(ladder) -> None:
    """oracle_wide - agentopsd_wide (the evidence at one lever) and oracle_wide - oracle (the lever with one evidence),
    paired by seed and warm start; the Bonferroni interval is wider than the 95% one and both hold the same mean."""
    rows = []
    for seed in range(10):
        noise = 0.03 * ((seed * 7) % 5 - 2)
        for method, value in (("grpo", 0.3), ("oracle", 0.3), ("oracle_wide", 0.5 + noise), ("agentopsd_wide", 0.3 + noise)):
            rows.append({"level": "KeyDoorBoxS9", "method": method, "seed": seed, "iterations": 16, "commit": "abc", "warm": f"w{seed}",
                         "greedy_before": 0.0, "sampled_before": 0.1, "greedy_after": value + 0.01 * (seed % 3),
                         "sampled_after": value, "wall_s": 1.0, "resumed": 0})
    rows[-1]["warm"] = "other"  # seed 9's agentopsd_wide ran from another warm start: it pairs with nothing
    lines = ladder.build_tables(rows, {"KeyDoorBoxS9": 35.0}, "cmd").splitlines()
    assert "## The ceiling study: paired contrasts" in lines
    evidence = next(line for line in lines if line.startswith("| oracle_wide − agentopsd_wide |"))
    assert "20.0 [20.0, 20.0] (9)" in evidence  # the same +20 points at every one of the 9 paired seeds
    lever = next(line for line in lines if line.startswith("| oracle_wide − oracle |")).split(" | ")
    mean, lo, hi = (float(x) for x in lever[3].replace("[", "").replace("]", "").replace(",", "").split()[:3])
    _, blo, bhi = (float(x) for x in lever[4].replace("[", "").replace("]", "").replace(",", "").split())
    assert mean == 20.0 and blo < lo < mean < hi < bhi
    # rows: oracle - grpo, oracle_wide - grpo, agentopsd_wide - grpo, oracle_wide - agentopsd_wide, oracle_wide - oracle
    # (no AgentOPSD runs: its two contrasts are left out); 5 rows x 2 measures = 10 intervals, 99.5% each
    assert sum(line.startswith("| ") and " − " in line for line in lines) == 5 and "10 intervals (99.50% each)" in "\n".join(lines)
    assert "paired contrasts" not in ladder.build_tables(_rows(0.1), {"KeyDoorBoxS5": 20.0, "KeyDoorBoxS9": 35.0}, "cmd")


def test_rows_round_trip_through_runs_csv(ladder, tmp_path) -> None:
    rows = _rows(0.0)
    (tmp_path / "horizon.json").write_text(json.dumps({"KeyDoorBoxS5": 20.0, "KeyDoorBoxS9": 35.0}))
    ladder.write_results(rows, tmp_path, "cmd")
    back = ladder.read_rows(tmp_path)
    assert len(back) == len(rows) and {r["seed"] for r in back} == set(range(10))
    assert (tmp_path / "horizon.png").stat().st_size > 0 and "Paired difference" in (tmp_path / "table.md").read_text()


def test_a_run_cut_short_resumes_across_commits_that_leave_the_trained_code_alone(ladder, tmp_path) -> None:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    git("config", "user.email", "t@t"), git("config", "user.name", "t")
    for rel in ("agentopsd/a.py", "scripts/s.py", "train.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    git("add", "-A"), git("commit", "-qm", "a")
    first = ladder.code_identity(git("rev-parse", "HEAD"), tmp_path)
    (tmp_path / "scripts" / "s.py").write_text("x = 2\n")
    git("commit", "-qam", "scripts only")
    assert ladder.code_identity(git("rev-parse", "HEAD"), tmp_path) == first
    (tmp_path / "agentopsd" / "a.py").write_text("x = 2\n")
    git("commit", "-qam", "trained code")
    assert ladder.code_identity(git("rev-parse", "HEAD"), tmp_path) != first


def test_a_run_killed_with_the_grid_resumes_from_its_checkpoint(ladder, tmp_path, monkeypatch) -> None:
    """The end of a sitting kills the grid and its runs at once: the run's meta, written before training, lets the
    next invocation resume from the checkpoint instead of starting over."""
    weights = tmp_path / "warm" / "s0" / "policy.pt"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"warm")
    calls: list[list[str]] = []

    def killed(code, run_dir, level, method, seed, iterations, extra):
        calls.append(extra)
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"ckpt")
        raise KeyboardInterrupt  # killed mid-run: nothing after _train runs

    monkeypatch.setattr(ladder, "_train", killed)
    args = (tmp_path, tmp_path, "c0", "KeyDoorBoxS5", "grpo", 0, 2, [])
    with pytest.raises(KeyboardInterrupt):
        ladder.run_one(*args, identity="code-a")
    with pytest.raises(KeyboardInterrupt):
        ladder.run_one(*args, identity="code-a")
    last = tmp_path / "runs" / "KeyDoorBoxS5-grpo-s0" / "checkpoints" / "last.ckpt"
    assert not any(a.startswith("ckpt_path=") for a in calls[0])
    assert f"ckpt_path={last}" in calls[1]  # resumed
    meta = json.loads((last.parents[1] / "meta.json").read_text())
    assert meta["code"] == "code-a" and meta["resumed"] == 1
    with pytest.raises(KeyboardInterrupt):  # other trained code: starts over
        ladder.run_one(*args, identity="code-b")
    assert not any(a.startswith("ckpt_path=") for a in calls[2])


def test_mc_iterations_are_the_first_and_the_midway_one(ladder) -> None:
    assert ladder.mc_iterations(16) == [1, 9]
    assert ladder.mc_iterations(1) == [1]


@pytest.mark.slow
def test_a_tiny_grid_runs_pairs_and_resumes(tmp_path) -> None:
    """Two methods, one seed, one rung, one iteration: a shared warm start, both evaluations, the table;
    a second invocation trains nothing."""
    tiny = ["warm_start.episodes=20", "warm_start.steps=2", "data.tasks_per_batch=2", "data.group_size=2",
            "evaluation.num_tasks=3", "model.hidden_size=32", "model.intermediate_size=64",
            "rollout.max_new_tokens=6", "checkpoint.every_n_iterations=1"]
    cmd = [sys.executable, "studies/ladder.py", "--levels", "KeyDoorBoxS5", "--methods", "grpo", "agentopsd", "--seeds", "0",
           "--iterations", "1", "--jobs", "1", "--out", str(tmp_path), "--code", str(ROOT), "--credit-mc-samples", "3", *tiny]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [p for p in (tmp_path / "runs").iterdir() if p.name != "latest"]  # the newest run's link
    assert {p.name for p in rows} == {"warm-s0", "KeyDoorBoxS5-before-s0", "KeyDoorBoxS5-grpo-s0", "KeyDoorBoxS5-agentopsd-s0"}
    weights = tmp_path / "warm" / "s0" / "policy.pt"
    for name in ("KeyDoorBoxS5-before-s0", "KeyDoorBoxS5-grpo-s0", "KeyDoorBoxS5-agentopsd-s0"):
        # one warm start, trained once, loaded by the rung's evaluation and by both methods
        assert f"loaded {weights} (warm_start.weights)" in (tmp_path / "runs" / name / "stdout.log").read_text()
    assert "supervised steps" in (tmp_path / "runs" / "warm-s0" / "stdout.log").read_text()
    # the rung's evaluation of the warm start evaluates once, before its one tiny iteration, not again after it
    assert "before RL (no evaluation after it)" in (tmp_path / "runs" / "KeyDoorBoxS5-before-s0" / "stdout.log").read_text()
    assert (tmp_path / "runs" / "KeyDoorBoxS5-grpo-s0" / "checkpoints" / "policy-000001.pt").is_file()
    table = (tmp_path / "table.md").read_text()
    assert "| agentopsd |" in table and "| grpo |" in table and "Success at temperature 1" in table
    # the AgentOPSD run's credit archive: config, compressed shards and its ground truth, made while its policies exist
    archive = tmp_path / "credit_data" / "KeyDoorBoxS5-agentopsd-s0"
    assert [p.name for p in (tmp_path / "credit_data").iterdir()] == [archive.name]  # GRPO's run is not archived
    assert json.loads((archive / "done.json").read_text())["mc_iterations"] == [1]
    assert [p.name for p in (archive / "rollouts").iterdir()] == ["rollouts-000001.tar.xz"]
    assert {p.name for p in (archive / "groundtruth").iterdir()} == {"expert-v2.json", "mc-iter0001-m3.json"}
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and "greedy" in again.stdout
    assert not list((tmp_path / "runs" / "KeyDoorBoxS5-grpo-s0" / "csv").glob("version_1"))  # nothing retrained
    # a fresh checkout has runs.csv but no run folders: the recorded runs stand, nothing trains, no warm start is made
    for name in ("runs", "warm"):
        os.rename(tmp_path / name, tmp_path / f"{name}-kept")
    fresh = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "warm").exists()
    assert "| agentopsd |" in (tmp_path / "table.md").read_text()
    assert len((tmp_path / "runs.csv").read_text().strip().splitlines()) == 3  # header and the two runs
    for name in ("runs", "warm"):
        os.rename(tmp_path / f"{name}-kept", tmp_path / name)
    # the credit-quality command on the grid's AgentOPSD run: every rule recomputed on its logged groups,
    # the paper's rule matching what training logged
    out = tmp_path / "cq"
    cq = subprocess.run([sys.executable, "studies/credit_quality.py", str(tmp_path / "runs" / "KeyDoorBoxS5-agentopsd-s0"),
                         "--resamples", "50", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert cq.returncode == 0, cq.stderr[-3000:]
    text = (out / "table.md").read_text()
    assert "## Every credit rule on the same rollouts" in text
    match = re.search(r"matches the logged one to ([0-9.e+-]+)\.", text)
    assert match and float(match.group(1)) < 1e-3
    rules = (out / "rules.csv").read_text().splitlines()
    assert rules[0].startswith("truth,env,stage,rule")
    assert all(sum(f",{rule}," in r for r in rules) >= 1 for rule in ("gigpo", "stepopsd", "token", "rlsd", "magnitude"))
    # the archive gives the credit-quality table the run folder gives, with no policy at hand (truth read back)
    tables = []
    for source, name in ((tmp_path / "runs" / "KeyDoorBoxS5-agentopsd-s0", "cq-run"), (archive, "cq-archive")):
        done = subprocess.run([sys.executable, "studies/credit_quality.py", str(source), "--resamples", "50", "--mc-samples", "3",
                               "--mc-iterations", "1", "--out", str(tmp_path / name)], cwd=ROOT, capture_output=True, text=True,
                              env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        tables.append([line for line in (tmp_path / name / "table.md").read_text().splitlines()
                       if "studies/credit_quality.py" not in line])
    assert tables[0] == tables[1] and any(line.startswith("| expert |") for line in tables[0])
    # the Monte Carlo truth: computed once, kept beside the run, read back by the next invocation
    mc_cmd = [sys.executable, "studies/credit_quality.py", str(tmp_path / "runs" / "KeyDoorBoxS5-agentopsd-s0"), "--resamples", "50",
              "--mc-samples", "2", "--mc-iterations", "1", "--mc-every"]
    first = subprocess.run([*mc_cmd, "--out", str(tmp_path / "mc1")], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    cache = tmp_path / "runs" / "KeyDoorBoxS5-agentopsd-s0" / "groundtruth" / "mc-iter0001-m2.json"
    saved = json.loads(cache.read_text())
    assert len(saved) == 4 and all(isinstance(v, list) for v in saved.values())  # 2 tasks x 2 copies
    # a cached truth is read, not recomputed: a truth that rises turn by turn (no policy would give it) shows up
    cache.write_text(json.dumps({k: [float(i) for i in range(len(v))] for k, v in saved.items()}))
    second = subprocess.run([*mc_cmd, "--out", str(tmp_path / "mc2")], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert ("| mc | agentopsd | BabyAI-KeyDoorBoxS5-v0 | iter1 | uniform | 4 | 0.000 [0.000, 0.000] | 4 | 0.500 [0.500, 0.500] | 4 |"
            in (tmp_path / "mc2" / "table.md").read_text())
    # an archive's cached truth is all the table needs: with the truth in it and no policy anywhere, the same rows
    (archive / "groundtruth" / cache.name).write_text(cache.read_text())
    os.rename(tmp_path / "warm", tmp_path / "warm-gone")
    third = subprocess.run([*mc_cmd[:2], str(archive), *mc_cmd[3:], "--out", str(tmp_path / "mc3")], cwd=ROOT,
                           capture_output=True, text=True, env=env, timeout=600)
    assert third.returncode == 0, third.stderr[-3000:]
    rows = [[line for line in (tmp_path / name / "table.md").read_text().splitlines() if line.startswith("| mc |")]
            for name in ("mc2", "mc3")]
    assert rows[0] and rows[0] == rows[1]


def test_a_seeds_warm_start_is_made_from_every_rung_whatever_the_levels_run(ladder, tmp_path, monkeypatch) -> None:
    """A run of one rung into the grid's folder (``--levels KeyDoorBoxS9``) must make a missing warm start by the
    grid's recipe: demonstrations of every rung, the longest rung's tokenizer."""
    calls: list[tuple[str, list[str]]] = []

    def fake(code, run_dir, level, method, seed, iterations, extra):
        calls.append((level, extra))
        (run_dir / "warm_start").mkdir()
        (run_dir / "warm_start" / "policy-abc.pt").write_bytes(b"w")
        return 0

    monkeypatch.setattr(ladder, "_train", fake)
    weights = ladder.warm_weights(tmp_path, tmp_path, 10, [])
    assert weights == tmp_path / "warm" / "s10" / "policy.pt" and weights.read_bytes() == b"w"
    (level, extra), = calls
    assert level == "KeyDoorBoxS9" and "model.env_id=agentopsd/BabyAI-KeyDoorBoxS9-v0" in extra
    mixed = next(a for a in extra if a.startswith("warm_start.env_ids="))
    assert all(f'"agentopsd/BabyAI-{lv}-v0"' in mixed for lv in ("KeyDoorBoxS5", "KeyDoorBoxS7", "KeyDoorBoxS9"))


def test_the_ceiling_studys_cells_select_the_oracle_and_the_wide_lever(ladder) -> None:
    """--methods oracle oracle_wide agentopsd_wide: AgentOPSD's config with the oracle's class and the wide lever,
    composed as train.py composes them; any other method is its conf/algorithm file."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from agentopsd.credit.algorithms import AgentOPSD
    from agentopsd.study.oracle import OracleOPSD

    assert ladder.method_overrides("gigpo") == ["algorithm=gigpo"]
    made = {}
    for method in ("oracle", "oracle_wide", "agentopsd_wide"):
        overrides = ["experiment=keydoor", f"env.id={ladder.env_id('KeyDoorBoxS9')}", f"env.max_turns={ladder.LEVELS['KeyDoorBoxS9']}",
                     *ladder.method_overrides(method)]
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
            made[method] = instantiate(compose("config", overrides=overrides).algorithm)
        assert made[method].name == method
    assert isinstance(made["oracle"], OracleOPSD) and made["oracle"].max_turns == 60
    assert (made["oracle"].mult_lambda, made["oracle"].mult_band) == (0.5, 0.2)
    assert isinstance(made["oracle_wide"], OracleOPSD) and (made["oracle_wide"].mult_lambda, made["oracle_wide"].mult_band) == (1.0, 0.5)
    wide = made["agentopsd_wide"]
    assert type(wide) is AgentOPSD and (wide.mult_lambda, wide.mult_band) == (1.0, 0.5)
