"""Test support: run the processors' CUDA host code on a machine without a GPU, and
see every Triton launch it makes.

- :func:`fake_cuda`: a ``FakeTensorMode`` in which tensors made with
  ``device="cuda"`` report CUDA and hold no data. The processors then take the
  branches they take on a GPU (``backend="auto"`` -> Triton, the per-device chunk
  budgets and kernel configs, ``torch.mm(..., out_dtype=)``), at real sizes, for
  free. A host read of a fake tensor raises (``DataDependentOutputException``).
  The deferred value checks record their work with CUDA events and pinned memory,
  which need a driver: inside the mode they take their CUDA-graph form
  (``torch._assert_async``, no host read), so a call with its default checks runs.
  Where the torch release cannot run ``addmm(..., out_dtype=)`` on meta tensors
  (torch 2.11), that call is computed as ``acc + mm(a, b, out_dtype=)`` inside the
  mode: a GEMM, not a kernel launch, so the recorded launches are the same.
- :func:`backward`: autograd's backward without autograd's C++ engine, which sets
  up a CUDA stream per device and so needs a driver: the graph's nodes are called
  in topological order from Python, under ``no_grad`` as the engine runs them.
- :func:`record_launches`: every launch of a ``@triton.jit`` kernel (kernels made
  under ``TRITON_INTERPRET=1``, i.e. Triton's ``InterpretedFunction``) with its
  arguments described as Triton's launcher specialises them (pointer dtypes and
  16-byte alignment, integer values, constexprs, ``num_warps``), whatever module
  defines the kernel. ``run=False`` records without running (for fake tensors).
- :func:`deferred_checks`: the deferred value checks' CUDA path on CPU tensors, with
  a copy that lands when the test says (at once: the race a fast GPU wins; held: a
  busy one), so that the rule of when a deferred error surfaces is tested here.

Nothing here imports the processors' private modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "DEVICE",
    "DeferredCopies",
    "Launch",
    "backward",
    "deferred_checks",
    "describe",
    "fake_cuda",
    "record_launches",
    "spec_key",
]


DEVICE = ("NVIDIA H100 80GB HBM3", (9, 0))
"""What the fake device reports as its name and compute capability."""


@contextlib.contextmanager
def fake_cuda(device: tuple[str, tuple[int, int]] = DEVICE) -> Iterator[Any]:
    """A fake-tensor mode with CUDA tensors (see the module docstring); yields the mode.
    Inside it ``torch.cuda.get_device_name`` / ``get_device_capability`` report
    ``device``, ``torch.Generator(device="cuda")`` is a CPU generator, and
    ``torch.autograd.grad`` / ``torch.autograd.backward`` run :func:`backward` (the C++
    engine needs a driver)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    name, capability = device
    real_generator = torch.Generator

    def generator(device: Any = None) -> torch.Generator:
        return real_generator()  # CUDA generators need a driver; fake tensors take no values

    patches: dict[tuple[Any, str], Any] = {
        (torch, "Generator"): generator,
        (torch.cuda, "is_current_stream_capturing"): lambda: True,
        (torch.cuda, "get_device_name"): lambda device=None: name,
        (torch.cuda, "get_device_capability"): lambda device=None: capability,
        (torch.autograd, "grad"): _grad,
        (torch.autograd, "backward"): _backward_api,
    }
    if not _addmm_out_dtype_traces():
        patches[(torch, "addmm")] = _addmm_without_meta_out_dtype(torch.addmm)
    saved = {k: getattr(*k) for k in patches}
    for (obj, attr), value in patches.items():
        setattr(obj, attr, value)
    try:
        with FakeTensorMode() as mode:
            yield mode
    finally:
        for (obj, attr), value in saved.items():
            setattr(obj, attr, value)


class _Event:
    """A CUDA event's host side: ``query`` is whether the copy behind it has landed."""

    def __init__(self, copies: DeferredCopies) -> None:
        self.copies = copies
        self.landed = copies.at_once

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.landed = True


@dataclasses.dataclass
class DeferredCopies:
    """The copies :func:`deferred_checks` recorded; ``at_once``: each lands as it is
    recorded. :meth:`land` lands every copy so far (what a host synchronisation does)."""

    at_once: bool
    events: list[_Event] = dataclasses.field(default_factory=list)

    def land(self) -> None:
        for e in self.events:
            e.landed = True


