"""The run report: which trajectories it draws, the numbers it shows, and the expert's ground truth beside the credit."""

from __future__ import annotations

import pytest

from agentopsd.tools.report import pick_credit_examples


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
    from agentopsd.tools.report import series

    # version_0 ran iterations 1-3, the resumed version_1 repeats 3 (after the checkpoint at 2) and goes on
    rows = [{"rollout/iteration": i, "rollout/success": 0.1 * i} for i in (1, 2, 3)]
    rows += [{"rollout/iteration": i, "rollout/success": 0.2 * i} for i in (3, 4)]
    x, y = series(rows, "rollout/success")
    assert x == [1, 2, 3, 4] and y[2] == 0.2 * 3  # the later row of iteration 3 wins


def test_wilson_interval_stays_in_bounds_and_narrows_with_episodes():
    from agentopsd.tools.report import wilson_interval

    for p in (0.0, 0.3, 1.0):
        lo, hi = wilson_interval(p, 10)
        assert 0.0 <= lo <= p <= hi <= 1.0
    assert wilson_interval(0.5, 100)[1] - wilson_interval(0.5, 100)[0] < wilson_interval(0.5, 10)[1] - wilson_interval(0.5, 10)[0]
    lo, hi = wilson_interval(0.5, 100)
    assert abs(lo - 0.404) < 0.002 and abs(hi - 0.596) < 0.002  # the textbook values


def test_credit_titles_and_captions_say_what_the_picture_shows():
    from agentopsd.tools.report import credit_caption, credit_title

    assert credit_title({"success": True, "seq_advantage": 0.7}) == "Which turn won the game?"
    assert "won" not in credit_title({"success": False, "seq_advantage": -0.7})
    flat = {"success": True, "seq_advantage": 0.0}
    assert credit_title(flat).startswith("No credit to assign: every copy of this task won")
    caption = credit_caption(flat, 0.5)
    assert "standardised within" in caption and "(1 - lam) + lam·w_k" in caption and "lam = 0.5" in caption
    assert "near 0" in caption and "0.9999" in caption  # the saturated prior says why
    assert "near 0" not in credit_caption({"success": False, "seq_advantage": -0.5}, 0.5)


def test_horizon_table_counts_episodes_and_has_no_before_without_an_evaluation_before_rl():
    from agentopsd.tools.report import horizon_table

    last = {"eval/iteration": 4.0, "eval/success": 0.5, "eval/success/horizon/1-5": 0.75, "eval/episodes/horizon/1-5": 4.0,
            "eval/success/horizon/6-10": 0.25, "eval/episodes/horizon/6-10": 4.0}
    assert horizon_table([last]) == {"1-5": {"after": 0.75, "n": 4.0}, "6-10": {"after": 0.25, "n": 4.0}}
    before = {"eval/iteration": 0.0, "eval/success": 0.0, "eval/success/horizon/1-5": 0.0, "eval/episodes/horizon/1-5": 4.0}
    assert horizon_table([before, last])["1-5"]["before"] == 0.0


def test_the_page_names_the_run_and_shows_config_seed_and_credit_statistics(tmp_path):
    import re

    from agentopsd.callbacks.rollout_logging import write_shard
    from agentopsd.tools.report import write_report

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


# ------------------------------------------------------------------ the expert's ground truth beside the credit

PICKUP = "agentopsd/BabyAI-PickupObj-v0"
WON_MOVES = ["drop", "go forward", "turn right", "pick up"]  # task 9, the green key 3 turns away: a wasted turn first
LOST_MOVES = ["go forward", "turn left", "toggle", "go forward"]  # task 6, the grey box: toggled (it vanishes), then moved on


def _played(env_id: str, task_index: int, moves: list[str], multipliers: list[float], seq_advantage: float, max_turns: int = 12) -> dict:
    """A rollout-shard record (the fields ``trajectory_records`` writes) of a scripted episode, observations as the env gave them."""
    import agentopsd.envs  # noqa: F401  (registers the agentopsd/* ids)
    from agentopsd.study.groundtruth import advance, make_env, start

    state = start(make_env(env_id, max_turns), task_index)
    turns = []
    for k, (move, w) in enumerate(zip(moves, multipliers)):
        advance(state, move)
        turns.append({"k": k, "action": move, "observation": state.observation, "reward": float(state.won), "valid": True,
                      "belief": 0.5, "revision": w - 1.0, "multiplier": w, "evidence": 0.0, "advantage": seq_advantage * w})
    return {"iteration": 1, "env": env_id, "task_index": task_index, "group": 0, "success": state.won, "score": float(state.won),
            "task_type": "pickup", "skill": "", "seq_advantage": seq_advantage, "turns": turns}


def _won_and_lost() -> list[dict]:
    # won: the wasted turn gets w = 1.0 and the first progress turn less (0.9), the others more: 2 of 3 pairs right
    won = _played(PICKUP, 9, WON_MOVES, [1.0, 0.9, 1.1, 1.1], 0.5)
    # lost: the fatal toggle gets the largest w (the most negative advantage), progress the least: every pair right
    lost = _played(PICKUP, 6, LOST_MOVES, [0.8, 0.8, 1.2, 1.0], -0.5)
    assert won["success"] and not lost["success"]
    return [won, lost]


def _run_folder(root, records: list[dict]):
    from agentopsd.callbacks.rollout_logging import write_shard

    run = root / "run"
    (run / "csv" / "version_0").mkdir(parents=True)
    (run / "csv" / "version_0" / "metrics.csv").write_text("step,rollout/iteration,rollout/success\n1,1.0,0.5\n")
    write_shard(run / "rollouts" / "rollouts-000001.tar", records)
    return run


