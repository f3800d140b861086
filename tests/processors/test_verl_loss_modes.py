"""Every loss mode of veRL 0.9.1 under every aggregation, at several group sizes and with
the decoupled rollout correction, against veRL's own ``compute_policy_loss_<mode>``
(``tests/support/verl_oracle.py``) in float64: ``policy_loss`` through the processor (each mode on
its own path) against veRL's loss of logprobs from materialised logits, its weights and
rejected mask from veRL's ``compute_rollout_correction_and_rejection_mask`` as veRL's
trainer hands them over. Compared: the loss, the gradients of the hidden states and the
weight, and every metric veRL logs. ``tests/processors/test_verl_parity.py`` holds the differences
kept on purpose; the ones these batches meet are undone here, each where it is met."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hookspec import Aggregation, ContractError, OutputContext, VocabShard
from tests.support import verl_oracle
from torch_impl.processors import (
    PolicyBatch,
    PolicyLossConfig,
    PolicyLossMode,
    RejectionBounds,
    RolloutCorrection,
    policy_loss,
)

pytestmark = pytest.mark.release_independent  # the processor's maths; no Megatron in it

H, V, IGNORE = 8, 29, -100
TOL = {"rtol": 1e-10, "atol": 1e-12}
EPS_TOL = {"rtol": 1e-7, "atol": 1e-8}
"""Where veRL's ``n_k + 1e-8`` enters the loss (seq-mean-token-mean, geo_mean's means): at
most ``1e-8`` relative per sequence, summed over sequences of either sign (losses and
gradients of order 1); pinned alone by ``test_seq_mean_token_mean_differs_from_verls_by_its_
epsilon_alone`` in ``tests/processors/test_verl_parity.py``."""
VERL_EPS = 1e-8
"""veRL's ``masked_mean`` divides by ``sum(M) + 1e-8``: undone exactly for the metrics."""

AGGREGATIONS = [str(how) for how in Aggregation]
FIXED_AGGREGATION = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}
"""The modes whose veRL function ignores ``loss_agg_mode``, and what it uses instead."""

MODE_OPTIONS: dict[str, dict[str, Any]] = {
    "vanilla": {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0},
    "gspo": {"clip_low": 0.03, "clip_high": 0.04},
    "dppo_tv": {"clip_low": 0.005, "clip_high": 0.008, "dual_clip": 1.2},
    "dppo_kl": {"clip_low": 5e-4, "clip_high": 8e-4, "dual_clip": 1.2},
    "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
    "gpg": {},
    "clip_cov": {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.2, "clip_cov_ub": 3.0},
    "kl_cov": {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.1},
    "geo_mean": {"clip_low": 0.2, "clip_high": 0.28},
    "dro": {"dro_beta": 0.5},
    "cispo": {"clip_low": 0.2, "clip_high": 0.28},
}
"""Each mode's options, chosen so that its branches are taken on the batches below
(clip_cov's ratio allows every candidate: among more, veRL draws at random and ours takes
the largest covariances, pinned in ``tests/processors/test_verl_parity.py``)."""

MODES = list(MODE_OPTIONS)

CASES = {"groups-of-2": (4, 9, 2), "groups-of-4": (8, 6, 4), "per-token": (5, 7, None)}
"""``(b, s, group size)``: GRPO advantages of groups of sequences, or per-token ones."""

METRICS = {
    "actor/pg_clipfrac": ("clip_fraction",),
    "actor/ppo_kl": ("ppo_kl",),
    "actor/pg_clipfrac_lower": ("dual_clip_fraction", "clip_fraction_lower"),
}
"""veRL's metric and ours (veRL's constant zeros, for gspo, sapo, cispo, are not ours)."""


@pytest.fixture(scope="module")
def verl() -> Any:
    return verl_oracle.load()


