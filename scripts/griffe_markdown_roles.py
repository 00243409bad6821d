"""A griffe extension (mkdocs.yml: mkdocstrings' python handler) that shows Sphinx roles as code on the site.

The docstrings cross-reference in Sphinx's style (``:func:`grpo_advantages```, ``:class:`~agentopsd.types.RolloutBatch```),
which mkdocstrings' Sphinx parser reads for ``:param:`` fields but leaves as raw text in prose: the site showed
":func:reshape_advantages". Each role becomes a Markdown code span (``~`` keeps the last name, as Sphinx shows it).
scripts/gen_config_reference.py does the same to the docstrings it quotes; tests/test_docs.py checks the built site.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|obj|exc|const):`(~?)([^`]+)`")


def markdown_roles(text: str) -> str:
    """``:func:`x``` -> ```x```; ``:class:`~a.b.C``` -> ```C```."""
    return ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)


class MarkdownRoles(griffe.Extension):
    """Rewrite every docstring of the loaded package once the tree is built (idempotent: a second pass finds
    no role left)."""

    def _rewrite(self, obj: Any) -> None:
        if obj.is_alias:
            return
        if obj.docstring is not None:
            obj.docstring.value = markdown_roles(obj.docstring.value)
        for member in obj.members.values():
            self._rewrite(member)

    def on_package(self, *, pkg: Any, **kwargs: Any) -> None:  # griffe >= 1.14
        self._rewrite(pkg)

    def on_package_loaded(self, *, pkg: Any, **kwargs: Any) -> None:  # older griffe
        self._rewrite(pkg)
