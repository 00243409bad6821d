"""The documentation site (docs/, mkdocs.yml) holds together: every page is in the nav, every link from the
README lands on a page and a heading, the configuration reference is what the generator writes today, the
error lines the troubleshooting guide quotes are the code's, and `mkdocs build --strict` passes where mkdocs
is installed (the `docs` extra). The pages' code blocks run in tests/test_readme.py and
tests/test_readme_commands.py, which read them through :func:`doc_pages`."""

from __future__ import annotations

import html.parser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GENERATED = DOCS / "reference" / "configuration.md"


def nav_pages() -> list[str]:
    """The site's pages in nav order, relative to docs/."""

    def walk(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, dict):
            return [p for value in node.values() for p in walk(value)]
        if isinstance(node, list):
            return [p for item in node for p in walk(item)]
        return []

    return walk(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])


def doc_pages() -> list[tuple[str, str]]:
    """(name, text) of README.md, then of every docs page in nav order: the pages whose code blocks the tests run."""
    return [("README.md", (ROOT / "README.md").read_text())] + [
        (f"docs/{page}", (DOCS / page).read_text()) for page in nav_pages()
    ]


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def slug(heading: str) -> str:
    """Python-Markdown's toc anchor of a heading (what mkdocs links to)."""
    text = re.sub(r"[^\w\s-]", "", re.sub(r"`", "", heading)).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert set(nav_pages()) == on_disk


def test_every_fenced_block_is_of_a_kind_the_tests_handle():
    """python runs, bash commands run or are checked, yaml instantiates, text is quoted output, json is a file a page's
    example writes (docs/own-environment.md: tests/test_own_environment.py): nothing else."""
    for name, text in doc_pages():
        for lang, _ in code_blocks(text):
            assert lang in ("python", "bash", "yaml", "text", "json"), f"{name}: a ```{lang} block no test handles"
            assert lang != "json" or name == "docs/own-environment.md", f"{name}: a ```json block no test writes"


def test_the_readme_is_a_five_minute_read_that_links_to_the_guides():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = set(re.findall(r"\]\((docs/[^)#\s]+)", readme))
    guides = {
        "getting-started.md",
        "configuration.md",
        "scaling-out.md",
        "real-llms.md",
        "export-and-evaluation.md",
        "credit.md",
        "adding-an-environment.md",
        "adding-an-algorithm.md",
        "results.md",
    }
    assert {f"docs/{g}" for g in guides} <= linked


def test_links_from_the_readme_land_on_a_page_and_a_heading():
    readme = (ROOT / "README.md").read_text()
    for target, anchor in re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme):
        page = ROOT / target
        assert page.is_file(), target
        if anchor:
            headings = {slug(h) for h in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.MULTILINE)}
            assert anchor in headings, f"{target}#{anchor}: no such heading"


def test_slug_matches_the_anchors_mkdocs_makes():
    assert slug("AgentOPSD's overhead") == "agentopsds-overhead"
    assert slug("Is the evidence or the lever the limit?") == "is-the-evidence-or-the-lever-the-limit"
    assert slug("`env` group: the environment") == "env-group-the-environment"


def _generator():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_config_reference
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return gen_config_reference


def test_the_configuration_reference_is_up_to_date():
    gen = _generator()
    assert GENERATED.read_text() == gen.render(), "run python scripts/gen_config_reference.py"


def test_every_configuration_key_has_a_meaning_and_the_supplement_holds_only_undocumented_keys():
    gen = _generator()
    sections, meanings, sources = gen.collect()
    keys = [k for rows in sections.values() for k in rows]
    assert len(keys) > 100 and not [k for k in keys if not meanings.get(k)]
    # a key the settings' docstrings (or Lightning) now document leaves the supplement; a key gone from conf/ too
    stale = [k for k in gen.MEANINGS if sources.get(k) != "supplement"]
    assert not stale, f"drop these from MEANINGS in scripts/gen_config_reference.py: {stale}"
    for key in (
        "optim.logits_chunk_tokens",
        "env.max_turns",
        "algorithm.mult_lambda",
        "rollout.vllm.enable_sleep_mode",
        "trainer.deterministic",
        "warm_start.steps",
        "model.path",
        "seed",
    ):
        assert key in keys, key


