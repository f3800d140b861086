"""The contract's version."""

SPEC_VERSION: tuple[int, int] = (1, 0)
"""``(major, minor)``: a minor bump adds optional fields or keywords only
(processors written for an older minor keep working); a major bump breaks."""
