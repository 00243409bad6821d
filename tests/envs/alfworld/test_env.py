"""ALFWorld: the real engine on generated scenes and on the official folder layout.

The [alfworld] extra is installed in CI; ``importorskip`` is only a guard for bare installs.
Expert success is checked here on one eval task per type (eval indices 0-5); the whole eval
list (72 tasks) is checked by generation itself, which keeps a scene only if the expert wins.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.error import ResetNeeded
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("alfworld")

from agentopsd.envs.alfworld import engine as alfworld_engine  # noqa: E402
from agentopsd.envs.alfworld.env import ENV_ID, INVALID, ALFWorldEnv, register_envs  # noqa: E402
from agentopsd.envs.alfworld.rooms import TASK_TYPES  # noqa: E402
from agentopsd.envs.alfworld.scenes import (  # noqa: E402
    GAME_FILE,
    SIZES,
    TRAJ_FILE,
    ensure_task,
    render_problem,
    sample_scene,
)
from agentopsd.envs.base import normalize_action  # noqa: E402
from agentopsd.rollout.skills import SkillBank  # noqa: E402

pytestmark = pytest.mark.alfworld
register_envs()

# Pinned: a change means the generated eval list changed (bump GENERATOR_VERSION when intended).
EVAL_FINGERPRINT = "c149a84699321e11c09898c4efb313757a036a3cbcf23a4a52f68ec7e99a002e"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("alfworld-cache")


@pytest.fixture(autouse=True)
def _generated_scenes(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    monkeypatch.setenv("AGENTOPSD_ALFWORLD_CACHE", str(cache))


@pytest.fixture(scope="module")
def eval_env(cache: Path) -> Iterator[ALFWorldEnv]:
    env = ALFWorldEnv(split="eval", source="generated", cache_dir=cache)
    yield env
    env.close()


def verify(game_file: Path) -> list[str] | None:
    return alfworld_engine.play_expert(game_file, 50)


def play_expert(env: ALFWorldEnv) -> tuple[list[float], dict]:
    """Rewards and last info of the expert's episode (capped above the 50-step horizon)."""
    rewards, terminated, info = [], False, {}
    while not terminated and len(rewards) < 60:
        _, reward, terminated, _, info = env.step(env.expert_action())
        rewards.append(reward)
    return rewards, info


def test_check_env_on_registered_id() -> None:
    env = gym.make(ENV_ID)
    assert env.spec.max_episode_steps == 50
    check_env(env.unwrapped)
    env.close()


@pytest.mark.parametrize("index", range(len(TASK_TYPES)))
def test_expert_wins_one_eval_task_of_each_type(eval_env: ALFWorldEnv, index: int) -> None:
    obs, info = eval_env.reset(options={"task_index": index})
    assert info["task_type"] == info["skill_key"] == TASK_TYPES[index]
    assert obs.startswith("You are in the middle of a room. Looking quickly around you, you see ")
    assert f"Your task is to: {info['task']}" in obs and info["task"]
    assert eval_env.observation_space.contains(obs)
    assert info["won"] is False and info["action_valid"] is True and "look" in info["admissible_actions"]
    rewards, last = play_expert(eval_env)
    assert last["won"] is True
    assert rewards[-1] == 1.0 and sum(rewards) == 1.0
    assert len(rewards) == info["expert_steps"] <= 50  # the stored plan is what the expert does


def test_seed_determinism(cache: Path) -> None:
    runs = []
    for _ in range(2):
        env = ALFWorldEnv(split="train", source="generated", cache_dir=cache)
        obs, info = env.reset(seed=7)
        trace = [obs, info["task_index"]]
        for _ in range(3):
            trace.append(env.step(env.expert_action())[0])
        runs.append(trace)
        env.close()
    assert runs[0] == runs[1]


