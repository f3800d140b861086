"""Rollout correction against veRL 0.9.1's own functions (``tests/support/verl_oracle.py``), in
float64: the importance weights, the rejection mask and the metrics of every option
(``compute_rollout_correction_and_rejection_mask``), and the policy loss with them through
the processor — values and the gradients of the hidden states and the weight — against
veRL's ``compute_policy_loss_vanilla`` / ``compute_policy_loss_bypass_mode`` applied to
logprobs from materialised logits. The geometric level, which veRL 0.9.1 does not have,
against its formula written out here."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from hookspec import ContractError, OutputContext, VocabShard
from tests.support import verl_oracle
from torch_impl.processors import (
    PolicyBatch,
    PolicyLossConfig,
    RejectionBounds,
    RolloutCorrection,
    policy_loss,
    rollout_correction,
)

pytestmark = pytest.mark.release_independent  # the processor's maths; no Megatron in it

B, S, H, V, IGNORE = 5, 9, 8, 37, -100
TOL = {"rtol": 1e-10, "atol": 1e-12}


@pytest.fixture(scope="module")
def verl() -> Any:
    return verl_oracle.load()


def _logprob_data(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, S, generator=g, dtype=torch.float64) * 3
    rollout = old + 0.25 * torch.randn(B, S, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, S, generator=g) > 0.25).double()
    mask[1] = 0.0  # an empty sequence
    mask[3, 2:] = 0.0  # a short one
    return {"old": old, "rollout": rollout, "mask": mask}


REJECTIONS = {
    "token_k1": RejectionBounds(upper=1.25, lower=0.8),
    "token_k2": 0.01,
    "token_k3": 0.01,
    "seq_sum_k1": RejectionBounds(upper=1.3, lower=0.6),
    "seq_sum_k2": 0.08,
    "seq_sum_k3": 0.08,
    "seq_mean_k1": 1.1,
    "seq_mean_k2": 0.02,
    "seq_mean_k3": 0.02,
    "seq_max_k2": 0.05,
    "seq_max_k3": 0.05,
}

CORRECTIONS = {
    "tis-token": RolloutCorrection(rollout_is="token", rollout_is_threshold=1.2),
    "tis-sequence": RolloutCorrection(rollout_is="sequence", rollout_is_threshold=1.5),
    "icepop-token": RolloutCorrection(
        rollout_is="token", rollout_is_threshold=1.25, rollout_is_threshold_lower=0.8
    ),
    "icepop-sequence": RolloutCorrection(
        rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_threshold_lower=0.5
    ),
    "normalized-token": RolloutCorrection(rollout_is="token", rollout_is_batch_normalize=True),
    "normalized-sequence": RolloutCorrection(
        rollout_is="sequence", rollout_is_batch_normalize=True
    ),
    **{f"rs-{name}": RolloutCorrection(rollout_rs={name: b}) for name, b in REJECTIONS.items()},
    "is-and-two-rejections": RolloutCorrection(
        rollout_is="token",
        rollout_is_threshold=1.5,
        rollout_rs={"token_k1": 1.3, "seq_mean_k3": 0.02},
    ),
}


@pytest.mark.parametrize("name", list(CORRECTIONS))
def test_weights_mask_and_metrics_equal_verls(verl: Any, name: str) -> None:
    config = CORRECTIONS[name]
    d = _logprob_data(seed=len(name))
    segments = torch.arange(B)[:, None].expand(B, S)
    ours = rollout_correction(d["old"], d["rollout"], d["mask"], segments, B, config)
    helper = verl.rollout_corr_helper
    proto, theirs_mask, theirs = helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=d["old"],
        rollout_log_prob=d["rollout"],
        response_mask=d["mask"],
        **verl_oracle.rollout_kwargs(config),
    )
    torch.testing.assert_close(d["mask"] * ours.keep, theirs_mask, **TOL)
    if config.rollout_is is None:
        assert proto is None and ours.weights is None
    else:
        torch.testing.assert_close(ours.weights, proto.batch["rollout_is_weights"], **TOL)
    assert 0.0 < float((ours.keep * d["mask"]).sum()) or config.rollout_rs
    missing = {k.removeprefix("rollout_corr/") for k in theirs} - set(ours.metrics)
    assert not missing, f"metrics veRL logs that ours lacks: {sorted(missing)}"
    for key, value in theirs.items():
        mine = ours.metrics[key.removeprefix("rollout_corr/")]
        # veRL takes some fractions as float32 (`.float().mean()`); ours keep the inputs' dtype
        tol = {"rtol": 2**-23, "atol": 2**-24} if "fraction" in key else TOL
        torch.testing.assert_close(mine, torch.tensor(value, dtype=torch.float64), **tol, msg=key)


def test_some_tokens_are_rejected_and_some_weights_truncated() -> None:
    """The options above bite: the parity is not of all-ones masks and untruncated weights."""
    d = _logprob_data(seed=3)
    segments = torch.arange(B)[:, None].expand(B, S)
    both = CORRECTIONS["is-and-two-rejections"]
    result = rollout_correction(d["old"], d["rollout"], d["mask"], segments, B, both)
    counted = d["mask"] > 0
    assert 0 < int((result.keep[counted] == 0).sum()) < int(counted.sum())
    truncated = CORRECTIONS["tis-token"]
    result = rollout_correction(d["old"], d["rollout"], d["mask"], segments, B, truncated)
    assert float(result.weights.max()) == truncated.rollout_is_threshold


def test_geometric_level_is_the_mean_log_ratio_of_the_sequence() -> None:
    d = _logprob_data(seed=5)
    segments = torch.arange(B)[:, None].expand(B, S)
    config = RolloutCorrection(rollout_is="geometric", rollout_is_threshold=1.1)
    ours = rollout_correction(d["old"], d["rollout"], d["mask"], segments, B, config)
    m = d["mask"]
    per_row = ((d["old"] - d["rollout"]) * m).sum(1) / (m.sum(1) + 1e-8)
    expected = torch.exp(per_row)[:, None].expand(B, S).clamp(max=1.1) * m
    torch.testing.assert_close(ours.weights, expected, **TOL)


def _problem(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, 3] = IGNORE
    logp = _materialised_logprobs(h, w, labels).detach()
    old = logp + 0.15 * torch.randn(B, S, generator=g, dtype=torch.float64)
    rollout = old + 0.2 * torch.randn(B, S, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, S, generator=g) > 0.2).double()
    mask[2] = 0.0
    adv = torch.randn(B, S, generator=g, dtype=torch.float64)
    return {"h": h, "w": w, "labels": labels, "old": old, "rollout": rollout, "mask": mask,
            "adv": adv}  # fmt: skip


def _materialised_logprobs(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = torch.einsum("sbh,vh->bsv", h, w).log_softmax(-1)
    lp = z.gather(2, y.clamp(min=0)[..., None]).squeeze(-1)
    return torch.where(y == IGNORE, 0.0, lp)


def _verl_actor(config: PolicyLossConfig, correction: RolloutCorrection) -> Any:
    clip = config.clip_low
    keys = verl_oracle.rollout_kwargs(correction)
    policy = {"rollout_correction": {"loss_type": correction.loss_type, **keys}}
    return verl_oracle.ActorConfig(
        clip_ratio=clip,
        clip_ratio_low=clip,
        clip_ratio_high=config.effective_clip_high,
        clip_ratio_c=config.dual_clip,
        global_batch_info={},
        policy_loss=verl_oracle.ActorConfig(policy),
    )


def _verl_loss(verl: Any, d: dict[str, Any], cfg: PolicyLossConfig) -> tuple[Any, ...]:
    """veRL's loss and the gradients of h and W through materialised float64 logits."""
    correction = cfg.rollout_correction
    assert correction is not None
    h, w = d["h"].clone().requires_grad_(), d["w"].clone().requires_grad_()
    logp = _materialised_logprobs(h, w, d["labels"])
    response_mask = d["mask"] * (d["labels"] != IGNORE)
    actor = _verl_actor(cfg, correction)
    if correction.bypass_mode:
        with verl_oracle.importable(verl):
            loss, metrics = verl.core_algos.compute_policy_loss_bypass_mode(
                d["rollout"], logp, d["adv"], response_mask, str(cfg.aggregation), actor
            )
    else:
        proto, modified, _ = verl.rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
            old_log_prob=d["old"],
            rollout_log_prob=d["rollout"],
            response_mask=response_mask,
            **verl_oracle.rollout_kwargs(correction),
        )
        weights = None if proto is None else proto.batch["rollout_is_weights"]
        loss, metrics = verl.core_algos.compute_policy_loss_vanilla(
            d["old"], logp, d["adv"], modified, str(cfg.aggregation), actor, weights
        )
    loss.backward()
    return loss.detach(), h.grad, w.grad, metrics


