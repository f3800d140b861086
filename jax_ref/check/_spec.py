"""``module:attr`` specs, resolved with one clear error (imports nothing heavy)."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from hookspec import ContractError

__all__ = ["resolve"]


@contextlib.contextmanager
def _current_directory_importable() -> Iterator[str]:
    """The current directory first on ``sys.path`` for the length of the block, as
    ``python -m`` has it (a console script such as ``hookcheck`` starts with its
    own ``bin`` directory there instead); ``sys.path`` as it was afterwards."""
    cwd = os.getcwd()
    if "" in sys.path or cwd in sys.path:
        yield cwd
        return
    sys.path.insert(0, cwd)
    try:
        yield cwd
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(cwd)


def resolve(spec: str, /, *, field: str = "processor") -> Any:
    """The object named by ``"package.module:attr.sub"``, imported as ``python -m``
    would (the current directory first on ``sys.path``); a ``ContractError`` if
    the module does not import or the attribute is missing."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ContractError(field, expected="'module:attr'", actual=repr(spec))
    with _current_directory_importable() as cwd:
        try:
            obj: Any = importlib.import_module(module_name)
        except Exception as exc:  # any import failure is the user's spec, reported in one line
            missing = isinstance(exc, ModuleNotFoundError) and exc.name == module_name.split(".")[0]
            raise ContractError(
                field,
                expected=f"an importable module {module_name!r}",
                actual=f"{type(exc).__name__}: {exc}".splitlines()[0],
                hint=f"looked in the current directory {cwd} and on sys.path (PYTHONPATH)"
                if missing
                else "",
            ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ContractError(
                field, expected=f"{spec!r} to exist", actual=f"no attribute {part!r}"
            )
        obj = getattr(obj, part)
    return obj