@pytest.mark.parametrize("index", [0, 3])
def test_a_snapshot_continues_exactly(cache: Path, index: int) -> None:
    """copy.deepcopy (the ground truth's State.copy) restores the episode: a restored state continued with the
    same seeded commands gives the same observations, and stepping the copy leaves the original alone."""
    import numpy as np

    from agentopsd.study.groundtruth import advance, mc_value, start

    env = gym.make(ENV_ID, split="eval", source="generated", cache_dir=cache, disable_env_checker=True)
    state = start(env, index)
    rng = np.random.default_rng(index)
    for _ in range(5):
        advance(state, state.admissible[rng.integers(len(state.admissible))])
    snap = state.copy()
    tail = [str(rng.choice(sorted(state.admissible))) for _ in range(6)]  # admissible now; later ones may answer INVALID
    played = [advance(state, a).observation for a in tail]
    assert [advance(snap.copy(), a).observation for a in tail[:1]] == played[:1]
    restored = snap.copy()
    assert [advance(restored, a).observation for a in tail] == played
    assert snap.turn == 5 and snap.history == state.history[:5]  # the snapshot itself was not stepped
    # the Monte Carlo value of the snapshot under ALFWorld's own expert: it wins from there, every time
    expert = lambda states: [(s.env.unwrapped.expert_action(), "") for s in states]  # noqa: E731
    assert mc_value(snap, expert, samples=2, max_turns=50) == 1.0
    env.close()


def test_the_expert_label_is_the_stored_plans_length(eval_env: ALFWorldEnv, cache: Path) -> None:
    """The expert's remaining path from the first state is the plan length stored with the scene; one
    expert step shortens it by one; the label never touches the state it measures."""
    from agentopsd.study.groundtruth import advance, expert_remaining, start

    _, info = eval_env.reset(options={"task_index": 2})
    env = gym.make(ENV_ID, split="eval", source="generated", cache_dir=cache, disable_env_checker=True)
    state = start(env, 2)
    assert expert_remaining(state) == info["expert_steps"] > 1
    assert state.turn == 0 and not state.history
    advance(state, env.unwrapped.expert_action())
    assert expert_remaining(state) == info["expert_steps"] - 1
    env.close()


def test_credit_quality_command_on_a_logged_alfworld_run(cache: Path, tmp_path: Path) -> None:
    """studies/credit_quality.py on ALFWorld: the logged episodes replayed and labelled by the expert."""
    import yaml

    from agentopsd.callbacks.rollout_logging import write_shard
    from agentopsd.study.groundtruth import advance, start

    records = []
    for index in (0, 1):
        env = gym.make(ENV_ID, split="train", max_episode_steps=50, disable_env_checker=True)
        state = start(env, index)
        turns = []
        for k, move in enumerate(["look", "inventory"]):  # two wasted turns, then the expert's plan
            advance(state, move)
            turns.append({"k": k, "action": move, "observation": state.observation, "valid": True, "advantage": 0.0})
        while not state.done:
            move = env.unwrapped.expert_action()
            advance(state, move)
            turns.append({"k": len(turns), "action": move, "observation": state.observation, "valid": True,
                          "advantage": float(len(turns))})
        records.append({"iteration": 1, "env": ENV_ID, "task_index": index, "group": index, "success": state.won,
                        "seq_advantage": 1.0, "turns": turns})
        env.close()
    run = tmp_path / "grpo-s0"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"name": "grpo"}, "env": {"id": ENV_ID, "max_turns": 50}}))
    write_shard(run / "rollouts" / "rollouts-000001.tar", records)
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "studies/credit_quality.py", str(run), "--resamples", "50", "--out", str(tmp_path / "t")],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    table = (tmp_path / "t" / "table.md").read_text()
    # the advantage is 0 on the opening turns and rises along the expert's plan: it orders nearly every pair as the
    # expert's remaining plan does (not all: the handcoded expert's plan is not a shortest path, "look" can shorten it)
    row = next(line for line in table.splitlines() if line.startswith("| expert | grpo | ALFWorld-v0 | early | advantage | 2 |"))
    assert float(row.split("|")[9].split()[0]) > 0.9
    assert "| grpo | progress |" in table and "| grpo | wasted |" in table


def test_invalid_actions_change_nothing(eval_env: ALFWorldEnv) -> None:
    _, info = eval_env.reset(options={"task_index": 0})
    for action in ["", "   ", "go to the moon", "take everything", "go to cabinet 1 please", 42]:
        obs, reward, terminated, truncated, after = eval_env.step(action)
        assert (obs, reward, terminated, truncated) == (INVALID, 0.0, False, False)
        assert after["action_valid"] is False
        assert after["admissible_actions"] == info["admissible_actions"]
    obs, _, _, _, after = eval_env.step("  GO   TO  " + info["admissible_actions"][0][len("go to ") :].upper())
    assert after["action_valid"] is True and obs.startswith("You arrive at")


