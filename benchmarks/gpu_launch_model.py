"""The launch and host-time term of the GPU model: a queue of host launches feeding the
GPU, fitted to nothing, fed with the figures the 2026-11-26 H200 run measured.

Each call is a list of work items in issue order, ``(host seconds, GPU seconds)``. The
host issues them one after another; the GPU runs each once it is issued and the GPU
is free::

    t_host = prologue
    for (host, gpu) in items:
        t_host += host                     # the launches of the item
        t_gpu = max(t_gpu, t_host) + gpu   # queued behind the launch and the GPU's work
    wall = max(t_host, t_gpu);  busy = sum(gpu) / (wall - prologue_before_first_kernel)

Per row tile (the fused loss) or vocabulary tile (logprobs + entropy) there is one
item: ``launches x HOST_PER_LAUNCH`` of host time against the tile's GEMMs and kernels
on the GPU (roughly ``max(host, GPU)`` per tile, with the GPU catching up behind a
host-bound stretch). A gradient flush (the fused loss's ``dh``/``dW`` GEMMs over the
buffer) is one more item. GEMMs are priced at the measured ``torch.mm`` rates, the
Triton kernels at their measured fraction of the copy bandwidth (from the profile, not
the single-launch microbenchmark), elementwise kernels at the copy bandwidth.

:func:`measured_before` reproduces the 2026-11-26 wall times of the code then (commit
49dd243) from its launch counts; :func:`predicted_after` predicts the design the engine
moves to (the user's loss once per gradient flush, a bounded number of launches per
tile, per-row results into preallocated vectors, the coefficients in one kernel),
with the kernels at their measured bandwidth and at the 0.85 of copy they are to
reach. Predictions, not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

__all__ = [
    "CEILINGS",
    "HOST_PER_LAUNCH",
    "MEASURED_WALL_MS",
    "Ceilings",
    "Queue",
    "Shape",
    "markdown",
    "measured_before",
    "predicted_after",
    "floor_ms",
    "queue",
]


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """What one H200 measured on 2026-11-26 (torch 2.11.0+cu130, Triton 3.6.0;
    ``measure.log``, ``profile.log``, ``timeline.log`` of that run)."""

    mm_fp32_out: float = 699.5e12  # torch.mm bf16 -> fp32, [8192,4096] @ [4096,8192], flop/s
    mm_dh: float = 765.8e12  # dh = gz @ W[cols], flop/s
    mm_dw: float = 755.6e12  # dW = gz.T @ h, flop/s
    copy_bw: float = 4.107e12  # 1 GiB fp32 copy, bytes read + written per second
    stats_of_copy: float = 0.54  # _chunk_stats_kernel, from the profiler's durations
    exp_rows_of_copy: float = 0.61  # _exp_rows_kernel, idem
    logit_grad_of_copy: float = 1.0  # _logit_grad_kernel, idem
    small_kernel_s: float = 1.5e-6  # a small elementwise kernel ([n] vectors): 129 in 0.148 ms
    scale_bw: float = (
        2.5e9 / 1.6e-3
    )  # the backward's dw.mul_(g_loss), non-vectorised: 2.5 GB in 1.6 ms


CEILINGS = Ceilings()

HOST_PER_LAUNCH = 25e-6
"""Host seconds per launch of the tile loop: about 2 ms of host time for about 80
launches per row tile in the fused loss (2026-11-26 profile: 163 ``mul``, 88 ``where``,
129 small elementwise kernels per call, the user's loss and its ``autograd.grad``)."""

MEASURED_WALL_MS = {
    ("fused loss", 8192, 4096, 151936): 58.25,
    ("fused loss", 8192, 1024, 65536): 19.30,
    ("logprobs + entropy", 8192, 4096, 151936): 66.13,
    ("logprobs + entropy", 8192, 1024, 65536): 9.29,
    ("logprobs + entropy", 32768, 4096, 151936): 276.0,
}
"""Wall times (CUDA events, median of 5) of the 2026-11-26 H200 run, bf16: ``bench.log``
(the first four) and ``peers-independent-32768.log``."""


@dataclasses.dataclass(frozen=True)
class Shape:
    n: int
    h: int
    v: int
    elt: int = 2  # bf16


SHAPES = (Shape(8192, 4096, 151936), Shape(32768, 4096, 151936), Shape(8192, 1024, 65536))


@dataclasses.dataclass(frozen=True)
class Queue:
    """The queue's result for one call (seconds)."""

    wall: float
    host: float
    gpu: float

    @property
    def busy(self) -> float:
        return self.gpu / self.wall


def queue(items: Sequence[tuple[float, float]], *, prologue: float) -> Queue:
    """The queue of the module docstring over ``(host s, GPU s)`` items."""
    t_host, t_gpu, gpu = prologue, 0.0, 0.0
    for host, work in items:
        t_host += host
        t_gpu = max(t_gpu, t_host) + work
        gpu += work
    return Queue(max(t_host, t_gpu), t_host, gpu)


def _mm(m: int, k: int, n: int, rate: float) -> float:
    return 2.0 * m * k * n / rate


def _pass(nbytes: float, fraction: float, c: Ceilings) -> float:
    return nbytes / (c.copy_bw * fraction)


def _tiles(total: int, size: int) -> list[int]:
    full, rest = divmod(total, size)
    return [size] * full + ([rest] if rest else [])


# ---------------------------------------------------------------- the code of 2026-11-26 (49dd243)

BEFORE_ROW_TILE = {4096: 384, 1024: 1024}  # rows of a fused-loss tile (the profile's GEMM counts)
BEFORE_FLUSH_ROWS = {4096: 3456, 1024: 8192}  # rows of the bf16 gradient buffer
BEFORE_SWEEP_TILE = {8192: (8192, 8192), 32768: (32768, 2048)}  # logprobs + entropy tiles
BEFORE_LAUNCHES = {
    "fused loss": 80,
    "logprobs + entropy": 13,
}  # per tile: the profile, the timeline
BEFORE_PROLOGUE = {
    "fused loss": 2.81e-3,
    "logprobs + entropy": 3.92e-3,
}  # timeline: to the first kernel


def _fused(
    s: Shape, *, row_tile: int, flush_rows: int, launches: float, flush_launches: float,
    exp_fraction: float, vectorised_scale: bool, c: Ceilings,
) -> list[tuple[float, float]]:  # fmt: skip
    """The fused loss's items: per row tile the logits GEMM, the exp kernel (one read of
    fp32, one bf16 write) and the ``[rows]`` work; per flush ``dh`` and ``dW``."""
    items: list[tuple[float, float]] = []
    done = 0
    for r in _tiles(s.n, row_tile):
        gpu = _mm(r, s.h, s.v, c.mm_fp32_out) + _pass(r * s.v * 6, exp_fraction, c)
        gpu += launches * 0.5 * c.small_kernel_s  # about half the launches are [rows] kernels
        items.append((launches * HOST_PER_LAUNCH, gpu))
        done += r
        if done % flush_rows == 0 or done == s.n:
            g = done % flush_rows or flush_rows
            flush = _mm(g, s.v, s.h, c.mm_dh) + _mm(s.v, g, s.h, c.mm_dw)
            items.append((flush_launches * HOST_PER_LAUNCH, flush))
    scale_bytes = 2 * s.v * s.h * s.elt
    items.append((HOST_PER_LAUNCH, scale_bytes / (c.copy_bw if vectorised_scale else c.scale_bw)))
    return items


def _sweep(
    s: Shape, *, tile: tuple[int, int], launches: float, stats_fraction: float, c: Ceilings
) -> list[tuple[float, float]]:
    """Logprobs + entropy: per vocabulary tile four GEMMs, the statistics kernel and the
    in-place gradient kernel. The ``dh`` GEMM also reads and writes its fp32 ``[rows, h]``
    accumulator once a vocabulary tile, added to its flop time: at 32768 x 2048 tiles
    that is 73 read-modify-writes of 537 MB, 17.8 ms over the GEMMs' rate in the profile."""
    rows, cols = tile
    items = []
    for cc in _tiles(s.v, cols):
        for r in _tiles(s.n, rows):
            rmw = r * s.h * 4 * 2 / c.copy_bw
            gpu = (
                2 * _mm(r, s.h, cc, c.mm_fp32_out)
                + _mm(r, cc, s.h, c.mm_dh)
                + rmw
                + _mm(cc, r, s.h, c.mm_dw)
            )
            gpu += _pass(r * cc * 4, stats_fraction, c) + _pass(r * cc * 6, c.logit_grad_of_copy, c)
            items.append((launches * HOST_PER_LAUNCH, gpu))
    return items


def measured_before(path: str, s: Shape, c: Ceilings = CEILINGS) -> Queue:
    """The queue of the code the 2026-11-26 run measured, from its launch counts."""
    launches = BEFORE_LAUNCHES[path]
    if path == "fused loss":
        items = _fused(s, row_tile=BEFORE_ROW_TILE[s.h], flush_rows=BEFORE_FLUSH_ROWS[s.h],
                       launches=launches, flush_launches=launches, exp_fraction=c.exp_rows_of_copy,
                       vectorised_scale=False, c=c)  # fmt: skip
    else:
        tile = BEFORE_SWEEP_TILE[s.n] if s.h == 4096 else (8192, 8192)
        items = _sweep(s, tile=tile, launches=launches, stats_fraction=c.stats_of_copy, c=c)
    return queue(items, prologue=BEFORE_PROLOGUE[path])


# ---------------------------------------------------------------- the design the engine moves to

AFTER_LAUNCHES_PER_TILE = 10
"""The bound the engine's rewrite targets: launches per row tile, whatever the user's loss."""
AFTER_FLUSH_LAUNCHES = 80
"""The user's loss and its ``autograd.grad``, the coefficients and the two GEMMs: once a flush."""
AFTER_PROLOGUE = 1.0e-3
"""The checks and setup in one kernel: an assumption of this prediction, not a measurement."""


def predicted_after(
    path: str, s: Shape, *, kernel_fraction: float | None = None, c: Ceilings = CEILINGS
) -> Queue:
    """The new design's queue: ``kernel_fraction`` of copy for the statistics and exp
    kernels (``None``: the fractions measured on 2026-11-26)."""
    if path == "fused loss":
        row_tile = 384 if s.h >= 4096 else 1024
        exp_fraction = c.exp_rows_of_copy if kernel_fraction is None else kernel_fraction
        items = _fused(s, row_tile=row_tile, flush_rows=3456 if s.h >= 4096 else 8192,
                       launches=AFTER_LAUNCHES_PER_TILE, flush_launches=AFTER_FLUSH_LAUNCHES,
                       exp_fraction=exp_fraction, vectorised_scale=True, c=c)  # fmt: skip
    else:
        stats_fraction = c.stats_of_copy if kernel_fraction is None else kernel_fraction
        tile = (min(s.n, 8192), 8192)  # rows inner at 32768: 8192-wide vocabulary tiles, not 2048
        items = _sweep(
            s, tile=tile, launches=AFTER_LAUNCHES_PER_TILE, stats_fraction=stats_fraction, c=c
        )
    return queue(items, prologue=AFTER_PROLOGUE)


def floor_ms(s: Shape, gemms: int, c: Ceilings = CEILINGS) -> float:
    """``gemms`` GEMM-equivalents at the measured bf16 -> fp32 rate (ms)."""
    return gemms * _mm(s.n, s.h, s.v, c.mm_fp32_out) * 1e3


def markdown() -> str:
    """The design page's launch tables."""
    lines = [
        "Reproduced: the code of 2026-11-26 (commit 49dd243), its launch counts and the kernel "
        "rates measured then:",
        "",
        "| path | shape (bf16) | launches / tile | host ms | GPU ms | model wall ms | busy "
        "| measured wall ms | model / measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (path, n, h, v), wall in MEASURED_WALL_MS.items():
        q = measured_before(path, Shape(n, h, v))
        lines.append(
            f"| {path} | {n}x{h}x{v} | {BEFORE_LAUNCHES[path]} | {q.host * 1e3:.1f} "
            f"| {q.gpu * 1e3:.1f} | {q.wall * 1e3:.1f} | {q.busy:.2f} | {wall:.1f} "
            f"| {q.wall * 1e3 / wall:.2f} |"
        )
    lines += [
        "",
        f"Predicted (not measured): at most {AFTER_LAUNCHES_PER_TILE} launches a tile, "
        f"the user's loss once a flush ({AFTER_FLUSH_LAUNCHES} launches), "
        f"a {AFTER_PROLOGUE * 1e3:.0f} ms prologue, the backward scale vectorised; "
        "the kernels at their measured fraction of copy, and at 0.85:",
        "",
        "| path | shape (bf16) | floor ms | wall ms (x floor), kernels as measured | busy "
        "| wall ms (x floor), kernels at 0.85 | busy | target x floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    targets = {("logprobs + entropy", 1024): "1.35", ("fused loss", 1024): "1.5"}
    for path, gemms in (("logprobs + entropy", 4), ("fused loss", 3)):
        for s in SHAPES:
            f = floor_ms(s, gemms)
            a, b = predicted_after(path, s), predicted_after(path, s, kernel_fraction=0.85)
            target = targets.get((path, s.h), "1.05" if gemms == 4 else "1.08")
            lines.append(
                f"| {path} | {s.n}x{s.h}x{s.v} | {f:.1f} "
                f"| {a.wall * 1e3:.1f} ({a.wall * 1e3 / f:.2f}x) | {a.busy:.2f} "
                f"| {b.wall * 1e3:.1f} ({b.wall * 1e3 / f:.2f}x) | {b.busy:.2f} | {target} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.parse_args(argv)
    print(markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
