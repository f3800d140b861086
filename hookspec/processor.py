"""The two kinds of processor, and the marker that tells them apart.

A *hookspec processor* takes one :class:`~hookspec.OutputContext` and returns
per-token values ``[b, s]``, a scalar loss ``[]``, or a mapping of names to
either. Mark one with :func:`processor`::

    @hookspec.processor
    def token_logprobs(ctx: hookspec.OutputContext):
        ...
        return {"logprobs": lp, "entropy": ent}        # each [b, s]

An *upstream processor* is what Megatron Core's native hook (0.18+) calls: a
callable taking the hook's sixteen keywords (``UPSTREAM_HOOK_KEYWORDS``), for
example ``fn(*, hidden_states, output_layer, output_weight, labels, context,
config, **_)``. Its result is returned unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeAlias, runtime_checkable

from .arrays import Array
from .context import OutputContext
from .errors import ContractError

__all__ = [
    "OutputProcessor",
    "Processor",
    "ProcessorResult",
    "UpstreamOutputProcessor",
    "is_hookspec_processor",
    "processor",
]

ProcessorResult: TypeAlias = "Array | Mapping[str, Array]"
"""Per-token values ``[b, s]``, a scalar loss ``[]``, or a mapping of either."""


@runtime_checkable
class OutputProcessor(Protocol):
    """A hookspec processor: ``(ctx: OutputContext) -> ProcessorResult``."""

    def __call__(self, ctx: OutputContext, /) -> Any: ...


class UpstreamOutputProcessor(Protocol):
    """An upstream-style processor: the native hook's keywords in, anything out."""

    def __call__(self, **kwargs: Any) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Processor:
    """A hookspec processor, marked so that an implementation can tell it from
    an upstream-style callable. Build one with :func:`processor`."""

    fn: Callable[[OutputContext], Any]
    name: str

    def __call__(self, ctx: OutputContext | None = None, /, **upstream_kwargs: Any) -> Any:
        if upstream_kwargs or not isinstance(ctx, OutputContext):
            given = sorted(upstream_kwargs)[:4]
            raise ContractError(
                f"processor {self.name!r}",
                expected="to be called with one hookspec.OutputContext",
                actual=f"a call with keywords {given}... (Megatron's native hook calls it so)",
                hint="Enable the model first: model = torch_impl.enable_output_processor(model)",
            )
        return self.fn(ctx)


def processor(fn: Callable[[OutputContext], Any], /, *, name: str | None = None) -> Processor:
    """Mark ``fn(ctx) -> ProcessorResult`` as a hookspec processor.

    Usable as a decorator; ``name`` defaults to the function's ``__name__``.
    Applied to a :class:`Processor`, returns it (renamed if ``name`` is given).
    """
    if isinstance(fn, Processor):
        return fn if name is None else dataclasses.replace(fn, name=name)
    if not callable(fn):
        raise ContractError("processor", expected="a callable (ctx) -> result", actual=type(fn).__name__)
    default = getattr(fn, "__name__", None)
    return Processor(fn=fn, name=name or (default if isinstance(default, str) else type(fn).__name__))


def is_hookspec_processor(obj: object) -> bool:
    """True for objects made by :func:`processor`; False for upstream callables."""
    return isinstance(obj, Processor)
