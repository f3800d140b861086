"""What the contract needs of an array, without importing any framework.

A torch tensor, a jax array and a numpy array all satisfy :class:`Array`; the
helpers below read shapes and dtypes through attributes only, the way
array-api-compat does, so that ``hookspec`` stays importable with neither torch
nor jax installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Array",
    "dtype_name",
    "format_shape",
    "framework_of",
    "is_array",
    "is_floating",
    "is_integer",
    "shape_of",
]


@runtime_checkable
class Array(Protocol):
    """Anything with a ``shape`` and a ``dtype``: torch, jax and numpy arrays."""

    @property
    def shape(self) -> Sequence[int]: ...

    @property
    def dtype(self) -> Any: ...


def is_array(x: object) -> bool:
    """True for objects with an integer-tuple ``shape`` and a ``dtype``."""
    shape = getattr(x, "shape", None)
    if shape is None or not hasattr(x, "dtype"):
        return False
    try:
        return all(isinstance(int(d), int) for d in shape)
    except TypeError:
        return False


def shape_of(x: Array) -> tuple[int, ...]:
    """The shape as a tuple of Python ints (``torch.Size`` and jax shapes alike)."""
    return tuple(int(d) for d in x.shape)


def dtype_name(x: Array) -> str:
    """The dtype's plain name: ``float32``, ``bfloat16``, ``int64``.

    ``torch.float32`` and ``dtype('float32')`` both become ``float32``.
    """
    name = str(x.dtype)
    for prefix in ("torch.", "dtype('"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name.rstrip("')")


_FLOAT_NAMES = frozenset({"float16", "bfloat16", "float32", "float64"})
_INT_NAMES = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})


def is_floating(x: Array) -> bool:
    return dtype_name(x) in _FLOAT_NAMES


def is_integer(x: Array) -> bool:
    return dtype_name(x) in _INT_NAMES


def format_shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def framework_of(x: object) -> str:
    """The framework an array belongs to, by the top-level module of its type:
    ``"torch"``, ``"numpy"``, ``"jax"`` (``jaxlib``'s arrays and jax's tracers
    alike). Read through the type's ``__module__``, importing nothing."""
    root = type(x).__module__.partition(".")[0]
    return "jax" if root == "jaxlib" else root