def test_a_settings_field_no_yaml_sets_still_appears_with_its_class_default():
    gen = _generator()
    sections, meanings, sources = gen.collect()
    value, _, default = sections["optim"]["optim.offload_optimizer"]
    assert default is False and sources["optim.offload_optimizer"] == "docstring"
    assert "optim.weight_decay" in sections["optim"]  # set by no yaml: documented from the class


def _source_text() -> str:
    """The project's Python, with implicitly concatenated string literals joined (a message split over lines)."""
    text = "\n".join(
        p.read_text() for d in ("agentopsd", "envs", "callbacks", "scripts", "studies") for p in (ROOT / d).rglob("*.py")
    )
    return re.sub(r"\"\s*\n\s*f?\"", "", text)


def test_the_error_lines_the_troubleshooting_guide_quotes_are_the_codes():
    """Each `error: ...` template line: every literal piece between its <placeholders> is in the source."""
    source = _source_text()
    page = (DOCS / "troubleshooting.md").read_text()
    lines = [
        line
        for lang, code in code_blocks(page)
        if lang == "text"
        for line in code.splitlines()
        if line.startswith("error: ")
    ]
    assert len(lines) >= 10
    for line in lines:
        for piece in re.split(r"<[^>]+>", line.removeprefix("error: ")):
            piece = piece.strip()
            if len(piece) >= 6:
                assert piece in source, (
                    f"troubleshooting.md quotes {piece!r}, which no message in the code holds"
                )


@pytest.mark.skipif(
    shutil.which("mkdocs") is None and not (Path(sys.executable).parent / "mkdocs").exists(),
    reason="needs the docs extra: pip install -e '.[docs]'",
)
@pytest.mark.timeout(300)
def test_the_site_builds_strictly(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    proc = subprocess.run(
        [
            str(mkdocs) if mkdocs.exists() else "mkdocs",
            "build",
            "--strict",
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    api = (tmp_path / "site" / "reference" / "credit" / "index.html").read_text()
    assert "reshape_advantages" in api and "turn_evidence" in api  # mkdocstrings rendered the docstrings
    # what the reader sees: no placeholder taken for an HTML tag (and hidden), no raw Sphinx role
    for page in sorted((tmp_path / "site").rglob("*.html")):
        text = page.read_text()
        name = page.relative_to(tmp_path / "site")
        parser = _Tags()
        parser.feed(text)
        assert not parser.tags - HTML_TAGS, f"{name}: <{'>, <'.join(sorted(parser.tags - HTML_TAGS))}> hidden as HTML tags"
        shown = re.sub(r"<[^>]+>", "", text)
        assert not SPHINX_ROLE.search(shown), f"{name} shows a raw Sphinx role: {SPHINX_ROLE.search(shown).group(0)}"


HTML_TAGS = set(
    "a abbr article aside b blockquote body br button caption code col colgroup dd del details div dl dt em "
    "figcaption figure footer form h1 h2 h3 h4 h5 h6 head header hr html i img input ins kbd label li link main "
    "mark meta nav ol p path pre rect g circle script section small span strong style sub summary sup svg table "
    "tbody td tfoot th thead title tr u ul".split()
)
"""The tags a page may hold; any other start tag in a built page is text that Markdown let through as HTML."""
SPHINX_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|obj|exc|const):`?~?[\w.]+")


class _Tags(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.add(tag)


def hidden_placeholders(text: str) -> list[str]:
    """The ``<word>``s of a Markdown page that a browser would take for tags and hide: outside fenced blocks, code
    spans and comments, and not an HTML tag."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)
    text = re.sub(r"(`+).+?\1", "", text)
    return [m.group(0) for m in re.finditer(r"</?([A-Za-z][\w-]*)[^>]*>", text) if m.group(1).lower() not in HTML_TAGS]


def test_no_page_hides_a_placeholder_or_shows_a_raw_role():
    """`runs/<name>/latest` outside a code span shows as "runs//latest"; the generated reference quotes comments and
    docstrings, so its generator makes them safe (scripts/gen_config_reference.py: markdown_text)."""
    for name, text in doc_pages():
        assert not hidden_placeholders(text), f"{name}: {hidden_placeholders(text)} would be hidden (put them in `code`)"
        prose = re.sub(r"(`+).+?\1", "", re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE))
        assert not SPHINX_ROLE.search(prose), f"{name}: a raw Sphinx role {SPHINX_ROLE.search(prose).group(0)}"


