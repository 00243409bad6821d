"""The study drivers that make results/ (not shipped in the wheel); shared helpers in :mod:`studies.common`."""
