"""benchmarks/peer_trl.py: both trainers must get the same work, or the ratio it prints means nothing.

The checks that need TRL run ``benchmarks/peer_trl.py --check-setup`` with the python of the TRL venv
(``bash scripts/build_trl_env.sh`` builds it, about a minute): TRL's own sampler and tokenizer then
produce the prompts compared with the project's collector's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("AGENTOPSD_TRL_VENV", ROOT / ".venv-trl"))


@pytest.fixture(scope="module")
def peer():
    spec = importlib.util.spec_from_file_location("peer_trl", ROOT / "benchmarks" / "peer_trl.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["peer_trl"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def policy(peer):
    from agentopsd.models.tiny import tiny_policy

    return tiny_policy(peer.EPISODE_ID, skills="babyai", **peer.PeerSetup().model)


def test_one_decision_reward_is_the_expert_match_trl_scores_too(peer):
    env = peer.OneDecisionEnv()
    obs, info = env.reset(seed=3, options={"task_index": 5})
    expert = info["expert_action"]
    wrong = next(a for a in ("turn left", "turn right", "move forward", "pick up") if a != expert)
    for action, reward in ((expert, 1.0), (wrong, 0.0)):
        env.reset(seed=3, options={"task_index": 5})
        _, r, terminated, truncated, step_info = env.step(action)
        assert (r, terminated, truncated, step_info["won"]) == (reward, True, False, reward == 1.0)
        completion = [{"role": "assistant", "content": f"<action>{action}</action>"}]
        assert peer.decision_reward([completion], [expert]) == [reward]
    assert peer.decision_reward(["no tags at all"], [expert]) == [0.0]


def test_trl_rows_template_to_the_collectors_prompts(peer, policy):
    """Without TRL: the rows' chat messages, templated, are the prompts the project's collector sends,
    task by task and copy by copy (TRL repeats each row group_size times in a row)."""
    setup = peer.PeerSetup(iterations=2)
    model, tokenizer = policy
    module = peer.project_module(setup, model, tokenizer)
    recorder = peer.PromptRecorder(tokenizer)
    module.collector.generator = recorder
    for it in range(setup.iterations):
        module.collector.collect(peer.iteration_tasks(setup, peer.ONE_DECISION_ID, it), with_teacher=False)
    rows = peer.trl_rows(setup, tokenizer)
    assert len(rows) == setup.iterations * setup.tasks_per_iteration
    templated = []
    for row in rows:
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        templated += [ids] * setup.group_size
    assert templated == recorder.prompts
    assert len({tuple(p) for p in recorder.prompts}) > 1  # different tasks, not one prompt everywhere


def test_setup_rejects_shapes_that_do_not_split(peer):
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        peer.PeerSetup(tasks_per_iteration=3, group_size=5, micro_batch_size=16)
    with pytest.raises(ValueError, match="warm-up"):
        peer.PeerSetup(iterations=1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trl_gets_the_same_prompts_order_and_settings():
    python = VENV / "bin" / "python"
    if not (VENV / ".agentopsd-trl-built").is_file() or not python.is_file():
        pytest.skip(f"the TRL venv is not built at {VENV}: run `bash scripts/build_trl_env.sh` (or set AGENTOPSD_TRL_VENV)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", TRL_EXPERIMENTAL_SILENCE="1")
    proc = subprocess.run([str(python), str(ROOT / "benchmarks" / "peer_trl.py"), "--check-setup", "--iterations", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    out = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, out
    assert "SAME WORK" in proc.stdout, out


def test_the_results_document_is_computed_from_the_measured_phases(peer):
    """The markdown ``--out`` writes: each side's row and the ratios come from the phases given
    (hand-computed here: TRL 1.2 s against 0.4 s is 3.00x; per generated token (1.2/300)/(0.4/600) = 6.00x)."""
    ours = peer.Phases(wall=0.4, generation=0.1, update=0.2, tokens=600)
    theirs = peer.Phases(wall=1.2, generation=0.5, update=0.6, tokens=300)
    text = peer.results_markdown("cmd --x", "versions", (ours, theirs), (ours, theirs), rows=64, multi_turns=6)
    assert "Command: `cmd --x`" in text and "versions" in text
    assert "| agentopsd | 0.400 | 0.100 | 0.100 | 0.200 | 1,500 | 9.4 | **3.00x** |" in text
    assert "| TRL GRPO | 1.200 | 0.500 | 0.100 | 0.600 | 250 | 4.7 |  |" in text
    assert text.count("By phase, TRL / this: generation 5.00x, scoring 1.00x, update 3.00x.") == 2  # each line's
    assert "**3.00x** (6.00x per generated token)" in text
    single_only = peer.results_markdown("cmd", "v", (ours, theirs), None, rows=64, multi_turns=0)
    assert "Multi turn" not in single_only and single_only.count("**3.00x**") == 1


# ------------------------------------------------------------------------------ --model smollm2


def test_model_option_picks_the_smollm2_setup_and_keeps_the_tiny_default(peer):
    """``--model smollm2``: the SmolLM2 recipe's shapes for both sides, the model loaded with LoRA and model.dtype=auto;
    explicit options still win; without ``--model`` the tiny comparison is what it was."""
    args = peer.parse_args(["--model", "smollm2"])
    setup = peer.setup_from_args(args)
    assert (setup.tasks_per_iteration, setup.group_size, setup.micro_batch_size, setup.iterations) == (4, 4, 4, 2)
    assert (setup.max_new_tokens, setup.temperature, setup.rows) == (8, 0.7, 16)
    assert (setup.pretrained, setup.dtype, setup.lora) == ("smollm2-135m", "auto", peer.LORA)
    assert peer.LORA == {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
    assert (args.rounds, args.multi_turn_rounds, args.multi_turn_turns) == (2, 2, 6)
    args = peer.parse_args(["--model", "smollm2", "--iterations", "3", "--rounds", "1"])
    assert (peer.setup_from_args(args).iterations, args.rounds, peer.setup_from_args(args).max_new_tokens) == (3, 1, 8)
    tiny = peer.parse_args([])
    assert (tiny.model, tiny.rounds, tiny.multi_turn_rounds) == ("tiny", 3, 2)
    assert peer.setup_from_args(tiny) == peer.PeerSetup()
    assert (peer.PeerSetup().pretrained, peer.PeerSetup().dtype, peer.PeerSetup().lora) == (None, "float32", None)
    with pytest.raises(SystemExit):
        peer.parse_args(["--model", "qwen"])


def test_trl_config_takes_the_smollm2_rows_tokens_and_precision(peer):
    """TRL's config (built here with a stand-in for ``GRPOConfig``) carries the setup's rows, tokens and temperature,
    and no autocast: the bf16 base and float32 adapters compute as they are stored, as on the project's side."""
    setup = peer.peer_setup("smollm2")
    cfg = peer.trl_config(lambda **kw: kw, setup, "/tmp/x")
    assert cfg["per_device_train_batch_size"] * cfg["gradient_accumulation_steps"] == setup.rows == 16
    assert (cfg["per_device_train_batch_size"], cfg["num_generations"]) == (4, 4)
    assert (cfg["max_completion_length"], cfg["temperature"], cfg["max_steps"]) == (8, 0.7, 2)
    assert (cfg["bf16"], cfg["fp16"], cfg["gradient_checkpointing"]) == (False, False, False)


