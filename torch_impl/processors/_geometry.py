"""The engine's tile sizes per device and its Triton kernels' launch shape.

A *tile* is the block of logits the engine forms with one GEMM, ``rows`` tokens by
``cols`` vocabulary entries, fp32 (fp64 for fp64 inputs), in the vocabulary sweep
(columns outer) or the row sweep (whole rows). ``docs/gpu-design.md`` derives the sizes
from a byte and flop model that ``benchmarks/gpu_model.py`` recomputes from these.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

__all__ = [
    "EXP_RANGE",
    "GRAD_BUFFER_BYTES",
    "MIN_TILE_COLS",
    "ROW_ALIGN",
    "TILES_BY_DEVICE",
    "TILE_BYTES",
    "KernelConfig",
    "grad_capacity",
    "interpreting",
    "triton_mode_mismatch",
    "kernel_config",
    "row_tile",
    "sweep_tile",
]

TILE_BYTES: dict[str, int] = {"cpu": 32 << 20, "cuda": 256 << 20}
"""``device.type -> bytes`` of one fp32 logits tile: the Triton backend's vocabulary
sweep, and the row sweep on either backend (``docs/processors.md``, "Backends and tiles")."""

GRAD_BUFFER_BYTES: dict[str, int] = {"cpu": 32 << 20, "cuda": 1 << 30}
"""``device.type -> bytes`` of the row sweep's gradient buffer ``G`` (its rows' logit
gradient, compute dtype), so that ``dh = G @ W`` and ``dW += G.T @ h`` are a few large GEMMs."""

TILES_BY_DEVICE: dict[str, tuple[int, int]] = {"cpu": (1024, 4096), "cuda": (4096, 8192)}
"""``device.type -> (rows, cols)`` of the torch backend's vocabulary-sweep tile."""

MIN_TILE_COLS = 1024
"""The Triton backend's vocabulary sweep keeps every row in one tile while a tile of all
rows by this many columns fits :data:`TILE_BYTES` (each ``dW`` tile is then one GEMM)."""

ROW_ALIGN = 128
"""On CUDA the row sweep's rows are a multiple of this (cuBLAS's tile height) where
there are more: no GEMM runs a partly empty row of tiles."""

EXP_RANGE = 60.0
"""The fused loss's single pass writes ``exp(z - c)`` with ``c`` at most the row's max
``M``; a row with ``M - c`` above this is redone with ``c = M``. ``exp(60)`` times a
vocabulary of 10**7 still fits fp32 and bf16."""


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the Triton kernels: ``block_m`` rows per program, ``block_n``
    columns per step (powers of two)."""

    block_m: int
    block_n: int
    num_warps: int = 4


def interpreting() -> bool:
    """Triton runs its kernels under the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_mode_mismatch() -> str:
    """Why Triton cannot run in the mode ``TRITON_INTERPRET`` asks now, or ``""``:
    ``import triton`` fixes the mode of its standard library (``tl.standard.max``), and
    a kernel decorated later under the other mode fails with ``InterpreterError``."""
    if "triton" not in sys.modules:
        return ""  # imported from here on, in the mode the environment says now
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    imported_interpreting = isinstance(tl.standard.max, InterpretedFunction)
    if imported_interpreting == interpreting():
        return ""
    then, now = ("with", "unset") if imported_interpreting else ("without", "set")
    return (
        f"Triton was imported {then} TRITON_INTERPRET=1 and it is {now} now: Triton fixes its "
        "interpreter mode when it is first imported (import megatron.core imports it); set "
        "TRITON_INTERPRET before that import, in the environment"
    )


def kernel_config(device: torch.device) -> KernelConfig:
    """On a GPU one row per program, 2048 columns (8 KiB of fp32) a step. Under the
    interpreter 16 rows per program and 64 columns a step: columns small enough that
    a small vocabulary has whole and ragged blocks (edges exercised), rows many enough
    that the interpreter, which runs the programs one after another in Python, runs
    few of them (2 rows per program made the Triton tests about 8 times slower)."""
    cuda = device.type == "cuda"
    return KernelConfig(block_m=1 if cuda else 16, block_n=2048 if cuda else 64)


def _budget(table: dict[str, int], device: torch.device, itemsize: int) -> int:
    return max(1, table.get(device.type, table["cuda"]) // itemsize)


def sweep_tile(
    n: int, local: int, device: torch.device, *, triton: bool, rows: int | None, cols: int | None
) -> tuple[int, int]:
    """``(rows, cols)`` of the vocabulary sweep's tile; a given size wins.

    Torch backend: :data:`TILES_BY_DEVICE`. Triton backend: :data:`TILE_BYTES` of
    fp32, every row while ``n x MIN_TILE_COLS`` fits, columns a multiple of 128
    where more than 128."""
    if not triton:
        r0, c0 = TILES_BY_DEVICE.get(device.type, TILES_BY_DEVICE["cuda"])
        return max(1, rows or r0), max(1, cols or c0)
    budget = _budget(TILE_BYTES, device, 4)
    if rows is None:
        floor = max(1, min(local, cols or MIN_TILE_COLS))
        rows = n if n * floor <= budget else max(1, budget // floor)
    rows = max(1, min(max(n, 1), rows))
    if cols is None:
        cols = max(1, budget // rows)
        if cols > 128:
            cols -= cols % 128
    return rows, max(1, min(max(local, 1), cols))


def row_tile(n: int, local: int, device: torch.device, *, rows: int | None) -> int:
    """Rows of the row sweep's tile (whole rows of the shard): a given number, else
    :data:`TILE_BYTES` of fp32 logits, a multiple of :data:`ROW_ALIGN` on CUDA."""
    if rows is None:
        rows = _budget(TILE_BYTES, device, 4) // max(1, local)
        if device.type == "cuda" and rows > ROW_ALIGN:
            rows -= rows % ROW_ALIGN
    return max(1, min(max(n, 1), rows))


def grad_capacity(n: int, local: int, tile_rows: int, itemsize: int, device: torch.device) -> int:
    """Rows of the row sweep's gradient buffer: a multiple of ``tile_rows`` within
    :data:`GRAD_BUFFER_BYTES`, at least one tile, at most every row."""
    fit = _budget(GRAD_BUFFER_BYTES, device, itemsize) // max(1, local)
    tiles = max(1, fit // tile_rows)
    return max(tile_rows, min(tiles * tile_rows, -(-max(n, 1) // tile_rows) * tile_rows))
