"""``agentopsd.credit`` stays the math's import path now that the math lives in ``agentopsd.credit.advantages``."""

from __future__ import annotations

import agentopsd.credit as credit
from agentopsd.credit import advantages


def test_the_package_exports_every_public_name_of_the_math():
    # what `from agentopsd.credit import X` reached when credit was one module: its functions, classes
    # and upper-case constants (not what it imported, such as torch)
    public = {n for n, v in vars(advantages).items()
              if not n.startswith("_") and (getattr(v, "__module__", None) == advantages.__name__ or n.isupper())}
    assert public == set(credit.__all__)
    assert all(getattr(credit, n) is getattr(advantages, n) for n in public)
