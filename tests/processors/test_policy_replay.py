"""``policy_loss`` with sampling replay (``PolicyBatch.sampling_support``), in float64 against
veRL 0.9.1's own loss (``tests/support/verl_oracle.py``) fed with logprobs from materialised logits:
the ratio's current logprob renormalised over the kept tokens (old and rollout logprobs
given on the same support), the KL's over the whole vocabulary against a reference taken
without the support (or on it, ``reference_on_support``), the counted tokens whose label is
outside the support left out of the loss and its normalisation. Values, the gradients of
the hidden states and the weight, the metrics; kept ids and vLLM's parameters; the fused
config's fallback; ``-inf`` old logprobs; bf16 compute beside naive bf16."""

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
    RolloutCorrection,
    SamplingSupport,
    policy_loss,
)

pytestmark = pytest.mark.release_independent  # the processor's maths; no Megatron in it

B, S, H, V, K, IGNORE = 4, 7, 8, 41, 9, -100
F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}


@pytest.fixture(scope="module")
def verl() -> Any:
    return verl_oracle.load()


def _logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[b, s, V]`` from ``h`` ``[s, b, h]``: the materialised logits, float64."""
    return torch.einsum("sbh,vh->bsv", h, w)


def _label_logprobs(z: torch.Tensor, keep: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """The label's logprob under ``softmax(z)`` renormalised over ``keep`` (``None``: all),
    ``-inf`` where the label is not kept, 0 where ignored."""
    zk = z if keep is None else torch.where(keep, z, -torch.inf)
    at = y.clamp(min=0)[..., None]
    lp = zk.gather(2, at).squeeze(-1) - torch.logsumexp(zk, -1)
    return torch.where(y == IGNORE, 0.0, lp)


def _problem(seed: int, form: str) -> dict[str, Any]:
    """Labels sampled from the kept set, two planted outside it (one counted, one not),
    one ignored; old logprobs on the support (the current policy's, perturbed), a
    reference over the whole vocabulary; ``form``: kept ids, or vLLM's parameters."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(S, B, H, generator=g, dtype=F64)
    w = torch.randn(V, H, generator=g, dtype=F64) * 0.8
    z = _logits(h, w)
    if form == "kept ids":
        keep = torch.zeros(B, S, V, dtype=torch.bool)
        keep.scatter_(2, torch.rand(B, S, V, generator=g).argsort(-1)[..., :K], True)
        ids = torch.where(keep, torch.arange(V), -1).sort(-1, descending=True).values[..., :K]
        support = SamplingSupport(kept_ids=ids[..., torch.randperm(K, generator=g)])
    else:
        kth = z.sort(-1, descending=True).values[..., 5:6]
        keep = z >= kth  # top_k = 6 (no ties in random float64 logits)
        support = SamplingSupport(top_k=6)
    probs = torch.where(keep, z, -torch.inf).softmax(-1)
    labels = torch.multinomial(probs.reshape(-1, V), 1, generator=g).reshape(B, S)
    outside = (~keep).to(torch.int8).argmax(-1)
    labels[1, 2], labels[2, 4] = outside[1, 2], outside[2, 4]
    labels[0, 3] = IGNORE
    mask = (torch.rand(B, S, generator=g) > 0.15).double()
    mask[1, 2], mask[2, 4] = 1.0, 0.0  # one label outside the support counted, one not
    lp = _label_logprobs(z, keep, labels)
    old = torch.where(torch.isfinite(lp), lp + 0.1 * torch.randn(B, S, generator=g), -1.0)
    ref = _label_logprobs(z, None, labels) + 0.2 * torch.randn(B, S, generator=g, dtype=F64)
    adv = torch.randn(B, S, generator=g, dtype=F64)
    return {"h": h, "w": w, "labels": labels, "keep": keep, "support": support, "mask": mask,
            "old": old.to(F64), "ref": ref, "adv": adv}  # fmt: skip


CONFIGS = {
    "grpo-k3": PolicyLossConfig(kl_coef=0.05, kl_estimator="low_var_kl", clip_high=0.28),
    "ppo-k1-dual-clip": PolicyLossConfig(kl_coef=0.1, kl_estimator="kl", dual_clip=3.0),
    "seq-mean-token-sum": PolicyLossConfig(kl_coef=0.02, aggregation="seq-mean-token-sum"),
}


def _verl_loss(verl: Any, d: dict[str, Any], cfg: PolicyLossConfig, **kw: Any) -> Any:
    """veRL's ``compute_policy_loss_vanilla`` on the renormalised logprobs plus
    ``kl_coef * agg_loss(kl_penalty(...))`` on the whole vocabulary's (or the support's,
    ``on_support``), over the mask without the labels outside the support; the gradients of
    h and W through the materialised logits."""
    h, w = d["h"].clone().requires_grad_(), d["w"].clone().requires_grad_()
    z = _logits(h, w)
    lp = _label_logprobs(z, d["keep"], d["labels"])
    inside = torch.isfinite(lp) & torch.isfinite(d["old"])
    mask = d["mask"] * (d["labels"] != IGNORE) * inside
    lp = torch.where(inside, lp, 0.0)
    clip = cfg.clip_low
    actor = verl_oracle.ActorConfig(
        clip_ratio=clip, clip_ratio_low=clip, clip_ratio_high=cfg.effective_clip_high,
        clip_ratio_c=cfg.dual_clip or 3.0, global_batch_info={},
        policy_loss=verl_oracle.ActorConfig({}),
    )  # fmt: skip
    agg = str(cfg.aggregation)
    old = torch.where(inside, d["old"], 0.0)
    pg, metrics = verl.core_algos.compute_policy_loss_vanilla(old, lp, d["adv"], mask, agg, actor)
    current = lp if kw.get("on_support") else _label_logprobs(z, None, d["labels"])
    name = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}[cfg.kl_estimator.value]
    kl = verl.core_algos.agg_loss(verl.core_algos.kl_penalty(current, d["ref"], name), mask, agg)
    loss = pg + cfg.kl_coef * kl
    dh, dw = torch.autograd.grad(loss, (h, w))
    return loss.detach(), dh, dw, metrics, mask


