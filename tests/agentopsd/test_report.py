"""Which trajectories the report draws as credit pictures."""

from __future__ import annotations

from agentopsd.report import pick_credit_examples


def _rec(i: int, success: bool, adv: float, credit: bool = True, turns: int = 4) -> dict:
    turn = {"belief": 0.5, "revision": 0.0, "multiplier": 1.0} if credit else {}
    return {"id": i, "success": success, "seq_advantage": adv, "turns": [dict(turn, k=k) for k in range(turns)]}


def test_latest_won_and_lost_with_mixed_outcomes_first() -> None:
    records = [_rec(0, True, 0.5), _rec(1, False, -0.5), _rec(2, True, 0.7), _rec(3, False, 0.0), _rec(4, False, -0.2)]
    assert [r["id"] for r in pick_credit_examples(records)] == [2, 4]


def test_falls_back_to_any_trajectory_with_credit() -> None:
    records = [_rec(0, False, 0.0), _rec(1, False, 0.0), _rec(2, False, 0.0, turns=2)]
    assert [r["id"] for r in pick_credit_examples(records)] == [1]


def test_nothing_without_credit_values() -> None:
    assert pick_credit_examples([_rec(0, True, 0.5, credit=False), _rec(1, False, -0.5, credit=False)]) == []


# ------------------------------------------------------------------ numbers the report shows


def test_a_resumed_run_never_jumps_back():
    from agentopsd.report import series

    # version_0 ran iterations 1-3, the resumed version_1 repeats 3 (after the checkpoint at 2) and goes on
    rows = [{"rollout/iteration": i, "rollout/success": 0.1 * i} for i in (1, 2, 3)]
    rows += [{"rollout/iteration": i, "rollout/success": 0.2 * i} for i in (3, 4)]
    x, y = series(rows, "rollout/success")
    assert x == [1, 2, 3, 4] and y[2] == 0.2 * 3  # the later row of iteration 3 wins


def test_wilson_interval_stays_in_bounds_and_narrows_with_episodes():
    from agentopsd.report import wilson_interval

    for p in (0.0, 0.3, 1.0):
        lo, hi = wilson_interval(p, 10)
        assert 0.0 <= lo <= p <= hi <= 1.0
    assert wilson_interval(0.5, 100)[1] - wilson_interval(0.5, 100)[0] < wilson_interval(0.5, 10)[1] - wilson_interval(0.5, 10)[0]
    lo, hi = wilson_interval(0.5, 100)
    assert abs(lo - 0.404) < 0.002 and abs(hi - 0.596) < 0.002  # the textbook values


def test_credit_titles_and_captions_say_what_the_picture_shows():
    from agentopsd.report import credit_caption, credit_title

    assert credit_title({"success": True, "seq_advantage": 0.7}) == "Which turn won the game?"
    assert "won" not in credit_title({"success": False, "seq_advantage": -0.7})
    flat = {"success": True, "seq_advantage": 0.0}
    assert credit_title(flat).startswith("No credit to assign: every copy of this task won")
    caption = credit_caption(flat, 0.5)
    assert "standardised within" in caption and "(1 - lam) + lam·w_k" in caption and "lam = 0.5" in caption
    assert "near 0" in caption and "0.9999" in caption  # the saturated prior says why
    assert "near 0" not in credit_caption({"success": False, "seq_advantage": -0.5}, 0.5)


def test_horizon_table_counts_episodes_and_has_no_before_without_an_evaluation_before_rl():
    from agentopsd.report import horizon_table

    last = {"eval/iteration": 4.0, "eval/success": 0.5, "eval/success/horizon/1-5": 0.75, "eval/episodes/horizon/1-5": 4.0,
            "eval/success/horizon/6-10": 0.25, "eval/episodes/horizon/6-10": 4.0}
    assert horizon_table([last]) == {"1-5": {"after": 0.75, "n": 4.0}, "6-10": {"after": 0.25, "n": 4.0}}
    before = {"eval/iteration": 0.0, "eval/success": 0.0, "eval/success/horizon/1-5": 0.0, "eval/episodes/horizon/1-5": 4.0}
    assert horizon_table([before, last])["1-5"]["before"] == 0.0


def test_the_page_names_the_run_and_shows_config_seed_and_credit_statistics(tmp_path):
    import re

    from agentopsd.report import write_report
    from callbacks.rollout_logging import write_shard

    run = tmp_path / "quickstart" / "2026-01-01_00-00-00"
    (run / "csv" / "version_0").mkdir(parents=True)
    header = ["step", "eval/iteration", "eval/success", "eval/episodes", "rollout/iteration", "rollout/success", "rollout/reward",
              "credit/mean_abs_revision", "credit/lambda"]
    lines = [",".join(header), "0,0.0,0.0,4.0,,,,,", "1,,,,1.0,0.25,0.25,0.02,0.5", "2,,,,2.0,0.5,0.5,0.04,0.5", "2,2.0,0.5,4.0,,,,,"]
    (run / "csv" / "version_0" / "metrics.csv").write_text("\n".join(lines) + "\n")
    turns = [{"k": k, "action": f"go\x13 {k}", "belief": 0.5, "revision": 0.1 * (k - 1), "multiplier": 1.0 + 0.1 * (k - 1), "advantage": 0.5}
             for k in range(3)]
    rec = {"iteration": 2, "env": "agentopsd/BabyAI-PickupObj-v0", "task_index": 3, "group": 0, "success": False, "score": 0.0,
           "task_type": "pickup", "skill": "", "seq_advantage": -0.5, "turns": turns}
    write_shard(run / "rollouts" / "rollouts-000002.tar", [rec])
    config = {"name": "quickstart", "seed": 7, "algorithm": {"name": "agentopsd", "mult_lambda": 0.5}}
    page = write_report(run, config=config).read_text()
    assert "quickstart" in page and "agentopsd" in page and "seed <b>7</b>" in page and "commit <b>" in page
    assert "mult_lambda: 0.5" in page  # the config
    assert "credit/mean_abs_revision" in page and "0.0300" in page  # mean over iterations of the credit statistics
    assert "Which turn lost the game?" in page and "Which turn won" not in page
    assert "0.0% before RL, 50.0% after 2 iterations" in page
    assert "0.950" in page  # (1 - 0.5) + 0.5 * 0.9: the multiplier applied to turn 0
    for image in re.findall(r"src=['\"]([^'\"]+)['\"]", page):
        assert (run / "report" / image).read_bytes()[:4] == b"\x89PNG"
