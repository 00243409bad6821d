"""Credit assignment: the math, the losses and the algorithms that tie them to a batch.

* :mod:`agentopsd.credit.advantages`: pure tensor functions (GRPO advantages, the prior, turn evidence,
  belief revisions, bounded multipliers, the baselines' rules);
* :mod:`agentopsd.credit.losses`: the clipped objective, KL and the distillation terms;
* :mod:`agentopsd.credit.algorithms`: the algorithm objects ``conf/algorithm/*.yaml`` instantiate.

``from agentopsd.credit import grpo_advantages, ...`` (docs/credit.md's example) reads the math from here, as it
did when the math was the single module ``agentopsd/credit.py``. The algorithms and losses are not imported
here, so that importing the math stays free of them.
"""

# the math's __all__ holds the names the single module exported; the constants and helper after it were public
# there too (the run report reads PRIOR_CLIP and applied_multiplier)
from agentopsd.credit import advantages as _advantages
from agentopsd.credit.advantages import *  # noqa: F403
from agentopsd.credit.advantages import PRIOR_CLIP, STD_EPS, applied_multiplier

__all__ = [*_advantages.__all__, "PRIOR_CLIP", "STD_EPS", "applied_multiplier"]
