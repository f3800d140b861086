"""One identity ``hookspec.Collectives`` for the tests that need a user's collectives
whose values are not the point (a stand-in for other ranks that contribute nothing).

``identity_collectives(name, *optional, **methods)`` makes a class with exactly the three
methods of spec 1.0 (``all_reduce_sum``, ``all_reduce_max``, ``gather_hidden_states``),
the optional methods named in ``optional`` (``all_gather``,
``all_reduce_sum_context_parallel``: spec 1.2), each the identity, and ``methods`` in
place of any of them or beside them (``__repr__`` included). A test that checks which
methods a user's collectives has gets exactly the set it asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["OPTIONAL", "REQUIRED", "identity_collectives"]

REQUIRED = ("all_reduce_sum", "all_reduce_max", "gather_hidden_states")
OPTIONAL = ("all_gather", "all_reduce_sum_context_parallel")


def _identity(self: Any, x: Any, /) -> Any:
    return x


def identity_collectives(name: str, /, *optional: str, **methods: Callable[..., Any]) -> type:
    """A collectives class called ``name``: the required methods and ``optional``, each
    the identity, overridden or extended by ``methods``."""
    unknown = set(optional) - set(OPTIONAL)
    if unknown:
        raise ValueError(f"not an optional collective of the contract: {sorted(unknown)}")
    namespace: dict[str, Any] = {m: _identity for m in (*REQUIRED, *optional)}
    namespace.update(methods)
    namespace["__doc__"] = (
        f"Identity collectives ({', '.join(sorted(set(namespace) - {'__doc__'}))})."
    )
    return type(name, (), namespace)
