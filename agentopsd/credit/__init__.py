"""Credit assignment: the math, the losses and the algorithms that tie them to a batch.

* :mod:`agentopsd.credit.advantages`: pure tensor functions (GRPO advantages, the prior, turn evidence,
  belief revisions, bounded multipliers, the baselines' rules);
* :mod:`agentopsd.credit.losses`: the clipped objective, KL and the distillation terms;
* :mod:`agentopsd.credit.algorithms`: the algorithm objects ``conf/algorithm/*.yaml`` instantiate.

``from agentopsd.credit import grpo_advantages, ...`` (the README's example) reads the math from here, as it
did when the math was the single module ``agentopsd/credit.py``. The algorithms and losses are not imported
here, so that importing the math stays free of them.
"""

from agentopsd.credit.advantages import (
    MODES,
    PRIOR_CLIP,
    STD_EPS,
    anchor_state_groups,
    applied_multiplier,
    apply_turn_penalties,
    belief_revisions,
    decayed_cumsum,
    discounted_turn_returns,
    gigpo_advantages,
    group_success_rate,
    grpo_advantages,
    lambda_at,
    mix_advantages,
    pack_turns,
    reshape_advantages,
    rlsd_token_advantages,
    stepopsd_multipliers,
    turn_evidence,
    turn_multipliers,
    unpack_turns,
)

# the old module's public names: its __all__ plus the constants and helper the report reads
__all__ = [
    "MODES",
    "PRIOR_CLIP",
    "STD_EPS",
    "anchor_state_groups",
    "applied_multiplier",
    "apply_turn_penalties",
    "belief_revisions",
    "decayed_cumsum",
    "discounted_turn_returns",
    "gigpo_advantages",
    "group_success_rate",
    "grpo_advantages",
    "lambda_at",
    "mix_advantages",
    "pack_turns",
    "reshape_advantages",
    "rlsd_token_advantages",
    "stepopsd_multipliers",
    "turn_evidence",
    "turn_multipliers",
    "unpack_turns",
]
