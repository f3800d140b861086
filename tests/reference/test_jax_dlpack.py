"""The DLPack boundary: zero-copy on a CPU, dtypes preserved, buffers never written."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hookspec import ContractError
from jax_ref.check.dlpack import shares_memory, to_jax, to_torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_to_jax_is_zero_copy_and_exact(dtype):
    t = torch.randn(6, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = t.clone()
    a = to_jax(t)
    assert shares_memory(t, a), "expected the JAX array to use the torch buffer"
    assert str(a.dtype) == str(dtype).removeprefix("torch.")
    assert torch.equal(torch.from_numpy(np.array(a.astype(jnp.float32))), t.float())
    back = to_torch(a)
    assert back.dtype == dtype and back.data_ptr() == t.data_ptr()
    assert torch.equal(t, before)


def test_requires_grad_tensor_crosses_detached():
    t = torch.randn(4, 3, requires_grad=True)
    a = to_jax(t)
    assert shares_memory(t, a) and t.requires_grad


def test_integer_and_float64_keep_their_width():
    labels = torch.arange(12, dtype=torch.int64).reshape(3, 4) * 10**9
    a = to_jax(labels)
    assert a.dtype == jnp.int64 and int(a[2, 3]) == 11 * 10**9
    f = torch.randn(3, dtype=torch.float64)
    assert to_jax(f).dtype == jnp.float64


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_jax_to_torch_is_zero_copy(dtype):
    a = jnp.arange(12, dtype=dtype).reshape(3, 4)
    t = to_torch(a)
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    assert t.dtype == getattr(torch, str(jnp.dtype(dtype)))


def test_copy_gives_an_independent_buffer():
    t = torch.randn(8)
    a = to_jax(t, copy=True)
    assert not shares_memory(t, a)
    t.add_(1.0)  # allowed only because the buffer was copied
    assert not np.allclose(np.asarray(a), t.numpy())


def _bad(name):
    if name == "complex32":
        return torch.zeros(4, dtype=torch.complex32)
    if name == "float8":
        return torch.zeros(4, dtype=torch.float8_e4m3fn)
    if name == "qint8":
        return torch.quantize_per_tensor(torch.zeros(4), 0.1, 0, torch.qint8)
    if name == "sparse":
        return torch.eye(3).to_sparse()
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["complex32", "float8", "qint8", "sparse"])
# made on purpose: torch warns that complex32 is experimental and qint8 deprecated
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_dtypes_the_boundary_cannot_carry_raise_contract_error(name):
    with pytest.raises(ContractError, match="hidden_states: expected a d") as info:
        to_jax(_bad(name), field="hidden_states")
    assert info.value.field == "hidden_states"


def test_non_tensors_are_refused():
    with pytest.raises(ContractError, match=r"torch\.Tensor"):
        to_jax(np.zeros(3))
    with pytest.raises(ContractError, match=r"jax\.Array"):
        to_torch([1, 2])
