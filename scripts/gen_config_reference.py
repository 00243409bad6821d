"""Write docs/reference/configuration.md: every configuration key, its meaning and its default.

    python scripts/gen_config_reference.py            # rewrite the page
    python scripts/gen_config_reference.py --check    # exit 1 when the page is out of date (tests/test_docs.py)

The keys are those of ``conf/`` (the root config, every group's files and every experiment) and the fields of
the typed settings their ``_target_`` names (agentopsd/config.py, agentopsd/credit/algorithms.py), so a field
added to a settings class appears here even before any yaml sets it. Each key's meaning is taken, first found,
from: the settings class' attribute docstring; :data:`MEANINGS` below (keys whose source documents them nowhere
else); the yaml line's own comment (with its aligned continuation lines); Lightning's own ``Trainer`` argument docs
(``trainer.*``). Three values are shown: what a bare ``python train.py`` composes (the quickstart experiment), what
``experiment=none`` composes (the root config and every group's own file, nothing on top), and the default: the
typed settings' own default or, for a group whose ``_target_`` is a function or class, that callable's default
(what a yaml that leaves the key out gets); a key with neither shows the values the files under ``conf/`` set.

Text from comments and docstrings is made safe for the site: Sphinx roles become code spans, and a word holding a
``<placeholder>`` outside a code span becomes one (Markdown would pass ``<name>`` through as an HTML tag, which the
browser hides).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
import sys
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
PAGE = ROOT / "docs" / "reference" / "configuration.md"
GROUPS = ("env", "model", "algorithm", "rollout", "trainer", "logger")
TYPED = {
    "env": "agentopsd.config.EnvConfig",
    "rollout": "agentopsd.config.RolloutConfig",
    "optim": "agentopsd.config.OptimConfig",
    "evaluation": "agentopsd.config.EvalConfig",
}
LEAF_DICTS = {"warm_start.habits", "env.kwargs", "model.lora"}
"""Dict-valued settings shown as one key (their entries are data, not settings)."""

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|obj|exc|const):`(~?)([^`]+)`")
"""A Sphinx role, as scripts/griffe_markdown_roles.py rewrites them on the API pages."""
_CODE = re.compile(r"(`+)(.+?)\1")
_PLACEHOLDER_WORD = re.compile(r"[^\s`()\[\]]*<[^<>\s]+>[^\s`()\[\],;]*")


def markdown_text(text: str) -> str:
    """``text`` (a comment or docstring) as Markdown that shows what it says: Sphinx roles (``:func:`x```) become
    code spans, and each word holding a ``<placeholder>`` outside a code span (``runs/<name>/latest``) becomes one,
    so the site does not take ``<name>`` for an HTML tag and hide it."""
    text = _ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)
    out, pos = [], 0
    for m in _CODE.finditer(text):
        out += [_wrap_placeholders(text[pos : m.start()]), m.group(0)]
        pos = m.end()
    out.append(_wrap_placeholders(text[pos:]))
    return "".join(out)


def _wrap_placeholders(prose: str) -> str:
    def wrap(m: re.Match) -> str:
        word = m.group(0)
        tail = re.search(r"[.:]+$", word)  # a sentence's full stop or colon stays outside the span
        cut = tail.start() if tail else len(word)
        return f"`{word[:cut]}`{word[cut:]}"

    out, pos = [], 0
    for m in _PLACEHOLDER_WORD.finditer(prose):
        out += [prose[pos : m.start()].replace("<", "&lt;"), wrap(m)]
        pos = m.end()
    return "".join([*out, prose[pos:].replace("<", "&lt;")])


class SetIn:
    """A key with no typed or target default: the values the files under ``conf/`` give it, by option."""

    def __init__(self, values: list[tuple[Any, str]]) -> None:
        self.values = values

    def __repr__(self) -> str:
        return f"SetIn({self.values!r})"


REQUIRED = object()
"""A parameter of a group's ``_target_`` with no default (the group's file must set it)."""

MEANINGS: dict[str, str] = {
    # The root config and the groups whose yaml has no comment and whose target documents no attribute.
    "name": "The run's name: its runs land in `runs/<name>/` (default: the experiment's name).",
    "seed": "Seed of everything a run draws: Lightning's `seed_everything`, the task stream (a function of seed and "
    "iteration), the tiny model's weights and the warm start's demonstrations.",
    "optim.lr": "AdamW's peak learning rate.",
    "optim.weight_decay": "AdamW's weight decay.",
    "optim.betas": "AdamW's betas.",
    "optim.min_lr_ratio": "The cosine schedule ends at this fraction of lr.",
    "optim.ppo_epochs": "Passes over each rollout batch per iteration.",
    "optim.grad_clip": "Clip the gradient's global norm to this (`torch.nn.utils.clip_grad_norm_`).",
    "warm_start.habits": "The demonstrator's bad habits: `{expert action: action taken instead}` at the decisive turns.",
    "warm_start.habit_prob": "How often the demonstrator follows a habit where it applies.",
    "model.text_episodes": "Tiny model: expert episodes whose text trains the tokenizer.",
    "rollout.vllm.gpu_memory_utilization": "vLLM's share of the GPU's memory (weights and KV cache).",
    "rollout.vllm.dtype": "vLLM's weight dtype.",
    "warm_start.steps": "Supervised steps of the warm start: a step budget, so a busy machine gets the same weights.",
    "warm_start.seconds": "A safety cap on the warm start's time; when hit, it ends at a load-dependent step.",
    "warm_start.noise": "Share of random actions in the demonstrations.",
    "rollout.vllm.colocate": "true: an engine inside every training process, on its own GPU; false: vLLM's own "
    "engine process (one GPU only; weights serialised to it).",
    "rollout.vllm.max_num_batched_tokens": "Tokens per engine step (prefill chunks and decodes together).",
    "trainer.strategy.timeout.seconds": "How long a collective may wait before the run ends naming the rank "
    "(null: 300 s on CPU, 30 min on GPUs).",
    "model.num_kv_heads": "Tiny model: key/value heads (fewer than num_heads: grouped-query attention, as in Qwen2.5).",
    "checkpoint.every_n_iterations": "Write `checkpoints/last.ckpt` (atomically; the one before stays as "
    "`previous.ckpt`) every this many iterations, and at the end.",
    "rollout_log.every_n_iterations": "Write a webdataset shard of rollouts, with each turn's credit, every this many iterations.",
    "rollout_log.max_samples": "Trajectories kept per logged shard.",
    "env.max_prompt_tokens": "Prompt length cap in tokens: the oldest history pairs are dropped first to fit.",
    "env.show_admissible": "List the admissible actions in the prompt (where the environment gives them).",
    "rollout.max_new_tokens": "Tokens generated per turn at most.",
    "rollout.temperature": "Sampling temperature of the training rollouts.",
    "rollout.top_p": "Nucleus sampling of the training rollouts (1 = off).",
    "algorithm.name": "The algorithm's registered name (`agentopsd.credit.algorithms.ALGORITHMS`).",
    "algorithm.aggregation": "How token losses are averaged: `token-mean` over every action token of the "
    "mini-batch (the paper's), or the other modes of `agentopsd.credit.losses.AGGREGATIONS`.",
    "model.path": "A hub id or a local folder (`load_policy`), or `smollm2-135m` (prepared from a pinned PyPI wheel).",
    "model.dtype": "float32, bfloat16, float16 or auto. On a CPU under `trainer.precision=32-true`, `auto` is bf16 where "
    "`/proc/cpuinfo` has avx512_bf16 or amx_bf16 and float32 elsewhere (emulated bf16 is slower than float32; one log "
    "line says which and why); bf16 there keeps a LoRA base in bf16 (adapters and AdamW states float32), or, for full "
    "fine-tuning, generates and scores on a bf16 copy of float32 master weights, with the old log-probs recomputed. "
    "On a GPU, or under a mixed precision, the loading dtype (`auto`: the checkpoint's) and `trainer.precision` "
    "sets the compute (`agentopsd.training.precision`).",
    "model.gradient_checkpointing": "Recompute each layer's activations in the backward (the non-reentrant kind): less memory, more time.",
    "model.lora": "LoRA adapters `{r, alpha, dropout, target_modules}` (the `lora` extra); null = full fine-tuning.",
    "model.meta_on_other_ranks": "FSDP2 only: a node's other processes build the model on the meta device and "
    "get its weights from local rank 0 after sharding (one host copy per node).",
    "model.env_id": "Tiny model: the environment whose text trains its BPE tokenizer.",
    "model.skills": "Tiny model: the skill bank whose text the tokenizer also learns.",
    "model.output_format": "Tiny model: the output format whose tags the tokenizer learns.",
    "model.vocab_size": "Tiny model: tokenizer vocabulary size.",
    "model.hidden_size": "Tiny model: hidden size.",
    "model.num_layers": "Tiny model: decoder layers.",
    "model.num_heads": "Tiny model: attention heads.",
    "model.intermediate_size": "Tiny model: MLP width.",
    "model.seed": "Tiny model: seed of its initial weights.",
    "trainer.strategy.save_distributed_checkpoint": "Save FSDP2's checkpoint as a folder of shards, one per process.",
    "trainer.strategy.timeout.accelerator": "Picks the timeout's default: 300 s on CPU, 30 min on GPUs.",
    "warm_start.episodes": "Expert episodes on training tasks (the demonstrations).",
    "warm_start.seed": "Seed of the demonstrations.",
    "warm_start.lr": "Learning rate of the supervised warm start.",
    "warm_start.batch_size": "Demonstration turns per supervised step.",
    "warm_start.warmup": "Supervised steps of linear learning-rate warm-up.",
    "warm_start.on_policy_episodes": "> 0: the warm-started student then plays this many episodes, and its turns that show a "
    "skill become teacher-view samples with the expert's label (the states its own mistakes reach).",
    "warm_start.on_policy_steps": "Supervised steps on those on-policy teacher-view samples.",
    "warm_start.on_policy_temperature": "The temperature the student samples its on-policy actions at.",
}

OPTION_NOTES: dict[str, str] = {
    # Group files without a header comment of their own.
    "env=alfworld": "ALFWorld households (`agentopsd/ALFWorld-v0`): the real engine, `ALFWORLD_DATA` or generated scenes.",
    "env=babyai": "BabyAI GoToLocal (`agentopsd/BabyAI-GoToLocal-v0`), minigrid as egocentric text: the root config's env.",
    "env=searchqa": "Search-based QA (`agentopsd/SearchQA-v0`, the Search-R1 protocol): BM25 over a generated corpus, "
    "your corpus and QA files, or an HTTP retriever.",
    "env=webshop": "WebShop (`agentopsd/WebShop-v0`): a generated catalogue, WebShop's reward.",
    "algorithm=grpo": "GRPO: every token of a trajectory gets its sequence advantage.",
    "rollout=hf": "transformers rollouts (`agentopsd.rollout.hf`): the root config's rollout.",
    "trainer=cpu": "One CPU process, float32: the root config's trainer.",
    "trainer=gpu": "One GPU, `bf16-mixed`, no distributed strategy.",
    "trainer=ddp": "DDP (`lightning.pytorch.strategies.DDPStrategy`) over `trainer.devices` x `trainer.num_nodes` "
    "processes; gloo on CPU.",
}
"""What an option is, for the group files whose header says nothing (a header comment, when added, wins)."""


def _attribute_docs(cls: type) -> dict[str, str]:
    """``field: type = value`` followed by a string literal: that string, for the class and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        module = sys.modules.get(klass.__module__)
        if module is None or not getattr(module, "__file__", None) or klass is object:
            continue
        tree = ast.parse(Path(module.__file__).read_text())
        node = next(
            (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == klass.__name__), None
        )
        if node is None:
            continue
        for stmt, nxt in zip(node.body, node.body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _trainer_docs() -> dict[str, str]:
    """Lightning's ``Trainer`` arguments, first sentence each, from its ``__init__`` docstring."""
    import lightning

    doc = lightning.Trainer.__init__.__doc__ or ""
    out: dict[str, str] = {}
    for name, text in re.findall(
        r"^ {12}(\w+): (.*?)(?=^ {12}\w+: |\Z)", doc, flags=re.MULTILINE | re.DOTALL
    ):
        text = " ".join(text.split())
        text = re.sub(r"\s*Default: .*$", "", text)
        out[name] = text.split(". ")[0].rstrip(".") + "."
    return out


def _yaml_comments(path: Path, prefix: str) -> dict[str, str]:
    """``key: value  # comment`` lines, by dotted key (nesting by indentation; list items are skipped)."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    last: tuple[str, int] | None = None  # the key whose comment the next aligned comment-only line continues
    for line in path.read_text().splitlines():
        more = re.match(r"^(\s+)#(.*)$", line)
        if more and last and len(more.group(1)) == last[1] and last[0] in out:
            out[last[0]] += " " + more.group(2).strip()
            continue
        last = None
        m = re.match(r"^(\s*)([\w.-]+):(.*)$", line)
        if not m:
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dotted = ".".join([prefix, *[k for _, k in stack], key] if prefix else [*[k for _, k in stack], key])
        stack.append((indent, key))
        if "#" in rest and not re.match(r"^\s*['\"]", rest):
            comment = rest.split("#", 1)[1].strip()
            if comment and not comment.startswith(" ") and dotted not in out:
                out[dotted] = comment
                last = (dotted, line.index("#", len(m.group(1)) + len(key) + 1))
    return out


def _flatten(node: Any, prefix: str) -> dict[str, Any]:
    """Dotted leaves of a plain container (``_target_`` left out; :data:`LEAF_DICTS` kept whole)."""
    if isinstance(node, dict) and node and prefix not in LEAF_DICTS:
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in ("_target_", "defaults", "hydra"):
                continue
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: node}


def _load_yaml(path: Path) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def _composed(*overrides: str) -> dict[str, Any]:
    """The config ``python train.py [overrides]`` composes, interpolations left as written."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from agentopsd.run.folders import register_resolvers

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides))
    return _flatten(OmegaConf.to_container(cfg, resolve=False), "")