@contextlib.contextmanager
def deferred_checks(*, at_once: bool) -> Iterator[DeferredCopies]:
    """Inside: ``torch_impl.value_checks`` takes its CUDA path (record now, read later)
    for CPU tensors; each copy's event lands at once (``at_once``) or when the test
    calls :meth:`DeferredCopies.land` or ``raise_pending_errors(wait=True)`` waits."""
    from torch_impl import value_checks

    copies = DeferredCopies(at_once)

    def copy_behind_event(stats: torch.Tensor) -> tuple[torch.Tensor, _Event]:
        event = _Event(copies)
        copies.events.append(event)
        return stats.clone(), event

    patches: dict[tuple[Any, str], Any] = {
        (value_checks, "_defers"): lambda values: True,
        (value_checks, "_copy_behind_event"): copy_behind_event,
        (torch.cuda, "is_current_stream_capturing"): lambda: False,  # needs a driver
    }
    saved = {k: getattr(*k) for k in patches}
    value_checks.raise_pending_errors(wait=True)
    for (obj, attr), value in patches.items():
        setattr(obj, attr, value)
    try:
        yield copies
    finally:
        for (obj, attr), value in saved.items():
            setattr(obj, attr, value)
        while value_checks.pending_checks():  # leave no recorded check behind
            with contextlib.suppress(Exception):
                value_checks.raise_pending_errors(wait=True)