def test_the_generator_makes_comments_and_docstrings_safe_for_the_site():
    gen = _generator()
    assert gen.markdown_text("`last` resumes runs/<name>/latest, or policy-<iteration>.pt.") == (
        "`last` resumes `runs/<name>/latest`, or `policy-<iteration>.pt`."
    )
    assert gen.markdown_text("(:mod:`agentopsd.training.balance`; :class:`~agentopsd.types.RolloutBatch`)") == (
        "(`agentopsd.training.balance`; `RolloutBatch`)"
    )
    assert gen.markdown_text("a < b and ``<kept>`` in code") == "a &lt; b and ``<kept>`` in code"
    assert not hidden_placeholders(gen.render())


def test_every_key_shows_a_default_or_a_value_and_the_root_values_are_shown():
    """Each key shows what `python train.py` gives, what `experiment=none` (the root config and the groups' own
    files) gives, or a default; a comment continued on aligned lines is quoted whole."""
    gen = _generator()
    sections, meanings, _ = gen.collect()
    blank = [
        k
        for rows in sections.values()
        for k, (value, bare, default) in rows.items()
        if value is gen.MISSING and bare is gen.MISSING and default is gen.MISSING
        and not any(other.startswith(f"{k}.") for other in rows)
    ]
    assert not blank, f"keys with nothing shown: {blank}"
    value, bare, _ = sections["top"]["num_iterations"]
    assert (value, bare) == (16, 10)  # the quickstart's, the root config's own
    assert sections["model"]["model.dtype"][2] == "auto"  # load_policy's own default
    assert "rounds away" in meanings["trainer.precision"]  # fsdp.yaml's comment goes on to a second line


def test_every_group_option_says_what_it_is():
    gen = _generator()
    for group in (*gen.GROUPS, "experiment"):
        for path in sorted((gen.CONF / group).glob("*.yaml")):
            option, header = f"{group}={path.stem}", gen._first_comment(path)
            assert header or gen.OPTION_NOTES.get(option), f"{option}: no header comment and no OPTION_NOTES entry"
            assert not (header and option in gen.OPTION_NOTES), f"{option} has a header now: drop it from OPTION_NOTES"


def test_the_code_layout_names_only_files_that_exist():
    page = (DOCS / "reference" / "architecture.md").read_text()
    named = set(re.findall(r"\b([\w]+\.(?:py|sh))\b", page))
    existing = {p.name for d in ("agentopsd", "envs", "callbacks", "scripts", "studies", "benchmarks", "tests/fakes")
                for p in (ROOT / d).rglob("*")}
    existing |= {p.name for p in ROOT.glob("*.py")}
    assert len(named) > 40 and not named - existing, sorted(named - existing)


METRIC = re.compile(r"^(rollout|loss|perf|eval|update|credit|warm_start)/[\w<]")
NOT_A_KEY = "<>"


def _literal(node) -> str | None:
    """A string constant, or an f-string with each ``{...}`` as ``<>``."""
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else NOT_A_KEY for v in node.values)
    return None


