"""Run a test body in several processes over gloo (one per rank), on loopback.

``run_distributed(fn, tp=2)`` spawns ``tp * pp`` processes (``vpp``: model chunks
per pipeline rank, for the interleaved schedule); each initialises
``torch.distributed`` and Megatron's parallel groups, calls ``fn(rank, *args)``
and reports an exception back to the parent, which re-raises it with the rank.
``fn`` must be a module-level function (it is pickled).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _worker(
    rank: int,
    fn: Callable[..., Any],
    tp: int,
    pp: int,
    port: int,
    backend: str,
    args: tuple,
    errors: Any,
    vpp: int | None = None,
) -> None:
    from torch_impl.testing.tiny import megatron_parallel

    try:
        with megatron_parallel(
            tp=tp, pp=pp, rank=rank, world_size=tp * pp, port=port, backend=backend, vpp=vpp
        ):
            fn(rank, *args)
    except BaseException:  # reported to the parent, which fails the test
        errors.put((rank, traceback.format_exc()))
        raise


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    tp: int = 1,
    pp: int = 1,
    backend: str = "gloo",
    vpp: int | None = None,
) -> None:
    from torch_impl.testing.tiny import free_port

    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    try:
        mp.start_processes(
            _worker,
            args=(fn, tp, pp, port, backend, args, errors, vpp),
            nprocs=tp * pp,
            join=True,
            start_method="spawn",
        )
    except mp.ProcessRaisedException as exc:
        reports = []
        while not errors.empty():
            rank, tb = errors.get()
            reports.append(f"--- rank {rank} ---\n{tb}")
        raise AssertionError("\n".join(reports) or str(exc)) from None
