"""Rollout: generation backends behind one protocol, and the lockstep collector."""

from agentopsd.rollout.base import Generation, Generator, SamplingConfig

__all__ = ["Generation", "Generator", "SamplingConfig"]
