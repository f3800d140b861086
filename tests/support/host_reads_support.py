"""The host-read detector of ``tests/processors/test_host_reads.py`` (its docstring says what it
finds and how), shared by the test files that prove a call reads no device value on the
host: :class:`HostReads` fails with :class:`HostRead` at each read, naming the site."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostRead", "HostReads"]

HAS_TRITON = importlib.util.find_spec("triton") is not None  # interpreted on a CPU: conftest.py
aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[2]

SCALAR_READS = {aten._local_scalar_dense.default, aten.item.default}
SHAPE_FROM_VALUES = {
    aten.nonzero,
    aten.masked_select,
    aten.unique_consecutive,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.repeat_interleave,  # without output_size: reads the repeats
    aten.bincount,
    aten.histc,
}
VALUE_CHECKS = os.path.join("torch_impl", "value_checks.py")
HOST_METHODS = {"tolist", "numpy", "cpu", "__array__", "item"}


class HostRead(AssertionError):
    """A device value read on the host: the op, and the first frame in the project."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.site = _site()
        super().__init__(f"host read: {what} at {self.site}")


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename)
        # an environment installed inside the checkout (CI's .venvs/) is not the project
        installed = "site-packages" in path.parts or Path(sys.prefix) in path.parents
        if ROOT in path.parents and ROOT / "tests" not in path.parents and not installed:
            return f"{path.relative_to(ROOT)}:{frame.lineno} `{(frame.line or '').strip()}`"
    return "outside the project"


def _bool_index(args: Any) -> bool:
    indices = args[1] if len(args) > 1 else []
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or []
    )


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: HostReads) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.owner.paused:
            packet = func.overloadpacket
            if func in SCALAR_READS:
                self.owner.found(f"aten.{packet.__name__} (bool/int/float/.item()/if of a tensor)")
            elif packet in SHAPE_FROM_VALUES and not (
                packet is aten.repeat_interleave and (kwargs or {}).get("output_size") is not None
            ):
                self.owner.found(f"aten.{packet.__name__} (output shape from the values)")
            elif packet in (aten.index, aten.index_put, aten.index_put_) and _bool_index(args):
                self.owner.found(
                    f"aten.{packet.__name__} with a boolean mask (output shape from the values)"
                )
        return func(*args, **(kwargs or {}))


class _Function(TorchFunctionMode):
    def __init__(self, owner: HostReads) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.owner.paused:
            name = getattr(func, "__name__", "")
            if name in HOST_METHODS:
                self.owner.found(f"Tensor.{name}()")
            elif name == "to" and any(
                self.owner.is_host(a) for a in (*args[1:], kwargs.get("device"))
            ):
                self.owner.found("Tensor.to(cpu)")
        return func(*args, **kwargs)


class HostReads:
    """Fail on the first host read inside the block (see the module docstring).
    ``device``: where the inputs live; on ``"cpu"`` a ``.to(x.device)`` is no copy,
    so only a literal ``"cpu"`` target counts there."""

    def __init__(self, device: str = "cpu") -> None:
        self.paused = False
        self.device = device

    def is_host(self, target: Any) -> bool:
        if isinstance(target, str):
            return target.startswith("cpu")
        return self.device != "cpu" and isinstance(target, torch.device) and target.type == "cpu"

    def found(self, what: str) -> None:
        if self.device == "cpu" and any(
            f.filename.endswith(VALUE_CHECKS) for f in traceback.extract_stack()
        ):
            return  # a value check reads on a CPU by design (it raises at once); deferred on CUDA
        self.paused = True  # the traceback's own formatting must not trip the mode
        raise HostRead(what)

    @contextlib.contextmanager
    def watching(self) -> Iterator[HostReads]:
        patched = None
        if HAS_TRITON:
            from triton.runtime.interpreter import InterpretedFunction

            real = InterpretedFunction.run
            owner = self

            def run(fn: Any, *args: Any, **kwargs: Any) -> Any:
                was, owner.paused = owner.paused, True  # the interpreter's copies to numpy
                try:
                    return real(fn, *args, **kwargs)
                finally:
                    owner.paused = was

            patched = (InterpretedFunction, real)
            InterpretedFunction.run = run  # type: ignore[method-assign]
        try:
            with _Function(self), _Dispatch(self):
                yield self
        finally:
            if patched is not None:
                patched[0].run = patched[1]  # type: ignore[method-assign]


# ---------------------------------------------------------------- the calls
