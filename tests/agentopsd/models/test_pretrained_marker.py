"""agentopsd/models/pretrained.py: a folder is prepared only when its completion marker is there (written last), so a
folder with ``config.json`` but no marker (a preparation from before atomic writes, a copy cut short, a hand-made
folder) is prepared again, never loaded as it is."""

from __future__ import annotations

import pytest

from agentopsd.models import pretrained
from tests.agentopsd.models.test_pretrained import fake_spec, write_stub


@pytest.fixture
def spec(tmp_path, monkeypatch):
    """The fake spec registered, an empty cache, and its wheel placed through the spec's variable."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    spec, wheel = fake_spec(tmp_path)
    monkeypatch.setitem(pretrained.PREPARED, spec.name, spec)
    monkeypatch.setenv(spec.env_var, str(wheel))
    return spec


def test_a_folder_with_config_but_no_marker_is_not_prepared(spec):
    folder = pretrained.prepared_dir(spec)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert not pretrained.is_prepared(folder), "config.json without the completion marker counted as prepared"
    (folder / pretrained.MARKER).write_text("{}")
    assert pretrained.is_prepared(folder)
    (folder / "config.json").unlink()
    assert not pretrained.is_prepared(folder)  # a marker alone is no model either


def test_prepare_redoes_a_folder_without_its_marker(spec):
    folder = pretrained.prepared_dir(spec)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"half": true}')  # what a cut-short copy leaves
    writes: list[int] = []

    def write(gguf, out):
        writes.append(1)
        write_stub(gguf, out)

    assert pretrained.prepare(spec.name, write=write) == folder
    assert writes == [1], "prepare() returned a folder without its completion marker instead of preparing it"
    assert (folder / pretrained.MARKER).is_file() and (folder / "config.json").read_text() == "{}"
    assert (folder / "weights.bin").is_file()
    assert pretrained.prepare(spec.name, write=write) == folder and writes == [1]  # now prepared: nothing runs again
