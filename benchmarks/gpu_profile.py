"""One profiled call after the timed ones: how busy the GPU was, and how many kernels
and launches the call made.

:func:`profile_call` runs ``fn()`` once under ``torch.profiler`` and returns, for a
CUDA device::

    span_ms       = last kernel end - first host op start          (the call's event span)
    kernel_ms     = |union of the kernels' intervals|               (overlaps counted once)
    busy_fraction = kernel_ms / span_ms
    kernels       = number of GPU kernels (memcpy and memset included)
    launches      = number of host launch calls (cudaLaunchKernel, cuLaunchKernel, ...)

The profiler's own host overhead widens the span a little: ``busy_fraction`` is a lower
bound of the unprofiled call's. On a CPU there are no kernels: the row gets the host
ops the call dispatched (``cpu_ops``, ``aten::`` calls at any depth) and
``busy_fraction`` ``None`` with the reason, so that the same code runs in CI.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LAUNCH_NAMES", "busy_of_intervals", "profile_call"]

LAUNCH_NAMES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
"""The host API calls counted as launches (the CUDA runtime's and the driver's)."""


def busy_of_intervals(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``[start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def profile_call(fn: Callable[[], Any], *, device: str) -> dict[str, Any]:
    """Profile one call of ``fn`` (see the module docstring); the fields of a row."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with (
        warnings.catch_warnings()
    ):  # torch 2.11 warns that a profile without a schedule is one cycle
        warnings.filterwarnings(
            "ignore", message=".*Profiler clears events at the end of each cycle"
        )
        with profile(activities=activities) as prof:
            fn()
            if cuda:
                torch.cuda.synchronize()
    events = list(prof.events())
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    if not cuda:
        ops = sum(1 for e in host if e.name.startswith("aten::"))
        return {
            "profile_cpu_ops": ops,
            "busy_fraction": None,
            "busy_note": "no CUDA kernels on a CPU: the host ops are counted instead",
        }
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    launches = sum(1 for e in host if e.name in LAUNCH_NAMES)
    if not kernels:
        return {
            "kernels": 0,
            "launches": launches,
            "busy_fraction": None,
            "busy_note": "no kernel recorded",
        }
    start = (
        min(e.time_range.start for e in host) if host else min(e.time_range.start for e in kernels)
    )
    end = max(e.time_range.end for e in kernels)
    busy = busy_of_intervals([(e.time_range.start, e.time_range.end) for e in kernels])
    span = max(end - start, 1e-9)
    return {
        "kernels": len(kernels),
        "launches": launches,
        "kernel_ms": busy / 1e3,
        "span_ms": span / 1e3,
        "busy_fraction": busy / span,
        "busy_note": (
            "one profiled call after the timed ones (torch.profiler; its overhead widens the span)"
        ),
    }
