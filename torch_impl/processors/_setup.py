"""The checked inputs of one logprob call (:class:`TileSetup`), the backend that runs
it and the chunk sizes per device: the one prologue of ``linear_logprobs`` and
``fused_token_loss``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal

import torch

from hookspec import Collectives, ContractError, SingleProcessCollectives
from hookspec.arrays import format_shape

from ._backends import auto_choice, triton_available
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
    "LOGITS_CHUNK_BYTES",
    "TILES_BY_DEVICE",
    "Backend",
    "KernelConfig",
    "TileSetup",
    "check_hidden",
    "cublas_chunks",
    "gather_rows",
    "kernel_config",
    "logits_budget",
    "make_setup",
    "refuse_double_backward",
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
"""``device.type -> (token_chunk_size, vocab_chunk_size)`` of the torch path of
``linear_logprobs`` when not given."""

LOGITS_CHUNK_BYTES: dict[str, int] = {"cpu": 32 << 20, "cuda": 1 << 30}
"""``device.type -> bytes`` of one fp32 logits chunk of the Triton backend, and of one
row tile of ``fused_token_loss`` on either backend: 32 MiB on a CPU (the fused tile
of ``2**23`` logits, as before), 1 GiB on a GPU (thousands of rows: 1766 at
V = 151936; the GEMMs stay large enough for cuBLAS to run near its peak)."""

MIN_CHUNK_COLS = 1024
"""The Triton backend keeps every row in one chunk while a chunk of all rows by this
many vocabulary entries fits the budget (then each ``dW`` chunk is one GEMM)."""


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the Triton epilogue kernels: ``block_m`` rows per program,
    ``block_n`` columns per step (powers of two)."""

    block_m: int
    block_n: int
    num_warps: int = 4


@dataclasses.dataclass(frozen=True)
class TileSetup:
    """What the tile loops need, checked; built by :func:`make_setup`."""

    labels_local: torch.Tensor  # [n] long: row of the label in this shard, or -1
    ignored: torch.Tensor  # [n] bool
    inv_t: torch.Tensor | float  # [n] (acc dtype) or a number: logit_scale / temperature
    fold: bool  # inv_t is folded into the hidden rows (torch path, compute dtype fp32/fp64)
    compute_dtype: torch.dtype
    acc_dtype: torch.dtype
    vocab_chunk: int
    token_chunk: int
    collectives: Collectives | None
    with_entropy: bool
    kernel: KernelConfig | None  # the Triton epilogues' launch shape; None on the torch path


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def kernel_config(device: torch.device) -> KernelConfig:
    """The epilogue kernels' launch shape: small blocks under the interpreter (edges
    exercised), 4 rows x 1024 columns per step on a GPU."""
    if device.type != "cuda":
        return KernelConfig(block_m=8, block_n=64, num_warps=4)
    return KernelConfig(block_m=4, block_n=1024, num_warps=8)


def logits_budget(device: torch.device) -> int:
    """Logits (fp32 elements) per chunk on ``device``: :data:`LOGITS_CHUNK_BYTES` / 4."""
    return LOGITS_CHUNK_BYTES.get(device.type, LOGITS_CHUNK_BYTES["cuda"]) // 4


