"""The documentation site (docs/, mkdocs.yml) holds together: every page is in the nav, every link from the
README lands on a page and a heading, the configuration reference is what the generator writes today, the
error lines the troubleshooting guide quotes are the code's, and `mkdocs build --strict` passes where mkdocs
is installed (the `docs` extra). The pages' code blocks run in tests/test_readme.py and
tests/test_readme_commands.py, which read them through :func:`doc_pages`."""

from __future__ import annotations

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
    """python runs, bash commands run or are checked, yaml instantiates, text is quoted output: nothing else."""
    for name, text in doc_pages():
        for lang, _ in code_blocks(text):
            assert lang in ("python", "bash", "yaml", "text"), f"{name}: a ```{lang} block no test handles"


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
    value, default = sections["optim"]["optim.offload_optimizer"]
    assert default is False and sources["optim.offload_optimizer"] == "docstring"
    assert "optim.weight_decay" in sections["optim"]  # set by no yaml: documented from the class


def _source_text() -> str:
    """The project's Python, with implicitly concatenated string literals joined (a message split over lines)."""
    text = "\n".join(
        p.read_text() for d in ("agentopsd", "envs", "callbacks", "scripts") for p in (ROOT / d).rglob("*.py")
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
    existing = {p.name for d in ("agentopsd", "envs", "callbacks", "scripts", "benchmarks") for p in (ROOT / d).rglob("*")}
    existing |= {p.name for p in ROOT.glob("*.py")}
    assert len(named) > 40 and not named - existing, sorted(named - existing)