_JUNK = st.text(alphabet=st.characters(codec="utf-8"), max_size=30)


@pytest.fixture(scope="module")
def fuzz_env(cache: Path) -> Iterator[dict]:
    """An env and its latest info, carried across hypothesis examples (one reset, not 30)."""
    env = ALFWorldEnv(split="eval", source="generated", cache_dir=cache)
    yield {"env": env, "info": None, "done": True}
    env.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_step_never_raises_on_any_text(fuzz_env: dict, data: st.DataObject) -> None:
    env = fuzz_env["env"]
    if fuzz_env["done"]:
        fuzz_env["info"] = env.reset(options={"task_index": 1})[1]
    before = fuzz_env["info"]
    # An index, not sampled_from(list): the list changes with the state, the strategy must not.
    commands = before["admissible_actions"]
    command = commands[data.draw(st.integers(0, 10_000)) % len(commands)]
    action = data.draw(
        st.one_of(
            st.text(),
            st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=31), max_size=50),
            st.text(min_size=2000, max_size=10_000),
            st.builds(lambda a, c, b: a + c + b, _JUNK, st.just(command), _JUNK),
        )
    )
    obs, reward, terminated, truncated, info = env.step(action)
    fuzz_env["info"], fuzz_env["done"] = info, terminated
    assert env.observation_space.contains(obs) and truncated is False
    valid = normalize_action(action) in {normalize_action(c) for c in before["admissible_actions"]}
    assert info["action_valid"] is valid
    if not valid:
        assert obs == INVALID and reward == 0.0 and info["admissible_actions"] == before["admissible_actions"]


def test_bad_arguments_raise_clear_errors(eval_env: ALFWorldEnv, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'train', 'eval'"):
        ALFWorldEnv(split="test")
    with pytest.raises(ValueError, match="valid_seen"):
        ALFWorldEnv(split="eval", eval_split="valid_train")
    with pytest.raises(ValueError, match="generated"):
        ALFWorldEnv(source="somewhere")
    with pytest.raises(ValueError, match="scene_seed"):
        ALFWorldEnv(scene_seed=-1)
    for bad in (-1, SIZES["eval"], "3", True):
        with pytest.raises(ValueError, match=r"\[0, 71\]"):
            eval_env.reset(options={"task_index": bad})
    with pytest.raises(ResetNeeded):
        ALFWorldEnv(split="eval", source="generated").step("look")


def test_missing_or_empty_data_dir_names_alfworld_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist.*ALFWORLD_DATA"):
        ALFWorldEnv(data_dir=tmp_path / "nowhere")
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"no playable ALFWorld games.*json_2\.1\.1.*traj_data\.json"):
        ALFWorldEnv()
    assert ALFWorldEnv(split="eval", source="generated").source == "generated"


def _copy_as_official(src: Path, dest: Path, solvable: bool = True) -> None:
    """A generated game dir as the release would hold it: without our expert record."""
    dest.mkdir(parents=True)
    game = json.loads((src / GAME_FILE).read_text())
    game["solvable"] = solvable
    (dest / GAME_FILE).write_text(json.dumps(game))
    traj = json.loads((src / TRAJ_FILE).read_text())
    traj.pop("agentopsd")
    (dest / TRAJ_FILE).write_text(json.dumps(traj))