LOSSES = {
    "decoupled-tis-token-mean": PolicyLossConfig(
        dual_clip=3.0,
        rollout_correction=RolloutCorrection(rollout_is="token", rollout_is_threshold=1.2),
    ),
    "decoupled-seq-is-rejection-seq-sum": PolicyLossConfig(
        dual_clip=3.0,
        clip_high=0.28,
        aggregation="seq-mean-token-sum",
        rollout_correction=RolloutCorrection(
            rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs={"token_k1": 1.3}
        ),
    ),
    "bypass-ppo-clip-rejection": PolicyLossConfig(
        dual_clip=3.0,
        rollout_correction=RolloutCorrection(
            rollout_is="token", rollout_rs={"seq_mean_k3": 0.03}, bypass_mode=True
        ),
    ),
    "bypass-reinforce-tis": PolicyLossConfig(
        dual_clip=3.0,
        aggregation="seq-mean-token-sum",
        rollout_correction=RolloutCorrection(
            rollout_is="token",
            rollout_is_threshold=1.3,
            bypass_mode=True,
            loss_type="reinforce",
        ),
    ),
}


def _processor(d: dict[str, Any], cfg: PolicyLossConfig) -> tuple[Any, ...]:
    """The processor's outputs on the problem ``d`` and the gradients of ``h`` and ``W``."""
    batch = PolicyBatch(
        old_logprobs=d["old"], advantages=d["adv"], mask=d["mask"], rollout_logprobs=d["rollout"]
    )
    h, w = d["h"].clone().requires_grad_(), d["w"].clone().requires_grad_()
    ctx = OutputContext(
        hidden_states=h, labels=d["labels"], vocab_weight=w, vocab=VocabShard(0, V, V),
        context=batch,
    )  # fmt: skip
    out = policy_loss(cfg, tile_rows=4, tile_cols=11)(ctx)
    out["loss"].backward()
    return out, h.grad, w.grad


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "autograd"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_policy_loss_with_correction_equals_verls_through_the_processor(
    verl: Any, name: str, fused: bool
) -> None:
    cfg = dataclasses.replace(LOSSES[name], fused=fused)
    d = _problem(seed=len(name))
    loss, dh, dw, metrics = _verl_loss(verl, d, cfg)
    out, h_grad, w_grad = _processor(d, cfg)
    torch.testing.assert_close(out["loss"], loss, **TOL)
    torch.testing.assert_close(h_grad, dh, **TOL)
    torch.testing.assert_close(w_grad, dw, **TOL)
    if "actor/pg_clipfrac" in metrics and cfg.rollout_correction.loss_type == "ppo_clip":
        clip = torch.tensor(metrics["actor/pg_clipfrac"], dtype=torch.float64)
        torch.testing.assert_close(out["clip_fraction"], clip, rtol=1e-7, atol=1e-9)
    if cfg.rollout_correction.bypass_mode:
        for key, value in metrics.items():
            if key.startswith("rollout_corr/"):
                tol = {"rtol": 2**-23, "atol": 2**-24} if "fraction" in key else TOL
                want = torch.tensor(value, dtype=torch.float64)
                torch.testing.assert_close(out[key], want, **tol, msg=key)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "autograd"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_a_micro_batch_without_a_counted_token_where_verl_refuses_it(
    verl: Any, name: str, fused: bool
) -> None:
    """veRL's correction raises on a micro-batch without a counted token (a pipeline's
    padding micro-batch has none); ours gives a loss of 0, zero gradients and finite
    metrics (a max, min or effective sample size of nothing is 0, not an infinity)."""
    cfg = dataclasses.replace(LOSSES[name], fused=fused)
    d = _problem(seed=2)
    d["mask"] = torch.zeros_like(d["mask"])
    with pytest.raises(ValueError, match="at least one valid token"):
        _verl_loss(verl, d, cfg)
    out, h_grad, w_grad = _processor(d, cfg)
    assert float(out["loss"].detach()) == 0.0 and not h_grad.any() and not w_grad.any()
    infinite = [k for k, v in out.items() if not bool(torch.isfinite(v))]
    assert not infinite, infinite


