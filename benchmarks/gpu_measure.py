"""What the GPU command measures first: the device's own ceilings at the shapes the
design uses, and what each Triton kernel reaches against them. Each row is appended to
``DIR/gpu_measure.jsonl`` as soon as it is measured.

    python -m benchmarks.gpu_measure --out DIR            # on CUDA
    python -m benchmarks.gpu_measure --dry --out DIR      # a CPU smoke run, tiny sizes

In order (``what`` of each row):

- ``mm``: the achieved throughput of ``torch.mm`` at the logits tile's shape of the
  Triton backend (8192 x 4096 x 151936 bf16: ``[8192, 4096] @ [4096, 8192]``):
  bf16 -> bf16 against bf16 -> fp32 (``out_dtype=torch.float32``); then the two
  gradient GEMMs (``dh = gz @ W``, ``dW = gz.T @ h``) with ``gz`` the doubled-stride
  bf16 view the in-place gradient leaves (row stride ``2 * cols``) against a
  contiguous ``gz``.
- ``copy``: the device's copy bandwidth (``dst.copy_(src)``, 1 GiB of fp32; bytes read plus
  written).
- ``kernel``: each Triton kernel on its own, as a fraction of that copy bandwidth,
  timed over ``BACK_TO_BACK`` (20) launches in a row, so that one launch's latency
  does not count (the copy too).
  The kernels are found by running the Triton backend's ``linear_logprobs`` (with and
  without the entropy, forward and backward) and ``fused_token_loss`` once at the
  target size and recording every kernel launch (Triton's launcher, any module);
  the largest launch per kernel and constexprs is then replayed alone. Bytes moved:
  the bytes of its tensor arguments as passed (the chunk it reads; an output it
  writes, in place or not, once more). A package may instead expose
  ``kernel_cases(device) -> [(name, launch, bytes)]`` in ``torch_impl.processors``: those
  are measured as given.
- ``floor``: the 3- and 4-GEMM floors at the target size (``benchmarks.methods``).

Method: ``--warmup`` untimed runs (compilation excluded), then the median of
``--runs`` runs timed with CUDA events. Nothing here is estimated: a row that did not
run says why.

Pass names for ``benchmarks.gpu_results``' measured-against-predicted table
(:func:`measured_passes`, milliseconds): ``"mm bf16->bf16"``, ``"mm bf16->fp32"``,
``"dh gemm strided"``, ``"dh gemm contiguous"``, ``"dW gemm strided"``, ``"dW gemm
contiguous"``, ``"copy 1024 MiB"``, ``"kernel <kernel>(<its flags>)"`` (e.g.
``"kernel _chunk_stats_kernel(PER_TOKEN_T=False,WITH_ENTROPY=True)"``), ``"floor3"``,
``"floor4"``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ._harness import ROOT

__all__ = [
    "BACK_TO_BACK",
    "DRY_SIZE",
    "RESULTS",
    "TARGET",
    "KernelCase",
    "chunk_shape",
    "main",
    "measure",
    "measured_passes",
    "recorded_kernel_cases",
    "time_ms",
]

RESULTS = "gpu_measure.jsonl"
TARGET = {"tokens": 8192, "hidden": 4096, "vocab": 151936, "dtype": "bf16"}
DRY_SIZE = {"tokens": 48, "hidden": 32, "vocab": 700, "dtype": "fp32"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One kernel to time alone: ``launch()`` runs it once; ``bytes`` it moves."""

    name: str
    launch: Callable[[], Any]
    bytes: int


def chunk_shape(n: int, vocab: int, device: str) -> tuple[int, int]:
    """``(rows, cols)`` of the Triton backend's fp32 logits tile in the vocabulary sweep,
    as the engine sizes it (``TILE_BYTES``; ``torch_impl.processors._geometry``)."""
    from torch_impl.processors._geometry import sweep_tile

    return sweep_tile(n, vocab, torch.device(device), triton=True, rows=None, cols=None)


BACK_TO_BACK = 20
"""Launches timed together for one kernel or copy time: one launch on an idle GPU
includes the launch latency (the 2026-11-26 run's 0.32 and 0.47 of copy bandwidth,
against 0.54 and 0.61 in the profiler)."""


