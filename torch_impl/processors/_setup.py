"""The validated inputs of one logprob call (:class:`Plan`), the backend that runs it,
and the tile sizes per device: the one prologue of ``linear_logprobs`` and
``fused_token_loss``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any, Literal

import torch

from hookspec import Collectives, ContractError
from hookspec.arrays import format_shape

from ._checks import (
    check_bool,
    check_finite_number,
    check_floating,
    check_int,
    check_temperature,
    check_token_labels,
    resolve_compute_dtype,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_TOKEN_CHUNK",
    "DEFAULT_VOCAB_CHUNK",
    "TILES_BY_DEVICE",
    "TRITON_WORKSPACE_BYTES",
    "Backend",
    "KernelConfig",
    "Plan",
    "check_hidden",
    "gather_rows",
    "make_plan",
    "triton_available",
]

Backend = Literal["auto", "torch", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")

DEFAULT_VOCAB_CHUNK = 4096
"""Vocabulary entries per tile of the torch path on a CPU (columns of a logits tile)."""

DEFAULT_TOKEN_CHUNK = 1024
"""Tokens per tile of the torch path on a CPU (rows of a logits tile): 16 MiB in fp32."""

TILES_BY_DEVICE: dict[str, tuple[int, int]] = {
    "cpu": (DEFAULT_TOKEN_CHUNK, DEFAULT_VOCAB_CHUNK),
    # Measured on one H200 (8192 x 4096 x 151936 bf16, logprobs + entropy): 4096 x 8192
    # took 102 ms against 235 ms for 1024 x 4096, with half the peak memory.
    "cuda": (4096, 8192),
}
"""``device.type -> (token_chunk_size, vocab_chunk_size)`` of the torch path when not given."""

TRITON_WORKSPACE_BYTES = 256 << 20
"""The Triton backward's logit-gradient workspace: ``[rows, chunk]`` in the compute dtype."""


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile shape and launch options of the Triton kernels (block sizes: powers of two >= 16)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    dot_fp32: bool = False  # upcast the dot operands (the interpreter's bf16 dot is wrong)
    tf32: bool = False  # let fp32 products use TF32 (off: IEEE fp32)
    splits: int = 0  # vocabulary splits of the forward per token block (0: enough to fill the device)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the tile loops need, validated; built by :func:`make_plan`."""

    labels_local: torch.Tensor  # [n] long: row of the label in this shard, or -1
    ignored: torch.Tensor  # [n] bool
    inv_t: torch.Tensor | float  # [n] or a number: 1 / temperature (times the logit scale)
    fold: bool  # inv_t is folded into the hidden rows (torch path, compute dtype fp32/fp64)
    compute_dtype: torch.dtype
    acc_dtype: torch.dtype
    vocab_chunk: int
    token_chunk: int
    collectives: Collectives | None
    with_entropy: bool
    kernel: KernelConfig | None  # the Triton kernels' config; None on the torch path


def triton_available() -> bool:
    """Triton is importable (it ships with the CUDA builds of torch)."""
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _kernel_config(device: torch.device, dtype: torch.dtype) -> KernelConfig:
    if device.type != "cuda":  # the interpreter: small blocks, fp32 dots, splits exercised
        return KernelConfig(block_m=32, block_n=64, block_k=32, dot_fp32=True, splits=3)
    tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    if dtype == torch.float32 and not tf32:
        return KernelConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)
    return KernelConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, tf32=tf32)


def resolve_backend(backend: Any, h: torch.Tensor) -> Literal["torch", "triton"]:
    """``"auto"``: Triton for bf16/fp16/fp32 on CUDA where Triton is importable, else
    torch. ``"triton"`` also runs on a CPU under ``TRITON_INTERPRET=1``."""
    if backend not in BACKENDS:
        raise ContractError("backend", expected=f"one of {BACKENDS}", actual=repr(backend))
    fits = h.dtype != torch.float64 and triton_available()
    if backend == "auto":
        return "triton" if fits and h.is_cuda else "torch"
    if backend == "triton":
        if h.dtype == torch.float64:
            raise ContractError(
                "backend", expected="'torch' for float64 inputs (tl.dot has no fp64)", actual="'triton'"
            )
        if not triton_available():
            raise ContractError(
                "backend", expected="'torch' or 'auto' (triton is not installed)", actual="'triton'"
            )
        if not (h.is_cuda or _interpreting()):
            raise ContractError(
                "backend",
                expected=f"'torch' or 'auto' for tensors on {h.device} (or TRITON_INTERPRET=1)",
                actual="'triton'",
            )
    return backend  # type: ignore[no-any-return]


