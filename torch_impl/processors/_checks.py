"""Input checks shared by the processors: each raises ``hookspec.ContractError``."""

from __future__ import annotations

import math
from typing import Any

import torch

from hookspec import ContractError, check_labels
from hookspec.arrays import format_shape

__all__ = [
    "check_floating",
    "check_shape",
    "check_temperature",
    "resolve_compute_dtype",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_floating(field: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ContractError(field, expected="a torch.Tensor", actual=type(x).__name__)
    if x.dtype not in _FLOATS:
        raise ContractError(field, expected="a floating dtype", actual=str(x.dtype).removeprefix("torch."))
    return x


def check_shape(field: str, x: torch.Tensor, shape: tuple[int, ...], what: str = "") -> None:
    if tuple(x.shape) != shape:
        raise ContractError(
            field, expected=f"shape {what or format_shape(shape)}", actual=format_shape(x.shape)
        )


def check_temperature(temperature: Any, n: int, *, field: str = "temperature") -> float | torch.Tensor:
    """A finite ``T > 0``: a Python number, or a tensor of ``n`` values (one per token).

    Returns a float or a tensor ``[n]`` (float32, or float64 when given float64). Reads the tensor's values.
    """
    if isinstance(temperature, torch.Tensor):
        if temperature.dim() == 0:
            temperature = float(temperature)
        else:
            check_floating(field, temperature)
            if temperature.numel() != n:
                raise ContractError(
                    field,
                    expected=f"a number or one value per token ({n})",
                    actual=format_shape(temperature.shape),
                )
            t = temperature.detach().reshape(n)
            t = t.double() if t.dtype == torch.float64 else t.float()
            bad = ~(torch.isfinite(t) & (t > 0))
            if bool(bad.any()):
                lo = float(t[bad].min()) if bool(torch.isfinite(t[bad]).any()) else float("nan")
                raise ContractError(
                    field,
                    expected="finite values > 0",
                    actual=f"{int(bad.sum())} values <= 0 or not finite (min {lo})",
                )
            return t
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ContractError(field, expected="a number > 0 or a tensor [n]", actual=type(temperature).__name__)
    if not (math.isfinite(temperature) and temperature > 0):
        raise ContractError(field, expected="a finite number > 0", actual=repr(temperature))
    return float(temperature)


def check_token_labels(
    labels: Any, n: int, vocab_size: int, ignore_index: int, *, check_values: bool
) -> torch.Tensor:
    if not isinstance(labels, torch.Tensor):
        raise ContractError("labels", expected="a torch.Tensor of token ids", actual=type(labels).__name__)
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise ContractError(
            "labels", expected="an integer dtype", actual=str(labels.dtype).removeprefix("torch.")
        )
    if tuple(labels.shape) != (n,):
        raise ContractError(
            "labels", expected=f"shape [n={n}] (one per hidden-state row)", actual=format_shape(labels.shape)
        )
    if check_values:
        check_labels(labels, vocab_size, ignore_index=ignore_index)
    return labels


def resolve_compute_dtype(
    device: torch.device, dtype: torch.dtype, override: torch.dtype | None
) -> torch.dtype:
    """The dtype the matmuls run in.

    ``override`` if given; float64 stays float64; on a CPU, float32 (most CPUs
    have no fast bf16/fp16 GEMM, and fp32 products are the more accurate);
    elsewhere the input dtype (the GEMM accumulates in fp32 on GPUs).
    """
    if override is not None:
        if override not in _FLOATS:
            raise ContractError("compute_dtype", expected="a floating torch dtype", actual=repr(override))
        return override
    if dtype == torch.float64:
        return torch.float64
    if device.type == "cpu":
        return torch.float32
    return dtype
