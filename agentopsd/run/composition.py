"""Hydra's composition errors as one line naming the key and the fix, exit 2, like every other bad configuration.

Hydra reports a typo'd key (``optim.lrr=1``) or option (``env=babyia``) in several lines (the search path, a
pointer to ``HYDRA_FULL_ERROR``) and exits 1. ``train.py`` composes the command line once before Hydra does
(:func:`check_composition`, a tenth of a second) and ``agentopsd-eval`` wraps its own composition; both turn
the error into one line with :func:`explain`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from agentopsd.run.validation import ConfigError

TINY_TARGET = "agentopsd.models.tiny.tiny_policy"
_NOT_OVERRIDABLE = re.compile(r"Could not override '([^']+)'")
_ALREADY_CHOSEN = re.compile(r"Multiple values for ([\w/.-]+)\.")


def _key_of(override: str) -> str:
    return override.lstrip("+~").partition("=")[0]


def _override_for(key: str, overrides: Sequence[str]) -> str:
    """The command-line item that sets ``key`` (as typed), or ``key`` alone when none does."""
    return next((o for o in overrides if _key_of(o) == key), key)


def _closest(word: str, choices: Sequence[str]) -> str | None:
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def missing_option(group: str, option: str, options: Sequence[str]) -> str:
    """``env=babyia``: a group option with no file in the config search path."""
    guess = _closest(option, options)
    hint = f"did you mean {group}={guess}? " if guess else ""
    return (f"{group}={option}: no config {group}/{option}.yaml; {hint}choose one of {', '.join(options)} "
            f"(a file of your own: put {group}/{option}.yaml in a folder and add --config-dir=<folder>)")


def missing_key(key: str, overrides: Sequence[str], compose_without: Callable[[list[str]], DictConfig] | None) -> str:
    """``optim.lrr=1``: a key the composed config does not have. ``compose_without`` composes the other overrides
    (to name the keys that exist there), or is None."""
    given = _override_for(key, overrides)
    value = given.partition("=")[2]
    parent_key, _, leaf = key.rpartition(".")
    cfg = None
    if compose_without is not None:
        try:
            cfg = compose_without([o for o in overrides if o != given])
        except Exception:  # another error in the rest of the line: name this key without suggestions
            cfg = None
    if cfg is not None and key == "model.path" and OmegaConf.select(cfg, "model._target_") == TINY_TARGET:
        return (f"{given}: model=tiny, this experiment's model, is built from scratch and loads no weights; name a model "
                f"config that loads a folder or hub id: model=qwen2.5-3b model.path={value} (any causal LM; add "
                "model.dtype=float32 on a CPU), or model=smollm2-135m")
    parent = OmegaConf.select(cfg, parent_key) if cfg is not None and parent_key else cfg
    known = [str(k) for k in parent.keys()] if isinstance(parent, DictConfig) else []
    guess = _closest(leaf, known)
    where = f"{parent_key} has no key '{leaf}'" if parent_key else f"the config has no key '{leaf}'"
    hint = f"; did you mean {parent_key + '.' if parent_key else ''}{guess}={value}?" if guess else (
        f" (its keys: {', '.join(known)})" if known else "")
    return f"{given}: {where}{hint} (+{key}={value} adds a new key, which nothing here reads)"


def explain(err: Exception, overrides: Sequence[str], compose_without: Callable[[list[str]], DictConfig] | None = None) -> str:
    """One line for an exception raised while Hydra composed ``overrides``."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        return missing_option(group, option, list(err.options or []))
    if isinstance(err, OverrideParseException):
        first = str(err.message).splitlines()[0] if err.message else "cannot be parsed"
        return (f"{err.override}: {first}; write key=value (quote values holding spaces, brackets or commas: "
                "'key=[a,b]')")
    found = _NOT_OVERRIDABLE.search(str(err))
    if found:
        return missing_key(found.group(1), overrides, compose_without)
    chosen = _ALREADY_CHOSEN.search(str(err))
    if chosen:  # +env=babyai: the root config already picks an env
        group = chosen.group(1)
        given = next((o for o in overrides if o.startswith("+") and _key_of(o) == group), f"+{group}=...")
        return f"{given}: {group} already has an option (the root config picks one); choose another with {given.lstrip('+')}, no +"
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return f"{first} (python train.py --cfg job prints the composed config; --help lists the groups)"


def _loader(argv: Sequence[str], conf_dir: Path):
    """Hydra's own config loader, with the search path ``hydra.main`` builds (``--config-dir`` included), and the
    parsed command line. None for a command line that does not compose a run (--help, --cfg, -m, ...)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_automatic_config_search_path, get_args_parser
    from hydra.core.config_search_path import SearchPathQuery

    args = get_args_parser().parse_args(list(argv))
    if args.help or args.hydra_help or args.cfg or args.info or args.shell_completion or args.multirun:
        return None, args  # Hydra's own commands: left to Hydra
    search_path = create_automatic_config_search_path(None, None, str(conf_dir))
    if args.config_dir is not None:
        folder = Path(args.config_dir).absolute()
        if not folder.is_dir():
            raise ConfigError(f"--config-dir={args.config_dir}: no such folder ({folder}); give the folder that holds "
                              "your config groups (env/, experiment/, ...)")
        search_path.prepend(provider="command-line", path=f"file://{folder}", anchor=SearchPathQuery(provider="schema"))
    return ConfigLoaderImpl(config_search_path=search_path), args


def check_composition(argv: Sequence[str], conf_dir: Path, config_name: str = "config") -> None:
    """Compose ``argv`` (train.py's command line) as Hydra will; a composition error raises :class:`ConfigError`
    with :func:`explain`'s line. Any failure of this check itself is left to Hydra to report."""
    from hydra.errors import HydraException
    from hydra.types import RunMode
    from omegaconf.errors import OmegaConfBaseException

    try:
        loader, args = _loader(argv, conf_dir)
    except (ImportError, AttributeError, SystemExit):  # Hydra's internals moved, or argparse refused: Hydra reports
        return
    if loader is None:
        return
    name = args.config_name or config_name
    overrides = list(args.overrides)

    def compose(items: list[str]) -> DictConfig:
        return loader.load_configuration(name, items, run_mode=RunMode.RUN)

    try:
        compose(overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(explain(err, overrides, compose)) from err
