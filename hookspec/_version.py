"""The contract's version."""

SPEC_VERSION: tuple[int, int] = (1, 1)
"""``(major, minor)``: a minor bump adds optional fields or keywords only
(processors written for an older minor keep working); a major bump breaks."""

# 1.1: ``OutputContext.check_values`` (default True) and ``labels_checked`` (default False).
