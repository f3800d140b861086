"""The one place where torch tensors and JAX arrays cross: DLPack, both ways.

``to_jax(t)`` is ``jax.dlpack.from_dlpack(t.detach())`` and ``to_torch(a)`` is
``torch.from_dlpack(a)``: on a CPU both share the buffer, no copy, whenever the
buffer is aligned the way XLA wants it (an offset view may be copied; see
:func:`shares_memory`). float32, bfloat16 and float16 cross natively, with the
integer and bool dtypes labels and masks need.

A shared buffer must never be written to after the exchange: JAX assumes its
arrays are immutable. Nothing in ``jax_ref`` writes to a tensor it has
exchanged; pass ``copy=True`` for an independent buffer when your code would.

Exchanges run inside :func:`jax_ref.float64`, so int64 labels and float64
tensors keep their dtype instead of being narrowed to 32 bits.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch

from hookspec import ContractError

from .._x64 import float64

__all__ = [
    "SUPPORTED_DTYPES",
    "shares_memory",
    "to_jax",
    "to_torch",
]

SUPPORTED_DTYPES: tuple[str, ...] = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
)
"""The dtype names the boundary exchanges. Others (complex, float8, quantized,
bit types) are refused with a :class:`ContractError` before DLPack sees them."""


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _check_dtype(field: str, dtype: Any) -> None:
    name = _name(dtype)
    if name not in SUPPORTED_DTYPES:
        raise ContractError(
            field,
            expected=f"a dtype the DLPack boundary carries ({', '.join(SUPPORTED_DTYPES)})",
            actual=name,
        )


def to_jax(t: torch.Tensor, /, *, field: str = "tensor", copy: bool = False) -> jax.Array:
    """``t`` as a JAX array over DLPack: same values, same dtype, shared buffer.

    ``t`` is detached first (autograd state does not cross). ``copy=True``
    copies the buffer. Raises :class:`ContractError` for a dtype, layout or
    device the boundary cannot carry.
    """
    if not isinstance(t, torch.Tensor):
        raise ContractError(field, expected="a torch.Tensor", actual=type(t).__name__)
    _check_dtype(field, t.dtype)
    if t.layout != torch.strided:
        raise ContractError(field, expected="a dense (strided) tensor", actual=f"layout {t.layout}")
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    try:
        with float64():
            out = jax.dlpack.from_dlpack(t)
            if copy:
                out = out.copy()
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        raise ContractError(
            field,
            expected="a tensor DLPack can hand to JAX",
            actual=f"{_name(t.dtype)} on {t.device}: {type(exc).__name__}: {exc}".splitlines()[0],
        ) from None
    return out


def to_torch(a: Any, /, *, field: str = "array", copy: bool = False) -> torch.Tensor:
    """A JAX (or numpy) array as a torch tensor over DLPack, sharing the buffer.

    The result must not be written to unless ``copy=True``.
    """
    if isinstance(a, np.ndarray):
        _check_dtype(field, a.dtype)
        out = torch.from_numpy(np.ascontiguousarray(a))
        return out.clone() if copy else out
    if not isinstance(a, jax.Array):
        raise ContractError(field, expected="a jax.Array", actual=type(a).__name__)
    _check_dtype(field, a.dtype)
    try:
        out = torch.from_dlpack(a)
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        raise ContractError(
            field,
            expected="an array DLPack can hand to torch",
            actual=f"{a.dtype}: {type(exc).__name__}: {exc}".splitlines()[0],
        ) from None
    return out.clone() if copy else out


def shares_memory(t: torch.Tensor, a: jax.Array, /) -> bool:
    """True when ``t`` and ``a`` start at the same address (a zero-copy exchange)."""
    try:
        return int(t.data_ptr()) == int(a.unsafe_buffer_pointer())
    except (AttributeError, RuntimeError, ValueError):
        return False
