"""The carried wheels a GPU machine lacks: ``scripts/gpu_check.sh --wheels DIR`` installs only those.

    python scripts/carried_wheels.py .gpu_wheels/*.whl    # prints the ones to install, one a line

The carried folder goes on ``PYTHONPATH``, which Python searches before the machine's site-packages: a carried
package the machine also has (its protobuf under vLLM, its tensorboardX) would shadow the machine's own, built
for its torch and its other packages. Leaving those out lets the machine's installed packages win. Standard
library only: it runs on the bare machine before anything is installed.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def distribution_name(wheel: str) -> str:
    """The distribution a wheel file holds, normalised (PEP 503): ``tensorboardX-2.6.5-py3-none-any.whl`` ->
    ``tensorboardx``; ``hydra_core-1.3.8-...`` -> ``hydra-core``."""
    name = Path(wheel).name.split("-", 1)[0]
    return name.replace("_", "-").replace(".", "-").lower()


def is_installed(distribution: str) -> bool:
    """Whether this Python already has ``distribution`` (any version)."""
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def wheels_to_install(wheels: Sequence[str], installed: Callable[[str], bool] = is_installed) -> list[str]:
    """The wheels whose distribution the machine does not have, in the given order."""
    return [w for w in wheels if not installed(distribution_name(w))]


if __name__ == "__main__":
    for wheel in wheels_to_install(sys.argv[1:]):
        print(wheel)
