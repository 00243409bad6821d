"""Supervised warm start on expert demonstrations stored as webdataset shards.

The environment's expert plays training tasks with two deliberate flaws: with probability
``noise`` a random admissible action is taken instead, and ``habits`` (``{expert action:
substitute}``) replace the expert's action with the substitute with probability
``habit_prob`` each time it comes up (a bad habit the student copies as its most likely
action, which only RL can unlearn). Two kinds of samples are written:

* student view (no skills): the label is the action actually taken, so the noisy actions
  are imitated too: the warm-started policy is imperfect and RL has room to improve;
* teacher view (skill block in the prompt): the label is always the expert's action, so the
  model learns that the skill block means "act like the expert" and the teacher view
  carries real information (its log-prob gap favours expert-like actions).

Demonstrations only show the states the expert (and its flaws) reach. With ``on_policy_episodes``
the warm-started student then plays training episodes itself, and every turn of those whose
teacher view holds a skill becomes one more teacher-view sample labelled with the expert's
action there (a DAgger-style pass for the teacher view alone): the teacher view learns the states
the student's own mistakes lead to (a locked door reached without its key), which the expert's
demonstrations never visit. ``on_policy_steps`` further supervised steps train on the mix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import webdataset as wds

from agentopsd.credit.losses import token_logprobs
from agentopsd.rollout.prompts import HistoryEntry, PromptBuilder
from agentopsd.rollout.scoring import checkpointing, decoder_and_head, hidden_at, whole_model_action_logits
from agentopsd.rollout.skills import SkillBank

log = logging.getLogger(__name__)


def write_demonstrations(
    env_id: str | list[str], path: Path, *, episodes: int, noise: float, seed: int, skills: str | None, max_turns: int, max_general: int | None = None,
    habits: dict[str, str] | None = None, habit_prob: float = 0.0,
) -> int:
    """Play ``episodes`` expert episodes and write their turns to one tar shard (atomically)."""
    if not 0.0 <= noise <= 1.0 or not 0.0 <= habit_prob <= 1.0:
        raise ValueError(f"warm_start.noise and warm_start.habit_prob must be in [0, 1], got {noise} and {habit_prob}")
    habits = dict(habits or {})
    rng = np.random.default_rng(seed)
    bank = SkillBank.for_env(skills, max_general=max_general) if skills else None
    # several ids (e.g. the rungs of a ladder): the expert plays them in turn, one episode each
    pool = [gym.make(i, split="train", disable_env_checker=True) for i in ([env_id] if isinstance(env_id, str) else env_id)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    count = 0
    t0 = time.perf_counter()
    every = max(1, episodes // 10)  # ten progress lines, whatever the size
    with wds.TarWriter(str(tmp)) as sink:
        for ep in range(episodes):
            if ep and ep % every == 0:
                log.info("warm start: demonstrations %d/%d episodes (%.0fs)", ep, episodes, time.perf_counter() - t0)
            env = pool[ep % len(pool)]
            obs, info = env.reset(seed=int(rng.integers(2**31 - 1)), options={"task_index": int(rng.integers(env.unwrapped.num_tasks))})
            history: list[dict] = []
            for _ in range(max_turns):
                # scope "turn": this turn's situations only, "" on turns that show none (no teacher sample there)
                skill = bank.block(info["skill_key"], info["task"], obs) if bank else ""
                expert = env.unwrapped.expert_action()
                admissible = info.get("admissible_actions") or [expert]
                taken = expert
                if expert in habits and rng.random() < habit_prob:
                    taken = habits[expert]
                elif rng.random() < noise:
                    taken = str(rng.choice(admissible))
                sample = {"task": info["task"], "history": history[-4:], "observation": obs, "admissible": info.get("admissible_actions"),
                          "skill": skill, "expert": expert, "taken": taken}
                sink.write({"__key__": f"{ep:06d}_{len(history):03d}", "json": json.dumps(sample).encode()})
                count += 1
                history.append({"observation": obs, "action": taken})
                obs, _, term, trunc, info = env.step(taken)
                if term or trunc:
                    break
    for env in pool:
        env.close()
    os.replace(tmp, path)
    return count


def action_scores(model, tokenizer, prompt: list[int], actions: list[str]) -> torch.Tensor:
    """``[len(actions)]``: the log-probability of each action's whole reply (``<action>..</action><|im_end|>``) after
    ``prompt``, one batched forward pass (the policy restricted to well-formed replies)."""
    ids, attn, target = _pack(tokenizer, [(prompt, _reply(tokenizer, a)) for a in actions])
    with torch.no_grad():
        lp = token_logprobs(model(input_ids=ids, attention_mask=attn).logits[:, :-1], ids[:, 1:])
    return (lp * target[:, 1:]).sum(-1)


def student_visits(
    model, tokenizer, builder: PromptBuilder, env_id: str | list[str], *, episodes: int, seed: int, skills: str,
    max_turns: int, temperature: float = 1.0, max_general: int | None = None,
) -> list[dict]:
    """The student plays ``episodes`` training episodes (sampling among the env's actions by their reply
    log-probabilities at ``temperature``); returns a demonstration-format sample (``taken``: the student's
    action, ``expert``: the expert's) for every turn whose teacher view holds a skill."""
    if temperature <= 0:
        raise ValueError(f"warm_start.on_policy_temperature must be > 0, got {temperature}")
    rng = np.random.default_rng(seed)
    bank = SkillBank.for_env(skills, max_general=max_general)
    pool = [gym.make(i, split="train", disable_env_checker=True) for i in ([env_id] if isinstance(env_id, str) else env_id)]
    was_training = model.training
    model.eval()
    out: list[dict] = []
    try:
        for ep in range(episodes):
            env = pool[ep % len(pool)]
            obs, info = env.reset(seed=int(rng.integers(2**31 - 1)), options={"task_index": int(rng.integers(env.unwrapped.num_tasks))})
            history: list[dict] = []
            for _ in range(max_turns):
                actions = list(info.get("admissible_actions") or [])
                if not actions:
                    raise ValueError(f"{env.spec.id if env.spec else env_id}: warm_start.on_policy_episodes needs an env that lists its admissible actions")
                prompt = builder.build(info["task"], [HistoryEntry(h["observation"], h["action"]) for h in history[-4:]], obs, actions)
                probs = torch.softmax(action_scores(model, tokenizer, prompt, actions) / temperature, 0).double().numpy()
                taken = actions[int(rng.choice(len(actions), p=probs / probs.sum()))]
                skill = bank.block(info["skill_key"], info["task"], obs)
                if skill:
                    out.append({"task": info["task"], "history": history[-4:], "observation": obs, "admissible": info.get("admissible_actions"),
                                "skill": skill, "expert": env.unwrapped.expert_action(), "taken": taken})
                history.append({"observation": obs, "action": taken})
                obs, _, term, trunc, info = env.step(taken)
                if term or trunc:
                    break
    finally:
        for env in pool:
            env.close()
        model.train(was_training)
    return out


def _pack(tokenizer, rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(ids, attention mask, reply mask)`` of ``(prompt, reply)`` rows."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(rows), max(len(p) + len(a) for p, a in rows)), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    target = torch.zeros_like(ids, dtype=torch.bool)
    for r, (p, a) in enumerate(rows):
        ids[r, : len(p) + len(a)] = torch.tensor(p + a)
        attn[r, : len(p) + len(a)] = 1
        target[r, len(p) : len(p) + len(a)] = True
    return ids, attn, target


def _reply(tokenizer, action: str) -> list[int]:
    return tokenizer.encode(f"<action>{action}</action>", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def _encode(builder: PromptBuilder, tokenizer, sample: dict, teacher: bool) -> tuple[list[int], list[int]]:
    history = [HistoryEntry(h["observation"], h["action"]) for h in sample["history"]]
    prompt = builder.build(sample["task"], history, sample["observation"], sample["admissible"], skill=sample["skill"] if teacher else "")
    return prompt, _reply(tokenizer, sample["expert"] if teacher else sample["taken"])


def _head_bytes(p: torch.Tensor, n: int = 4096) -> bytes:
    """The first ``n`` bytes of a tensor's data, whatever its dtype."""
    return p.detach().cpu().contiguous().view(-1).view(torch.uint8)[:n].numpy().tobytes()


def warm_start(model, tokenizer, env_cfg, cfg, out_dir: Path) -> dict[str, float]:
    """Write (or reuse) the demonstration shard, then train on it for ``cfg.seconds`` or ``cfg.steps``.

    ``cfg.weights`` (a ``policy-*.pt`` an earlier warm start saved) skips all of it and loads those weights:
    several runs, e.g. the rungs of a ladder, then start from one warm start (the model's tokenizer must match).
    """
    if cfg.get("weights"):
        model.load_state_dict(torch.load(cfg.weights, map_location="cpu"))
        print(f"warm start: loaded {cfg.weights} (warm_start.weights)")
        return {"warm_start/cached": 1.0}
    on_policy = int(cfg.get("on_policy_episodes") or 0) > 0
    if on_policy and not env_cfg.skills:
        raise ValueError("warm_start.on_policy_episodes adds teacher-view samples: set env.skills, or warm_start.on_policy_episodes=0")
    if on_policy and float(cfg.get("on_policy_temperature", 1.0)) <= 0:
        raise ValueError(f"warm_start.on_policy_temperature must be > 0, got {cfg.on_policy_temperature}")
    # the name carries every setting the demonstrations depend on, so a stale shard is never reused
    habits = dict(cfg.get("habits") or {})
    habit_prob = float(cfg.get("habit_prob", 0.0))
    tag = hashlib.sha1(json.dumps([sorted(habits.items()), habit_prob, env_cfg.skills]).encode()).hexdigest()[:6]
    env_ids = list(cfg.get("env_ids") or [env_cfg.id])
    if len(env_ids) > 1:  # the shard's name carries every id it mixes
        tag += "-" + hashlib.sha1("|".join(env_ids).encode()).hexdigest()[:6]
    shard = Path(out_dir) / f"demos-{env_cfg.id.split('/')[-1]}-{cfg.episodes}-{cfg.noise}-{cfg.seed}-{env_cfg.max_turns}-{env_cfg.get('skill_max_general')}-{tag}.tar"
    if not shard.exists():
        log.info("warm start: the expert plays %d training episodes (demonstrations, cached in %s)", cfg.episodes, out_dir)
        t0 = time.perf_counter()
        n = write_demonstrations(env_ids if len(env_ids) > 1 else env_cfg.id, shard, episodes=cfg.episodes, noise=cfg.noise, seed=cfg.seed, skills=env_cfg.skills,
                                 max_turns=env_cfg.max_turns, max_general=env_cfg.get("skill_max_general"), habits=habits, habit_prob=habit_prob)
        log.info("wrote %d demonstration turns to %s in %.1fs", n, shard, time.perf_counter() - t0)
    # the warm-started weights are cached next to the shard: a rerun with the same settings
    # (and the same initial weights) skips the supervised stage
    # the first 4 KB of each parameter's bytes (as bytes: numpy has no bf16, and a bf16 base is a different start)
    init = hashlib.sha1(b"".join(_head_bytes(p) for p in model.parameters())).hexdigest()[:10]
    key = hashlib.sha1(f"{shard.name}|{sorted(cfg.items())}|{init}|{env_cfg.history_window}|{env_cfg.get('show_admissible')}".encode()).hexdigest()[:12]
    cached = Path(out_dir) / f"policy-{key}.pt"
    if cached.exists():
        model.load_state_dict(torch.load(cached, map_location="cpu"))
        print(f"warm start: loaded {cached}")
        return {"warm_start/cached": 1.0}
    samples = [json.loads(s["json"]) for s in wds.WebDataset(str(shard), shardshuffle=False, nodesplitter=lambda urls: urls)]  # every rank reads it whole
    log.info("warm start: %d supervised steps on %d demonstration turns", cfg.steps, len(samples))
    builder = PromptBuilder(tokenizer, output_format=env_cfg.output_format, history_window=env_cfg.history_window,
                            max_prompt_tokens=env_cfg.max_prompt_tokens, show_admissible=env_cfg.get("show_admissible", True),
                            **({"system_prompt": env_cfg.system_prompt} if env_cfg.get("system_prompt") is not None else {}))
    encoded = [_encode(builder, tokenizer, s, teacher=False) for s in samples]
    if env_cfg.skills and cfg.teacher_fraction > 0:
        rng = np.random.default_rng(cfg.seed)
        chosen = rng.random(len(samples)) < cfg.teacher_fraction
        encoded += [_encode(builder, tokenizer, s, teacher=True) for s, c in zip(samples, chosen) if c and s["skill"]]
    step, losses, seconds = _train(model, tokenizer, encoded, steps=cfg.steps, lr=cfg.lr, warmup=cfg.warmup, batch_size=cfg.batch_size,
                                   seconds=cfg.seconds, seed=cfg.seed)
    extra = {}
    if on_policy:
        t1 = time.perf_counter()
        visits = student_visits(model, tokenizer, builder, env_ids if len(env_ids) > 1 else env_cfg.id, episodes=int(cfg.on_policy_episodes),
                                seed=cfg.seed + 1, skills=env_cfg.skills, max_turns=env_cfg.max_turns,
                                temperature=float(cfg.get("on_policy_temperature", 1.0)), max_general=env_cfg.get("skill_max_general"))
        log.info("warm start: the student played %d episodes, %d teacher-view samples on its own states (%.0fs)",
                 cfg.on_policy_episodes, len(visits), time.perf_counter() - t1)
        mine = [_encode(builder, tokenizer, s, teacher=True) for s in visits]
        # about half of each further batch comes from the student's own states: a few thousand samples
        # among tens of thousands of demonstration turns would hardly be seen otherwise
        encoded += mine * max(1, len(encoded) // max(1, len(mine)))
        more, more_losses, more_seconds = _train(model, tokenizer, encoded, steps=int(cfg.get("on_policy_steps", 200)), lr=cfg.lr,
                                                 warmup=cfg.warmup, batch_size=cfg.batch_size, seconds=cfg.seconds, seed=cfg.seed + 1)
        step, losses, seconds = step + more, losses + more_losses, seconds + more_seconds
        extra = {"warm_start/on_policy_samples": float(len(visits)),
                 "warm_start/on_policy_expert_differs": float(np.mean([v["taken"] != v["expert"] for v in visits])) if visits else 0.0}
    stats = {"warm_start/steps": float(step), "warm_start/loss": float(np.mean(losses[-20:])) if losses else float("nan"),
             "warm_start/seconds": seconds, "warm_start/samples": float(len(encoded)), **extra}
    tmp = cached.with_suffix(".tmp")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, cached)
    log.info("warm start: %s", stats)
    print(f"warm start: {step} steps in {stats['warm_start/seconds']:.0f}s, final loss {stats['warm_start/loss']:.3f}")
    return stats


def reply_nll(model, ids: torch.Tensor, attn: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean negative log-probability of the reply tokens (``target``) of right-padded rows, with gradient.

    The loss reads only the few reply positions, so the LM head runs there only (a 49k-vocabulary head over every
    prompt position was about a fifth of a SmolLM2 step's forward, and its logits the largest tensor), and the
    decoder runs as the update's forward does (:func:`~agentopsd.rollout.scoring.hidden_at`): a prompt prefix the
    batch's rows share (the system prompt) once, the rows' own parts packed by length instead of padded to the
    longest. The same value and gradient as the whole model's logits at every position, up to float rounding.
    """
    source = torch.zeros_like(target)
    source[:, :-1] = target[:, 1:]  # position j-1 predicts reply token j
    pair = decoder_and_head(model)
    if pair is None:
        logits = whole_model_action_logits(model, ids, attn, source)
    else:
        decoder, head = pair
        hidden = (decoder(input_ids=ids, attention_mask=attn).last_hidden_state[source] if checkpointing(decoder)
                  else hidden_at(decoder, ids, attn, source))
        logits = head(hidden)
    return -token_logprobs(logits, ids[:, 1:][target[:, 1:]]).mean()


def _train(model, tokenizer, encoded: list[tuple[list[int], list[int]]], *, steps: int, lr: float, warmup: int, batch_size: int,
           seconds: float, seed: int) -> tuple[int, list[float], float]:
    """Supervised steps on ``(prompt, reply)`` pairs (loss on the reply tokens), cosine lr after a linear warmup;
    returns (steps taken, losses, seconds)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    t0, step, losses = time.perf_counter(), 0, []
    while step < steps and time.perf_counter() - t0 < seconds:
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / max(1, warmup)) * 0.5 * (1 + math.cos(math.pi * step / steps))
        ids, attn, target = _pack(tokenizer, [encoded[i] for i in torch.randint(len(encoded), (batch_size,), generator=gen).tolist()])
        loss = reply_nll(model, ids, attn, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if step % max(1, steps // 10) == 0 and step < steps:
            log.info("warm start: step %d/%d, loss %.3f (%.0fs)", step, steps, float(np.mean(losses[-10:])), time.perf_counter() - t0)
    return step, losses, time.perf_counter() - t0
