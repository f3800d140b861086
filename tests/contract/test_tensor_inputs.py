"""Tensor-valued inputs and options, each class swept:

1. A shape is checked as a shape: a ``[b, s]`` temperature has the element count of
   the ``[s * b]`` rows and was taken in row-major order (each row another token's
   ``T``). Every comparison of an input's element count in the library is listed.
2. A tensor on the ``meta`` device (a shape without values) is refused by name,
   wherever it enters: hidden states, weight, labels, a tensor temperature, a
   processor's context tensors. It failed inside ``torch.autocast`` or ``.item()``.
3. Options and configs compare and hash: ``LinearOptions`` with a tensor temperature
   compares it by identity (``==`` raised on a tensor's truth value).
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hookspec import ContractError, OutputContext, VocabShard
from torch_impl._call import HookOptions, MTPOptions
from torch_impl.processors import (
    DistillConfig,
    LinearOptions,
    PolicyLossConfig,
    SparseTeacher,
    cross_entropy_loss,
    distillation_loss,
    fused_token_loss,
    linear_logprobs,
    linear_topk_logprobs,
    selected_logprobs,
)
from torch_impl.processors._checks import check_temperature

ROOT = Path(__file__).resolve().parents[2]
N, H, V = 10, 4, 7


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(N, H, generator=g),
        torch.randn(V, H, generator=g),
        torch.randint(0, V, (N,), generator=g),
    )


# ---------------------------------------------------------------- 1. shapes as shapes


@pytest.mark.parametrize("shape", [(2, 5), (5, 2), (10, 1), (1, 10)])
def test_a_temperature_of_more_than_one_dim_is_refused_at_construction(
    shape: tuple[int, ...],
) -> None:
    """``_options.py``: only the dtype was checked; ``[2, 5]`` for 10 rows was flattened."""
    with pytest.raises(ContractError) as info:
        LinearOptions(temperature=torch.ones(shape))
    assert info.value.field == "temperature" and "[n]" in str(info.value.expected)
    assert str(list(shape)).replace(" ", "") in str(info.value).replace(" ", "")


@pytest.mark.parametrize("shape", [(2, 5), (10, 1)])
def test_check_temperature_compares_the_shape_not_the_count(shape: tuple[int, ...]) -> None:
    """``_checks.py``: ``numel() != n`` let any tensor of ``n`` elements through."""
    with pytest.raises(ContractError) as info:
        check_temperature(torch.ones(shape), N)
    assert info.value.field == "temperature"
    assert isinstance(check_temperature(torch.ones(N), N), torch.Tensor)


def test_a_per_row_temperature_is_each_rows_own() -> None:
    """The accepted form against float64: row ``i`` divided by ``T[i]``."""
    h, w, y = _inputs()
    t = torch.linspace(0.5, 2.0, N)
    got = linear_logprobs(h, w, y, options=LinearOptions(temperature=t)).logprobs
    z = (h.double() @ w.double().T) / t.double()[:, None]
    want = z.log_softmax(-1).gather(1, y[:, None])[:, 0]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _count_comparisons(path: Path) -> list[str]:
    """``x.numel()`` / ``x.nelement()`` compared with anything but 0 (a count of an
    input standing for its shape)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        counts = [
            s
            for s in sides
            if isinstance(s, ast.Call)
            and isinstance(s.func, ast.Attribute)
            and s.func.attr in ("numel", "nelement")
        ]
        zero = any(isinstance(s, ast.Constant) and s.value == 0 for s in sides)
        if counts and not zero:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


# The one count comparison left: a scratch buffer's capacity, not an input's shape.
COUNT_COMPARISONS_ALLOWED = {"torch_impl/processors/_tiles.py"}


def test_no_input_shape_is_checked_by_its_element_count() -> None:
    found = [
        site
        for package in ("hookspec", "torch_impl", "jax_ref")
        for path in sorted((ROOT / package).rglob("*.py"))
        for site in _count_comparisons(path)
    ]
    assert [s for s in found if s.split(":")[0] not in COUNT_COMPARISONS_ALLOWED] == []
    assert found, "the scan finds the engine's buffer capacity check (it can see a comparison)"


