"""The process state a tool (``python -m torch_impl.doctor``, ``hookcheck``) must
leave as it found it when a caller runs it in process.

:func:`callers_state_kept` saves and restores what the tools' tiny models and
checks change: the random number generators (torch CPU and initialised CUDA
devices, Python's ``random``, NumPy's global one), torch's default dtype and
grad mode, and the environment variables (``MASTER_PORT`` and friends). The
process group and Megatron's ``parallel_state`` are kept by
:func:`torch_impl.testing.tiny.megatron_parallel`, which reuses a caller's
and tears down only what it made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["CallerState", "callers_state_kept"]


@dataclasses.dataclass(frozen=True)
class CallerState:
    """A snapshot of the state :func:`callers_state_kept` restores."""

    torch_rng: torch.Tensor
    cuda_rng: tuple[torch.Tensor, ...]
    python_rng: Any
    numpy_rng: Any
    default_dtype: torch.dtype
    grad_enabled: bool
    environ: dict[str, str]

    @classmethod
    def now(cls) -> CallerState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
        numpy = sys.modules.get("numpy")
        return cls(
            torch_rng=torch.random.get_rng_state(),
            cuda_rng=tuple(cuda),
            python_rng=random.getstate(),
            numpy_rng=numpy.random.get_state() if numpy is not None else None,
            default_dtype=torch.get_default_dtype(),
            grad_enabled=torch.is_grad_enabled(),
            environ=dict(os.environ),
        )

    def restore(self) -> None:
        torch.random.set_rng_state(self.torch_rng)
        if self.cuda_rng:
            torch.cuda.set_rng_state_all(list(self.cuda_rng))
        random.setstate(self.python_rng)
        if self.numpy_rng is not None:
            sys.modules["numpy"].random.set_state(self.numpy_rng)
        torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(self.grad_enabled)
        for name in set(os.environ) - set(self.environ):
            del os.environ[name]
        for name, value in self.environ.items():
            if os.environ.get(name) != value:
                os.environ[name] = value


@contextlib.contextmanager
def callers_state_kept() -> Iterator[CallerState]:
    """Run the body, then put back the state of :class:`CallerState` as it was."""
    state = CallerState.now()
    try:
        yield state
    finally:
        state.restore()
