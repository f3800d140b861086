"""``module:attr`` specs, resolved with one clear error (imports nothing heavy)."""

from __future__ import annotations

import importlib
from typing import Any

from hookspec import ContractError

__all__ = ["resolve"]


def resolve(spec: str, /, *, field: str = "processor") -> Any:
    """The object named by ``"package.module:attr.sub"``; a ``ContractError`` if
    the module does not import or the attribute is missing."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ContractError(field, expected="'module:attr'", actual=repr(spec))
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is the user's spec, reported in one line
        raise ContractError(
            field,
            expected=f"an importable module {module_name!r}",
            actual=f"{type(exc).__name__}: {exc}".splitlines()[0],
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ContractError(field, expected=f"{spec!r} to exist", actual=f"no attribute {part!r}")
        obj = getattr(obj, part)
    return obj