def cublas_chunks(
    n: int, vocab: int, budget: int, token_chunk: int | None, vocab_chunk: int | None
) -> tuple[int, int]:
    """``(rows, cols)`` of the Triton backend's logits chunk within ``budget`` elements:
    every row while ``n x MIN_CHUNK_COLS`` fits, columns a multiple of 128 where
    more than 128; a given size wins."""
    if token_chunk is None:
        floor = max(1, min(vocab, vocab_chunk or MIN_CHUNK_COLS))
        token_chunk = n if n * floor <= budget else max(1, budget // floor)
    rows = max(1, min(n, token_chunk))
    if vocab_chunk is None:
        vocab_chunk = max(1, budget // rows)
        if vocab_chunk > 128:
            vocab_chunk -= vocab_chunk % 128
    return rows, max(1, min(max(vocab, 1), vocab_chunk))


def _backend(backend: Any, h: torch.Tensor, weight: torch.Tensor) -> Literal["torch", "triton"]:
    """``"auto"``: the device class's choice (:mod:`._backends`) for bf16/fp16/fp32,
    torch for float64. ``"triton"`` also runs on a CPU under ``TRITON_INTERPRET=1``."""
    if backend not in BACKENDS:
        raise ContractError("backend", expected=f"one of {BACKENDS}", actual=repr(backend))
    fp64 = torch.float64 in (h.dtype, weight.dtype)
    if backend == "auto":
        return "torch" if fp64 else auto_choice(h.device).backend
    if backend == "triton":
        if fp64:
            raise ContractError(
                "backend",
                expected="'torch' for float64 inputs (the epilogues run in fp32)",
                actual="'triton'",
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


def check_shard(vocab_start: int, local: int, vocab_size: int, collectives: Collectives | None) -> None:
    """A weight that is part of the vocabulary needs collectives that reduce over the
    other parts: with none (``None``, or one rank's ``SingleProcessCollectives``) the
    logprobs would be normalised over this shard alone."""
    if vocab_start == 0 and local == vocab_size:
        return
    if collectives is None or isinstance(collectives, SingleProcessCollectives):
        raise ContractError(
            "collectives",
            expected=(
                f"the vocab-parallel group's Collectives: the weight holds rows [{vocab_start}, "
                f"{vocab_start + local}) of a vocabulary of {vocab_size}, the rest lives on other ranks"
            ),
            actual="None" if collectives is None else "SingleProcessCollectives() (one rank)",
        )


def refuse_double_backward(name: str) -> None:
    """Called first in a custom backward: under ``create_graph=True`` (grad mode on in
    backward) the gradient would have no graph, and its own gradient (a Hessian-vector
    product) would read as zero. Refuse by name instead."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{name}: double backward (create_graph=True) is not supported: its gradient is formed "
            "by tiles outside autograd, so a second derivative would silently be zero. For Hessian-"
            "vector products compute the logprobs from materialised logits"
        )


def make_setup(
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
) -> TileSetup:
    """Check the options and inputs of one call (``h`` already gathered) and build its
    :class:`TileSetup`."""
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
    check_shard(vocab_start, local, vocab_size, collectives)
    vocab_chunk = None if vocab_chunk_size is None else check_int("vocab_chunk_size", vocab_chunk_size, low=1)
    token_chunk = None if token_chunk_size is None else check_int("token_chunk_size", token_chunk_size, low=1)
    which = _backend(backend, h, weight)
    labels = check_token_labels(labels, n, vocab_size, ignore_index, check_values=check_values)
    labels = labels.to(device=h.device, dtype=torch.long)
    t = check_temperature(temperature, n, check_values=check_values)
    # float64 if either operand is: a float32 weight with float64 hidden states (or the
    # reverse) is multiplied exactly in float64, as torch's promotion would
    wide = torch.float64 if torch.float64 in (h.dtype, weight.dtype) else h.dtype
    if which == "triton":
        cdtype = resolve_compute_dtype(h.device, h.dtype, compute_dtype or h.dtype)
        if cdtype == torch.float64:
            raise ContractError(
                "compute_dtype", expected="not float64 with backend 'triton'", actual="float64"
            )
    else:
        cdtype = resolve_compute_dtype(h.device, wide, compute_dtype)
    acc = torch.float64 if cdtype == torch.float64 else torch.float32
    # 1 / T in the accumulation dtype: a float32 temperature with float64 inputs gives
    # an exact float64 quotient of its (float32) values
    inv_t: torch.Tensor | float = (
        (scale / t.to(device=h.device, dtype=acc)).contiguous() if isinstance(t, torch.Tensor) else scale / t
    )
    if which == "triton":
        kernel: KernelConfig | None = kernel_config(h.device)
        rows, cols = cublas_chunks(n, local, logits_budget(h.device), token_chunk, vocab_chunk)
    else:
        kernel = None
        token_default, vocab_default = TILES_BY_DEVICE.get(h.device.type, TILES_BY_DEVICE["cuda"])
        rows = token_default if token_chunk is None else token_chunk
        cols = vocab_default if vocab_chunk is None else vocab_chunk
    ignored = labels == ignore_index
    local_row = labels - vocab_start
    in_shard = (local_row >= 0) & (local_row < local) & ~ignored
    return TileSetup(
        labels_local=torch.where(in_shard, local_row, -1),
        ignored=ignored,
        inv_t=inv_t,
        fold=which == "torch" and cdtype in (torch.float32, torch.float64),
        compute_dtype=cdtype,
        acc_dtype=acc,
        vocab_chunk=cols,
        token_chunk=rows,
        collectives=collectives,
        with_entropy=with_entropy,
        kernel=kernel,
    )
