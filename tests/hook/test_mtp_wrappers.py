"""The MTP wrappers, ``scaled_mtp_gradient`` and ``detached_head``, take what the
forward takes and check it as early.

``scaled_mtp_gradient`` used to leave the gradient unscaled where the wrapped
processor returned a ``Mapping`` that is not a ``dict`` (``MappingProxyType``),
which ``validate_mtp_result`` accepts: through the hook every MTP-layer gradient
came back unscaled. It raised ``OverflowError`` for ``10**400`` and refused
``numpy.float32(0.5)`` and ``Fraction(1, 2)``. A keyword-style callable wrapped in
either failed with a plain ``TypeError`` after the model had run, where the same
callable unwrapped gets a ``ContractError`` before the forward.
"""

from __future__ import annotations

import ast
import types
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import hookspec
from hookspec import ContractError, OutputContext
from tests.support.hook_cases import grads
from tests.support.mtp_support import build_mtp_gpt
from torch_impl import enable_output_processor
from torch_impl.mtp import default_mtp_loss, detached_head, scaled_mtp_gradient
from torch_impl.testing.tiny import tiny_batch

ROOT = Path(__file__).resolve().parents[2]


@hookspec.processor
def proxied_mtp_loss(ctx: OutputContext) -> Any:
    """``default_mtp_loss`` with its result behind a read-only ``MappingProxyType``."""
    return types.MappingProxyType(dict(default_mtp_loss(ctx)))


def _mtp_grads(model: Any, **kw: Any) -> dict[str, torch.Tensor]:
    batch = tiny_batch()
    model.zero_grad(set_to_none=True)
    out = model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"], **kw)
    out.float().sum().backward()
    return {k: v for k, v in grads(model).items() if k.startswith("mtp.")}


@pytest.mark.usefixtures("megatron_single")
def test_a_mapping_result_gets_its_gradient_scaled_through_the_hook() -> None:
    want = _mtp_grads(build_mtp_gpt(mtp_loss_scaling_factor=0.1 * 0.5).eval())
    model = enable_output_processor(build_mtp_gpt(mtp_loss_scaling_factor=0.1).eval())
    got = _mtp_grads(model, mtp_processor=scaled_mtp_gradient(proxied_mtp_loss, 0.5))
    unscaled = _mtp_grads(model, mtp_processor=proxied_mtp_loss)
    assert want.keys() == got.keys() and len(got) > 10
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-9, msg=name)
        if grad.abs().max() > 0:
            assert not torch.allclose(unscaled[name], grad), name


def _unit_context() -> tuple[OutputContext, torch.Tensor]:
    x = torch.ones(2, 3, requires_grad=True)
    return OutputContext(hidden_states=torch.zeros(3, 2, 4)), x


@pytest.mark.parametrize(
    "result",
    [
        lambda x: {"loss": x * 1.0},
        lambda x: types.MappingProxyType({"loss": x * 1.0}),
        lambda x: types.MappingProxyType(
            {"loss": x * 1.0, "accepted": torch.ones(2, 3, dtype=torch.bool)}
        ),
        lambda x: x * 1.0,
    ],
    ids=["dict", "mappingproxy", "mappingproxy-accepted", "tensor"],
)
@pytest.mark.parametrize(
    "factor",
    [
        0.5,
        2,
        np.float32(0.5),
        np.float16(0.25),
        np.float64(0.5),
        np.int64(3),
        Fraction(1, 2),
        10**30,
    ],
    ids=[
        "float",
        "int",
        "np.float32",
        "np.float16",
        "np.float64",
        "np.int64",
        "Fraction",
        "10**30",
    ],
)
def test_every_real_factor_scales_every_result_form(result: Any, factor: Any) -> None:
    ctx, x = _unit_context()
    out = scaled_mtp_gradient(hookspec.processor(lambda c: result(x)), factor)(ctx)
    loss = out["loss"] if isinstance(out, dict) else out
    assert torch.equal(loss, torch.ones(2, 3))
    loss.sum().backward()
    assert torch.equal(x.grad, torch.full((2, 3), float(factor)))  # type: ignore[arg-type]
    if not isinstance(out, torch.Tensor):
        assert set(out) == set(result(torch.ones(2, 3)))


@pytest.mark.parametrize(
    ("factor", "actual"),
    [
        (10**400, "(beyond the float range)"),
        (Fraction(10**400, 3), "(beyond the float range)"),
        (-(10**400), "(beyond the float range)"),
        (np.float32("inf"), "inf"),
        (Fraction(0), "Fraction(0, 1)"),
        (np.bool_(True), "True"),
        (1 + 0j, "(1+0j)"),
    ],
    ids=[
        "10**400",
        "Fraction(10**400, 3)",
        "-(10**400)",
        "np.float32 inf",
        "Fraction(0)",
        "np.bool_",
        "complex",
    ],
)
def test_a_factor_beyond_the_float_range_or_not_real_is_named(factor: Any, actual: str) -> None:
    with pytest.raises(ContractError, match=r"^factor: expected a finite number > 0") as e:
        scaled_mtp_gradient(default_mtp_loss, factor)
    assert actual in str(e.value.actual)


def upstream_style(*, hidden_states: Any, labels: Any, **_: Any) -> Any:
    raise AssertionError("never called")


@pytest.mark.parametrize(
    "wrap",
    [
        detached_head,
        lambda p: scaled_mtp_gradient(p, 0.5),
        lambda p: detached_head(scaled_mtp_gradient(p, 2.0)),
    ],
    ids=["detached_head", "scaled_mtp_gradient", "both"],
)
def test_a_wrapped_keyword_style_callable_is_refused_as_an_unwrapped_one(wrap: Any) -> None:
    # the unwrapped one, through the model's forward: test_mtp.py's
    # test_mtp_processor_taking_upstream_keywords_is_refused_before_the_model_runs
    with pytest.raises(ContractError, match=r"^mtp_processor: expected a callable \(ctx\)") as e:
        wrap(upstream_style)
    assert "@hookspec.processor" in str(e.value)
    with pytest.raises(
        ContractError, match=r"^mtp_processor: expected a hookspec processor or a callable"
    ):
        wrap(3)


def test_no_library_code_asks_a_result_for_a_dict_where_the_contract_says_mapping() -> None:
    """The class of the MappingProxyType defect: ``isinstance(x, dict)`` (or a
    ``dict`` in a tuple) anywhere in the library, where a processor's result is
    typed ``Mapping`` by the contract. None is left; a new one must say why here."""
    found = []
    for package in ("hookspec", "torch_impl", "jax_ref"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if "testing" in path.relative_to(ROOT).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Call)
                    and getattr(node.func, "id", None) == "isinstance"
                    and len(node.args) == 2
                ):
                    kinds = (
                        node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                    )
                    if any(getattr(k, "id", None) == "dict" for k in kinds):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
