"""Test support: every Triton launch the GPU benchmark and the GPU tests make, recorded
on a CPU.

Each scenario is a call the GPU command makes, through the public API, at its real
size and dtype, on a fake CUDA device (``tests/support/fake_cuda.py``): the processors take
their CUDA branches (``backend="auto"`` -> Triton, 1 GiB chunks, the GPU kernel
config, bf16 gradients written in place), the kernels are recorded, not run, and
backward runs through the graph by hand. So the launches are the GPU's, with the
GPU's constexprs, dtypes and divisibility, whatever module defines the kernels.

- ``bench:<method>:<size>``: each Triton method of ``benchmarks.gpu_methods.METHODS``
  (the method function itself) at each size of ``benchmarks.gpu_logprobs.SIZES`` that
  runs it (``methods_at``: the sampling-replay methods at the peaked size only);
- ``gpu-test:...``: the shapes, dtypes and options of the gpu-marked tests that call
  the processors' tensor functions (``tests/processors/test_gpu_checks.py``,
  ``tests/processors/test_processors_triton.py``);
- ``processor:...``: every processor and tensor function of ``tests/processors/test_host_reads.py``
  at a small awkward size (what the Megatron GPU tests run on their tiny models), in
  bf16 and fp32.

    python -m tests.support.launch_scenarios      # print the launched specialisations
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .fake_cuda import Launch, backward, fake_cuda, record_launches

__all__ = ["SCENARIOS", "STOPPED_BY_A_HOST_READ", "record_all", "unique"]

Scenario = Callable[[], None]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IGNORE = -100


def _inputs(
    n: int, h: int, v: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hid = torch.zeros(n, h, dtype=dtype, device="cuda").requires_grad_()
    w = torch.zeros(v, h, dtype=dtype, device="cuda").requires_grad_()
    return hid, w, torch.zeros(n, dtype=torch.long, device="cuda")


def _backward(*outs: torch.Tensor | None) -> None:
    """Ones as cotangents on every output that carries a gradient (the benchmark's)."""
    roots = [(o, torch.ones_like(o)) for o in outs if o is not None and o.requires_grad]
    if roots:
        backward(roots)


def _bench(method: str, size: dict[str, Any]) -> Scenario:
    def run() -> None:
        from benchmarks.gpu_methods import METHODS

        hid, w, y = _inputs(size["tokens"], size["hidden"], size["vocab"], DTYPES[size["dtype"]])
        _backward(*METHODS[method].fn(hid, w, y))

    return run


def _logprobs(
    n: int,
    h: int,
    v: int,
    dtype: torch.dtype,
    backend: str,
    *,
    grad: bool = True,
    softcap: float | None = None,
) -> Scenario:
    def run() -> None:
        from torch_impl.processors import LinearOptions, linear_logprobs

        hid, w, y = _inputs(n, h, v, dtype)
        with contextlib.nullcontext() if grad else torch.no_grad():
            options = LinearOptions(backend=backend, softcap=softcap)  # type: ignore[arg-type]
            r = linear_logprobs(hid, w, y, with_entropy=True, options=options)
        if grad:
            _backward(r.logprobs, r.entropy)

    return run


def _fused(
    n: int,
    h: int,
    v: int,
    dtype: torch.dtype,
    backend: str,
    *,
    per_token_t: bool,
    entropy_grad: bool = True,
    softcap: float | None = None,
) -> Scenario:
    def run() -> None:
        from torch_impl.processors import LinearOptions, fused_token_loss

        hid, w, y = _inputs(n, h, v, dtype)
        t: Any = torch.ones(n, device="cuda") if per_token_t else 1.0

        def loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
            return (lp - 0.1 * ent**2).sum() if entropy_grad else lp.sum()

        options = LinearOptions(
            temperature=t,
            backend=backend,  # type: ignore[arg-type]
            softcap=softcap,
        )
        _backward(
            fused_token_loss(hid, w, y, loss, options=options, entropy_grad=entropy_grad).loss
        )

    return run


def _smoothed(
    n: int, h: int, v: int, dtype: torch.dtype, *, softcap: float | None, fused: bool
) -> Scenario:
    """The mean logit (label smoothing) with class weights and a bias: the statistics
    kernel's ``WITH_SUM``/``WEIGHTED`` and the gradient kernel's ``WITH_U``."""

    def run() -> None:
        from torch_impl.processors import LinearOptions, fused_token_loss, linear_logprobs

        hid, w, y = _inputs(n, h, v, dtype)
        cw, b = (
            torch.rand(v, device="cuda"),
            torch.zeros(v, device="cuda", dtype=dtype, requires_grad=True),
        )
        options = LinearOptions(backend="triton", softcap=softcap)
        if fused:
            r = fused_token_loss(
                hid, w, y, lambda lp, _, rows: lp.sum(), options=options, bias=b,
                mean_logit_loss=lambda m, rows: m.sum(), mean_logit_weights=cw,
            )  # fmt: skip
            _backward(r.loss)
        else:
            r2 = linear_logprobs(
                hid, w, y, options=options, bias=b, with_mean_logit=True, mean_logit_weights=cw
            )
            _backward(r2.logprobs, r2.mean_logit)

    return run


def _processor(name: str, dtype: torch.dtype, backend: str | None) -> Scenario:
    def run() -> None:
        from tests.processors import test_host_reads as hr

        call = hr.PROCESSORS.get(name) or hr.TENSOR_FUNCTIONS[name]
        d = hr._data("cuda")
        d["h_leaf"] = d["h"].to(dtype).requires_grad_()
        d["w_leaf"] = d["w"].to(dtype).requires_grad_()
        _backward(hr._loss(call(d, backend)))  # type: ignore[arg-type]

    return run


def _scenarios() -> dict[str, Scenario]:
    from benchmarks.gpu_logprobs import SIZES, methods_at
    from benchmarks.gpu_methods import METHODS

    out: dict[str, Scenario] = {}
    for size in SIZES:  # each Triton method at the sizes the benchmark runs it
        tag = f"{size['tokens']}x{size['hidden']}x{size['vocab']} {size['dtype']}"
        for m in methods_at(size, list(METHODS)):
            if METHODS[m].backend == "triton":
                out[f"bench:{m}:{tag}"] = _bench(m, size)
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    for backend in ("triton", "auto"):
        out[f"gpu-test:checks logprobs 2053x1024x32771 bf16 {backend}"] = _logprobs(
            2053, 1024, 32771, bf16, backend
        )
        out[f"gpu-test:checks fused 2053x1024x32771 bf16 {backend}"] = _fused(
            2053, 1024, 32771, bf16, backend, per_token_t=False
        )
    out["gpu-test:checks graph 1031x512x20011 bf16 no grad"] = _logprobs(
        1031, 512, 20011, bf16, "triton", grad=False
    )
    for dt in (bf16, fp32):
        out[f"gpu-test:checks fused vs float64 4099x1000x32771 {dt}"] = _fused(
            4099, 1000, 32771, dt, "triton", per_token_t=False
        )
        out[f"gpu-test:triton fused per-token T 4099x1000x32771 {dt}"] = _fused(
            4099, 1000, 32771, dt, "triton", per_token_t=True
        )
        for per_token_t in (False, True):  # the single pass (no entropy gradient)
            out[f"gpu-test:fused single pass T per token {per_token_t} 4099x1000x32771 {dt}"] = (
                _fused(4099, 1000, 32771, dt, "triton", per_token_t=per_token_t, entropy_grad=False)
            )
    for n, h, v, dt in ((4099, 1000, 32771, bf16), (8192, 4096, 151936, bf16),
                        (2048, 1024, 65536, fp16), (1021, 512, 20011, fp32)):  # fmt: skip
        out[f"gpu-test:triton three-way {n}x{h}x{v} {dt}"] = _logprobs(n, h, v, dt, "auto")
    # a softcap's specialisations (SOFTCAP=True), compiled though the GPU command runs none
    out["softcap:logprobs 2053x1024x32771 bf16"] = _logprobs(
        2053, 1024, 32771, bf16, "triton", softcap=30.0
    )
    for eg in (False, True):
        out[f"softcap:fused entropy_grad {eg} 4099x1000x32771 bf16"] = _fused(
            4099, 1000, 32771, bf16, "triton", per_token_t=True, entropy_grad=eg, softcap=30.0
        )
    for cap in (None, 30.0):  # label smoothing's mean logit, weighted, with and without a cap
        for fused in (False, True):
            out[
                f"mean-logit:{'fused' if fused else 'logprobs'} softcap {cap} 2053x1024x32771 bf16"
            ] = _smoothed(2053, 1024, 32771, bf16, softcap=cap, fused=fused)
    from tests.processors import test_host_reads as hr

    for dt in (bf16, fp32):
        for name in hr.PROCESSORS:
            out[f"processor:{name} {dt}"] = _processor(name, dt, None)
        for name in hr.TENSOR_FUNCTIONS:
            if name in hr.WITH_BACKEND:
                out[f"processor:{name} {dt}"] = _processor(name, dt, "triton")
    return out


SCENARIOS: dict[str, Scenario] = {}
STOPPED_BY_A_HOST_READ: list[str] = []
"""The scenarios of the last :func:`record_all` that a host read ended early."""


@contextlib.contextmanager
def _interpreting() -> Iterator[None]:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "on", "yes"):
        raise RuntimeError("record under TRITON_INTERPRET=1 (set before triton kernels are made)")
    yield