# ---------------------------------------------------------------- 2. meta tensors


def _meta(case: str) -> tuple[tuple[Any, ...], dict[str, Any], str]:
    h, w, y = _inputs()
    if case == "hidden and weight":
        return (h.to("meta"), w.to("meta"), y), {}, "hidden"
    if case == "weight":
        return (h, w.to("meta"), y), {}, "weight"
    if case == "labels":
        return (h, w, y.to("meta")), {}, "labels"
    if case == "labels, unchecked":
        return (h, w, y.to("meta")), {"check_values": False}, "labels"
    if case == "temperature":
        return (h, w, y), {"temperature": torch.ones(N, device="meta")}, "temperature"
    assert case == "temperature, unchecked"
    return (
        (h, w, y),
        {"temperature": torch.ones(N, device="meta"), "check_values": False},
        "temperature",
    )


META_CASES = [
    "hidden and weight",
    "weight",
    "labels",
    "labels, unchecked",
    "temperature",
    "temperature, unchecked",
]


def _call(fn: str, args: tuple[Any, ...], options: dict[str, Any]) -> Any:
    opts = LinearOptions(**options)  # a meta temperature is refused here, at construction
    if fn == "linear_logprobs":
        return linear_logprobs(*args, options=opts)
    if fn == "linear_topk_logprobs":
        h, w, y = args
        return linear_topk_logprobs(h, w, k=2, labels=y, options=opts)
    return fused_token_loss(*args, lambda lp, ent, rows: lp.sum(), options=opts)


@pytest.mark.parametrize("case", META_CASES)
@pytest.mark.parametrize("fn", ["linear_logprobs", "linear_topk_logprobs", "fused_token_loss"])
def test_a_meta_tensor_is_refused_by_name_in_every_tensor_function(fn: str, case: str) -> None:
    """Before: ``unsupported scalarType`` (autocast), ``.item() cannot be called on meta
    tensors``, ``Cannot copy out of meta tensor``."""
    args, options, field = _meta(case)
    with pytest.raises(ContractError) as info:
        _call(fn, args, options)
    # inside a transform a processor's reshape of its rows is wrapped too: the first wrapped is
    # named
    allowed = {field, "hidden_states"} if fn == "selected_logprobs" else {field}
    assert info.value.field in allowed and "meta" in str(info.value)


def _ctx(**kw: Any) -> OutputContext:
    g = torch.Generator().manual_seed(1)
    s, b = 5, 2
    base: dict[str, Any] = {
        "hidden_states": torch.randn(s, b, H, generator=g),
        "vocab_weight": torch.randn(V, H, generator=g),
        "labels": torch.randint(0, V, (b, s), generator=g),
        "vocab": VocabShard(0, V, V),
    }
    return OutputContext(**{**base, **kw})


def _meta_ctx(change: str) -> OutputContext:
    ctx = _ctx()
    if change == "hidden_states":
        return ctx.replace(
            hidden_states=ctx.hidden_states.to("meta"), vocab_weight=ctx.vocab_weight.to("meta")
        )
    if change == "labels":
        return ctx.replace(labels=ctx.labels.to("meta"))
    if change == "loss_mask":
        return ctx.replace(loss_mask=torch.ones(2, 5, device="meta"))
    if change == "context.temperature":
        return ctx.replace(context={"temperature": torch.ones(2, 5, device="meta")})
    k = 3
    ids = torch.arange(k).expand(2, 5, k).contiguous()
    lp = torch.full((2, 5, k), -2.0)
    if change == "context.ids":
        return ctx.replace(context=SparseTeacher(ids=ids.to("meta"), logprobs=lp))
    if change == "context.logprobs":
        return ctx.replace(context=SparseTeacher(ids=ids, logprobs=lp.to("meta")))
    assert change == "context.mask"
    return ctx.replace(
        context=SparseTeacher(ids=ids, logprobs=lp, mask=torch.ones(2, 5, device="meta"))
    )


