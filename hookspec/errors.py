"""The one exception type of the contract."""

from __future__ import annotations

from typing import Any

__all__ = ["ContractError"]


class ContractError(ValueError):
    """Input or output at the contract boundary that breaks the contract.

    Every instance names the offending ``field``, what was ``expected`` and what
    was ``actual``, so that a failure reads as one line::

        ContractError: labels: expected shape [b=2, s=8], got [2, 7]

    It subclasses :class:`ValueError` so that callers catching ``ValueError`` keep
    working; type mismatches (a processor returning a list, say) raise it too.
    """

    def __init__(self, field: str, *, expected: Any, actual: Any, hint: str = "") -> None:
        self.field = field
        self.expected = expected
        self.actual = actual
        self.hint = hint
        message = f"{field}: expected {expected}, got {actual}"
        if hint:
            message = f"{message}. {hint}"
        super().__init__(message)
