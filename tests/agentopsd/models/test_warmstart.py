"""Demonstrations for the supervised warm start: noise, habits and the two label kinds."""

from __future__ import annotations

import json

import pytest
import torch
import webdataset as wds

import agentopsd.envs  # noqa: F401
from agentopsd.models.warmstart import write_demonstrations

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

    from agentopsd.models.warmstart import write_demonstrations

    ids = ["agentopsd/BabyAI-PickupObjS5-v0", "agentopsd/BabyAI-GoToObj-v0"]
    shard = tmp_path / "mixed.tar"
    write_demonstrations(ids, shard, episodes=4, noise=0.0, seed=0, skills="babyai", max_turns=40)
    firsts = [json.loads(s["json"]) for s in wds.WebDataset(str(shard), shardshuffle=False) if s["__key__"].endswith("_000")]
    assert [f["task"].split()[0] for f in firsts] == ["pick", "go", "pick", "go"]


KEYDOOR = "agentopsd/BabyAI-KeyDoorBoxS5-v0"
SPLIT = "babyai_keydoor_split"


@pytest.fixture(scope="module")
def keydoor_policy(tmp_path_factory):
    from agentopsd.models.tiny import tiny_policy

    return tiny_policy(KEYDOOR, skills=SPLIT, vocab_size=400, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                       num_kv_heads=1, text_episodes=4, cache_dir=str(tmp_path_factory.mktemp("tok")))


def _builder(tok):
    from agentopsd.rollout.prompts import PromptBuilder

    return PromptBuilder(tok, output_format="action", history_window=0, max_prompt_tokens=1024, show_admissible=False, system_prompt="Act.")


def test_action_scores_are_the_reply_log_probabilities(keydoor_policy) -> None:
    """One batched pass equals scoring each reply alone (padding must not leak into a shorter reply)."""
    import torch

    from agentopsd.credit.losses import token_logprobs
    from agentopsd.models.warmstart import _reply, action_scores

    model, tok = keydoor_policy
    prompt = _builder(tok).build("pick up the red box", [], "You see: no objects.", None)
    actions = ["turn left", "pick up", "go forward", "done"]
    batched = action_scores(model, tok, prompt, actions)
    for a, got in zip(actions, batched):
        ids = torch.tensor([prompt + _reply(tok, a)])
        with torch.no_grad():
            lp = token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])[0, len(prompt) - 1:]
        assert abs(float(lp.sum()) - float(got)) < 1e-4


def test_student_visits_label_the_students_own_informed_turns(keydoor_policy) -> None:
    """The untrained student wanders (at a high temperature: untrained, it all but always says its shortest
    reply); every returned turn shows a skill, carries the expert's action for that state, and the student's
    sampled action; turns that show no skill are not returned."""
    from agentopsd.models.warmstart import student_visits
    from agentopsd.rollout.skills import SkillBank

    model, tok = keydoor_policy
    visits = student_visits(model, tok, _builder(tok), KEYDOOR, episodes=6, seed=0, skills=SPLIT, max_turns=32, temperature=100.0)
    bank = SkillBank.for_env(SPLIT)
    assert visits, "six random episodes of 32 turns should face the key, the door or the box at least once"
    actions = {"turn left", "turn right", "go forward", "pick up", "drop", "toggle", "done"}
    for v in visits:
        assert v["skill"] and v["skill"] == bank.block("", v["task"], v["observation"])
        assert v["expert"] in actions and v["taken"] in actions
    # the same seed plays the same episodes
    again = student_visits(model, tok, _builder(tok), KEYDOOR, episodes=6, seed=0, skills=SPLIT, max_turns=32, temperature=100.0)
    assert [(v["observation"], v["taken"]) for v in again] == [(v["observation"], v["taken"]) for v in visits]


def test_split_skill_file_tells_the_door_with_and_without_its_key() -> None:
    from agentopsd.rollout.skills import SkillBank

    bank = SkillBank.for_env(SPLIT)
    base = "Mission: pick up the red box\nYou see: a locked red door right in front of you.\nWalls: x.\n"
    assert bank.situational(base + "You are carrying a red key.\nLast action: x").categories == ("door",)
    assert bank.situational(base + "You are carrying nothing.\nLast action: x").categories == ("keyless_door",)
    assert bank.situational(base + "You are carrying a blue key.\nLast action: x").categories == ()


