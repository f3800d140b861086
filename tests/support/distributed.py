"""Run a test body in several processes over gloo (one per rank), on loopback.

``run_distributed(fn, tp=2)`` spawns ``tp * cp * pp`` processes (tensor, context and
pipeline parallel; ``vpp``: model chunks per pipeline rank, for the interleaved
schedule); each initialises
``torch.distributed`` and Megatron's parallel groups, calls ``fn(rank, *args)``
and reports an exception back to the parent, which re-raises it with the rank. The ranks
meet at a ``launcher_store`` the parent holds (``torch_impl.process_state``).
``fn`` must be a module-level function (it is pickled).

The ranks are forked from a server process that has imported torch and Megatron once
(``multiprocessing``'s forkserver, one per test process, started by the first call):
a spawned rank imports them anew, which took most of a tp=2 test's time (a trivial
tp=2 body: about a minute spawned, 0.6 s forked, on a loaded 2-core machine). The
server's environment and ``sys.path`` are those of the test process when it starts
(``tests/conftest.py`` sets the threads and Triton's mode before any test), and a rank
starts from the server's state, not the test's: state a rank needs goes in ``args``.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

# What the server imports before it forks a rank: what every rank imports first.
PRELOAD = ("torch", "megatron.core", "torch_impl.testing.tiny", "tests.support.distributed")


ROOT = Path(__file__).resolve().parents[2]


def rank_context() -> Any:
    """The ``multiprocessing`` context the ranks start from (the forkserver, preloaded and
    running): for queues passed to them."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    _ensure_server()
    return ctx


def _ensure_server() -> None:
    """Start the server, where it is not running, with the repository root on its path:
    it does not take the test process's ``sys.path`` (Python 3.11 and 3.12 pass it to the
    server's ``main``, which drops it), and a rank unpickles ``fn`` from ``tests``."""
    from multiprocessing import forkserver

    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *([before] if before else [])])
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


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
    cp: int = 1,
) -> None:
    from torch_impl.process_state import rank_store
    from torch_impl.testing.tiny import megatron_parallel

    try:
        world_size = tp * pp * cp
        with megatron_parallel(
            tp=tp,
            pp=pp,
            cp=cp,
            rank=rank,
            world_size=world_size,
            store=rank_store(port, world_size),
            backend=backend,
            vpp=vpp,
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
    cp: int = 1,
) -> None:
    from torch_impl.process_state import launcher_store

    errors = rank_context().SimpleQueue()
    world_size = tp * pp * cp
    store = launcher_store(world_size)  # held until the ranks are done
    try:
        mp.start_processes(
            _worker,
            args=(fn, tp, pp, store.port, backend, args, errors, vpp, cp),
            nprocs=world_size,
            join=True,
            start_method="forkserver",
        )
    except mp.ProcessRaisedException as exc:
        reports = []
        while not errors.empty():
            rank, tb = errors.get()
            reports.append(f"--- rank {rank} ---\n{tb}")
        raise AssertionError("\n".join(reports) or str(exc)) from None


class _RowsGather(torch.autograd.Function):
    """All-gather rows along dim 0; backward: all-reduce and keep this rank's rows (a
    reduce-scatter), as Megatron's ``gather_from_sequence_parallel_region(...,
    tensor_parallel_output_grad=True)``, whose buffers live on CUDA."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.rows = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        r = torch.distributed.get_rank(ctx.group)
        return grad[r * ctx.rows : (r + 1) * ctx.rows], None


class GlooSequenceParallel:
    """``inner`` collectives with ``gather_hidden_states`` as under sequence parallel, over
    gloo (Megatron's sequence-parallel gather needs CUDA); every other method is ``inner``'s."""

    def __init__(self, inner: Any, group: Any) -> None:
        self.inner, self.group = inner, group

    def all_reduce_sum(self, x: torch.Tensor, /) -> torch.Tensor:
        return self.inner.all_reduce_sum(x)

    def all_reduce_max(self, x: torch.Tensor, /) -> torch.Tensor:
        return self.inner.all_reduce_max(x)

    def all_gather(self, x: torch.Tensor, /) -> torch.Tensor:
        return self.inner.all_gather(x)

    def gather_hidden_states(self, x: torch.Tensor, /) -> torch.Tensor:
        return _RowsGather.apply(x, self.group)
