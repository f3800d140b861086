"""Every integer option of the public API is checked against int64 where it
enters, and every number option against the float range: ``2**70`` or
``10**400`` gets a ``ContractError`` naming the option, never an
``OverflowError`` or a ``RuntimeError`` from deep inside a forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import hookspec
from hookspec import ContractError
from torch_impl.processors import (
    LinearOptions,
    PolicyLossConfig,
    cross_entropy_loss,
    linear_logprobs,
    policy_loss,
    selected_logprobs,
)

HUGE = (2**63, 2**70, -(2**63) - 1)
N, H, V = 6, 4, 8


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(N, H, generator=g),
        torch.randn(V, H, generator=g),
        torch.randint(0, V, (N,), generator=g),
    )


_OPTION_INTS = ("ignore_index", "tile_rows", "tile_cols")


@pytest.mark.parametrize("value", HUGE)
@pytest.mark.parametrize("option", _OPTION_INTS)
def test_linear_options_integer_fields(option: str, value: int) -> None:
    with pytest.raises(ContractError) as info:
        LinearOptions(**{option: value})
    assert info.value.field == option, info.value
    assert "int" in str(info.value.expected)


_FACTORIES: list[tuple[str, Callable[..., Any], str]] = [
    ("selected_logprobs", selected_logprobs, "tile_cols"),
    ("selected_logprobs", selected_logprobs, "tile_rows"),
    ("cross_entropy_loss", cross_entropy_loss, "tile_cols"),
    ("cross_entropy_loss", cross_entropy_loss, "tile_rows"),
    ("policy_loss", policy_loss, "tile_cols"),
    ("policy_loss", policy_loss, "tile_rows"),
]


@pytest.mark.parametrize("value", HUGE)
@pytest.mark.parametrize(
    ("name", "factory", "option"), _FACTORIES, ids=[f"{n}-{o}" for n, _, o in _FACTORIES]
)
def test_processor_factory_integer_options_are_checked_when_made(
    name: str, factory: Callable[..., Any], option: str, value: int
) -> None:
    with pytest.raises(ContractError) as info:
        factory(**{option: value})
    assert info.value.field == option, (name, info.value)


_NUMBER_OPTIONS = (
    "clip_low",
    "clip_high",
    "dual_clip",
    "kl_coef",
    "entropy_coef",
    "log_ratio_clamp",
)


@pytest.mark.parametrize("option", _NUMBER_OPTIONS)
def test_policy_config_numbers_beyond_the_float_range(option: str) -> None:
    with pytest.raises(ContractError) as info:
        PolicyLossConfig(**{option: 10**400})
    assert info.value.field == option and "10000" in str(info.value.actual)


@pytest.mark.parametrize("option", ("temperature", "logit_scale"))
def test_number_options_beyond_the_float_range(option: str) -> None:
    with pytest.raises(ContractError) as info:
        LinearOptions(**{option: 10**400})
    assert info.value.field == option


def test_in_range_integers_still_work_at_the_int64_edges() -> None:
    """``ignore_index`` at -2**62 and an ``int64``-sized chunk are taken, and
    change nothing: the result equals the default call's, bitwise."""
    h, w, y = _inputs()
    want = linear_logprobs(h, w, y).logprobs
    got = linear_logprobs(
        h, w, y, options=LinearOptions(tile_cols=2**63 - 1, tile_rows=2**63 - 1)
    ).logprobs
    assert torch.equal(got, want)


@pytest.mark.parametrize("value", HUGE)
def test_enable_output_processor_refuses_ignore_index_beyond_int64(
    megatron_single: None, value: int
) -> None:
    """The reported defect: ``ignore_index=2**70`` was accepted and the forward
    then failed with ``OverflowError``."""
    from torch_impl import enable_output_processor, is_output_processor_enabled
    from torch_impl.testing.tiny import build_tiny_gpt

    model = build_tiny_gpt()
    with pytest.raises(ContractError) as info:
        enable_output_processor(model, ignore_index=value)
    assert info.value.field == "ignore_index" and "int64" in str(info.value.expected)
    assert not is_output_processor_enabled(model), "refused before the model is touched"
    assert enable_output_processor(model, ignore_index=-(2**63)) is model


@pytest.mark.parametrize("field", ("ignore_index", "mtp_depth"))
def test_context_integers_beyond_int64(field: str) -> None:
    import numpy as np

    ctx = hookspec.OutputContext(hidden_states=np.zeros((2, 1, 3), np.float32))
    with pytest.raises(ContractError) as info:
        hookspec.validate_context(ctx.replace(**{field: 2**70}))
    assert info.value.field == field


@pytest.mark.parametrize("value", [str(2**70), str(-1), str(2**32)])
def test_hookcheck_seed_beyond_its_range_is_named(value: str) -> None:
    import io

    from jax_ref.check.hookcheck import main

    err = io.StringIO()
    code = main(
        ["--seed", value, "--dtype", "float32", "--no-synthetic"], out=io.StringIO(), err=err
    )
    assert code == 2
    line = err.getvalue().strip().splitlines()[-1]
    assert line.startswith("hookcheck: error: --seed: expected an int in [0, 2**32 - 1]"), line
    assert "processor" not in line


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**70, True, 1.0, "-100"])
def test_hook_options_made_directly_check_ignore_index(value: Any) -> None:
    """``HookOptions`` made by hand checks what ``enable_output_processor`` checks."""
    from torch_impl import HookOptions

    with pytest.raises(ContractError) as info:
        HookOptions(ignore_index=value)
    assert info.value.field == "ignore_index"


def test_hook_options_keep_ignore_index_as_a_python_int() -> None:
    import numpy as np

    from torch_impl import HookOptions

    got = HookOptions(ignore_index=np.int64(-7)).ignore_index
    assert type(got) is int and got == -7
    assert HookOptions(ignore_index=2**63 - 1).ignore_index == 2**63 - 1