def test_on_policy_teacher_samples_need_a_skill_file(tmp_path, keydoor_policy) -> None:
    from omegaconf import OmegaConf

    from agentopsd.models.warmstart import warm_start

    model, tok = keydoor_policy
    env = OmegaConf.create({"id": KEYDOOR, "skills": None, "max_turns": 8, "history_window": 0, "show_admissible": False,
                            "system_prompt": "Act.", "output_format": "action", "max_prompt_tokens": 512})
    ws = OmegaConf.create({"episodes": 2, "noise": 0.0, "teacher_fraction": 0.5, "seed": 0, "lr": 1e-3, "batch_size": 4,
                           "warmup": 1, "steps": 1, "seconds": 60, "on_policy_episodes": 2})
    with pytest.raises(ValueError, match="on_policy_episodes"):
        warm_start(model, tok, env, ws, tmp_path)
    assert not list(tmp_path.iterdir())  # refused before any demonstration was written


def test_reply_loss_equals_the_whole_models_loss_and_gradient(keydoor_policy) -> None:
    """The warm start's loss with the LM head at the reply positions only and shared prefixes run once equals
    the loss over the whole model's logits, and so does its gradient (rows of unequal length sharing a prompt)."""
    import torch

    from agentopsd.credit.losses import token_logprobs
    from agentopsd.models.warmstart import _pack, _reply, reply_nll

    model, tok = keydoor_policy
    b = _builder(tok)
    rows = [(b.build("pick up the red box", [], obs, None), _reply(tok, a))
            for obs, a in [("You see: no objects.", "turn left"), ("You see: a red box right in front of you.", "pick up"),
                           ("You see: a wall.", "go forward"), ("You see: no objects.", "done")]]
    ids, attn, target = _pack(tok, rows)
    assert len({len(p) + len(a) for p, a in rows}) > 1  # unequal lengths: padding is in play
    model.train()

    def grads(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    lp = token_logprobs(model(input_ids=ids, attention_mask=attn).logits[:, :-1], ids[:, 1:])
    mask = target[:, 1:]
    plain = -(lp * mask).sum() / mask.sum()
    want = grads(plain)
    fast = reply_nll(model, ids, attn, target)
    got = grads(fast)
    assert abs(float(fast) - float(plain)) < 1e-5
    assert want.keys() == got.keys() and any(g.abs().max() > 0 for g in want.values())
    for k, g in want.items():
        torch.testing.assert_close(got[k], g, atol=1e-6, rtol=1e-4, msg=k)


def test_a_bf16_base_warm_starts_and_keys_apart(tmp_path, keydoor_policy) -> None:
    """model.dtype=auto stores a LoRA base in bf16 on a CPU with native bf16: the warm start's cache key reads its
    bytes (numpy has no bf16: it raised TypeError before training), and a float32 model keys as it did."""
    import copy

    from omegaconf import OmegaConf

    from agentopsd.models.warmstart import _head_bytes, warm_start

    model, tok = keydoor_policy
    half = copy.deepcopy(model).to(torch.bfloat16)
    env = OmegaConf.create({"id": KEYDOOR, "skills": None, "max_turns": 8, "history_window": 0, "show_admissible": False,
                            "system_prompt": "Act.", "output_format": "action", "max_prompt_tokens": 512})
    ws = OmegaConf.create({"episodes": 2, "noise": 0.0, "teacher_fraction": 0.0, "seed": 0, "lr": 1e-3, "batch_size": 2,
                           "warmup": 1, "steps": 1, "seconds": 60})
    warm_start(half, tok, env, ws, tmp_path)
    assert len(list(tmp_path.glob("*.pt"))) == 1  # trained and cached under its own key
    weights = torch.randn(3000)
    assert _head_bytes(weights) == weights.numpy().tobytes()[:4096]  # float32: the key earlier runs cached under
