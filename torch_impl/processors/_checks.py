"""Input checks shared by the processors, each raising ``hookspec.ContractError``
naming the field, the expected and the given. Numbers are checked once, where they
enter; tensors by shape and dtype only, except where a docstring says so.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from hookspec import ContractError
from hookspec import check_int64 as check_int  # an int in [low, high] and int64
from hookspec.arrays import format_shape

from ..value_checks import check_labels_deferred, check_positive_deferred, refuse_meta

__all__ = [
    "FLOATS",
    "UNSUPPORTED_LOGIT_OPTIONS",
    "check_bool",
    "check_instance",
    "check_enum",
    "check_finite_number",
    "check_floating",
    "check_int",
    "check_shape",
    "check_temperature",
    "context_logit_scale",
    "context_softcap",
    "context_field",
    "describe_tensor",
    "resolve_compute_dtype",
]


def _number(number: float) -> str:
    return str(number) if isinstance(number, int) else f"{number:g}"  # ints exactly, however large


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        opening, closing = "(" if low_open else "[", ")" if high_open else "]"
        return f"in {opening}{_number(low)}, {_number(high)}{closing}"
    if low is not None:
        return f"{'>' if low_open else '>='} {_number(low)}"
    if high is not None:
        return f"{'<' if high_open else '<='} {_number(high)}"
    return ""


def check_finite_number(
    field: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a ``float``: a real number (Python or NumPy, not ``bool``, not a
    tensor), finite, and in ``[low, high]`` (``low_open``/``high_open``: that end
    excluded; ``None``: unbounded)."""
    expected = f"a finite number {_interval(low, high, low_open, high_open)}".rstrip()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ContractError(field, expected=expected, actual=_describe(value))
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range (10**400)
        raise ContractError(
            field, expected=expected, actual=f"{value!r} (beyond the float range)"
        ) from None
    below = low is not None and (number <= low if low_open else number < low)
    above = high is not None and (number >= high if high_open else number > high)
    if not math.isfinite(number) or below or above:
        raise ContractError(field, expected=expected, actual=repr(value))
    return number


def check_enum(field: str, kind: Any, value: Any) -> Any:
    """``kind(value)``: a member of the enum ``kind`` or its value."""
    try:
        return kind(value)
    except ValueError:
        raise ContractError(
            field, expected=f"one of {[k.value for k in kind]}", actual=repr(value)
        ) from None


def check_instance(
    field: str, value: Any, kind: type | tuple[type, ...], expected: str, hint: str = ""
) -> Any:
    """``x`` is an instance of ``kind`` (the error names its type)."""
    if not isinstance(value, kind):
        raise ContractError(field, expected=expected, actual=type(value).__name__, hint=hint)
    return value


def check_bool(field: str, value: Any) -> bool:
    """``value`` is a ``bool`` (not a truthy string or number)."""
    if not isinstance(value, bool):
        raise ContractError(field, expected="True or False", actual=_describe(value))
    return value


def _describe(value: Any) -> str:
    if isinstance(value, (str, numbers.Number)) or value is None:
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"a tensor {format_shape(value.shape)} (pass a Python number)"
    return type(value).__name__


