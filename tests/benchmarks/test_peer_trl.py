"""benchmarks/peer_trl.py: both trainers must get the same work, or the ratio it prints means nothing.

The checks that need TRL run ``benchmarks/peer_trl.py --check-setup`` with the python of the TRL venv
(``bash scripts/build_trl_env.sh`` builds it, about a minute): TRL's own sampler and tokenizer then
produce the prompts compared with the project's collector's.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert "generation 5.00x, scoring 1.00x, update 3.00x" in text
    assert "**3.00x** (6.00x per generated token)" in text
    single_only = peer.results_markdown("cmd", "v", (ours, theirs), None, rows=64, multi_turns=0)
    assert "Multi turn" not in single_only and single_only.count("**3.00x**") == 1