PROCESSOR_META = [
    ("sel", "hidden_states"),
    ("sel", "labels"),
    ("sel", "loss_mask"),
    ("sel", "context.temperature"),
    ("ce", "hidden_states"),
    ("ce", "labels"),
    ("distill", "hidden_states"),
    ("distill", "context.ids"),
    ("distill", "context.logprobs"),
    ("distill", "context.mask"),
    ("distill", "loss_mask"),
]


@pytest.mark.parametrize(("proc", "change"), PROCESSOR_META)
@pytest.mark.parametrize("check_values", [True, False])
def test_a_meta_tensor_in_a_processors_context_is_refused_by_name(
    proc: str, change: str, check_values: bool
) -> None:
    """Every tensor of the context and of the user context, read or not."""
    make = {"sel": selected_logprobs, "ce": cross_entropy_loss, "distill": distillation_loss}[proc]
    ctx = _meta_ctx(change).replace(check_values=check_values)
    with pytest.raises(ContractError) as info:
        make()(ctx)
    assert info.value.field == change and "meta" in str(info.value)


# ---------------------------------------------------------------- 3. options compare and hash


def test_options_with_tensor_temperatures_compare_by_identity() -> None:
    t = torch.ones(N)
    a, b = LinearOptions(temperature=t), LinearOptions(temperature=t)
    c = LinearOptions(temperature=torch.ones(N))  # equal values, another tensor
    assert a == b and hash(a) == hash(b)
    assert a != c and not (a == c)
    assert len({a, b, c}) == 2
    assert LinearOptions(temperature=2) == LinearOptions(temperature=2.0)
    assert hash(LinearOptions(temperature=2)) == hash(LinearOptions(temperature=2.0))
    assert LinearOptions(temperature=2.0) != LinearOptions(temperature=t)
    assert LinearOptions(tile_rows=4) != LinearOptions(tile_rows=8)
    assert LinearOptions() != "LinearOptions()"


@pytest.mark.parametrize(
    "make",
    [
        lambda: LinearOptions(temperature=1.5, vocab=VocabShard(0, 4, 4)),
        lambda: DistillConfig(beta=0.3),
        lambda: PolicyLossConfig(clip_low=0.1),
        lambda: MTPOptions(),
        lambda: HookOptions(),
    ],
    ids=["LinearOptions", "DistillConfig", "PolicyLossConfig", "MTPOptions", "HookOptions"],
)
def test_every_options_class_compares_and_hashes(make: Any) -> None:
    """The sweep: every options and config class, two equal instances equal, with
    one hash; a changed field unequal."""
    a, b = make(), make()
    assert a == b and hash(a) == hash(b)
    field = next(
        f for f in dataclasses.fields(a) if isinstance(getattr(a, f.name), bool | int | float)
    )
    value = getattr(a, field.name)
    changed = (not value) if isinstance(value, bool) else value + 1
    try:
        other = dataclasses.replace(a, **{field.name: changed})
    except ContractError:
        return
    assert other != a


# ---------------------------------------------------------------- 4. torch.func transforms


def _transformed(fn: str, transform: str) -> Any:
    h, w, y = _inputs()

    def run(hh: torch.Tensor, ww: torch.Tensor, yy: torch.Tensor) -> torch.Tensor:
        if fn == "linear_logprobs":
            return linear_logprobs(hh, ww, yy).logprobs.sum()
        if fn == "linear_topk_logprobs":
            return linear_topk_logprobs(hh, ww, k=2, labels=yy).logprobs.sum()
        if fn == "fused_token_loss":
            return fused_token_loss(hh, ww, yy, lambda lp, ent, rows: lp.sum()).loss
        ctx = OutputContext(
            hidden_states=hh.reshape(N, 1, H),
            vocab_weight=ww,
            labels=yy.reshape(1, N),
            vocab=VocabShard(0, V, V),
        )
        return selected_logprobs()(ctx)["logprobs"].sum()

    if transform == "grad":
        return torch.func.grad(lambda hh: run(hh, w, y))(h)
    if transform == "grad of the weight":
        return torch.func.grad(lambda ww: run(h, ww, y))(w)
    if transform == "vmap":
        return torch.func.vmap(lambda hh: run(hh, w, y))(h[None].expand(2, N, H))
    assert transform == "vmap of the labels"
    return torch.func.vmap(lambda yy: run(h, w, yy))(y[None].expand(2, N))


