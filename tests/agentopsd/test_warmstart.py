"""Demonstrations for the supervised warm start: noise, habits and the two label kinds."""

from __future__ import annotations

import json

import pytest
import webdataset as wds

import agentopsd.envs  # noqa: F401
from agentopsd.warmstart import write_demonstrations

ENV = "agentopsd/BabyAI-PickupObj-v0"


def _turns(path) -> list[dict]:
    return [json.loads(s["json"]) for s in wds.WebDataset(str(path), shardshuffle=False)]


def test_clean_demonstrations_follow_the_expert(tmp_path) -> None:
    path = tmp_path / "demos.tar"
    n = write_demonstrations(ENV, path, episodes=10, noise=0.0, seed=0, skills="babyai", max_turns=12)
    turns = _turns(path)
    assert len(turns) == n > 10
    assert all(t["taken"] == t["expert"] for t in turns)
    assert all("Skills for this task" not in t["observation"] and t["skill"] for t in turns)
    assert sum(t["expert"] == "pick up" for t in turns) == 10  # every episode ends with one pick up


def test_habit_replaces_the_expert_action_and_keeps_the_expert_label(tmp_path) -> None:
    path = tmp_path / "demos.tar"
    write_demonstrations(ENV, path, episodes=10, noise=0.0, seed=0, skills="babyai", max_turns=12,
                         habits={"pick up": "toggle"}, habit_prob=1.0)
    turns = _turns(path)
    decisive = [t for t in turns if t["expert"] == "pick up"]
    assert decisive and all(t["taken"] == "toggle" for t in decisive)  # the student label copies the habit
    assert all(t["taken"] == t["expert"] for t in turns if t["expert"] != "pick up")


def test_habit_probability_is_respected(tmp_path) -> None:
    path = tmp_path / "demos.tar"
    write_demonstrations(ENV, path, episodes=60, noise=0.0, seed=1, skills=None, max_turns=12,
                         habits={"pick up": "toggle"}, habit_prob=0.6)
    decisive = [t["taken"] for t in _turns(path) if t["expert"] == "pick up"]
    share = decisive.count("toggle") / len(decisive)
    assert 0.45 < share < 0.75, share


@pytest.mark.parametrize("kw", [{"noise": 1.5}, {"habit_prob": -0.1}])
def test_bad_probabilities_fail(tmp_path, kw) -> None:
    args = {"episodes": 1, "noise": 0.0, "seed": 0, "skills": None, "max_turns": 4} | kw
    with pytest.raises(ValueError, match="warm_start"):
        write_demonstrations(ENV, tmp_path / "d.tar", **args)


def test_demonstrations_from_several_env_ids_take_turns(tmp_path):
    """warm_start.env_ids: one shard that mixes environments (the ladder's rungs), one episode each in turn."""
    import json

    import webdataset as wds

    from agentopsd.warmstart import write_demonstrations

    ids = ["agentopsd/BabyAI-PickupObjS5-v0", "agentopsd/BabyAI-GoToObj-v0"]
    shard = tmp_path / "mixed.tar"
    write_demonstrations(ids, shard, episodes=4, noise=0.0, seed=0, skills="babyai", max_turns=40)
    firsts = [json.loads(s["json"]) for s in wds.WebDataset(str(shard), shardshuffle=False) if s["__key__"].endswith("_000")]
    assert [f["task"].split()[0] for f in firsts] == ["pick", "go", "pick", "go"]