def test_a_correction_without_rollout_logprobs_is_refused_by_name() -> None:
    d = _problem(seed=1)
    cfg = LOSSES["decoupled-tis-token-mean"]
    batch = PolicyBatch(old_logprobs=d["old"], advantages=d["adv"], mask=d["mask"])
    ctx = OutputContext(
        hidden_states=d["h"], labels=d["labels"], vocab_weight=d["w"],
        vocab=VocabShard(0, V, V), context=batch,
    )  # fmt: skip
    with pytest.raises(ContractError, match=r"context\.rollout_logprobs"):
        policy_loss(cfg)(ctx)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rollout_is": "tokens"}, "rollout_is"),
        ({"rollout_is_threshold": 0.0}, "rollout_is_threshold"),
        (
            {"rollout_is_threshold": 2.0, "rollout_is_threshold_lower": 3.0},
            "rollout_is_threshold_lower",
        ),
        ({"rollout_rs": {"token_k4": 1.0}}, "rollout_rs"),
        ({"rollout_rs": {"token_k3": RejectionBounds(upper=1.0, lower=0.5)}}, "rollout_rs"),
        ({"loss_type": "reinforce"}, "loss_type"),
        ({"loss_type": "a2c", "bypass_mode": True}, "loss_type"),
    ],
)
def test_bad_correction_options_are_refused_by_name(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ContractError) as info:
        RolloutCorrection(**kwargs)
    assert info.value.field.startswith(field)