def logged_metric_keys() -> set[str]:
    """Every metric key the code writes: a dict key, a dict comprehension's key or an assigned subscript whose string
    starts with a metric prefix (reads and collective labels are neither). ``<>`` stands for a formatted part; the two
    families whose part names a term are expanded: ``loss/<term>`` over every loss statistic the update records,
    ``perf/<phase>_seconds`` over the phases the module times."""
    import ast
    from dataclasses import fields

    from agentopsd.credit.losses import PolicyLossStats

    keys: set[str] = set()
    for folder in ("agentopsd", "callbacks", "envs"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.resolve() != path.absolute():  # agentopsd/envs and agentopsd/callbacks are links to these
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                candidates = (
                    [k for k in node.keys if k is not None] if isinstance(node, ast.Dict)
                    else [node.key] if isinstance(node, ast.DictComp)
                    else [node.slice] if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
                    else []
                )
                keys |= {t for t in map(_literal, candidates) if t and METRIC.match(t)}
    module = "".join((ROOT / "agentopsd" / "training" / name).read_text() for name in ("module.py", "objective.py", "update.py"))
    assert {"loss/<>", "perf/<>_seconds"} <= keys, "the update's loss/ or perf/ families moved: update this test"
    keys -= {"loss/<>", "perf/<>_seconds"}
    terms = {f.name for f in fields(PolicyLossStats)}
    terms |= set(re.findall(r'stats\["(\w+)"\] =', module)) | set(re.findall(r'stats_log\.setdefault\("(\w+)"', module))
    keys |= {f"loss/{t}" for t in terms}
    phases = set(re.findall(r'phase_seconds\["(\w+)"\] =', module))
    phases |= set(re.findall(r'"(\w+)": (?:t_\w+|got\.seconds)', "".join(re.findall(r"self\.phase_seconds = \{[^}]*\}", module))))
    keys |= {f"perf/{p}_seconds" for p in phases}
    if '.replace("eval/", "eval/sampled/", 1)' in (ROOT / "agentopsd" / "training" / "evaluation.py").read_text():
        keys.add("eval/sampled/<>")
    return keys


def documented_metric_keys() -> set[str]:
    """The keys docs/metrics.md lists: the first cell of its tables' rows, ``<...>`` read as ``<>``."""
    page = (DOCS / "metrics.md").read_text()
    cells = re.findall(r"^\| `([^`]+)` \|", page, flags=re.MULTILINE)
    return {re.sub(r"<[^>]*>", NOT_A_KEY, c) for c in cells if METRIC.match(c)}


def metric_documented(key: str, documented: set[str]) -> bool:
    """``key`` (a logged column such as ``eval/success/horizon/1-5``, or a pattern with ``<>``) is on the page."""
    if key in documented:
        return True
    patterns = [re.escape(d).replace(re.escape(NOT_A_KEY), ".+") for d in documented if NOT_A_KEY in d]
    return any(re.fullmatch(p, key) for p in patterns)


def test_every_metric_the_code_logs_is_on_the_metrics_page_and_no_other():
    logged, documented = logged_metric_keys(), documented_metric_keys()
    assert len(logged) > 60, sorted(logged)
    missing = sorted(k for k in logged if not metric_documented(k, documented))
    assert not missing, f"docs/metrics.md does not explain {missing}"
    gone = sorted(d for d in documented if not any(k == d or metric_documented(k, {d}) for k in logged))
    assert not gone, f"docs/metrics.md lists keys the code no longer logs: {gone}"


def test_the_metrics_check_reads_patterns_and_columns():
    documented = {"eval/success/horizon/<>", "loss/pg_loss"}
    assert metric_documented("eval/success/horizon/6-10", documented)
    assert metric_documented("eval/success/horizon/<>", documented)
    assert not metric_documented("loss/clip_frac", documented)


def test_the_license_file_is_the_license_pyproject_names():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'license = { text = "Apache-2.0" }' in pyproject
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert re.search(r'^Repository = "https://github\.com/[\w-]+/[\w-]+"$', pyproject, flags=re.MULTILINE)