def _materialised_logprobs(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = torch.einsum("sbh,vh->bsv", h, w).log_softmax(-1)
    return torch.where(y == IGNORE, 0.0, z.gather(2, y.clamp(min=0)[..., None]).squeeze(-1))


def _batch(case: str, seed: int) -> dict[str, Any]:
    """Hidden states, weight, labels (one ignored), old and rollout logprobs, advantages and
    a mask with an empty sequence (row 1) and a short one (row 2)."""
    b, s, group = CASES[case]
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(s, b, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    labels = torch.randint(0, V, (b, s), generator=g)
    labels[0, 2] = IGNORE
    logp = _materialised_logprobs(h, w, labels)
    old = logp + 0.3 * torch.randn(b, s, generator=g, dtype=torch.float64)
    old[0, 1] = logp[0, 1] - 1.5  # a ratio past 3 with a negative advantage: the dual clip
    rollout = old + 0.2 * torch.randn(b, s, generator=g, dtype=torch.float64)
    if group is None:
        adv = torch.randn(b, s, generator=g, dtype=torch.float64)
    else:
        rewards = torch.randn(b // group, group, generator=g, dtype=torch.float64)
        norm = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-6)
        adv = norm.reshape(b, 1).expand(b, s).clone()
    adv[0, 1] = -1.0
    mask = (torch.rand(b, s, generator=g) > 0.2).double()
    mask[0, 1] = 1.0
    mask[1] = 0.0
    mask[2, 3:] = 0.0
    return {"h": h, "w": w, "labels": labels, "old": old, "rollout": rollout, "adv": adv,
            "mask": mask, "b": b}  # fmt: skip


def _config(mode: str, aggregation: str, **kw: Any) -> PolicyLossConfig:
    return PolicyLossConfig(loss_mode=mode, aggregation=aggregation, **MODE_OPTIONS[mode] | kw)


def _actor(verl: Any, config: PolicyLossConfig) -> Any:
    """``config`` as veRL's actor config and its ``policy_loss`` section."""
    policy = {
        "clip_cov_ratio": config.clip_cov_ratio,
        "clip_cov_lb": config.clip_cov_lb,
        "clip_cov_ub": config.clip_cov_ub,
        "kl_cov_ratio": config.kl_cov_ratio,
        "ppo_kl_coef": config.ppo_kl_coef,
        "dro_beta": config.dro_beta,
    }
    factor = config.loss_scale_factor
    return verl_oracle.ActorConfig(
        clip_ratio=config.clip_low,
        clip_ratio_low=config.clip_low,
        clip_ratio_high=config.effective_clip_high,
        clip_ratio_c=config.dual_clip or 3.0,
        tau_pos=config.tau_pos,
        tau_neg=config.tau_neg,
        global_batch_info={} if factor is None else {"loss_scale_factor": factor},
        policy_loss=verl_oracle.ActorConfig(policy),
    )


def _verls(verl: Any, d: dict[str, Any], config: PolicyLossConfig) -> tuple[Any, ...]:
    """veRL's loss, the gradients of ``h`` and ``W`` through materialised float64 logits,
    its metrics and the mask its loss read (the rollout correction's, as veRL's trainer
    hands its weights and rejected mask to the loss)."""
    h, w = d["h"].clone().requires_grad_(), d["w"].clone().requires_grad_()
    logp = _materialised_logprobs(h, w, d["labels"])
    mask, weights = d["mask"] * (d["labels"] != IGNORE), None
    correction = config.rollout_correction
    if correction is not None:
        helper = verl.rollout_corr_helper
        proto, mask, _ = helper.compute_rollout_correction_and_rejection_mask(
            old_log_prob=d["old"], rollout_log_prob=d["rollout"], response_mask=mask,
            **verl_oracle.rollout_kwargs(correction),
        )  # fmt: skip
        weights = None if proto is None else proto.batch["rollout_is_weights"]
    fn = verl.core_algos.get_policy_loss_fn(str(config.loss_mode))
    actor = _actor(verl, config)
    loss, metrics = fn(d["old"], logp, d["adv"], mask, str(config.aggregation), actor, weights)
    loss.backward()
    return loss.detach(), h.grad, w.grad, metrics, mask


def _ours(d: dict[str, Any], config: PolicyLossConfig) -> tuple[Any, ...]:
    """The processor's outputs and the gradients of ``h`` and ``W``; geo_mean's mean over
    every row as veRL's (``global_sequences`` = the rows)."""
    rows = d["b"] if config.loss_mode == PolicyLossMode.GEO_MEAN else None
    batch = PolicyBatch(
        old_logprobs=d["old"], advantages=d["adv"], mask=d["mask"],
        rollout_logprobs=d["rollout"], global_sequences=rows,
    )  # fmt: skip
    h, w = d["h"].clone().requires_grad_(), d["w"].clone().requires_grad_()
    ctx = OutputContext(
        hidden_states=h, labels=d["labels"], vocab_weight=w, vocab=VocabShard(0, V, V),
        context=batch,
    )  # fmt: skip
    out = policy_loss(config, tile_rows=5, tile_cols=7)(ctx)
    out["loss"].backward()
    return out, h.grad, w.grad


def _compare(verl: Any, d: dict[str, Any], config: PolicyLossConfig) -> None:
    loss, dh, dw, metrics, mask = _verls(verl, d, config)
    out, our_dh, our_dw = _ours(d, config)
    eps = config.aggregation == "seq-mean-token-mean" or config.loss_mode == "geo_mean"
    tol = EPS_TOL if eps else TOL
    torch.testing.assert_close(out["loss"].detach(), loss, **tol)
    torch.testing.assert_close(our_dh, dh, **tol)
    torch.testing.assert_close(our_dw, dw, **tol)
    total = float(mask.sum())
    for key, value in metrics.items():
        want = torch.tensor(value, dtype=torch.float64)
        names = [n for n in METRICS.get(key, (key,)) if n in out]
        if not names:
            assert value == 0.0, key  # one of veRL's constant zeros
            continue
        mine = out[names[0]].detach()
        if key.startswith("actor/") and total:
            mine = mine * total / (total + VERL_EPS)
        tol = {"rtol": 2**-23, "atol": 2**-24} if "fraction" in key and "rollout" in key else TOL
        torch.testing.assert_close(mine, want, **tol, msg=key)


def _mode_aggregations() -> list[Any]:
    return [
        pytest.param(mode, how, id=f"{mode}-{how}")
        for mode in MODES
        for how in ([FIXED_AGGREGATION[mode]] if mode in FIXED_AGGREGATION else AGGREGATIONS)
    ]


@pytest.mark.parametrize(("mode", "how"), _mode_aggregations())
def test_every_mode_under_every_aggregation_equals_verls(verl: Any, mode: str, how: str) -> None:
    factor = 7.0 if how == "seq-mean-token-sum-norm" else None
    config = _config(mode, how, loss_scale_factor=factor)
    _compare(verl, _batch("groups-of-2", seed=len(mode) + len(how)), config)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_at_each_group_size_equals_verls(verl: Any, mode: str, case: str) -> None:
    config = _config(mode, FIXED_AGGREGATION.get(mode, "token-mean"))
    _compare(verl, _batch(case, seed=3 + len(mode)), config)


CORRECTIONS = {
    "tis-token-and-token-k1": RolloutCorrection(
        rollout_is="token", rollout_is_threshold=1.2, rollout_rs={"token_k1": 1.3}
    ),
    "icepop-sequence-and-seq-mean-k3": RolloutCorrection(
        rollout_is="sequence",
        rollout_is_threshold=1.5,
        rollout_is_threshold_lower=0.6,
        rollout_rs={"seq_mean_k3": 0.012},
    ),
    "seq-sum-k1-rejection-only": RolloutCorrection(
        rollout_rs={"seq_sum_k1": RejectionBounds(upper=2.0, lower=0.7)}
    ),
}


@pytest.mark.parametrize("correction", list(CORRECTIONS))
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_with_the_decoupled_correction_equals_verls(
    verl: Any, mode: str, correction: str
) -> None:
    """The weights multiply each mode's term and the rejection leaves the loss and its
    normalisation; geo_mean takes the rejection only (weights: refused by name)."""
    how = FIXED_AGGREGATION.get(mode, "token-mean")
    chosen = CORRECTIONS[correction]
    if mode == "geo_mean" and chosen.rollout_is is not None:
        with pytest.raises(ContractError, match="rollout_correction"):
            _config(mode, how, rollout_correction=chosen)
        return
    d = _batch("per-token", seed=5)  # the batch each correction rejects part of (below)
    _compare(verl, d, _config(mode, how, rollout_correction=chosen))


def test_the_batches_take_every_branch(verl: Any) -> None:
    """The metrics that say a branch was taken are neither 0 nor 1 on these batches, and the
    corrections reject some tokens and bound some weights: otherwise the parity above
    could hold with a branch never run."""
    d = _batch("groups-of-2", seed=11)
    for mode, keys in {
        "vanilla": ("clip_fraction", "dual_clip_fraction"),
        "gspo": ("clip_fraction",),
        "dppo_tv": ("clip_fraction", "clip_fraction_lower"),
        "dppo_kl": ("clip_fraction", "clip_fraction_lower"),
        "clip_cov": ("clip_fraction",),
        "geo_mean": ("clip_fraction", "clip_fraction_lower"),
        "cispo": ("clip_fraction",),
    }.items():
        out, _, _ = _ours(d, _config(mode, FIXED_AGGREGATION.get(mode, "token-mean")))
        for key in keys:
            assert 0.0 < float(out[key]) < 1.0, (mode, key)
    d = _batch("per-token", seed=5)
    for name, correction in CORRECTIONS.items():
        out, _, _ = _ours(d, _config("vanilla", "token-mean", rollout_correction=correction))
        assert 0.0 < float(out["rollout_corr/rollout_rs_masked_fraction"]) < 1.0, name
        if correction.rollout_is is not None:
            keys = ("rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low")
            assert sum(float(out[f"rollout_corr/{k}"]) for k in keys) > 0.0, name