def time_ms(
    fn: Callable[[], Any], *, device: str, runs: int, warmup: int, launches: int = 1
) -> float:
    """The median over ``runs`` runs (after ``warmup``) of the time of ``launches``
    back-to-back calls of ``fn()`` between two events, divided by ``launches`` (ms)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        if device == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(launches):
                fn()
            b.record()
            torch.cuda.synchronize()
            times.append(float(a.elapsed_time(b)) / launches)
        else:
            t0 = time.perf_counter()
            for _ in range(launches):
                fn()
            times.append(1e3 * (time.perf_counter() - t0) / launches)
    return statistics.median(times)


@contextlib.contextmanager
def _recording() -> Iterator[list[tuple[Any, Any, tuple[Any, ...], dict[str, Any]]]]:
    """Every Triton launch in the block: ``(kernel, grid, args, kwargs)``, compiled
    (``JITFunction``) or interpreted (``InterpretedFunction``), run as usual."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    got: list[tuple[Any, Any, tuple[Any, ...], dict[str, Any]]] = []
    saved = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def spy_of(real: Callable[..., Any]) -> Callable[..., Any]:
        def spy(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            if not warmup:
                got.append((self, grid, args, kwargs))
            return real(self, *args, grid=grid, warmup=warmup, **kwargs)

        return spy

    for cls, real in saved.items():
        cls.run = spy_of(real)  # type: ignore[method-assign]
    try:
        yield got
    finally:
        for cls, real in saved.items():
            cls.run = real  # type: ignore[method-assign]


def _bytes_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    return sum(
        a.numel() * a.element_size()
        for a in (*args, *kwargs.values())
        if isinstance(a, torch.Tensor)
    )


def recorded_kernel_cases(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> list[KernelCase]:
    """The Triton backend's kernels, found by running it once (see the module docstring):
    per kernel and constexprs, the first launch on a full chunk, replayable."""
    from torch_impl.processors import LinearOptions, fused_token_loss, linear_logprobs

    triton = LinearOptions(backend="triton")
    with _recording() as got:
        for entropy in (True, False):
            hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
            r = linear_logprobs(hh, ww, y, with_entropy=entropy, options=triton)
            (r.logprobs.sum() + (r.entropy.sum() if r.entropy is not None else 0.0)).backward()
        for entropy_grad in (True, False):  # two passes a tile, and the single pass
            hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
            loss = (
                (lambda lp, ent, rows: (lp - 0.01 * ent).sum())
                if entropy_grad
                else (lambda lp, ent, rows: lp.sum())
            )
            fused_token_loss(
                hh, ww, y, loss, options=triton, entropy_grad=entropy_grad
            ).loss.backward()
    cases: dict[str, KernelCase] = {}
    biggest: dict[str, int] = {}
    for fn, grid, args, kwargs in got:
        flags = ",".join(f"{k}={v}" for k, v in sorted(kwargs.items()) if isinstance(v, bool))
        name = f"{fn.__name__}({flags})" if flags else fn.__name__
        size = _bytes_of(args, kwargs)
        if size <= biggest.get(name, 0):
            continue  # keep the largest launch: a full chunk, not a remainder
        biggest[name] = size

        def launch(fn: Any = fn, grid: Any = grid, args: Any = args, kwargs: Any = kwargs) -> None:
            type(fn).run(fn, *args, grid=grid, warmup=False, **kwargs)

        cases[name] = KernelCase(name, launch, size)
    return list(cases.values())


def _cases(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[list[KernelCase], str]:
    import torch_impl.processors as processors

    given = getattr(processors, "kernel_cases", None)
    if callable(given):
        return [KernelCase(*c) for c in given(h.device)], "torch_impl.processors.kernel_cases"
    return recorded_kernel_cases(h, w, y), "recorded from one run of the Triton backend"


def _append(out: Path | None, row: dict[str, Any]) -> dict[str, Any]:
    text = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
    print(f"  {text}", flush=True)
    if out is not None:
        with (out / RESULTS).open("a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def measure(
    size: dict[str, Any], *, device: str, runs: int, warmup: int, out: Path | None
) -> list[dict[str, Any]]:
    """Every row of the module docstring at ``size``, each appended as it is measured."""
    dtype = DTYPES[size["dtype"]]
    n, hid, v = size["tokens"], size["hidden"], size["vocab"]
    rows, cols = chunk_shape(n, v, device)
    fields = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "CPU",
        "dtype": size["dtype"],
    }
    got: list[dict[str, Any]] = []

    def row(**kw: Any) -> None:
        got.append(_append(out, {**fields, **kw}))

    PerMs = Callable[[float], dict[str, Any]] | None

    def timed(
        what: str,
        case: str,
        fn: Callable[[], Any],
        per_ms: PerMs = None,
        launches: int = 1,
        **kw: Any,
    ) -> float | None:
        """Time ``fn`` (``launches`` back to back) and append its row (with
        ``per_ms(t)``'s fields), or why it did not run."""
        if launches > 1:
            kw["launches"] = launches
        try:
            t = time_ms(fn, device=device, runs=runs, warmup=warmup, launches=launches)
        except Exception as exc:  # a row that did not run says why
            row(
                what=what,
                case=case,
                error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}",
                **kw,
            )
            return None
        row(what=what, case=case, time_ms=t, **kw, **(per_ms(t) if per_ms else {}))
        return t

    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(n, hid, device=device, generator=g).to(dtype)
    w = (torch.randn(v, hid, device=device, generator=g) * hid**-0.5).to(dtype)
    y = torch.randint(0, v, (n,), device=device, generator=g)
    hs, wc = h[:rows], w[:cols]
    flop = 2.0 * rows * cols * hid
    shape = f"{rows}x{cols}x{hid}"

    def tflops(t: float) -> dict[str, Any]:
        return {"tflops": flop / t / 1e9}

    dt = size["dtype"]
    # the logits GEMM: out in the operands' dtype against fp32 out
    timed("mm", f"mm {dt}->{dt}", lambda: torch.mm(hs, wc.T), tflops, shape=shape)
    to_fp32 = f"mm {dt}->fp32" if dt != "fp32" else "mm fp32->fp32 (out_dtype)"
    timed("mm", to_fp32, lambda: torch.mm(hs, wc.T, out_dtype=torch.float32), tflops, shape=shape)
    # the gradient GEMMs on the in-place gradient's doubled-stride view, and contiguous
    buf = torch.randn(rows, 2 * cols, device=device, generator=g).to(dtype)
    for layout, gz in (("strided", buf[:, :cols]), ("contiguous", buf[:, :cols].contiguous())):
        stride = list(gz.stride())
        timed(
            "mm",
            f"dh gemm {layout}",
            lambda gz=gz: torch.mm(gz, wc),
            tflops,
            shape=shape,
            stride=stride,
        )
        timed(
            "mm",
            f"dW gemm {layout}",
            lambda gz=gz: torch.mm(gz.T, hs),
            tflops,
            shape=shape,
            stride=stride,
        )
    del buf
    # the copy bandwidth (bytes read plus written)
    numel = (1 << 30) // 4 if device == "cuda" else 1 << 20
    src = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    moved = 2 * src.nbytes
    t_copy = timed("copy", f"copy {src.nbytes >> 20} MiB", lambda src=src, dst=dst: dst.copy_(src),
                   lambda t: {"gbps": moved / t / 1e6}, launches=BACK_TO_BACK,
                   bytes=moved)  # fmt: skip
    copy_gbps = None if t_copy is None else moved / t_copy / 1e6
    del src, dst
    # each Triton kernel alone, against the copy bandwidth
    try:
        cases, source = _cases(h, w, y)
    except Exception as exc:
        row(
            what="kernel",
            case="(none)",
            error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}",
        )
        cases, source = [], ""
    for c in cases:

        def bandwidth(t: float, c: KernelCase = c) -> dict[str, Any]:
            gbps = c.bytes / t / 1e6
            return {"gbps": gbps, **({"of_copy": gbps / copy_gbps} if copy_gbps else {})}

        timed(
            "kernel",
            f"kernel {c.name}",
            c.launch,
            bandwidth,
            BACK_TO_BACK,
            bytes=c.bytes,
            source=source,
        )
    # the floors at the size
    from .methods import floor3, floor4

    for name, floor in (("floor3", floor3), ("floor4", floor4)):
        hh, ww = h.detach().clone(), w.detach().clone()
        timed(
            "floor",
            name,
            lambda floor=floor, hh=hh, ww=ww: floor(hh, ww, y),
            gemms=int(name[-1]),
            shape=f"{n}x{v}x{hid}",
        )
    return got


def measured_passes(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``{pass name: ms}`` of one run's rows (the names of the module docstring)."""
    return {r["case"]: float(r["time_ms"]) for r in rows if "time_ms" in r and not r.get("error")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--dry", action="store_true", help="on the CPU, tiny sizes (a smoke run)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu")
    args = ap.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        print("gpu_measure: no CUDA device here: nothing measured (--dry for a CPU smoke run)")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.dry else "cuda"
    size = DRY_SIZE if args.dry else TARGET
    print(f"== gpu_measure at {size} on {device}", flush=True)
    measure(
        size,
        device=device,
        runs=2 if args.dry else args.runs,
        warmup=1 if args.dry else args.warmup,
        out=args.out,
    )
    print(f"gpu_measure: rows in {args.out / RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
