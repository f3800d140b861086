"""Run Megatron Core's pipeline schedules on a CPU, for tests, examples and notebooks.

Every schedule that ``megatron.core.pipeline_parallel.get_forward_backward_func()``
returns (no pipelining, 1F1B, interleaved) touches CUDA even when the model and the
process group (gloo) live on the CPU. On megatron-core 0.16.1 and 0.19.2 these are:

- ``schedules.py``: ``total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")``
  in each of the three schedules (the token counter);
- ``p2p_communication.py``: the receive buffers and the shape-exchange buffers,
  ``torch.empty(shape, device=torch.cuda.current_device(), ...)``, and
  ``torch.cuda.synchronize()`` after a batched send/receive (``batch_p2p_sync``).

:func:`cpu_schedule` makes them run on the CPU with torch-level shims while it is
entered, and touches no Megatron symbol:

1. :class:`CPUDeviceMode`, a ``torch.overrides.TorchFunctionMode``: a factory call's
   ``device=`` that names CUDA (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")``) or
   is an int (a CUDA ordinal) becomes ``"cpu"``; ``Tensor.cuda()`` returns the tensor,
   and ``Tensor.to`` with such a device stays on the CPU;
2. ``unittest.mock.patch("torch.cuda.current_device", return_value=0)`` (the mode then
   maps the ordinal 0 to the CPU);
3. ``unittest.mock.patch("torch.cuda.synchronize")`` (a no-op: gloo's point-to-point
   operations have completed when ``wait()`` returns);
4. ``unittest.mock.patch("torch.cuda.current_stream")``: a stand-in stream whose
   ``wait_event`` and ``wait_stream`` do nothing (work on the CPU is not queued on
   streams). On 0.19.2, ``finalize_model_grads`` -> ``DistributedDataParallel.finish_grad_sync``
   -> ``_ParamAndGradBucketGroup.start_grad_sync`` calls ``torch.cuda.current_stream()``
   on every call (to wait for CUDA-graph gradient events), so a DDP-wrapped model's
   step needs it; 0.16.1 does not call it there.

Used as::

    with cpu_schedule():
        losses = get_forward_backward_func()(forward_step_func=..., model=[model], ...)

Megatron's ``DistributedDataParallel`` (its grad buffers on
``torch.cuda.current_device()``) builds on the CPU under the same context.

One setting is needed beside the shim, for the interleaved schedule with two
pipeline ranks over gloo: ``batch_p2p_comm=False`` in the model's config
(:data:`INTERLEAVED_GLOO`). With the default ``True``, a steady-state step posts,
in one ``torch.distributed.batch_isend_irecv`` call on the pipeline group, a send
to the previous rank, a receive from it, a send to the next and a receive from it
(``p2p_communication._batched_p2p_ops``, in that order). With two ranks the
previous and the next rank are the same process, and ``batch_isend_irecv`` matches
operations between one pair of ranks in one direction in posting order (torch
documents this for every backend): rank 0 posts its send to rank 1 as "previous" (a
gradient) before its send to rank 1 as "next" (an activation), while rank 1 posts its
receive from rank 0 as "previous" (an activation) first, so messages land in the wrong
buffers (same shape: no error, wrong values; seen here from the third micro-batch on).
With ``False``, Megatron's ``_p2p_ops`` posts every rank's sends and receives in one
per-peer order (send-next before send-prev, recv-prev before recv-next), which keeps
them apart. The cause and a reproduction: ``docs/upstream.md``, report 4.
1F1B is unaffected (each rank talks one way at a time).

Only for CPU runs of tiny models: the mode sees every torch call made inside it
(a Python call's overhead each), and it moves CUDA requests to the CPU silently.
Nothing in the library imports this module.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["INTERLEAVED_GLOO", "CPUDeviceMode", "cpu_schedule", "is_cuda_device"]

INTERLEAVED_GLOO: dict[str, Any] = {"batch_p2p_comm": False}
"""``TransformerConfig`` settings for the interleaved schedule over gloo with two
pipeline ranks (see the module docstring)."""


def is_cuda_device(device: object) -> bool:
    """True for a device argument that would place a tensor on a GPU: a string or
    ``torch.device`` of type ``"cuda"``, or an int (torch reads an int as a CUDA
    ordinal)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class CPUDeviceMode(TorchFunctionMode):
    """While active, a torch call asked for a CUDA device gets the CPU.

    - ``f(..., device=d)`` with ``is_cuda_device(d)``: called with ``device="cpu"``;
    - ``tensor.cuda(...)``: returns ``tensor`` (already on the CPU);
    - ``tensor.to(d, ...)`` / ``tensor.to(device=d, ...)`` with a CUDA ``d``: the
      device argument becomes ``"cpu"`` (a dtype given beside it still applies).

    Every other call passes through unchanged.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _Patches:
    """The three ``torch.cuda`` patches, shared by every thread inside
    :func:`cpu_schedule`: made by the first entry, undone by the last exit.

    A patch is process-wide (a module attribute) while :class:`CPUDeviceMode` is
    per thread (torch's mode stack is thread-local). Patched once per entry, two
    threads with interleaved exits left ``torch.cuda`` patched: the second entry
    saved the first one's stand-ins as the "originals" and put them back last.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries = 0
        self.stack: contextlib.ExitStack | None = None

    def enter(self) -> None:
        with self.lock:
            if self.entries == 0:
                stream = mock.NonCallableMock(spec=["wait_event", "wait_stream", "synchronize"])
                with contextlib.ExitStack() as stack:
                    stack.enter_context(mock.patch("torch.cuda.current_device", return_value=0))
                    stack.enter_context(mock.patch("torch.cuda.synchronize"))
                    stack.enter_context(
                        mock.patch("torch.cuda.current_stream", return_value=stream)
                    )
                    self.stack = stack.pop_all()
            self.entries += 1

    def exit(self) -> None:
        with self.lock:
            self.entries -= 1
            if self.entries == 0 and self.stack is not None:
                stack, self.stack = self.stack, None
                stack.close()


_PATCHES = _Patches()


@contextlib.contextmanager
def cpu_schedule() -> Iterator[None]:
    """Enter :class:`CPUDeviceMode` and patch ``torch.cuda.current_device`` (returns
    0), ``torch.cuda.synchronize`` (does nothing) and ``torch.cuda.current_stream``
    (a stream whose waits do nothing); all are undone on exit, also when the body
    raises. See the module docstring for the CUDA calls this covers.

    Reentrant, in one thread and across threads: the patches are made by the first
    entry and undone by the last exit, whatever the order of the exits; the mode
    is each entering thread's own.
    """
    _PATCHES.enter()
    try:
        with CPUDeviceMode():
            yield
    finally:
        _PATCHES.exit()