def check_hidden(hidden: Any) -> torch.Tensor:
    check_floating("hidden", hidden)
    if hidden.dim() != 2:
        raise ContractError("hidden", expected="2 dims [n, h]", actual=format_shape(hidden.shape))
    return hidden


def gather_rows(hidden: torch.Tensor, collectives: Collectives | None) -> torch.Tensor:
    """The full rows every vocab shard needs: ``collectives.gather_hidden_states``,
    whose backward sums the shards' hidden-state gradients (all-reduce, or
    reduce-scatter under sequence parallel). ``collectives`` is checked here, where
    it enters: ``None`` or a ``hookspec.Collectives``."""
    if collectives is None:
        return hidden
    if not isinstance(collectives, Collectives):
        raise ContractError(
            "collectives",
            expected="None or a hookspec.Collectives (all_reduce_sum, all_reduce_max, gather_hidden_states)",
            actual=type(collectives).__name__,
        )
    return collectives.gather_hidden_states(hidden)


def make_plan(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor,
    logit_scale: float,
    ignore_index: int,
    with_entropy: bool,
    vocab_start: int,
    vocab_size: int | None,
    collectives: Collectives | None,
    vocab_chunk_size: int | None,
    token_chunk_size: int | None,
    compute_dtype: torch.dtype | None,
    check_values: bool,
    backend: Backend,
) -> Plan:
    """Validate the options and inputs of one call (``h`` already gathered) and build its :class:`Plan`."""
    check_floating("weight", weight)
    check_bool("with_entropy", with_entropy)
    check_bool("check_values", check_values)
    check_int("ignore_index", ignore_index, low=-(1 << 62))
    scale = check_finite_number("logit_scale", logit_scale, low=0.0, low_open=True)
    n, hidden = h.shape
    if weight.dim() != 2 or weight.shape[1] != hidden:
        raise ContractError(
            "weight", expected=f"shape [V_local, h={hidden}]", actual=format_shape(weight.shape)
        )
    if weight.device != h.device:
        raise ContractError("weight", expected=f"on {h.device}", actual=str(weight.device))
    local = int(weight.shape[0])
    check_int("vocab_start", vocab_start, low=0)
    if vocab_size is None:
        vocab_size = vocab_start + local
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < vocab_start + local:
        raise ContractError(
            "vocab_size",
            expected=f"an int >= vocab_start + V_local = {vocab_start + local}",
            actual=repr(vocab_size),
        )
    check_int("vocab_size", vocab_size)  # within int64, as the labels it bounds
    token_default, vocab_default = TILES_BY_DEVICE.get(h.device.type, TILES_BY_DEVICE["cuda"])
    vocab_chunk = (
        vocab_default if vocab_chunk_size is None else check_int("vocab_chunk_size", vocab_chunk_size, low=1)
    )
    token_chunk = (
        token_default if token_chunk_size is None else check_int("token_chunk_size", token_chunk_size, low=1)
    )
    which = resolve_backend(backend, h)
    labels = check_token_labels(labels, n, vocab_size, ignore_index, check_values=check_values)
    labels = labels.to(device=h.device, dtype=torch.long)
    t = check_temperature(temperature, n, check_values=check_values)
    inv_t: torch.Tensor | float = (scale / t).to(h.device) if isinstance(t, torch.Tensor) else scale / t
    if which == "triton":
        cdtype = resolve_compute_dtype(h.device, h.dtype, compute_dtype or h.dtype)
        if cdtype == torch.float64:
            raise ContractError(
                "compute_dtype", expected="not float64 with backend 'triton'", actual="float64"
            )
    else:
        cdtype = resolve_compute_dtype(h.device, h.dtype, compute_dtype)
    acc = torch.float64 if cdtype == torch.float64 else torch.float32
    if isinstance(inv_t, torch.Tensor):
        inv_t = inv_t.to(acc).contiguous()
    ignored = labels == ignore_index
    local_row = labels - vocab_start
    in_shard = (local_row >= 0) & (local_row < local) & ~ignored
    return Plan(
        labels_local=torch.where(in_shard, local_row, -1),
        ignored=ignored,
        inv_t=inv_t,
        fold=which == "torch" and cdtype in (torch.float32, torch.float64),
        compute_dtype=cdtype,
        acc_dtype=acc,
        vocab_chunk=vocab_chunk,
        token_chunk=token_chunk,
        collectives=collectives,
        with_entropy=with_entropy,
        kernel=_kernel_config(h.device, cdtype) if which == "triton" else None,
    )
