"""The torch side of the cross-check: run a processor, keep its values and VJPs.

Either kind of processor runs, on a context captured *inside* Megatron's output
hook (:func:`run_through_hook`, a real forward of an enabled model) or on a
context built by hand (:func:`run_on_context`, synthetic and adversarial cases).

The processor sees the hidden states as a fresh leaf ``h = hidden.detach()
.requires_grad_()`` and the weight as the model's own parameter (the tied
embedding with tied weights), so ``torch.autograd.grad`` gives the partial
derivatives the reference computes: ``d out / d h`` and ``d out / d W`` with the
other held fixed. For every floating output ``k`` a seeded random cotangent
``c_k`` (rounded to the output's dtype) gives::

    grad_hidden[k], grad_weight[k] = autograd.grad(out_k, (h, W), c_k)

An output that does not depend on ``h`` or ``W`` (a detached metric) gets zeros.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hookspec import (
    IGNORE_INDEX,
    UPSTREAM_HOOK_KEYWORDS,
    ContractError,
    OutputContext,
    is_hookspec_processor,
    processor,
    validate_context,
    validate_result,
)

__all__ = [
    "SINGLE_OUTPUT",
    "TorchRun",
    "call_processor",
    "cotangent_of",
    "outputs_of",
    "run_on_context",
    "run_through_hook",
    "vjps_of",
]

SINGLE_OUTPUT = "output"
"""The name under which a processor's one-array result is reported."""


@dataclasses.dataclass(frozen=True)
class TorchRun:
    """One run of a torch processor with its VJPs.

    ``context``: the typed context the processor saw (``hidden_states`` is the
    leaf ``h``, ``vocab_weight`` the weight ``W``). ``outputs``: name ->
    detached value. ``cotangents``, ``grad_hidden``, ``grad_weight``: name ->
    tensor, for floating outputs. ``single``: the processor returned one array
    (reported as ``"output"``). ``via_hook``: it ran inside Megatron's hook.
    """

    context: OutputContext
    outputs: dict[str, torch.Tensor]
    cotangents: dict[str, torch.Tensor]
    grad_hidden: dict[str, torch.Tensor]
    grad_weight: dict[str, torch.Tensor]
    single: bool
    via_hook: bool


def call_processor(proc: Any, ctx: OutputContext, /) -> Any:
    """``proc(ctx)`` for a hookspec processor; ``proc(**upstream keywords)`` otherwise."""
    if is_hookspec_processor(proc):
        return proc(ctx)
    return proc(**{k: getattr(ctx, k) for k in UPSTREAM_HOOK_KEYWORDS})


def processor_name(proc: Any) -> str:
    return str(
        getattr(proc, "name", None) or getattr(proc, "__name__", None) or type(proc).__name__
    )


def outputs_of(result: Any, name: str) -> tuple[dict[str, torch.Tensor], bool]:
    if isinstance(result, torch.Tensor):
        return {SINGLE_OUTPUT: result}, True
    if (
        isinstance(result, Mapping)
        and result
        and all(isinstance(v, torch.Tensor) for v in result.values())
    ):
        return {str(k): v for k, v in result.items()}, False
    raise ContractError(
        f"processor {name!r} result",
        expected="a torch.Tensor or a non-empty mapping of str to torch.Tensor",
        actual=type(result).__name__
        if not isinstance(result, Mapping)
        else f"mapping {dict(result)!r:.80}",
    )