def _ours(d: dict[str, Any], cfg: PolicyLossConfig, dtype: Any = F64, **kw: Any) -> Any:
    batch = PolicyBatch(
        old_logprobs=d["old"], advantages=d["adv"], mask=d["mask"], ref_logprobs=d["ref"],
        sampling_support=d["support"], **kw,
    )  # fmt: skip
    h = d["h"].to(dtype, copy=True).requires_grad_()
    w = d["w"].to(dtype, copy=True).requires_grad_()
    ctx = OutputContext(
        hidden_states=h, labels=d["labels"], vocab_weight=w, vocab=VocabShard(0, V, V),
        context=batch,
    )  # fmt: skip
    out = policy_loss(cfg, tile_rows=6, tile_cols=13)(ctx)
    out["loss"].backward()
    return out, h.grad, w.grad


@pytest.mark.parametrize("form", ["kept ids", "top_k"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_policy_loss_on_the_support_equals_verls(verl: Any, name: str, form: str) -> None:
    d = _problem(len(name) + len(form), form)
    cfg = CONFIGS[name]
    loss, dh, dw, metrics, mask = _verl_loss(verl, d, cfg)
    out, h_grad, w_grad = _ours(d, cfg)
    torch.testing.assert_close(out["loss"], loss, **TOL)
    torch.testing.assert_close(h_grad, dh, **TOL)
    torch.testing.assert_close(w_grad, dw, **TOL)
    clip = torch.tensor(metrics["actor/pg_clipfrac"], dtype=F64)
    torch.testing.assert_close(out["clip_fraction"], clip, rtol=1e-7, atol=1e-9)
    counted = d["mask"] * (d["labels"] != IGNORE)
    outside = counted.sum() - mask.sum()
    assert outside >= 1  # the planted label, counted, outside the support
    torch.testing.assert_close(out["support/outside_fraction"], outside / counted.sum())


def test_reference_on_the_support(verl: Any) -> None:
    """``reference_on_support``: the KL reads the renormalised current logprob too."""
    d = _problem(3, "kept ids")
    cfg = dataclasses.replace(CONFIGS["grpo-k3"], reference_on_support=True)
    loss, dh, dw, _, _ = _verl_loss(verl, d, cfg, on_support=True)
    out, h_grad, w_grad = _ours(d, cfg)
    torch.testing.assert_close(out["loss"], loss, **TOL)
    torch.testing.assert_close(h_grad, dh, **TOL)
    torch.testing.assert_close(w_grad, dw, **TOL)
    whole, _, _ = _ours(d, CONFIGS["grpo-k3"])
    assert not torch.isclose(whole["kl"], out["kl"])  # the choice changes the KL


def test_the_fused_config_takes_the_autograd_path_with_a_support() -> None:
    d = _problem(5, "top_k")
    fused, h1, w1 = _ours(d, CONFIGS["grpo-k3"])
    plain, h2, w2 = _ours(d, dataclasses.replace(CONFIGS["grpo-k3"], fused=False))
    assert torch.equal(fused["loss"], plain["loss"]) and torch.equal(h1, h2)
    assert torch.equal(w1, w2)


def test_minus_inf_old_logprobs_leave_the_loss_and_nan_is_refused(verl: Any) -> None:
    """An old logprob of ``-inf`` (the label outside the old policy's support) is allowed
    with a support and leaves the loss; a NaN is still refused by name."""
    d = _problem(11, "kept ids")
    d["old"][0, 1] = -torch.inf
    assert d["mask"][0, 1] > 0 and d["labels"][0, 1] != IGNORE
    cfg = CONFIGS["ppo-k1-dual-clip"]
    loss, dh, dw, _, _ = _verl_loss(verl, d, cfg)
    out, h_grad, w_grad = _ours(d, cfg)
    torch.testing.assert_close(out["loss"], loss, **TOL)
    torch.testing.assert_close(h_grad, dh, **TOL)
    torch.testing.assert_close(w_grad, dw, **TOL)
    d["old"][0, 1] = torch.nan
    with pytest.raises(ContractError, match=r"context\.old_logprobs"):
        _ours(d, cfg)
    d["support"] = None
    d["old"][0, 1] = -torch.inf
    with pytest.raises(ContractError, match=r"context\.old_logprobs"):
        _ours(d, cfg)  # without a support -inf is not a logprob


def test_with_a_rollout_correction(verl: Any) -> None:
    """The decoupled correction reads old and rollout logprobs on the support; a token whose
    rollout logprob is ``-inf`` leaves the loss before the correction's statistics."""
    d = _problem(13, "kept ids")
    g = torch.Generator().manual_seed(1)
    rollout = d["old"] + 0.2 * torch.randn(B, S, generator=g, dtype=F64)
    correction = RolloutCorrection(rollout_is="token", rollout_is_threshold=1.5)
    cfg = PolicyLossConfig(rollout_correction=correction)
    h, w = d["h"].clone().requires_grad_(), d["w"].clone().requires_grad_()
    z = _logits(h, w)
    lp = _label_logprobs(z, d["keep"], d["labels"])
    inside = torch.isfinite(lp)
    mask = d["mask"] * (d["labels"] != IGNORE) * inside
    proto, modified, _ = verl.rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=d["old"], rollout_log_prob=rollout, response_mask=mask,
        **verl_oracle.rollout_kwargs(correction),
    )  # fmt: skip
    actor = verl_oracle.ActorConfig(
        clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
        global_batch_info={}, policy_loss=verl_oracle.ActorConfig(
            {"rollout_correction": {"loss_type": "ppo_clip",
                                    **verl_oracle.rollout_kwargs(correction)}}),
    )  # fmt: skip
    loss, _ = verl.core_algos.compute_policy_loss_vanilla(
        d["old"], torch.where(inside, lp, 0.0), d["adv"], modified, "token-mean", actor,
        proto.batch["rollout_is_weights"],
    )  # fmt: skip
    dh, dw = torch.autograd.grad(loss, (h, w))
    out, h_grad, w_grad = _ours(d, cfg, rollout_logprobs=rollout)
    torch.testing.assert_close(out["loss"], loss.detach(), **TOL)
    torch.testing.assert_close(h_grad, dh, **TOL)
    torch.testing.assert_close(w_grad, dw, **TOL)


def test_bf16_compute_beside_naive_bf16_against_float64(
    verl: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the GPU's compute dtype (bf16 operands, forced on the CPU as
    ``tests/processors/test_precision.py`` does) the loss and the gradient of h stay within a small
    multiple of naive bf16's error (materialised bf16 logits, fp32 softmax) against float64
    on the same rounded inputs."""
    d = _problem(17, "top_k")
    cfg = CONFIGS["grpo-k3"]
    want, _, _, _, _ = _verl_loss(verl, d, cfg)
    bf = {**d, "h": d["h"].bfloat16().double(), "w": d["w"].bfloat16().double()}
    exact, dh_exact, _, _, _ = _verl_loss(verl, bf, cfg)  # the rounded inputs, float64

    naive_h = bf["h"].bfloat16().requires_grad_()
    z = _logits(naive_h.float(), bf["w"].bfloat16().float()).bfloat16().float()
    lp = _label_logprobs(z, d["keep"], d["labels"])
    full = _label_logprobs(z, None, d["labels"])
    counted = d["mask"] * (d["labels"] != IGNORE) * torch.isfinite(lp)
    ratio = torch.exp(torch.where(counted > 0, lp - d["old"].float(), 0.0))
    adv = d["adv"].float()
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    r = d["ref"].float() - full
    kl = torch.exp(r) - r - 1
    naive = ((pg + cfg.kl_coef * kl) * counted).sum() / counted.sum()
    naive.backward()
    naive_err = (naive.double() - exact).abs() + 1e-7
    naive_dh_err = (naive_h.grad.double() - dh_exact).abs().max()

    support = d["support"]
    batch = PolicyBatch(old_logprobs=d["old"].float(), advantages=adv, mask=d["mask"],
                        ref_logprobs=d["ref"].float(), sampling_support=support)  # fmt: skip
    monkeypatch.setattr(
        "torch_impl.processors._options.resolve_compute_dtype",
        lambda device, dtype, override: torch.float64 if dtype == torch.float64 else torch.bfloat16,
    )
    h = bf["h"].bfloat16().requires_grad_()
    ctx = OutputContext(
        hidden_states=h, labels=d["labels"], vocab_weight=bf["w"].bfloat16(),
        vocab=VocabShard(0, V, V), context=batch,
    )  # fmt: skip
    out = policy_loss(cfg, tile_rows=6, tile_cols=13)(ctx)
    out["loss"].backward()
    ours_err = (out["loss"].double() - exact).abs()
    ours_dh_err = (h.grad.double() - dh_exact).abs().max()
    assert ours_err <= 4 * naive_err, (ours_err, naive_err)
    assert ours_dh_err <= 4 * naive_dh_err + 1e-6, (ours_dh_err, naive_dh_err)
    assert (out["loss"].double() - want).abs() < 0.05  # and near the unrounded float64 loss


@pytest.mark.parametrize("form", ["kept ids", "top_k"])
def test_the_jax_reference(form: str) -> None:
    """``jax_ref.processors.policy_loss`` reads the batch's sampling support as the
    processor does: values and gradients through ``cross_check`` (float32 inputs)."""
    pytest.importorskip("jax")
    from jax_ref.check.comparison import cross_check
    from jax_ref.processors import policy_loss as reference

    d = _problem(19, form)
    cfg = dataclasses.replace(CONFIGS["grpo-k3"], fused=False)
    batch = PolicyBatch(
        old_logprobs=d["old"].float(), advantages=d["adv"].float(), mask=d["mask"].float(),
        ref_logprobs=d["ref"].float(), sampling_support=d["support"],
    )  # fmt: skip
    ctx = OutputContext(
        hidden_states=d["h"].float(), labels=d["labels"], vocab_weight=d["w"].float(),
        vocab=VocabShard(0, V, V), context=batch,
    )  # fmt: skip
    report = cross_check(policy_loss(cfg, tile_rows=6, tile_cols=13), reference(cfg), ctx)
    assert report.passed, report
    assert "support/outside_fraction" in {row.output for row in report.rows}