def _show(value: Any) -> str:
    if value is MISSING:
        return "-"
    if value is REQUIRED:
        return "(required)"
    if isinstance(value, SetIn):
        return ", ".join(f"{_show(v)} in `{option}`" for v, option in value.values)
    if isinstance(value, str) and value == "":
        return '`""`'
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return f"`{text}`".replace("|", "\\|")


def _first_comment(path: Path) -> str:
    """The file's header comment, as one line (the ``@package`` directive left out)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if not text.startswith("@package"):
            lines.append(text)
    return markdown_text(" ".join(lines)).replace("|", "\\|")


def _target_defaults(node: Any, prefix: str, out: dict[str, list[Any]]) -> None:
    """For each key of a mapping with a ``_target_``: that callable's default for the argument of that name
    (:data:`REQUIRED` where it has none), appended to ``out[dotted key]``; nested mappings likewise."""
    if not isinstance(node, dict):
        return
    target = node.get("_target_")
    params: dict[str, inspect.Parameter] = {}
    if isinstance(target, str):
        try:
            params = dict(inspect.signature(_import(target)).parameters)
        except (ImportError, AttributeError, TypeError, ValueError):  # an optional extra's class: no default shown
            params = {}
    for key, value in node.items():
        if key in ("_target_", "defaults", "hydra"):
            continue
        dotted = f"{prefix}.{key}" if prefix else str(key)
        param = params.get(key)
        if param is not None and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            out.setdefault(dotted, []).append(REQUIRED if param.default is param.empty else param.default)
        _target_defaults(value, dotted, out)


def _option(path: Path, prefix: str) -> str:
    """How a file is chosen: ``env=babyai``, ``experiment=quickstart``, or ``conf/config.yaml`` (the root)."""
    if path.parent == CONF:
        return "conf/config.yaml"
    return f"{path.parent.name}={path.stem}"


def collect() -> tuple[dict[str, dict[str, Any]], dict[str, str], dict[str, str]]:
    """Every key: {section: {key: (python train.py value, experiment=none value, default)}}, meanings, where each
    meaning came from. The default is the typed settings' own, else the group ``_target_``'s argument default
    (where every target that takes the key agrees), else :class:`SetIn`: the values the files give it."""
    composed = _composed()
    bare = _composed("experiment=none")
    keys: dict[str, tuple[Any, Any]] = {}
    comments: dict[str, str] = {}
    callable_defaults: dict[str, list[Any]] = {}
    set_in: dict[str, list[tuple[Any, str]]] = {}
    files = [(CONF / "config.yaml", "")]
    for group in GROUPS:
        files += [(p, group) for p in sorted((CONF / group).glob("*.yaml"))]
    # the quickstart's comments first: it is what a bare `python train.py` runs
    files += [
        (p, "")
        for p in sorted((CONF / "experiment").glob("*.yaml"), key=lambda p: (p.stem != "quickstart", p.stem))
    ]
    for path, prefix in files:
        data = _load_yaml(path)
        if isinstance(data, list):  # a logger list
            continue
        for key, value in _flatten(data or {}, prefix).items():
            if not key:  # an empty file (experiment=none)
                continue
            keys.setdefault(key, (composed.get(key, None if key in composed else MISSING), MISSING))
            shown = (value, _option(path, prefix))
            if shown not in set_in.setdefault(key, []):
                set_in[key].append(shown)
        _target_defaults(data or {}, prefix, callable_defaults)
        for key, text in _yaml_comments(path, prefix).items():
            comments.setdefault(key, text)
    docs: dict[str, str] = {}
    class_defaults: dict[str, Any] = {}
    typed = dict(TYPED)
    from agentopsd.credit.algorithms import ALGORITHMS

    for cls in ALGORITHMS.values():
        for f in fields(cls):
            class_defaults.setdefault(f"algorithm.{f.name}", f.default)
        for name, text in _attribute_docs(cls).items():
            docs.setdefault(f"algorithm.{name}", text)
    for section, target in typed.items():
        cls = _import(target)
        assert is_dataclass(cls), target
        for f in fields(cls):
            class_defaults[f"{section}.{f.name}"] = (
                f.default_factory()
                if f.default_factory is not MISSING
                else REQUIRED
                if f.default is MISSING
                else f.default
            )
        docs.update({f"{section}.{k}": v for k, v in _attribute_docs(cls).items()})
    for key in class_defaults:
        keys.setdefault(key, (composed.get(key, MISSING), MISSING))
    for key, found in callable_defaults.items():
        distinct = [d for i, d in enumerate(found) if all(repr(d) != repr(e) for e in found[:i])]
        if len(distinct) == 1:
            class_defaults.setdefault(key, distinct[0])
    keys = {
        k: (v[0], bare.get(k, MISSING), _default(k, class_defaults, set_in, v[0], bare.get(k, MISSING)))
        for k, v in keys.items()
        if k not in ("logger",)
    }
    trainer = _trainer_docs()
    meanings: dict[str, str] = {}
    sources: dict[str, str] = {}
    for key in keys:
        leaf = key.split(".", 1)[1] if key.startswith("trainer.") else ""
        # the project's own words first (a comment says why this project sets it); Lightning's generic docs last
        for source, text in (
            ("docstring", docs.get(key)),
            ("supplement", MEANINGS.get(key)),
            ("comment", comments.get(key)),
            ("lightning", trainer.get(leaf)),
        ):
            if text:
                meanings[key], sources[key] = text, source
                break
    sections: dict[str, dict[str, Any]] = {}
    for key in sorted(keys, key=_order):
        sections.setdefault(_section(key), {})[key] = keys[key]
    return sections, meanings, sources


def _default(key: str, class_defaults: dict[str, Any], set_in: dict[str, list[tuple[Any, str]]], *shown: Any) -> Any:
    """The default shown for ``key``: typed or target default; else, where neither composition shows a value, the
    values the files under conf/ set (a dict-valued key that has entries of its own shows none: they are rows)."""
    if key in class_defaults:
        return class_defaults[key]
    if all(v is MISSING for v in shown) and key in set_in:
        return SetIn(set_in[key][:3])
    return MISSING


def _section(key: str) -> str:
    head = key.split(".", 1)[0]
    return (
        head
        if "." in key
        and head in (*GROUPS, "optim", "evaluation", "warm_start", "data", "checkpoint", "rollout_log")
        else "top"
    )


ORDER = ("top", "data", "optim", "evaluation", "checkpoint", "rollout_log", "warm_start", *GROUPS)


def _order(key: str) -> tuple[int, str]:
    return ORDER.index(_section(key)), key


TITLES = {
    "top": "Run",
    "data": "`data`: the task stream",
    "optim": "`optim`: the update (`agentopsd.config.OptimConfig`)",
    "evaluation": "`evaluation`: the fixed evaluation list (`agentopsd.config.EvalConfig`)",
    "checkpoint": "`checkpoint`",
    "rollout_log": "`rollout_log`: rollout shards",
    "warm_start": "`warm_start`: the supervised warm start (`agentopsd.models.warmstart`)",
    "env": "`env` group: the environment (`agentopsd.config.EnvConfig`)",
    "model": "`model` group: the policy (`agentopsd.models.loading.load_policy`, `agentopsd.models.tiny.tiny_policy`)",
    "algorithm": "`algorithm` group: the credit and loss (`agentopsd.credit.algorithms`)",
    "rollout": "`rollout` group: sampling (`agentopsd.config.RolloutConfig`)",
    "trainer": "`trainer` group: Lightning's `Trainer`",
    "logger": "`logger` group",
}


def render() -> str:
    sections, meanings, _ = collect()
    out = [
        "# Configuration keys",
        "",
        "<!-- Generated by scripts/gen_config_reference.py from conf/ and the typed settings; do not edit by hand "
        "(tests/test_docs.py fails when it is out of date). -->",
        "",
        "Every key a run reads, with its meaning and its default. **`python train.py`** is the value a bare "
        "`python train.py` composes (the quickstart experiment); **`experiment=none`** is what the root config "
        "and every group's own file give, nothing on top (`python train.py experiment=none`); `-` where that "
        "config does not have the key. **default** is what a yaml that leaves the key out gets: the typed "
        "settings' own default, or the default of the function or class the group's `_target_` names "
        "(`(required)`: the group's file must set it); a key with neither shows the values the files under "
        "`conf/` set, and where (`bfloat16` in `model=qwen2.5-3b`). A key that the composed config lacks is "
        "added with a leading `+` (`+optim.logits_chunk_tokens=1024`). "
        "Groups and experiments: [Configuration](../configuration.md).",
        "",
    ]
    for section in ORDER:
        out += [f"## {TITLES[section]}", ""]
        if section in GROUPS or section == "experiment":
            out += _options_table(section)
        if section == "logger":
            out += [
                "Each file is a list of Lightning loggers writing into the run's folder; their arguments are "
                "Lightning's.",
                "",
            ]
            continue
        rows = sections.get(section, {})
        out += [
            "| key | `python train.py` | `experiment=none` | default | meaning |",
            "|---|---|---|---|---|",
        ]
        for key, (value, bare, default) in rows.items():
            has_rows = any(k.startswith(f"{key}.") for k in rows) or section == "top" and key in sections

            def cell(v: Any, has_rows: bool = has_rows) -> str:
                return "see below" if has_rows and (v is MISSING or isinstance(v, dict)) else _show(v)

            out.append(
                f"| `{key}` | {cell(value)} | {cell(bare)} | {'' if default is MISSING else _show(default)} | "
                f"{markdown_text(meanings.get(key, '')).replace('|', chr(92) + '|')} |"
            )
        out.append("")
    out += ["## `experiment`: recipes on top of the groups", ""] + _options_table("experiment")
    return "\n".join(out)


def _options_table(group: str) -> list[str]:
    rows = ["| option | what it is |", "|---|---|"]
    for path in sorted((CONF / group).glob("*.yaml")):
        option = f"{group}={path.stem}"
        rows.append(f"| `{option}` | {_first_comment(path) or OPTION_NOTES.get(option, '')} |")
    return [*rows, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when the page differs from what would be written"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(
                f"{PAGE.relative_to(ROOT)} is out of date: run python scripts/gen_config_reference.py",
                file=sys.stderr,
            )
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