@pytest.fixture(scope="module")
def lora_stand_in(peer, policy):
    """The tiny model as ``load_policy(..., dtype, lora)`` would hand SmolLM2: the base in bf16, LoRA adapters
    float32 (peft's own upcast), the tiny tokenizer."""
    import copy

    from agentopsd.models.loading import apply_lora

    model, tokenizer = policy
    return apply_lora(copy.deepcopy(model).to(torch.bfloat16), peer.LORA), tokenizer


def test_smollm2_loads_through_load_policy_with_its_dtype_and_lora(peer, monkeypatch, lora_stand_in):
    import agentopsd.models.loading as loading

    calls = []
    monkeypatch.setattr(loading, "load_policy", lambda path, **kw: calls.append((path, kw)) or lora_stand_in)
    assert peer.peer_policy(peer.peer_setup("smollm2")) is lora_stand_in
    assert calls == [("smollm2-135m", {"dtype": "auto", "lora": peer.LORA})]


def test_both_sides_train_the_same_bf16_base_and_float32_adapters(peer, lora_stand_in, policy):
    """The project's module for the smollm2 setup holds the weights as ``model.dtype=bfloat16`` says on a CPU (base
    bf16, adapters float32, a merged bf16 copy generates); the model TRL gets is the same; a float32 copy is caught."""
    import copy

    model, tokenizer = lora_stand_in
    setup = peer.peer_setup("smollm2", dtype="bfloat16")  # forced: this CPU need not compute bf16 natively
    module = peer.project_module(setup, model, tokenizer)
    plan = module.weight_plan
    assert (plan.frozen_half, plan.generation_dtype) == (True, torch.bfloat16)
    assert module.collector.generator.weights_dtype == torch.bfloat16
    ours = peer.project_weights(module)
    summary = peer.weights_summary(ours)
    assert set(summary) == {"frozen bfloat16", "trainable float32"}, summary
    lora = peer.lora_summary(ours)
    assert (lora["r"], lora["alpha"], lora["dropout"]) == (16, 32, 0.0)
    # all-linear, as peft expands it: every projection of every layer, not the LM head
    assert {t.rsplit(".", 1)[-1] for t in lora["target_modules"]} == {f"{p}_proj" for p in "qkvo"} | {"gate_proj", "up_proj",
                                                                                                      "down_proj"}
    assert peer.model_problems(copy.deepcopy(model), ours) == []
    assert peer.model_problems(copy.deepcopy(model).float(), ours) == [
        f"weights by dtype: TRL {peer.weights_summary(copy.deepcopy(model).float())!r} vs project {summary!r}"]
    # the tiny default: one float32 policy, no adapters, no generation copy
    tiny = peer.project_module(peer.PeerSetup(), *policy)
    assert (tiny.weight_plan.frozen_half, tiny.weight_plan.generation_dtype) == (False, None)