def describe_tensor(value: Any) -> str:
    """``"a float32 tensor of shape [2, 3]"`` for a tensor, else its type's name."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    return (
        f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {format_shape(value.shape)}"
    )


def context_field(context: Any, name: str) -> Any:
    """``context[name]`` for a mapping (how veRL passes it), else
    ``getattr(context, name)``; ``None`` when absent."""
    if isinstance(context, Mapping):
        return context.get(name)
    return getattr(context, name, None)


FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_floating(field: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ContractError(field, expected="a torch.Tensor", actual=type(value).__name__)
    if value.dtype not in FLOATS:
        raise ContractError(
            field, expected="a floating dtype", actual=str(value.dtype).removeprefix("torch.")
        )
    refuse_meta(value, field=field)  # a shape without values: torch would fail deep inside
    return value


def check_shape(field: str, value: Any, want: tuple[int, ...], expected: str) -> torch.Tensor:
    """``value`` a tensor of shape ``want`` (``expected`` says it: ``"[b=2, s=3]"``)."""
    if not isinstance(value, torch.Tensor):
        raise ContractError(
            field, expected=f"a torch.Tensor {expected}", actual=type(value).__name__
        )
    if tuple(value.shape) != want:
        raise ContractError(field, expected=f"shape {expected}", actual=format_shape(value.shape))
    return value


def check_temperature(
    temperature: Any, n: int, *, field: str = "temperature", check_values: bool = True
) -> float | torch.Tensor:
    """A finite ``T > 0``: a number, or a tensor ``[n]`` (one per row; a ``[b, s]`` is
    refused, not flattened), returned as a float or a float32 (float64 if given) tensor
    whose values are checked with ``check_values``, without a host read on CUDA."""
    if isinstance(temperature, torch.Tensor) and temperature.dim() == 0:
        temperature = float(temperature)
    if isinstance(temperature, torch.Tensor):
        check_floating(field, temperature)  # the shape, not the count: a [b, s] is not [s * b]
        check_shape(
            field, temperature, (n,), f"[n={n}] or a number (one value per row, in the rows' order)"
        )
        t = temperature.detach()
        t = t.double() if t.dtype == torch.float64 else t.float()
        if check_values:
            check_positive_deferred(t, field=field)
        return t
    if isinstance(temperature, bool) or not isinstance(
        temperature, numbers.Real
    ):  # Python or NumPy
        raise ContractError(
            field, expected="a number > 0 or a tensor [n]", actual=type(temperature).__name__
        )
    return check_finite_number(field, temperature, low=0.0, low_open=True)


def check_token_labels(
    labels: Any, n: int, vocab_size: int, ignore_index: int, *, check_values: bool
) -> torch.Tensor:
    check_shape("labels", labels, (n,), f"[n={n}] of token ids (one per hidden-state row)")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise ContractError(
            "labels", expected="an integer dtype", actual=str(labels.dtype).removeprefix("torch.")
        )
    refuse_meta(labels, field="labels")
    if check_values:
        check_labels_deferred(
            labels, vocab_size, ignore_index=ignore_index, set_by="LinearOptions(ignore_index=)"
        )
    return labels


def resolve_compute_dtype(
    device: torch.device, dtype: torch.dtype, override: torch.dtype | None
) -> torch.dtype:
    """The dtype the matmuls run in: ``override`` if given (a checked option); float64
    stays float64; on a CPU float32 (no fast bf16/fp16 GEMM there); elsewhere the input dtype."""
    if override is not None:
        return override
    return torch.float32 if device.type == "cpu" and dtype != torch.float64 else dtype


UNSUPPORTED_LOGIT_OPTIONS: tuple[str, ...] = (
    "logit_dtype",
    "output_logit_softcapping",
    "logit_softcapping",
)
"""Config fields that would change the stock logits in a way the built-in processors do
not follow; none is read by megatron-core 0.13.1 to 0.19.2's output path, so a release
that adds one gets a ``ContractError`` naming it when set, not a silent difference."""


def context_softcap(ctx: Any) -> float | None:
    """The model's final-logit softcap ``s``, ``config.final_logit_softcapping``
    (Gemma's name; None, 0 or False: off), applied after ``logit_scale``."""
    value = getattr(getattr(ctx, "config", None), "final_logit_softcapping", None)
    if value is None or value is False or (isinstance(value, numbers.Real) and value == 0):
        return None
    return check_finite_number("config.final_logit_softcapping", value, low=0.0, low_open=True)


_PROBE = (1.0, -2.0, 0.5, 3.0, 1e4, -1e6, 1e30, -1e-30)
"""The float64 values ``ctx.scale_logits`` is probed on: both signs, 1e-30 to 1e30 in
size, so that a clamp, a softcap or a flush of small values (``c * z`` on part of the
range only) is refused."""


def context_logit_scale(ctx: Any, *, processor: str) -> float:
    """The factor ``c`` by which the stock model scales its logits, for a processor
    that forms ``c * hidden @ weight.T`` itself; any other change to the stock logits
    is refused by name (a set field of :data:`UNSUPPORTED_LOGIT_OPTIONS`).

    ``ctx.scale_logits`` (Megatron's ``LanguageModule._scale_logits``: MuP's
    ``config.mup_output_mult`` where ``config.use_mup``) must be ``x -> c * x`` with
    one finite ``c > 0`` on :data:`_PROBE`, to ``rtol=1e-6``. Without it (a context
    built by hand) ``c`` is the config's MuP multiplier, else 1.
    """
    config = getattr(ctx, "config", None)
    for name in UNSUPPORTED_LOGIT_OPTIONS:
        value = getattr(config, name, None)
        if value is not None and value is not False and value != 0:
            raise ContractError(
                f"config.{name}",
                expected=f"unset (None): processor {processor!r} forms the logits from the weight "
                "and does not follow this option of the model's output layer",
                actual=repr(value),
                hint="use an upstream-style processor that calls output_layer, or unset the option",
            )
    mup = 1.0
    if config is not None and getattr(config, "use_mup", False):
        mup = check_finite_number(
            "config.mup_output_mult",
            getattr(config, "mup_output_mult", 1.0),
            low=0.0,
            low_open=True,
        )
    scale_logits = getattr(ctx, "scale_logits", None)
    if scale_logits is None:
        return mup
    x = torch.tensor(_PROBE, dtype=torch.float64).reshape(1, 1, -1)  # [s, b, V]
    expected = "logits -> c * logits with one finite c > 0 (MuP's output multiplier)"
    try:
        with torch.no_grad():
            y = scale_logits(x)
    except Exception as exc:  # a scaling that is not a plain function of the logits
        raise ContractError(
            "scale_logits", expected=expected, actual=f"{type(exc).__name__} on a probe"
        ) from None
    if not isinstance(y, torch.Tensor) or tuple(y.shape) != tuple(x.shape):
        raise ContractError("scale_logits", expected=expected, actual=type(y).__name__)
    y = y.detach().to(device="cpu", dtype=torch.float64)
    c = float(y.flatten()[0])
    if not (math.isfinite(c) and c > 0) or not torch.allclose(y, c * x, rtol=1e-6, atol=0.0):
        raise ContractError(
            "scale_logits",
            expected=f"{expected}: processor {processor!r} scales its own logits by c",
            actual=f"{_PROBE} -> {tuple(float(f'{v:.6g}') for v in y.flatten().tolist())}",
        )
    return c