def record_all(names: list[str] | None = None) -> list[Launch]:
    """Every launch of every scenario (or of ``names``), in order, each tagged with its scenario."""
    if not SCENARIOS:
        SCENARIOS.update(_scenarios())
    from torch._subclasses.fake_tensor import DataDependentOutputException

    launches: list[Launch] = []
    stopped = STOPPED_BY_A_HOST_READ
    stopped.clear()
    from benchmarks import gpu_methods

    cached = dict(
        gpu_methods._BATCH
    )  # the benchmark caches its loss batch per size: fake ones here
    with _interpreting(), fake_cuda():  # one mode: no fake tensor may outlive its mode
        for name, run in SCENARIOS.items():
            if names is not None and name not in names:
                continue
            with record_launches(run=False) as got:
                try:
                    run()
                except DataDependentOutputException:
                    # a host read (tests/processors/test_host_reads.py fails for it) ends the
                    # call on fake tensors; the launches before it count
                    stopped.append(name)
            for launch in got:
                launch.scenario = name
            launches += got
    gpu_methods._BATCH.clear()
    gpu_methods._BATCH.update(cached)
    return launches


def unique(launches: list[Launch]) -> list[tuple[Launch, int]]:
    """One launch per specialisation (the first seen) and how many launches share it."""
    first: dict[str, tuple[Launch, int]] = {}
    for launch in launches:
        seen = first.get(launch.key)
        first[launch.key] = (launch, 1) if seen is None else (seen[0], seen[1] + 1)
    return list(first.values())


def _main() -> None:
    launches = record_all()
    for launch, count in unique(launches):
        ints = [a["int"] for a in launch.args if isinstance(a, dict) and "int" in a]
        ptrs = [a["tensor"] + ("" if a["aligned16"] else " (unaligned)") for a in launch.args
                if isinstance(a, dict) and "tensor" in a]  # fmt: skip
        flags = {k: v for k, v in launch.constexprs.items()}
        print(f"{launch.kernel.split(':')[1]:<22} {flags} ints={ints} "
              f"ptrs={sorted(set(ptrs))} x{count}  first: {launch.scenario}")  # fmt: skip
    print(f"{len(launches)} launches, {len(unique(launches))} specialisations")
    print("stopped by a host read:", STOPPED_BY_A_HOST_READ)


if __name__ == "__main__":
    _main()
