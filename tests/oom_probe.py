"""``python tests/oom_probe.py <train.py overrides>``: train.py with an out-of-memory error planted on one rank.

``OOM_RANK`` (global rank) and ``OOM_PHASE`` (``update`` or ``evaluation``) say where: that rank raises
``torch.OutOfMemoryError`` in that phase of the first iteration, as a GPU that ran out would. Lightning's
launcher starts the other ranks by running this same command, so every rank is patched alike.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from agentopsd.rollout import factory  # noqa: E402
from agentopsd.training import module as module_lib  # noqa: E402
from agentopsd.training.distributed import rank_and_world  # noqa: E402


def _planted(original, phase):
    def run(*args, **kwargs):
        if phase == os.environ.get("OOM_PHASE", "update") and rank_and_world()[0] == int(os.environ.get("OOM_RANK", "1")):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (planted by tests/oom_probe.py)")
        return original(*args, **kwargs)

    return run


# inside the phases the module guards: the update itself, and the engine sync that opens the evaluation before
# training (the first phase to touch the rollout engine)
module_lib.AgentRLModule._update = _planted(module_lib.AgentRLModule._update, "update")
factory.engine_sync = _planted(factory.engine_sync, "evaluation")

if __name__ == "__main__":
    from agentopsd.run.train import cli

    cli()