TRANSFORM_FIELDS = {
    "grad": "hidden",
    "grad of the weight": "weight",
    "vmap": "hidden",
    "vmap of the labels": "labels",
}


@pytest.mark.parametrize("transform", sorted(TRANSFORM_FIELDS))
@pytest.mark.parametrize(
    "fn", ["linear_logprobs", "linear_topk_logprobs", "fused_token_loss", "selected_logprobs"]
)
def test_torch_func_transforms_are_refused_by_name(fn: str, transform: str) -> None:
    """Before: torch's "must override the setup_context staticmethod" (vmap, grad) from
    the old-style ``autograd.Function``; the gradients are formed in tiles outside
    autograd, so the transforms are refused, naming the transformed input."""
    with pytest.raises(ContractError) as info:
        _transformed(fn, transform)
    field = TRANSFORM_FIELDS[transform]
    if fn == "selected_logprobs":  # a processor names the context's fields
        field = {"hidden": "hidden_states", "weight": "vocab_weight"}.get(field, field)
    # inside a transform a processor's reshape of its rows is wrapped too: the first wrapped is
    # named
    allowed = {field, "hidden_states"} if fn == "selected_logprobs" else {field}
    assert info.value.field in allowed
    assert "torch.func" in str(info.value) and "torch.autograd.grad" in str(info.value)


def test_torch_autograd_grad_is_the_supported_route_against_float64() -> None:
    h, w, y = _inputs()
    hh = h.clone().requires_grad_()
    (dh,) = torch.autograd.grad(linear_logprobs(hh, w, y).logprobs.sum(), hh)
    h64 = h.double().requires_grad_()
    want = (h64 @ w.double().T).log_softmax(-1).gather(1, y[:, None]).sum()
    (dh64,) = torch.autograd.grad(want, h64)
    torch.testing.assert_close(dh.double(), dh64, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ 5. Triton's mode, fixed at its import

TRITON_ORDER = """
import os, sys, torch
if sys.argv[1] == "before":
    os.environ["TRITON_INTERPRET"] = "1"
import megatron.core  # imports triton
os.environ["TRITON_INTERPRET"] = "1"
from hookspec import ContractError
from torch_impl.processors import LinearOptions, linear_logprobs
g = torch.Generator().manual_seed(0)
h, w = torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g)
y = torch.tensor([0, 4, 2])
try:
    lp = linear_logprobs(h, w, y, options=LinearOptions(backend="triton")).logprobs
except ContractError as exc:
    print("refused", exc.field, "first imported" in str(exc) and "import megatron.core" in str(exc))
else:
    want = (h.double() @ w.double().T).log_softmax(-1).gather(1, y[:, None])[:, 0]
    print("ran", bool(torch.allclose(lp.double(), want, atol=1e-5)))
"""


@pytest.mark.parametrize(
    ("order", "outcome"), [("after", "refused backend True"), ("before", "ran True")]
)
def test_triton_interpreter_set_after_triton_is_imported_is_named(order: str, outcome: str) -> None:
    """``TRITON_INTERPRET=1`` set after ``import megatron.core`` (which imports Triton):
    every ``backend="triton"`` call failed with Triton's ``InterpreterError`` ("Cannot
    call @triton.jit'd outside of the scope of a kernel"); now a ``ContractError``
    naming the order. Set before the import, the kernels run (the control)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONWARNINGS"] = "ignore"
    done = subprocess.run(
        [sys.executable, "-c", TRITON_ORDER, order],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert done.stdout.strip().splitlines()[-1:] == [outcome], done.stdout + done.stderr[-2000:]
