"""The two kinds of processor, the marker that tells them apart, and the check
an upstream-style callable gets where it is registered.

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
config, **_)``. Its result is returned unchanged. Like a pluggy hook
implementation, it may take fewer keywords than the spec (with ``**_`` for the
rest), never one the spec does not pass: :func:`check_upstream_processor`
says so when it is registered, not at the first forward.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from .context import OutputContext
from .conventions import UPSTREAM_HOOK_KEYWORDS
from .errors import ContractError

__all__ = [
    "Processor",
    "check_upstream_processor",
    "is_hookspec_processor",
    "processor",
]


@dataclasses.dataclass(frozen=True)
class Processor:
    """A hookspec processor, marked so that an implementation can tell it from
    an upstream-style callable. Build one with :func:`processor`."""

    fn: Callable[[OutputContext], Any]
    name: str

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ContractError(
                "processor", expected="a callable (ctx) -> result", actual=type(self.fn).__name__
            )
        if not isinstance(self.name, str):
            raise ContractError("processor name", expected="a str", actual=repr(self.name))

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
    """Mark ``fn(ctx) -> result`` as a hookspec processor.

    Usable as a decorator; ``name`` defaults to the function's ``__name__``.
    Applied to a :class:`Processor`, returns it (renamed if ``name`` is given).
    """
    if isinstance(fn, Processor):
        return fn if name is None else dataclasses.replace(fn, name=name)
    if not callable(fn):
        raise ContractError(
            "processor", expected="a callable (ctx) -> result", actual=type(fn).__name__
        )
    default = getattr(fn, "__name__", None)
    return Processor(
        fn=fn, name=name or (default if isinstance(default, str) else type(fn).__name__)
    )


def is_hookspec_processor(obj: object) -> bool:
    """True for objects made by :func:`processor`; False for upstream callables."""
    return isinstance(obj, Processor)


def check_upstream_processor(fn: Callable[..., Any], /, *, field: str = "output_processor") -> None:
    """Check an upstream-style callable's parameters against ``UPSTREAM_HOOK_KEYWORDS``.

    The hook calls ``fn(**kwargs)`` with the sixteen keywords. Every parameter
    ``fn`` names must be one of them (or ``*args``/``**kwargs``); a parameter
    without a default must be one of them or Python fails at the call. A
    callable of one positional parameter that is not an upstream keyword, such
    as ``def f(ctx)``, is a hookspec processor without its marker. A callable
    whose signature cannot be read (a builtin) is accepted as it is.

    Raises :class:`ContractError` naming the unknown parameters.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return
    known = set(UPSTREAM_HOOK_KEYWORDS)
    named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unknown = [p.name for p in named if p.name not in known or p.kind is p.POSITIONAL_ONLY]
    if not unknown:
        return
    name = getattr(fn, "__name__", type(fn).__name__)
    looks_typed = len(named) == 1 and named[0].kind is not named[0].KEYWORD_ONLY
    if looks_typed:
        raise ContractError(
            field,
            expected="a hookspec processor, or a callable taking the upstream hook's keywords",
            actual=f"{name}({named[0].name}), a callable of one positional parameter",
            hint="If it takes a hookspec.OutputContext, decorate it with @hookspec.processor",
        )
    raise ContractError(
        field,
        expected=f"a callable whose parameters are among the upstream hook's keywords "
        f"{list(UPSTREAM_HOOK_KEYWORDS)} (add **_ for the ones it ignores)",
        actual=f"{name} with unknown parameter(s) {unknown}",
        hint="A hookspec processor takes one OutputContext: decorate it with @hookspec.processor",
    )