def test_an_observation_turn_carries_no_default_system_message(peer, policy):
    """TRL's multi-turn rollout appends each observation as a user turn: with SmolLM2's template (a default system
    message when a conversation does not start with one) templating it alone would add that message every turn."""
    import copy

    _, tokenizer = policy
    smol = copy.copy(tokenizer)
    smol.chat_template = (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    for tok in (tokenizer, smol):
        text = tok.decode(peer.user_turn_ids(tok, "You see a wall."))
        assert text == "<|im_start|>user\nYou see a wall.<|im_end|>\n<|im_start|>assistant\n", text


def test_peak_memory_is_measured_per_run(peer):
    import mmap

    peer.reset_peak_memory()
    before = peer.peak_memory_mib()
    # fresh anonymous pages, touched: resident on top of what the process held (a bytearray may reuse memory the
    # allocator kept resident from earlier tests in this worker, and then the peak does not move)
    block = mmap.mmap(-1, 64 << 20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    runs = [[peer.Phases(1.0, 0.5, 0.3, 10), *peer.with_peak([peer.Phases(1.0, 0.5, 0.3, 10)])]]
    block.close()
    assert runs[0][-1].peak_mib >= before + 60
    assert peer.steady(runs).peak_mib == runs[0][-1].peak_mib


def test_the_smollm2_results_say_why_trl_is_faster_where_it_is(peer):
    """The notes come from the measured parts: TRL faster at scoring (0.02 s against 0.4 s) gets its why-line with the
    parts (merge 0.2, forwards 0.15, rest 0.05; TRL 0 forward calls); no why-line for a phase TRL is slower at."""
    ours = peer.Phases(wall=2.0, generation=0.6, update=1.0, tokens=100, parts={peer.MERGE: 0.2, peer.FORWARDS: 0.15},
                       peak_mib=1500.0)
    theirs = peer.Phases(wall=6.0, generation=3.0, update=2.98, tokens=100,
                         parts={peer.FORWARDS: 0.0, peer.FORWARD_CALLS: 0}, peak_mib=2500.0)
    notes = peer.explanations(peer.peer_setup("smollm2"), {"single turn": (ours, theirs), "multi turn": (ours, theirs)})
    text = "\n".join(notes)
    assert "adapters merged into its bf16 generation copy 0.200, log-prob forwards 0.150, the rest (prompts" in text
    assert "0.050; TRL: 0 log-prob forward calls (0.000 s), the rest 0.020." in text
    assert "**Why TRL is faster at scoring** (single turn, multi turn): with one optimizer step per generation" in text
    assert "Why TRL is faster at generation" not in text and "Why TRL is faster at update" not in text
    assert "single turn this 1,500, TRL 2,500; multi turn this 1,500, TRL 2,500" in text
    assert "Why this trainer is faster at generation" in text and "Why this trainer is faster at update" in text
    doc = peer.results_markdown("cmd", "v", (ours, theirs), (ours, theirs), rows=16, multi_turns=6, notes=notes)
    assert doc.endswith("\n".join(notes) + "\n")
    # TRL slower everywhere: no why-line; TRL faster at generation: said, unexplained
    slow = dataclasses.replace(theirs, update=3.5, wall=7.0)  # scoring 0.5
    assert "Why TRL is faster" not in "\n".join(peer.explanations(peer.peer_setup("smollm2"), {"single turn": (ours, slow)}))
    fast = dataclasses.replace(slow, generation=0.5)
    assert "**Why TRL is faster at generation** (single turn): not explained" in "\n".join(
        peer.explanations(peer.peer_setup("smollm2"), {"single turn": (ours, fast)}))
