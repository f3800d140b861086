"""The contract's version."""

SPEC_VERSION: tuple[int, int] = (1, 2)
"""``(major, minor)``: a minor bump adds optional fields or keywords only
(processors written for an older minor keep working); a major bump breaks."""

# 1.1: ``OutputContext.check_values`` (default True) and ``labels_checked`` (default False).
# 1.2: ``Collectives.all_reduce_sum_context_parallel`` (optional at run time: needed only
#      under cp > 1).
#      ``Collectives.all_gather`` (optional at run time: needed only by a vocab-parallel top-k
#      at tp > 1).
#      A processor result may be per token with trailing dims, ``[b, s, ...]``
#      (top-k: ``[b, s, k]``).
