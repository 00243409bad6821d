"""Per-iteration metrics that say "not measured" instead of repeating an old value.

Lightning keeps every value a hook logged with ``on_step=True`` for the rest of the epoch and hands it to the
loggers again at each later step until the hook logs that key again (one epoch is the whole run here). A metric
that an iteration does not measure (the loss terms when no row had a nonzero advantage, the evidence-outcome
correlation when every episode lost, every ``credit/`` statistic when no teacher view was scored) would therefore
show the previous iteration's number in the CSV, TensorBoard and W&B, as if it had been measured again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import lightning as L


def log_step(module: L.LightningModule, metrics: Mapping[str, float], seen: set[str], **log_kwargs: object) -> dict[str, float]:
    """``module.log_dict(metrics, on_step=True, **log_kwargs)``, plus NaN for each key of ``seen`` (the keys this
    call site logged at earlier steps) that ``metrics`` lacks; adds ``metrics``' keys to ``seen``. Returns what it logged.

    Each call site (a hook and its ``log_kwargs``) keeps its own ``seen``: Lightning files a value under the hook
    that logged it, so only that hook can overwrite it."""
    missing = seen.difference(metrics)
    seen.update(metrics)
    logged = {**metrics, **dict.fromkeys(sorted(missing), math.nan)}
    module.log_dict(logged, on_step=True, **log_kwargs)
    return logged