def test_bf16_compute_beside_naive_bf16_against_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """The corrected loss at the GPU's compute dtype (bf16 operands, forced on the CPU as
    ``tests/processors/test_precision.py`` does): no worse than the naive bf16 loss (bf16 logits,
    float32 log-softmax) against float64, plus bf16's rounding."""
    cfg = LOSSES["decoupled-tis-token-mean"]
    d = _problem(seed=11)
    batch = PolicyBatch(
        old_logprobs=d["old"], advantages=d["adv"], mask=d["mask"], rollout_logprobs=d["rollout"]
    )

    def ours(dtype: torch.dtype) -> torch.Tensor:
        ctx = OutputContext(
            hidden_states=d["h"].to(dtype), labels=d["labels"], vocab_weight=d["w"].to(dtype),
            vocab=VocabShard(0, V, V), context=batch,
        )  # fmt: skip
        return policy_loss(cfg)(ctx)["loss"].double()

    truth = ours(torch.float64)
    monkeypatch.setattr(
        "torch_impl.processors._options.resolve_compute_dtype",
        lambda device, dtype, override: torch.float64 if dtype == torch.float64 else torch.bfloat16,
    )
    h16, w16 = d["h"].bfloat16(), d["w"].bfloat16()
    z = torch.einsum("sbh,vh->bsv", h16, w16).float().log_softmax(-1)
    naive_lp = z.gather(2, d["labels"].clamp(min=0)[..., None]).squeeze(-1).double()
    naive_lp = torch.where(d["labels"] == IGNORE, 0.0, naive_lp)
    m = d["mask"] * (d["labels"] != IGNORE)
    result = rollout_correction(
        d["old"], d["rollout"], m, torch.arange(B)[:, None].expand(B, S), B,
        cfg.rollout_correction,
    )  # fmt: skip
    ratio = torch.exp(naive_lp - d["old"])
    pg = torch.maximum(-d["adv"] * ratio, -d["adv"] * ratio.clamp(0.8, 1.2))
    pg = torch.where(d["adv"] < 0, torch.minimum(pg, -d["adv"] * 3.0), pg) * result.weights
    naive = (pg * m).sum() / m.sum()
    error = (ours(torch.bfloat16) - truth).abs()
    assert float(error) <= float((naive - truth).abs()) + 2**-8 * float(truth.abs())


@pytest.mark.parametrize("name", [*CORRECTIONS, "geometric"])
def test_the_jax_reference_gives_the_same_weights_and_mask(name: str) -> None:
    jax_rollout = pytest.importorskip("jax_ref.rollout")
    import jax.numpy as jnp
    import numpy as np

    import jax_ref

    config = CORRECTIONS.get(name) or RolloutCorrection(rollout_is="geometric")
    d = _logprob_data(seed=len(name) + 1)
    segments = torch.arange(B)[:, None].expand(B, S)
    ours = rollout_correction(d["old"], d["rollout"], d["mask"], segments, B, config)
    with jax_ref.float64():
        arrays = (jnp.asarray(d[k].numpy()) for k in ("old", "rollout", "mask"))
        weights, keep = jax_rollout.rollout_correction(*arrays, config)
        keep = torch.from_numpy(np.asarray(keep).copy())
        if weights is not None:
            weights = torch.from_numpy(np.asarray(weights).copy())
    torch.testing.assert_close(ours.keep, keep, **TOL)
    if config.rollout_is is None:
        assert weights is None
    else:
        torch.testing.assert_close(ours.weights, weights, **TOL)