def test_official_layout_is_played_by_the_same_loader(eval_env: ALFWorldEnv, tmp_path: Path) -> None:
    generated = [eval_env.game_file(i).parent for i in range(len(TASK_TYPES))]
    for i, src in enumerate(generated):
        trial = f"{TASK_TYPES[i]}-Obj-None-Recep-{i}/trial_T{i}"
        _copy_as_official(src, tmp_path / "json_2.1.1" / "valid_unseen" / trial)
    _copy_as_official(generated[0], tmp_path / "json_2.1.1" / "valid_unseen" / "x-movable-1/trial_T9")
    _copy_as_official(generated[1], tmp_path / "json_2.1.1" / "valid_unseen" / "y-1/trial_T8", solvable=False)
    _copy_as_official(generated[2], tmp_path / "json_2.1.1" / "train" / "z-1/trial_T7")
    env = ALFWorldEnv(split="eval", eval_split="valid_unseen", data_dir=tmp_path)
    assert env.source == "official" and env.num_tasks == len(TASK_TYPES)  # movable and unsolvable skipped
    obs, info = env.reset(options={"task_index": 3})
    assert info["expert_steps"] == -1 and info["task_type"] in TASK_TYPES
    rewards, last = play_expert(env)
    assert last["won"] and rewards[-1] == 1.0
    env.close()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALFWORLD_DATA", str(tmp_path))
        assert ALFWorldEnv(split="train").num_tasks == 1


def test_generated_scenes_are_byte_identical(tmp_path: Path) -> None:
    assert sample_scene("train", 11) == sample_scene("train", 11)
    assert sample_scene("eval", 3) != sample_scene("train", 3)
    assert sample_scene("eval", 3, seed=1) != sample_scene("eval", 3)
    digest = hashlib.sha256()
    for i in range(SIZES["eval"]):
        scene = sample_scene("eval", i)
        digest.update(render_problem(scene).encode())
        digest.update(scene.task_desc.encode())
    assert digest.hexdigest() == EVAL_FINGERPRINT
    dirs = [ensure_task(tmp_path / name, "eval", 1, verify) for name in ("a", "b")]
    for name in (GAME_FILE, TRAJ_FILE):
        assert (dirs[0] / name).read_bytes() == (dirs[1] / name).read_bytes()
    assert json.loads((dirs[0] / TRAJ_FILE).read_text())["task_type"] == TASK_TYPES[1]


def test_textworld_speedup_changes_no_text(eval_env: ALFWorldEnv) -> None:
    game = eval_env.game_file(1)
    fast = alfworld_engine.play_expert(game, 50)
    alfworld_engine.speed_up_textworld(enable=False)
    try:
        slow = alfworld_engine.play_expert(game, 50)
    finally:
        alfworld_engine.speed_up_textworld(enable=True)
    assert fast is not None and fast == slow


def test_generated_task_index_cycles_task_types(eval_env: ALFWorldEnv) -> None:
    assert eval_env.num_tasks == 72 and ALFWorldEnv(split="train", source="generated").num_tasks == 3600
    assert [sample_scene("eval", i).task_type for i in range(12)] == list(TASK_TYPES) * 2


def test_skills_retrieve_each_task_type() -> None:
    bank = SkillBank.for_env("alfworld")
    assert set(c.name for c in bank.categories) == set(TASK_TYPES)
    for i, task_type in enumerate(TASK_TYPES):
        task = sample_scene("eval", i).task_desc
        assert bank.retrieve(task_type, task).categories == (task_type,)
    # Without the key, the task sentence alone finds the category, for every ALFWorld template.
    from alfworld.gen.goal_library import gdict

    for task_type in TASK_TYPES:
        for template in gdict[task_type]["templates"]:
            task = template.format(obj="mug", recep="cabinet", toggle="desklamp", mrecep="")
            assert bank.retrieve("", task).categories == (task_type,), task
    unrelated = bank.retrieve("trivia", "Who wrote the novel about a whale, and in which year?")
    assert unrelated.categories == () and unrelated.general == bank.general


def test_module_import_does_not_load_the_engine() -> None:
    code = "import sys, agentopsd.envs.alfworld.env; sys.exit(int('alfworld' in sys.modules or 'textworld' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2]).returncode == 0


def test_missing_extra_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "alfworld.agents.environment.alfred_tw_env", None)
    alfworld_engine.load_engine.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"pip install 'agentopsd\[alfworld\]'"):
            ALFWorldEnv(source="generated")
    finally:
        alfworld_engine.load_engine.cache_clear()


def test_cache_folder_is_reused(cache: Path) -> None:
    env = ALFWorldEnv(split="eval", source="generated", cache_dir=cache)
    first = env.game_file(0)
    mtime = first.stat().st_mtime_ns
    assert env.game_file(0) == first and first.stat().st_mtime_ns == mtime