def test_a_replayed_record_gets_the_expert_labels_known_for_its_moves() -> None:
    from agentopsd.study.groundtruth import FATAL_GAIN
    from agentopsd.tools.report import credit_accuracy, expert_truths

    won, lost = _won_and_lost()
    t_won, t_lost = expert_truths([won, lost], {"id": PICKUP, "max_turns": 12})
    assert not t_won.missing and not t_lost.missing
    assert t_won.path == (3, 3, 2, 1, 0) and t_won.labels == ("wasted", "progress", "progress", "progress")
    assert t_won.gains == (0.0, 1.0, 1.0, 1.0)
    assert t_lost.path == (3, 2, 1, -1, -1) and t_lost.labels == ("progress", "progress", "fatal", "lost")
    assert t_lost.gains == (1.0, 1.0, -FATAL_GAIN, 0.0)
    assert credit_accuracy(won, t_won) == (2 / 3, 3)
    assert credit_accuracy(lost, t_lost) == (1.0, 5)
    assert credit_accuracy(dict(won, seq_advantage=0.0), t_won) == (0.5, 3)  # no credit to assign: chance exactly


def test_the_page_shows_the_expert_path_and_labels_beside_the_credit(tmp_path) -> None:
    import re

    from agentopsd.tools.report import write_report

    run = _run_folder(tmp_path, _won_and_lost())
    config = {"name": "quickstart", "seed": 0, "algorithm": {"name": "agentopsd", "mult_lambda": 0.5},
              "env": {"id": PICKUP, "max_turns": 12}}
    page = write_report(run, config=config).read_text()
    assert page.count("<th>expert path before -> after</th><th>label</th>") == 2
    cells = re.findall(r"<td>([^<]*)</td><td style='color:\w+'>(\w+)</td></tr>", page)
    assert cells == [("3 -> 3", "wasted"), ("3 -> 2", "progress"), ("2 -> 1", "progress"), ("1 -> 0", "progress"),
                     ("3 -> 2", "progress"), ("2 -> 1", "progress"), ("1 -> none", "fatal"), ("none -> none", "lost")]
    assert "largest |credit| to the turns that shortened it in a won game and to the fatal turn in a lost one" in page
    assert "orders 0.67 of the 3 turn pairs" in page and "orders 1.00 of the 5 turn pairs" in page
    assert "not available" not in page
    for image in ("credit_0.png", "credit_1.png"):
        assert (run / "report" / image).read_bytes()[:4] == b"\x89PNG"


def test_without_a_replayable_env_the_report_says_the_ground_truth_is_not_available(tmp_path) -> None:
    from agentopsd.tools.report import expert_truths, write_report
    from tests.conftest import TOY_ID

    walk = [{"k": k, "action": "right", "observation": f"You are at position {k + 1}.", "reward": 0.0, "valid": True,
             "belief": 0.5, "revision": 0.0, "multiplier": 1.0 + 0.1 * k, "advantage": 0.5} for k in range(3)]
    records = [{"iteration": 1, "env": TOY_ID, "task_index": 1, "group": 0, "success": True, "score": 1.0, "task_type": "walk",
                "skill": "", "seq_advantage": 0.5, "turns": walk}]
    run = _run_folder(tmp_path, records)
    page = write_report(run, config={"seed": 0, "env": {"id": TOY_ID, "max_turns": 10}}).read_text()
    assert f"Ground truth not available: {TOY_ID} has none (only envs with a cheap state snapshot" in page
    assert "<td>n/a</td><td>n/a</td></tr>" in page and "Which turn won the game?" in page
    assert (run / "report" / "credit_0.png").read_bytes()[:4] == b"\x89PNG"
    # a BabyAI log the replay cannot reproduce (another level, or an edited log) falls back the same way
    tampered = _won_and_lost()[0]
    tampered["turns"][1]["observation"] = "something else"
    (truth,) = expert_truths([tampered], {"max_turns": 12})
    assert truth.missing.startswith("the replay failed (ValueError:") and "turn 1: replayed observation differs" in truth.missing
    (truth,) = expert_truths([tampered], {})
    assert truth.missing == "the run's config has no env.max_turns to replay the trajectory with"


@pytest.mark.slow
def test_the_report_of_a_tiny_babyai_run_labels_every_plotted_turn(tiny_runs) -> None:
    """``train.py experiment=babyai_tiny report=true``: a real run (shared with ``test_train``), its logged turns
    replayed by the report."""
    import re

    out, _ = tiny_runs("babyai_tiny")
    page = (out / "report" / "index.html").read_text()
    credit = page[page.index("<h2>Credit per turn"):page.index("<h2>Credit statistics")]
    sections = credit.split("<h3>")[1:]
    assert sections and "not available" not in credit
    for section in sections:
        assert section.count("<th>expert path before -> after</th><th>label</th>") == 1
        rows = re.findall(r"<td>(\d+|none) -> (\d+|none)</td><td style='color:\w+'>(progress|wasted|fatal|lost)</td></tr>",
                          section)
        assert rows and len(rows) == section.count("</td></tr>")  # every plotted turn carries its expert path and label
        # the expert gain of each turn, from the page's own rows: lost already 0, fatal its own class, else before - after
        gains = [0 if b == "none" else "fatal" if a == "none" else int(b) - int(a) for b, a, _ in rows]
        labels = ["lost" if b == "none" else "fatal" if a == "none" else "progress" if int(b) > int(a) else "wasted"
                  for b, a, _ in rows]
        assert [label for _, _, label in rows] == labels
        pairs = sum(gains[i] != gains[j] for i in range(len(gains)) for j in range(i + 1, len(gains)))
        if pairs:
            assert f"of the {pairs} turn pairs that differ in expert gain" in section
        else:
            assert "here no two turns differ in expert gain" in section
