"""A byte and flop model of each pass of the engine on a GPU, per candidate design,
and the time it predicts on an H100 and an H200 from three measured ceilings.

Every GEMM is priced by its roofline, ``max(flops / GEMM_FLOPS, bytes / COPY_BW)``
(its operands read once, its output written once, an accumulator also read); every
memory-bound pass by its bytes over the copy bandwidth, or by its instruction issue
where that is slower (the statistics kernel with a cross-warp reduction per step).
Launch overheads and the small per-row work (``[n]`` vectors) are left out. The tile
sizes are the code's (:mod:`torch_impl.processors._geometry`), so that the design
page (``docs/gpu-design.md``, whose tables ``python -m benchmarks.gpu_model
--markdown`` prints) cannot drift from what runs.

Predictions, not measurements: ``docs/gpu-results.md`` holds what a GPU measured.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence

import torch

from torch_impl.processors import _geometry as geometry

__all__ = [
    "DESIGNS",
    "DEVICES",
    "DEVICE_CLASSES",
    "WORKLOAD",
    "Device",
    "Pass",
    "Prediction",
    "Workload",
    "markdown",
    "predict",
    "predicted_ms",
]


@dataclasses.dataclass(frozen=True)
class Device:
    """The ceilings a prediction uses (measured on that part, see the design page)."""

    name: str
    gemm_flops: float  # bf16 torch.mm, 8192^3, flop/s
    copy_bw: float  # device-to-device copy, bytes read + written per second
    sms: int
    clock_hz: float  # sustained SM clock under load


DEVICES = (
    Device("H100", gemm_flops=800e12, copy_bw=3.0e12, sms=132, clock_hz=1.575e9),
    Device("H200", gemm_flops=800e12, copy_bw=4.3e12, sms=132, clock_hz=1.575e9),
)


@dataclasses.dataclass(frozen=True)
class Workload:
    n: int = 8192  # tokens
    h: int = 4096  # hidden
    v: int = 151936  # vocabulary (one shard at tp = 1)
    elt: int = 2  # bf16
    bias: bool = False  # an output-layer bias: an add per logit, a column sum per gradient tile
    softcap: bool = False  # a final-logit softcap: a tanh an element in each kernel, no byte more


WORKLOAD = Workload()

STATS_RATE_REDUCING = 3.3
"""Elements per clock per SM of a statistics kernel with four cross-warp reductions
per 4 x 1024 step (618 SASS instructions per warp per 512 elements)."""

STATS_RATE_PER_LANE = 8.0
"""Elements per clock per SM of the per-lane statistics kernel: about 16 instructions
per element (load, scale, compare, one exponential, three selects, three FMAs, the
max), 128 lanes issuing per clock, no cross-warp reduction in the loop."""


@dataclasses.dataclass(frozen=True)
class Pass:
    """One pass, repeated ``count`` times: ``flops`` (0: memory-bound), ``bytes`` moved,
    and for a kernel bound by instruction issue, the elements it touches and its rate."""

    name: str
    count: int
    flops: float
    bytes: float
    elements: float = 0.0
    rate: float = 0.0  # elements per clock per SM; 0: not issue-bound

    def seconds(self, dev: Device) -> float:
        t = max(self.flops / dev.gemm_flops, self.bytes / dev.copy_bw)
        if self.rate:
            t = max(t, self.elements / (self.rate * dev.sms * dev.clock_hz))
        return self.count * t


SOFTCAP_ISSUE = {"statistics": (10.8, 3.3), "gradient": (12.0, 3.1), "exp": (10.0, 3.2)}
"""What a softcap adds to each kernel an element: SASS instructions, and the kernel's
special-function (MUFU) results an element with it; counted in the sm_90 compile with
Triton 3.6 (docs/gpu-design.md, "A softcap's cost"), not timed."""

KERNEL_SASS = {"gradient": 14.2, "exp": 10.5}
"""The plain gradient and ``exp_rows`` kernels' SASS an element (compiled, sm_90); the
statistics kernel's issue is :data:`STATS_RATE_PER_LANE`'s."""


def _capped(w: Workload, p: Pass, kernel: str) -> Pass:
    """``p`` with a softcap: issue-bound at ``min(128 / SASS, 16 / MUFU)`` elements a
    clock an SM (128 lanes issue a clock, 16 MUFU results), its bytes unchanged."""
    if not w.softcap:
        return p
    sass = (128 / p.rate if p.rate else KERNEL_SASS[kernel]) + SOFTCAP_ISSUE[kernel][0]
    rate = min(128 / sass, 16 / SOFTCAP_ISSUE[kernel][1])
    elements = p.elements or p.bytes / (6 if kernel != "statistics" else 4)
    return dataclasses.replace(p, name=p.name + " + softcap", elements=elements, rate=rate)


@dataclasses.dataclass(frozen=True)
class Prediction:
    design: str
    floor_gemms: int
    passes: tuple[Pass, ...]
    peak_extra_bytes: float

    def seconds(self, dev: Device) -> float:
        return sum(p.seconds(dev) for p in self.passes)

    def floor(self, dev: Device, w: Workload = WORKLOAD) -> float:
        return self.floor_gemms * 2 * w.n * w.h * w.v / dev.gemm_flops

    def ratio(self, dev: Device) -> float:
        return self.seconds(dev) / self.floor(dev)


def _gemm(
    name: str,
    m: int,
    k: int,
    n: int,
    *,
    out: int,
    elt: int,
    accumulate: bool = False,
    count: int = 1,
) -> Pass:
    """``[m, k] @ [k, n]`` with ``elt``-byte operands and an ``out``-byte output."""
    moved = (m * k + k * n) * elt + m * n * out * (2 if accumulate else 1)
    return Pass(name, count, 2.0 * m * k * n, moved)


def _tiles(total: int, size: int) -> list[tuple[int, int]]:
    """``[(size of a tile, how many)]`` covering ``total``."""
    full, rest = divmod(total, size)
    return [(size, full)] + ([(rest, 1)] if rest else [])


_CUDA = torch.device("cuda")


def logprobs_entropy(w: Workload = WORKLOAD) -> Prediction:
    """``linear_logprobs`` with entropy, Triton backend: the vocabulary sweep, four GEMMs."""
    rows, cols = geometry.sweep_tile(w.n, w.v, _CUDA, triton=True, rows=None, cols=None)
    passes: list[Pass] = []
    for c, k in _tiles(w.v, cols):
        for r, _ in _tiles(w.n, rows):
            logits = _gemm("logits (forward)", r, w.h, c, out=4, elt=w.elt, count=k)
            stats = Pass(
                "statistics kernel: read the tile", k, 0, r * c * 4, r * c, STATS_RATE_PER_LANE
            )
            passes += [logits, _capped(w, stats, "statistics")]
            passes += [dataclasses.replace(logits, name="logits (backward)")]
            grad = Pass("gradient kernel: read fp32, write bf16 in place", k, 0, r * c * 6)
            passes += [_capped(w, grad, "gradient")]
            passes += [
                _gemm("dh += gz @ W[cols]", r, c, w.h, out=4, elt=w.elt, accumulate=True, count=k)
            ]
            passes += [_gemm("dW[cols] = gz.T @ h", c, r, w.h, out=w.elt, elt=w.elt, count=k)]
            passes += _bias_passes(w, r, c, k, twice=True)
    peak = (
        rows * cols * 4 + w.n * w.h * 4 + w.v * w.h * w.elt + w.n * w.h * w.elt + w.bias * w.v * 8
    )
    return Prediction("logprobs + entropy" + _with(w), 4, _merge(passes), peak)


def _with(w: Workload) -> str:
    return ", with a bias" * w.bias + ", with a softcap" * w.softcap


def _bias_passes(w: Workload, r: int, c: int, k: int, *, twice: bool = False) -> list[Pass]:
    """A bias on ``k`` tiles ``[r, c]``: ``b`` added to the fp32 logits tile (read and
    written; ``twice``: the backward's recomputed tile too), and ``db`` the column sum
    of the gradient tile (a GEMV reading it once; memory-bound: no GEMM flops)."""
    if not w.bias:
        return []
    add = Pass("bias add: read and write the fp32 tile", k * (1 + twice), 0, r * c * 8 + c * 4)
    return [add, Pass("db += column sum of the gradient (GEMV)", k, 0, r * c * w.elt + c * 8)]


def _row_sweep(w: Workload, *, epilogue: Callable[[int], list[Pass]], design: str) -> Prediction:
    rows = geometry.row_tile(w.n, w.v, _CUDA, rows=None)
    buffer = geometry.grad_capacity(w.n, w.v, rows, w.elt, _CUDA)
    passes: list[Pass] = []
    for r, k in _tiles(w.n, rows):
        passes.append(_gemm("logits", r, w.h, w.v, out=4, elt=w.elt, count=k))
        passes += [dataclasses.replace(p, count=p.count * k) for p in epilogue(r)]
        passes += _bias_passes(w, r, w.v, k)[:1]
    for i, (g, k) in enumerate(_tiles(w.n, buffer)):
        passes += _bias_passes(w, g, w.v, k)[1:]
        passes.append(_gemm("dh = G @ W", g, w.v, w.h, out=4, elt=w.elt, count=k))
        first = i == 0
        passes.append(
            _gemm("dW += G.T @ h", w.v, g, w.h, out=w.elt, elt=w.elt, accumulate=not first, count=1)
        )
        if k > 1:  # the full buffers after the first accumulate
            passes.append(
                _gemm(
                    "dW += G.T @ h", w.v, g, w.h, out=w.elt, elt=w.elt, accumulate=True, count=k - 1
                )
            )
    passes.append(Pass("backward: dW *= incoming gradient", 1, 0, 2 * w.v * w.h * w.elt))
    peak = (
        rows * w.v * 4
        + buffer * w.v * w.elt
        + w.v * w.h * w.elt
        + w.n * w.h * (4 + w.elt)
        + w.bias * w.v * 8
    )
    return Prediction(design + _with(w), 3, _merge(passes), peak)


def fused_single_pass(w: Workload = WORKLOAD) -> Prediction:
    """The fused loss without an entropy gradient (GRPO, cross entropy), Triton
    backend: one epilogue pass (read fp32, write ``E`` in bf16) a tile."""
    return _row_sweep(
        w,
        epilogue=lambda r: [
            _capped(w, Pass("exp kernel: read fp32, write E (bf16)", 1, 0, r * w.v * 6), "exp")
        ],
        design="fused loss, single pass (chosen)",
    )


def fused_two_pass(w: Workload = WORKLOAD) -> Prediction:
    """The fused loss with an entropy gradient: statistics, then the gradient."""
    return _row_sweep(
        w,
        epilogue=lambda r: [
            Pass(
                "statistics kernel: read the tile", 1, 0, r * w.v * 4, r * w.v, STATS_RATE_PER_LANE
            ),
            Pass("gradient kernel: read fp32, write bf16 into G", 1, 0, r * w.v * 6),
        ],
        design="fused loss, two passes (entropy gradient)",
    )


def fused_label_smoothing(w: Workload = WORKLOAD) -> Prediction:
    """The fused loss with label smoothing: the two passes, the statistics kernel adding
    each logit to one more per-lane sum (one add more of its ~16 instructions an
    element, the same bytes); the gradient kernel's per-row term is ``[n]`` work."""
    return _row_sweep(
        w,
        epilogue=lambda r: [
            Pass(
                "statistics kernel + logit sum: read the tile",
                1,
                0,
                r * w.v * 4,
                r * w.v,
                STATS_RATE_PER_LANE * 16 / 17,
            ),
            Pass("gradient kernel: read fp32, write bf16 into G", 1, 0, r * w.v * 6),
        ],
        design="fused loss, label smoothing (two passes)",
    )


def fused_before(w: Workload = WORKLOAD) -> Prediction:
    """The previous design: 1 GiB tiles of 1766 rows, the gradient in place, ``dh`` per
    tile, an fp32 ``dW`` accumulator written by every tile and cast at the end, the
    statistics kernel with cross-warp reductions."""
    rows = (1 << 30) // 4 // w.v
    passes: list[Pass] = []
    for i, (r, k) in enumerate(_tiles(w.n, rows)):
        passes.append(_gemm("logits", r, w.h, w.v, out=4, elt=w.elt, count=k))
        passes.append(
            Pass("statistics kernel (reductions)", k, 0, r * w.v * 4, r * w.v, STATS_RATE_REDUCING)
        )
        passes.append(Pass("gradient kernel in place", k, 0, r * w.v * 6))
        passes.append(_gemm("dh = gz @ W", r, w.v, w.h, out=4, elt=w.elt, count=k))
        acc = _gemm(
            "dW += gz.T @ h (fp32)", w.v, r, w.h, out=4, elt=w.elt, accumulate=i > 0, count=k
        )
        passes.append(acc)
    passes.append(Pass("cast dW to bf16", 1, 0, w.v * w.h * (4 + w.elt)))
    passes.append(Pass("backward: dW *= incoming gradient", 1, 0, 2 * w.v * w.h * w.elt))
    peak = rows * w.v * 4 + w.v * w.h * (4 + w.elt) + w.n * w.h * (4 + w.elt)
    return Prediction("fused loss, before", 3, _merge(passes), peak)


def fused_buffer_two_pass_reducing(w: Workload = WORKLOAD) -> Prediction:
    """Candidate: the bf16 gradient buffer and full-shape ``dh``/``dW`` GEMMs, with the
    statistics kernel's cross-warp reductions kept (no per-lane accumulators)."""
    return _row_sweep(
        w,
        epilogue=lambda r: [
            Pass("statistics kernel (reductions)", 1, 0, r * w.v * 4, r * w.v, STATS_RATE_REDUCING),
            Pass("gradient kernel: read fp32, write bf16 into G", 1, 0, r * w.v * 6),
        ],
        design="candidate: gradient buffer, reducing statistics kernel",
    )


def _merge(passes: Sequence[Pass]) -> tuple[Pass, ...]:
    """Passes of the same name and shape summed into one row."""
    out: dict[tuple[str, float, float, float], Pass] = {}
    for p in passes:
        key = (p.name, p.flops, p.bytes, p.rate)
        out[key] = dataclasses.replace(p, count=out[key].count + p.count) if key in out else p
    return tuple(out.values())


DEVICE_CLASSES = tuple(d.name for d in DEVICES)


def predicted_ms(device_class: str, w: Workload = WORKLOAD) -> dict[str, float]:
    """The model's time of each pass ``benchmarks.gpu_measure`` measures first, by its
    name there (``{}`` for a class the model has no ceilings for): the vocabulary
    sweep's tile GEMMs, the copy, the floors. The kernels' is their bytes at the copy
    bandwidth (a fraction of 1.0 of it), stated on the design page."""
    dev = {d.name: d for d in DEVICES}.get(device_class)
    if dev is None:
        return {}
    rows, cols = geometry.sweep_tile(w.n, w.v, _CUDA, triton=True, rows=None, cols=None)
    logits = _gemm("", rows, w.h, cols, out=4, elt=w.elt)
    dh = _gemm("", rows, cols, w.h, out=4, elt=w.elt)
    dw = _gemm("", cols, rows, w.h, out=w.elt, elt=w.elt)
    floor = 2 * w.n * w.h * w.v / dev.gemm_flops
    out = {
        "mm bf16->fp32": logits.seconds(dev),
        "mm bf16->bf16": dataclasses.replace(logits, bytes=logits.bytes - rows * cols * 2).seconds(
            dev
        ),
        "dh gemm strided": dh.seconds(dev),
        "dh gemm contiguous": dh.seconds(dev),
        "dW gemm strided": dw.seconds(dev),
        "dW gemm contiguous": dw.seconds(dev),
        "copy 1024 MiB": 2 * (1 << 30) / dev.copy_bw,
        "floor3": 3 * floor,
        "floor4": 4 * floor,
    }
    return {k: v * 1e3 for k, v in out.items()}


DESIGNS: dict[str, Callable[[], Prediction]] = {
    "logprobs_entropy": logprobs_entropy,
    "fused_single_pass": fused_single_pass,
    "fused_two_pass": fused_two_pass,
    "fused_label_smoothing": fused_label_smoothing,
    "fused_before": fused_before,
    "fused_buffer_reducing": fused_buffer_two_pass_reducing,
    "logprobs_entropy_bias": lambda: logprobs_entropy(Workload(bias=True)),
    "fused_single_pass_bias": lambda: fused_single_pass(Workload(bias=True)),
    "logprobs_entropy_softcap": lambda: logprobs_entropy(Workload(softcap=True)),
    "fused_single_pass_softcap": lambda: fused_single_pass(Workload(softcap=True)),
}


def predict(design: str) -> Prediction:
    return DESIGNS[design]()


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def markdown() -> str:
    """The design page's tables."""
    lines = [
        "| design | floor | "
        + " | ".join(f"{d.name} ms (x floor)" for d in DEVICES)
        + " | peak extra |"
    ]
    lines.append("|---|---|" + "---|" * len(DEVICES) + "---|")
    for key in DESIGNS:
        p = predict(key)
        cells = [f"{_ms(p.seconds(d))} ({p.ratio(d):.3f}x)" for d in DEVICES]
        lines.append(
            f"| {p.design} | {p.floor_gemms} GEMMs, {_ms(p.floor(DEVICES[0]))} ms | "
            + " | ".join(cells)
            + f" | {p.peak_extra_bytes / 1e9:.2f} GB |"
        )
    for key in ("logprobs_entropy", "fused_single_pass"):
        p = predict(key)
        lines += ["", f"Passes of *{p.design}*:", ""]
        lines.append(
            "| pass | times | GFLOP | GB | " + " | ".join(f"{d.name} ms" for d in DEVICES) + " |"
        )
        lines.append("|---|---|---|---|" + "---|" * len(DEVICES))
        for q in p.passes:
            lines.append(
                f"| {q.name} | {q.count} | {q.count * q.flops / 1e9:.0f} "
                f"| {q.count * q.bytes / 1e9:.2f} | "
                + " | ".join(_ms(q.seconds(d)) for d in DEVICES)
                + " |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the design page's tables")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown())
        return 0
    for key in DESIGNS:
        p = predict(key)
        print(
            p.design,
            *(f"{d.name} {p.ratio(d):.3f}x" for d in DEVICES),
            f"{p.peak_extra_bytes / 1e9:.2f} GB",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