def cotangent_of(name: str, like: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(like.shape, generator=g, dtype=torch.float64).to(like.dtype)


def vjps_of(
    outputs: dict[str, torch.Tensor],
    h: torch.Tensor,
    w: torch.Tensor,
    seed: int,
    cotangent: Callable[[str, torch.Tensor, int], torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Each floating output's cotangent (``cotangent(name, out, seed)``, default
    :func:`cotangent_of`) and its pullbacks to ``h`` and ``w``."""
    cots, dh, dw = {}, {}, {}
    for key, out in outputs.items():
        if not out.is_floating_point():
            continue
        cot = (cotangent or cotangent_of)(key, out, seed)
        cots[key] = cot
        gh: torch.Tensor | None
        gw: torch.Tensor | None
        if out.requires_grad:
            gh, gw = torch.autograd.grad(out, (h, w), cot, retain_graph=True, allow_unused=True)
        else:
            gh = gw = None
        dh[key] = torch.zeros_like(h) if gh is None else gh.detach()
        dw[key] = torch.zeros_like(w) if gw is None else gw.detach()
    return cots, dh, dw


def _leaf_weight(ctx: OutputContext) -> OutputContext:
    w = ctx.vocab_weight
    if not isinstance(w, torch.Tensor):
        raise ContractError(
            "vocab_weight", expected="a torch.Tensor [V_local, h]", actual=type(w).__name__
        )
    if w.is_leaf and w.requires_grad:
        return ctx
    leaf = w.detach().requires_grad_()
    out_w = leaf if ctx.output_weight is w else ctx.output_weight
    return ctx.replace(vocab_weight=leaf, output_weight=out_w)


def run_on_context(proc: Any, ctx: OutputContext, /, *, seed: int = 0) -> TorchRun:
    """Run ``proc`` on ``ctx`` (hidden states replaced by a fresh leaf) and take its VJPs.

    ``ctx`` is checked first (``hookspec.validate_context``: shapes and label range).
    """
    validate_context(ctx)
    ctx = _leaf_weight(ctx)
    h = ctx.hidden_states.detach().requires_grad_()  # type: ignore[attr-defined]
    ctx = ctx.replace(hidden_states=h)
    name = processor_name(proc)
    with torch.enable_grad():
        result = call_processor(proc, ctx)
        if is_hookspec_processor(proc):
            validate_result(
                result, batch=ctx.batch_size, seq=ctx.seq_len, field=f"processor {name!r} result"
            )
        outputs, single = outputs_of(result, name)
        cots, dh, dw = vjps_of(outputs, h, ctx.vocab_weight, seed)  # type: ignore[arg-type]
    detached = {k: v.detach() for k, v in outputs.items()}
    return TorchRun(ctx, detached, cots, dh, dw, single, via_hook=False)


def _forward(model: torch.nn.Module, batch: Mapping[str, Any], proc: Any, user_context: Any) -> Any:
    return model(
        batch["input_ids"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch.get("labels"),
        loss_mask=batch.get("loss_mask"),
        output_processor=proc,
        output_processor_context=user_context,
    )


def capture_context(
    model: torch.nn.Module, batch: Mapping[str, Any], /, *, user_context: Any = None
) -> OutputContext:
    """The typed context the hook builds for one forward of ``model`` on ``batch``."""
    seen: dict[str, OutputContext] = {}

    @processor
    def capture(ctx: OutputContext) -> Any:
        seen["ctx"] = ctx
        return (
            ctx.hidden_states.detach().float().sum(-1).transpose(0, 1)  # type: ignore[attr-defined]
        )

    with torch.no_grad():
        _forward(model, batch, capture, user_context)
    return seen["ctx"]


def run_through_hook(
    proc: Any,
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    /,
    *,
    user_context: Any = None,
    make_user_context: Callable[[OutputContext], Any] | None = None,
    ignore_index: int = IGNORE_INDEX,
    seed: int = 0,
) -> TorchRun:
    """Run ``proc`` inside the output hook of an enabled ``model`` on ``batch``.

    ``make_user_context(ctx)``, when given, builds the ``output_processor_context``
    from a first, capturing forward (old logprobs near the current ones, say);
    the second forward passes it through Megatron to the processor.
    """
    if make_user_context is not None:
        user_context = make_user_context(capture_context(model, batch, user_context=user_context))
    stash: dict[str, Any] = {}
    name = processor_name(proc)
    if is_hookspec_processor(proc):

        def body(ctx: OutputContext) -> Any:
            h = ctx.hidden_states.detach().requires_grad_()  # type: ignore[attr-defined]
            ctx = ctx.replace(hidden_states=h)
            stash["ctx"] = ctx
            stash["result"] = result = proc(ctx)
            return result

        wrapper: Any = processor(body, name=name)
    else:

        def wrapper(**kwargs: Any) -> Any:
            kwargs["hidden_states"] = kwargs["hidden_states"].detach().requires_grad_()
            stash["kwargs"] = kwargs
            stash["result"] = result = proc(**kwargs)
            return result

    with torch.enable_grad():
        _forward(model, batch, wrapper, user_context)
        if "ctx" in stash:
            ctx = stash["ctx"]
        else:
            from torch_impl import build_output_context, unwrap_model

            ctx = build_output_context(
                unwrap_model(model), stash["kwargs"], ignore_index=ignore_index
            )
        outputs, single = outputs_of(stash["result"], name)
        cots, dh, dw = vjps_of(outputs, ctx.hidden_states, ctx.vocab_weight, seed)
    detached = {k: v.detach() for k, v in outputs.items()}
    return TorchRun(ctx, detached, cots, dh, dw, single, via_hook=True)