def _addmm_out_dtype_traces() -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=torch.float32)`` runs on meta tensors.
    torch 2.11's decomposition of ``addmm`` (``torch/_decomp/decompositions.py``) takes
    ``out_dtype`` for ``beta`` and raises ``TypeError`` there (so under fake tensors and
    ``torch.compile``); on CUDA the eager kernel runs instead."""
    a = torch.empty(2, 2, dtype=torch.bfloat16, device="meta")
    acc = torch.empty(2, 2, dtype=torch.float32, device="meta")
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32)
    except TypeError:
        return False
    return True


def _addmm_without_meta_out_dtype(real: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.addmm`` with ``out_dtype`` computed as ``acc + mm(a, b, out_dtype)`` (the
    same shapes and dtypes; only the meta path differs), where the release's meta
    decomposition cannot run it."""

    def addmm(
        acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        out_dtype = kwargs.pop("out_dtype", None)
        if out_dtype is None or args or set(kwargs) - {"out"}:
            return real(
                acc, a, b, *args, **({"out_dtype": out_dtype} if out_dtype else {}), **kwargs
            )
        res = acc + torch.mm(a, b, out_dtype=out_dtype)
        out = kwargs.get("out")
        return res if out is None else out.copy_(res)

    return addmm


def _as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _grad(
    outputs: Any,
    inputs: Any,
    grad_outputs: Any = None,
    retain_graph: Any = None,
    create_graph: bool = False,
    only_inputs: bool = True,
    allow_unused: bool | None = None,
    is_grads_batched: bool = False,
    materialize_grads: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad`` through :func:`backward` (first order only)."""
    assert not create_graph and not is_grads_batched, "fake_cuda: first-order gradients only"
    outs = _as_list(outputs)
    cots = _as_list(grad_outputs) if grad_outputs is not None else [None] * len(outs)
    roots = [(o, c if c is not None else torch.ones_like(o)) for o, c in zip(outs, cots)]
    ins = _as_list(inputs)
    got = backward(roots, inputs=ins)
    res = tuple(got.get(id(t)) for t in ins)
    if materialize_grads:
        res = tuple(torch.zeros_like(t) if g is None else g for t, g in zip(ins, res))
    elif not allow_unused and any(g is None for g in res):
        raise RuntimeError("fake_cuda: an input was not used in the graph (allow_unused=False)")
    return res


def _backward_api(tensors: Any, grad_tensors: Any = None, **_: Any) -> None:
    """``torch.autograd.backward`` through :func:`backward`: the leaves' ``.grad`` set."""
    outs = _as_list(tensors)
    cots = _as_list(grad_tensors) if grad_tensors is not None else [None] * len(outs)
    roots = [(o, c if c is not None else torch.ones_like(o)) for o, c in zip(outs, cots)]
    _leaves: dict[int, torch.Tensor] = {}
    for leaf, g in backward(roots, leaves=_leaves).items():
        t = _leaves[leaf]
        if g is not None:
            t.grad = g if t.grad is None else t.grad + g


def backward(
    roots: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    inputs: list[torch.Tensor] | None = None,
    leaves: dict[int, torch.Tensor] | None = None,
) -> dict[int, torch.Tensor | None]:
    """``torch.autograd.backward`` of ``[(output, cotangent), ...]`` by calling the graph's
    nodes from Python; returns ``{id(leaf): its gradient}`` and, for each of ``inputs``
    that is not a leaf, ``{id(input): its gradient}`` (``.grad`` is not set). ``leaves``,
    when given, receives ``{id(leaf): leaf}``."""
    order: list[Any] = []
    seen: set[Any] = set()

    def visit(fn: Any) -> None:  # iterative depth-first post-order
        stack = [(fn, False)]
        while stack:
            node, done = stack.pop()
            if node is None:
                continue
            if done:
                order.append(node)
                continue
            if node in seen:
                continue
            seen.add(node)
            stack.append((node, True))
            for nxt, _ in node.next_functions:
                stack.append((nxt, False))

    grads: dict[Any, dict[int, torch.Tensor]] = {}
    for out, cot in roots:
        assert out.grad_fn is not None, "backward of a tensor that needs no gradient"
        visit(out.grad_fn)
        slot = grads.setdefault(out.grad_fn, {})
        slot[out.output_nr] = cot if out.output_nr not in slot else slot[out.output_nr] + cot
    wanted = {(t.grad_fn, t.output_nr): id(t) for t in inputs or [] if t.grad_fn is not None}
    result: dict[int, torch.Tensor | None] = {}
    with torch.no_grad():
        for fn in reversed(order):
            got = grads.pop(fn, {})
            for (node, nr), key in wanted.items():
                if node is fn:
                    result[key] = got.get(nr)
            if type(fn).__name__ == "AccumulateGrad":
                result[id(fn.variable)] = got.get(0)
                if leaves is not None:
                    leaves[id(fn.variable)] = fn.variable
                continue
            n_in = len(fn._input_metadata)
            args = [got.get(i) for i in range(n_in)]
            if hasattr(fn, "_forward_cls"):  # a custom autograd.Function's backward
                outs = fn.apply(*args)
            else:
                args = [
                    a if a is not None else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
                    for a, m in zip(args, fn._input_metadata)
                ]
                outs = fn(*args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            for (nxt, idx), g in zip(fn.next_functions, outs):
                if nxt is None or g is None:
                    continue
                meta = nxt._input_metadata[idx]  # as the engine's validate_outputs: reduce, cast
                if tuple(g.shape) != tuple(meta.shape):
                    g = g.sum_to_size(meta.shape)
                if g.dtype != meta.dtype:
                    g = g.to(meta.dtype)
                slot = grads.setdefault(nxt, {})
                slot[idx] = g if idx not in slot else slot[idx] + g
    return result


def describe(x: Any) -> Any:
    """One launch argument as the launcher specialises it (JSON-able)."""
    if isinstance(x, torch.Tensor):
        offset = x.storage_offset() * x.element_size()  # allocations are >= 256-byte aligned
        return {"tensor": str(x.dtype).removeprefix("torch."), "aligned16": offset % 16 == 0}
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return {"int": x}
    if isinstance(x, float):
        return {"float": x}
    if hasattr(x, "value"):  # tl.constexpr
        return describe(x.value)
    return {"other": type(x).__name__}


def _int_class(v: int) -> str:
    """What Triton's launcher keeps of an integer: 1 is a constant, a multiple of 16 is
    marked divisible, and the width (i32 or i64)."""
    width = "i32" if -(2**31) <= v < 2**31 else ("u64" if v >= 2**63 else "i64")
    return "one" if v == 1 else (f"{width}/16" if v % 16 == 0 else width)


def spec_key(kernel: str, args: list[Any], constexprs: dict[str, Any]) -> str:
    """The specialisation a launch compiles: two launches with the same key run the same
    binary (sizes that differ only where the launcher does not look are one key)."""
    shape = []
    for a in args:
        if isinstance(a, dict) and "int" in a:
            shape.append(_int_class(a["int"]))
        elif isinstance(a, dict) and "float" in a:
            shape.append("fp32")
        else:
            shape.append(a)
    return json.dumps([kernel, shape, sorted(constexprs.items())], sort_keys=True, default=str)


@dataclasses.dataclass
class Launch:
    """One kernel launch: ``kernel`` as ``module:qualname`` of the ``@triton.jit``
    function, its positional ``args`` (described), its keyword ``constexprs``
    (``num_warps`` and ``num_stages`` among them), and where it came from."""

    kernel: str
    args: list[Any]
    constexprs: dict[str, Any]
    scenario: str = ""

    @property
    def key(self) -> str:
        return spec_key(self.kernel, self.args, self.constexprs)


def _as_bound(
    fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """A launch as the launcher binds it, whether its arguments came by position or by
    name: the kernel's parameters that are not constexpr, in the signature's order, and
    the rest (constexprs, ``num_warps``) by name."""
    params = list(inspect.signature(fn).parameters.values())
    named = dict(zip((p.name for p in params), args)) | kwargs
    constexpr = {p.name for p in params if "constexpr" in str(p.annotation)}
    positional = [named.pop(p.name) for p in params if p.name not in constexpr and p.name in named]
    return positional, named


@contextlib.contextmanager
def record_launches(*, run: bool = True) -> Iterator[list[Launch]]:
    """Record every interpreted Triton launch (``TRITON_INTERPRET=1`` must have been set
    before the kernels were made); ``run=False``: record only (the kernel does not run)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: list[Launch] = []
    real: Callable[..., Any] = InterpretedFunction.run

    def spy(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        if not warmup:
            fn = self.fn
            positional, named = _as_bound(fn, args, kwargs)
            launches.append(
                Launch(
                    kernel=f"{fn.__module__}:{fn.__qualname__}",
                    args=[describe(a) for a in positional],
                    constexprs={k: describe(v) for k, v in named.items()},
                )
            )
        if run:
            return real(self, *args, grid=grid, warmup=warmup, **kwargs)
        return None

    InterpretedFunction.run = spy  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        InterpretedFunction.run = real  # type: ignore[method-assign]
