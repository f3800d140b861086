"""The flax.nnx output head: Megatron's output layer in JAX, loaded over DLPack."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jax_ref
from jax_ref.check.dlpack import shares_memory
from jax_ref.head import OutputHead
from jax_ref.references import linear_logprobs


def test_from_torch_shares_the_buffer_and_matches_torch_linear():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(11, 5, generator=g, dtype=torch.float64)
    b = torch.randn(11, generator=g, dtype=torch.float64)
    h = torch.randn(3, 4, 5, generator=g, dtype=torch.float64)
    with jax_ref.float64():
        head = OutputHead.from_torch(w, b, logit_scale=0.5)
        assert shares_memory(w, head.weight[...]) and shares_memory(b, head.bias[...])
        got = np.asarray(head(jnp.asarray(h.numpy())))
    want = (torch.nn.functional.linear(h, w, b) * 0.5).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-14)


def test_bf16_weight_crosses_natively():
    w = torch.randn(7, 3).to(torch.bfloat16)
    head = OutputHead.from_torch(w)
    assert head.weight[...].dtype == jnp.bfloat16 and shares_memory(w, head.weight[...])


def test_nnx_grad_of_the_head_is_the_reference_vjp():
    rng = np.random.default_rng(1)
    with jax_ref.float64():
        w = jnp.asarray(rng.normal(size=(13, 6)))
        h = jnp.asarray(rng.normal(size=(4, 6)))
        y = jnp.asarray(rng.integers(0, 13, size=4))
        head = OutputHead(w)
        grads = nnx.grad(lambda m: m.logprobs(h, y, temperature=0.8).logprobs.sum())(head)
        want = jax.grad(lambda w_: linear_logprobs(h, w_, y, temperature=0.8).logprobs.sum())(w)
        np.testing.assert_allclose(np.asarray(grads["weight"][...]), np.asarray(want), rtol=1e-13)


@pytest.mark.parametrize("tied", [False, True])
def test_from_megatron_matches_the_output_layer(megatron_single, tied):
    from torch_impl.testing.tiny import build_tiny_gpt

    model = build_tiny_gpt(share_embeddings_and_output_weights=tied)
    h = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(2))
    weight = model.shared_embedding_or_output_weight() if tied else None
    with torch.no_grad():
        want, _ = model.output_layer(h, weight=weight)
    with jax_ref.float64():
        head = OutputHead.from_megatron(model)
        assert head.tied is tied and head.bias is None and head.logit_scale == 1.0
        got = np.asarray(head(jnp.asarray(h.double().numpy())))
    np.testing.assert_allclose(got, want.double().numpy(), rtol=1e-5, atol=1e-6)


def test_from_megatron_applies_the_mup_output_multiplier(megatron_single):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from torch_impl.testing.tiny import build_tiny_gpt

    if "use_mup" not in {f.name for f in dataclasses.fields(TransformerConfig)}:
        pytest.skip("this Megatron Core has no MuP")
    model = build_tiny_gpt(use_mup=True, mup_base_hidden_size=16)
    assert model.config.mup_output_mult != 1.0
    h = torch.randn(3, 2, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, _ = model.output_layer(h)
        want = model._scale_logits(logits)
    with jax_ref.float64():
        head = OutputHead.from_megatron(model)
        got = np.asarray(head(jnp.asarray(h.double().numpy())))
    assert head.logit_scale == model.config.mup_output_mult
    np.testing.assert_allclose(got, want.double().numpy(), rtol=1e-5, atol=1e-6)
