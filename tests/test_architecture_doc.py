"""The code layout page (docs/reference/architecture.md) names every package and module the tree holds, and the
package keeps its parts in subpackages: only a handful of files at agentopsd/'s top."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "architecture.md"


def _tree_block() -> str:
    match = re.search(r"```text\n(.*?)```", PAGE.read_text(), re.S)
    assert match, "docs/reference/architecture.md has no ```text tree"
    return match.group(1)


def _package_dirs() -> list[Path]:
    """agentopsd/'s own subpackages (envs/, callbacks/ and conf/ are links to the top-level folders)."""
    return sorted(p for p in (ROOT / "agentopsd").iterdir() if p.is_dir() and not p.is_symlink() and (p / "__init__.py").exists())


def test_the_page_names_every_subpackage_and_module():
    block = _tree_block()
    missing = [f"{d.name}/" for d in _package_dirs() if f"{d.name}/" not in block]
    for d in _package_dirs():
        missing += [f"{d.name}/{f.name}" for f in sorted(d.glob("*.py"))
                    if f.name != "__init__.py" and not re.search(rf"\b{re.escape(f.name)}", block)]
    assert not missing, f"docs/reference/architecture.md does not name: {missing}"


def test_the_page_names_nothing_the_tree_lacks():
    block = _tree_block()
    package = block.split("\nenvs/", 1)[0]  # the agentopsd/ section: up to the next top-level folder
    named_dirs = set(re.findall(r"^  (\w+)/ ", package, re.M))
    real = {d.name for d in _package_dirs()}
    assert named_dirs <= real | {"envs", "callbacks", "conf"}, named_dirs - real
    for folder in re.findall(r"^(\w+)/ ", block, re.M):  # the repository's top-level folders
        assert (ROOT / folder).is_dir(), folder


def test_a_handful_of_top_level_files():
    top = sorted(p.name for p in (ROOT / "agentopsd").glob("*.py"))
    assert len(top) <= 5, f"agentopsd/ holds {len(top)} files at its top ({top}): group them into a subpackage"
