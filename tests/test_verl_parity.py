"""veRL 0.9.1's KL estimators and aggregations against ours, with veRL's own functions
(``tests/verl_oracle.py``) as the oracle, in float64: ``kl_penalty`` under every name veRL
accepts (``kl``, ``k1``, ``abs``, ``mse``, ``k2``, ``low_var_kl``, ``k3``, each with ``+``),
values and gradients; ``agg_loss`` in its five modes against ``aggregation_weights``; and
the GRPO loss veRL's actor forms (``compute_policy_loss_vanilla`` plus ``kl_coef`` times
the aggregated ``kl_penalty``) against ``policy_loss`` through the processor, with the
gradients of the hidden states and the weight."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hookspec import OutputContext, VocabShard
from tests import verl_oracle
from torch_impl.processors import (
    PolicyBatch,
    PolicyLossConfig,
    aggregation_weights,
    kl_penalty,
    policy_loss,
)

pytestmark = pytest.mark.release_independent  # the processor's maths; no Megatron in it

B, S, H, V, IGNORE = 6, 8, 8, 29, -100
TOL = {"rtol": 1e-10, "atol": 1e-12}
VERL_KL = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


@pytest.fixture(scope="module")
def verl() -> Any:
    return verl_oracle.load()


def _ours_for(name: str) -> PolicyLossConfig:
    """veRL's ``kl_loss_type`` as our config: the name as it is, and veRL's k3 value clamp."""
    k3 = name.rstrip("+") in ("low_var_kl", "k3")
    return PolicyLossConfig(kl_estimator=name, kl_value_clamp=10.0 if k3 else None)


@pytest.mark.parametrize("name", VERL_KL + [f"{n}+" for n in VERL_KL])
def test_kl_penalty_equals_verls_value_and_gradient(verl: Any, name: str) -> None:
    g = torch.Generator().manual_seed(len(name))
    logp = -torch.rand(B, S, generator=g, dtype=torch.float64) * 4
    ref = logp + torch.randn(B, S, generator=g, dtype=torch.float64)
    ref[0, 0] = logp[0, 0] + 12.0  # k3 past veRL's value clamp of 10
    config = _ours_for(name)
    mine_lp, theirs_lp = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    mine = kl_penalty(
        mine_lp,
        ref,
        config.kl_estimator,
        clamp=config.log_ratio_clamp,
        value_clamp=config.kl_value_clamp,
        straight_through=config.kl_straight_through,
    )
    theirs = verl.core_algos.kl_penalty(theirs_lp, ref, name)
    torch.testing.assert_close(mine, theirs, **TOL)
    weights = torch.rand(B, S, generator=g, dtype=torch.float64)
    (mine * weights).sum().backward()
    (theirs * weights).sum().backward()
    torch.testing.assert_close(mine_lp.grad, theirs_lp.grad, **TOL)


AGGREGATIONS = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
]


@pytest.mark.parametrize("factor", [None, 4096.0])
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregation_equals_verls_agg_loss(verl: Any, mode: str, factor: float | None) -> None:
    if factor is not None and mode != "seq-mean-token-sum-norm":
        pytest.skip("loss_scale_factor is read by seq-mean-token-sum-norm only")
    g = torch.Generator().manual_seed(len(mode))
    loss = torch.randn(B, S, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, S, generator=g) > 0.3).double()
    mask[2] = 0.0  # an empty sequence: veRL and ours leave it out of the sequence mean
    segments = torch.arange(B)[:, None].expand(B, S)
    mine_l, theirs_l = loss.clone().requires_grad_(), loss.clone().requires_grad_()
    weights = aggregation_weights(mask, segments, B, mode, loss_scale_factor=factor)
    mine = (weights * mine_l).sum()
    theirs = verl.core_algos.agg_loss(theirs_l, mask, mode, loss_scale_factor=factor)
    # veRL divides a sequence's token sum by n_k + 1e-8 in seq-mean-token-mean; ours by n_k
    tol = {"rtol": 1e-7, "atol": 1e-12} if mode == "seq-mean-token-mean" else TOL
    torch.testing.assert_close(mine, theirs, **tol)
    mine.backward()
    theirs.backward()
    torch.testing.assert_close(mine_l.grad, theirs_l.grad, **tol)


def test_seq_mean_token_mean_differs_from_verls_by_its_epsilon_alone(verl: Any) -> None:
    """The one difference kept on purpose: veRL's ``1e-8`` beside each sequence's count."""
    loss = torch.ones(1, 4, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    ours = (aggregation_weights(mask, torch.zeros(1, 4, dtype=torch.long), 1, "seq-mean-token-mean")
            * loss).sum()  # fmt: skip
    theirs = verl.core_algos.agg_loss(loss, mask, "seq-mean-token-mean")
    assert float(ours) == 1.0
    assert float(theirs) == pytest.approx(2.0 / (2.0 + 1e-8), abs=0.0)


def _materialised_logprobs(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = torch.einsum("sbh,vh->bsv", h, w).log_softmax(-1)
    return torch.where(y == IGNORE, 0.0, z.gather(2, y.clamp(min=0)[..., None]).squeeze(-1))


ACTOR_LOSSES = {
    "grpo-low_var_kl-seq-mean-token-mean": ("low_var_kl", "token-mean", None),
    "k3+-seq-mean-token-sum-norm": ("k3+", "seq-mean-token-sum-norm", 64.0),
    "abs-token-sum": ("abs", "token-sum", None),
    "mse-seq-mean-token-sum": ("mse", "seq-mean-token-sum", None),
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "autograd"])
@pytest.mark.parametrize("name", list(ACTOR_LOSSES))
def test_the_actor_loss_equals_verls_through_the_processor(
    verl: Any, name: str, fused: bool
) -> None:
    kl_type, mode, factor = ACTOR_LOSSES[name]
    kl_coef, clip = 0.05, 0.2
    g = torch.Generator().manual_seed(len(name))
    h = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[1, 2] = IGNORE
    lp = _materialised_logprobs(h, w, labels).detach()
    old = lp + 0.2 * torch.randn(B, S, generator=g, dtype=torch.float64)
    ref = lp + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)
    adv = torch.randn(B, S, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, S, generator=g) > 0.2).double()
    mask[4] = 0.0

    # veRL: the actor's pg loss plus kl_coef times the aggregated kl_penalty
    th, tw = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp = _materialised_logprobs(th, tw, labels)
    response_mask = mask * (labels != IGNORE)
    actor = verl_oracle.ActorConfig(
        clip_ratio=clip, clip_ratio_low=clip, clip_ratio_high=clip, clip_ratio_c=3.0,
        global_batch_info={"loss_scale_factor": factor} if factor else {},
    )  # fmt: skip
    pg, _ = verl.core_algos.compute_policy_loss_vanilla(old, logp, adv, response_mask, mode, actor)
    kld = verl.core_algos.kl_penalty(logp, ref, kl_type)
    kl = verl.core_algos.agg_loss(kld, response_mask, mode, loss_scale_factor=factor)
    theirs = pg + kl_coef * kl
    theirs.backward()

    k3 = kl_type.rstrip("+") in ("low_var_kl", "k3")
    config = PolicyLossConfig(
        clip_low=clip, dual_clip=3.0, kl_coef=kl_coef, kl_estimator=kl_type, aggregation=mode,
        kl_value_clamp=10.0 if k3 else None, loss_scale_factor=factor, fused=fused,
    )  # fmt: skip
    batch = PolicyBatch(old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref)
    oh, ow = h.clone().requires_grad_(), w.clone().requires_grad_()
    ctx = OutputContext(
        hidden_states=oh, labels=labels, vocab_weight=ow, vocab=VocabShard(0, V, V), context=batch
    )
    out = policy_loss(config, tile_rows=5, tile_cols=7)(ctx)
    out["loss"].backward()
    torch.testing.assert_close(out["loss"], theirs.detach(), **TOL)
    torch.testing.assert_close(oh.grad, th.grad, **TOL)
    torch.testing.assert_close(ow.grad, tw.grad, **TOL)
    torch.testing.assert_close(out["kl"], kl.detach(), **TOL)


def test_verl_names_are_taken_as_they_are() -> None:
    config = PolicyLossConfig(kl_estimator="low_var_kl+", aggregation="seq-mean-token-sum-norm")
    assert config.kl_estimator == "k3" and config.kl_straight_through
    assert PolicyLossConfig(kl_estimator="mse").kl_estimator == "k2"
    assert PolicyLossConfig(kl_estimator="kl").kl_estimator == "k1"
