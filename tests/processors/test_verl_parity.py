"""veRL 0.9.1's KL estimators and aggregations against ours, with veRL's own functions
(``tests/support/verl_oracle.py``) as the oracle, in float64: ``kl_penalty`` under every name veRL
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
from tests.support import verl_oracle
from tests.support.distributed import run_distributed
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
    "kl-token-mean": ("kl", "token-mean", None),
}


def _actor_problem(name: str, v: int = V) -> dict[str, Any]:
    """Hidden states, weight, labels (one ignored), old and reference logprobs near the
    current ones, advantages and a mask with an empty sequence."""
    g = torch.Generator().manual_seed(len(name))
    h = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    w = torch.randn(v, H, generator=g, dtype=torch.float64) * 0.7
    labels = torch.randint(0, v, (B, S), generator=g)
    labels[1, 2] = IGNORE
    lp = _materialised_logprobs(h, w, labels).detach()
    old = lp + 0.2 * torch.randn(B, S, generator=g, dtype=torch.float64)
    ref = lp + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)
    adv = torch.randn(B, S, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, S, generator=g) > 0.2).double()
    mask[4] = 0.0
    return {"h": h, "w": w, "labels": labels, "old": old, "ref": ref, "adv": adv, "mask": mask}


def _verl_actor_loss(verl: Any, name: str, d: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """veRL: the actor's pg loss plus kl_coef times the aggregated kl_penalty, on
    materialised float64 logits; ``(loss, kl, dh, dW)``."""
    kl_type, mode, factor = ACTOR_LOSSES[name]
    th, tw = d["h"].clone().requires_grad_(), d["w"].clone().requires_grad_()
    logp = _materialised_logprobs(th, tw, d["labels"])
    response_mask = d["mask"] * (d["labels"] != IGNORE)
    actor = verl_oracle.ActorConfig(
        clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
        global_batch_info={"loss_scale_factor": factor} if factor else {},
    )  # fmt: skip
    core = verl.core_algos
    pg, _ = core.compute_policy_loss_vanilla(d["old"], logp, d["adv"], response_mask, mode, actor)
    kld = core.kl_penalty(logp, d["ref"], kl_type)
    kl = core.agg_loss(kld, response_mask, mode, loss_scale_factor=factor)
    theirs = pg + 0.05 * kl
    theirs.backward()
    return theirs.detach(), kl.detach(), th.grad, tw.grad


def _actor_config(name: str, fused: bool) -> PolicyLossConfig:
    kl_type, mode, factor = ACTOR_LOSSES[name]
    k3 = kl_type.rstrip("+") in ("low_var_kl", "k3")
    return PolicyLossConfig(
        clip_low=0.2, dual_clip=3.0, kl_coef=0.05, kl_estimator=kl_type, aggregation=mode,
        kl_value_clamp=10.0 if k3 else None, loss_scale_factor=factor, fused=fused,
    )  # fmt: skip


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "autograd"])
@pytest.mark.parametrize("name", list(ACTOR_LOSSES))
def test_the_actor_loss_equals_verls_through_the_processor(
    verl: Any, name: str, fused: bool
) -> None:
    d = _actor_problem(name)
    loss, kl, dh, dw = _verl_actor_loss(verl, name, d)
    batch = PolicyBatch(
        old_logprobs=d["old"], advantages=d["adv"], mask=d["mask"], ref_logprobs=d["ref"]
    )
    oh, ow = d["h"].clone().requires_grad_(), d["w"].clone().requires_grad_()
    ctx = OutputContext(
        hidden_states=oh, labels=d["labels"], vocab_weight=ow, vocab=VocabShard(0, V, V),
        context=batch,
    )  # fmt: skip
    out = policy_loss(_actor_config(name, fused), tile_rows=5, tile_cols=7)(ctx)
    out["loss"].backward()
    torch.testing.assert_close(out["loss"], loss, **TOL)
    torch.testing.assert_close(oh.grad, dh, **TOL)
    torch.testing.assert_close(ow.grad, dw, **TOL)
    torch.testing.assert_close(out["kl"], kl, **TOL)


def test_verl_names_are_taken_as_they_are() -> None:
    config = PolicyLossConfig(kl_estimator="low_var_kl+", aggregation="seq-mean-token-sum-norm")
    assert config.kl_estimator == "k3" and config.kl_straight_through
    assert PolicyLossConfig(kl_estimator="mse").kl_estimator == "k2"
    assert PolicyLossConfig(kl_estimator="kl").kl_estimator == "k1"


# --- every loss mode of veRL's register_policy_loss, through the processor ------------------

# name -> (our config's keywords, veRL's actor keys, veRL's loss_agg_mode)
MODES: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "vanilla": ({"dual_clip": 3.0}, {}, "token-mean"),
    "gspo": ({"clip_low": 3e-3, "clip_high": 4e-3}, {}, "seq-mean-token-mean"),
    "dppo_tv": ({"clip_low": 2e-3, "clip_high": 3e-3, "dual_clip": 1.15}, {}, "token-mean"),
    "dppo_kl": ({"clip_low": 1e-4, "clip_high": 2e-4, "dual_clip": 1.15}, {}, "token-sum"),
    "sapo": ({"tau_pos": 1.2, "tau_neg": 1.6}, {}, "seq-mean-token-mean"),
    "gpg": ({}, {}, "seq-mean-token-sum"),
    "clip_cov": ({"clip_cov_ratio": 0.5, "clip_cov_lb": 0.3, "clip_cov_ub": 2.0}, {}, "token-mean"),
    "kl_cov": ({"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.3}, {}, "seq-mean-token-sum-norm"),
    "geo_mean": ({"clip_low": 0.1, "clip_high": 0.15}, {}, "seq-mean-token-mean"),
    "dro": ({"dro_beta": 0.7}, {}, "token-mean"),
    "cispo": ({"clip_low": 0.1, "clip_high": 0.12}, {}, "token-mean"),
}
# veRL keeps 1e-8 beside each count in these (its masked_mean; sapo's and geo_mean's means)
EPSILON_MODES = {"sapo", "geo_mean", "gspo"}
# veRL's metric -> ours (the modes' pg_clipfrac_lower is our clip_fraction_lower but vanilla's)
METRICS = {"actor/pg_clipfrac": "clip_fraction", "actor/ppo_kl": "ppo_kl"}


def _mode_problem(seed: int, b: int, v: int = V) -> dict[str, Any]:
    """Sequences of several lengths (an empty one, a short one), an ignored label."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(S, b, H, generator=g, dtype=torch.float64)
    w = torch.randn(v, H, generator=g, dtype=torch.float64) * 0.7
    labels = torch.randint(0, v, (b, S), generator=g)
    labels[0, 3] = IGNORE
    lp = _materialised_logprobs(h, w, labels).detach()
    mask = (torch.rand(b, S, generator=g) > 0.2).double()
    mask[1] = 0.0
    mask[2, 3:] = 0.0
    adv = torch.randn(b, generator=g, dtype=torch.float64)[:, None].expand(b, S).clone()
    adv[3:] += 0.3 * torch.randn(b - 3, S, generator=g, dtype=torch.float64)  # per token
    old = lp + 0.1 * torch.randn(b, S, generator=g, dtype=torch.float64)
    return {"h": h, "w": w, "labels": labels, "old": old, "adv": adv, "mask": mask}


def _verl_mode_loss(verl: Any, name: str, d: dict[str, Any], config: PolicyLossConfig) -> Any:
    """veRL's registered loss of ``name`` on float64 materialised-logit logprobs."""
    _, _, mode = MODES[name]
    h, w = d["h"].clone().requires_grad_(), d["w"].clone().requires_grad_()
    logp = _materialised_logprobs(h, w, d["labels"])
    response_mask = d["mask"] * (d["labels"] != IGNORE)
    policy = {k: getattr(config, k) for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")}
    policy |= {k: getattr(config, k) for k in ("kl_cov_ratio", "ppo_kl_coef", "dro_beta")}
    actor = verl_oracle.ActorConfig(
        clip_ratio=config.clip_low, clip_ratio_low=config.clip_low,
        clip_ratio_high=config.effective_clip_high, tau_pos=config.tau_pos,
        tau_neg=config.tau_neg, global_batch_info={},
        policy_loss=verl_oracle.ActorConfig(policy),
        **({} if config.dual_clip is None else {"clip_ratio_c": config.dual_clip}),
    )  # fmt: skip
    loss_fn = verl.core_algos.get_policy_loss_fn(name)
    loss, metrics = loss_fn(d["old"], logp, d["adv"], response_mask, mode, actor)
    loss.backward()
    n = float(response_mask.sum())
    unbiased = {k: v * (n + 1e-8) / n for k, v in metrics.items()}  # veRL's 1e-8 undone
    return loss.detach(), h.grad, w.grad, unbiased


def _our_mode_loss(name: str, d: dict[str, Any], config: PolicyLossConfig) -> Any:
    b = d["h"].shape[1]
    counts = {"global_sequences": float(b)} if name == "geo_mean" else {}
    batch = PolicyBatch(old_logprobs=d["old"], advantages=d["adv"], mask=d["mask"], **counts)
    h, w = d["h"].clone().requires_grad_(), d["w"].clone().requires_grad_()
    v = w.shape[0]
    ctx = OutputContext(
        hidden_states=h, labels=d["labels"], vocab_weight=w, vocab=VocabShard(0, v, v),
        context=batch,
    )  # fmt: skip
    out = policy_loss(config, tile_rows=5, tile_cols=7)(ctx)
    out["loss"].backward()
    return out["loss"].detach(), h.grad, w.grad, out


@pytest.mark.parametrize("b", [6, 9], ids=["b6", "b9"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "autograd"])
@pytest.mark.parametrize("name", list(MODES))
def test_every_loss_mode_equals_verls_through_the_processor(
    verl: Any, name: str, fused: bool, b: int
) -> None:
    """Loss, the gradients of the hidden states and the weight, and veRL's metrics. geo_mean
    averages over every row in veRL (``torch.mean``): ours is given ``global_sequences=b``."""
    ours_kw, _, mode = MODES[name]
    config = PolicyLossConfig(loss_mode=name, aggregation=mode, fused=fused, **ours_kw)
    d = _mode_problem(seed=len(name) + b, b=b)
    loss, dh, dw, metrics = _verl_mode_loss(verl, name, d, config)
    mine, mh, mw, out = _our_mode_loss(name, d, config)
    tol = {"rtol": 1e-7, "atol": 1e-9} if name in EPSILON_MODES else TOL
    torch.testing.assert_close(mine, loss, **tol)
    torch.testing.assert_close(mh, dh, **tol)
    torch.testing.assert_close(mw, dw, **tol)
    lower = "dual_clip_fraction" if name == "vanilla" else "clip_fraction_lower"
    for key, value in metrics.items():
        ours = METRICS.get(key, lower)
        if ours not in out:  # veRL's constant 0 (gspo's, sapo's, cispo's lower fractions)
            assert value == 0.0, key
            continue
        want = torch.tensor(value, dtype=torch.float64)
        torch.testing.assert_close(out[ours], want, rtol=1e-10, atol=1e-12, msg=key)


def test_the_options_bite() -> None:
    """The parity above is not of trivial branches: each mode's selection or clip is active."""
    d = _mode_problem(seed=3, b=9)
    for name in ("clip_cov", "dppo_tv", "dppo_kl", "cispo", "geo_mean"):
        config = PolicyLossConfig(loss_mode=name, aggregation=MODES[name][2], **MODES[name][0])
        out = _our_mode_loss(name, d, config)[3]
        assert 0.0 < float(out["clip_fraction"]) < 1.0, name


def test_clip_cov_takes_the_largest_covariances_where_verl_draws_at_random() -> None:
    """With more candidates than ``clip_cov_ratio`` allows, veRL draws the tokens to leave out
    at random (``torch.randperm``); ours takes those of largest covariance: deterministic."""
    d = _mode_problem(seed=11, b=9)
    config = PolicyLossConfig(loss_mode="clip_cov", clip_cov_ratio=0.02, clip_cov_lb=0.0)
    first = _our_mode_loss("clip_cov", d, config)
    again = _our_mode_loss("clip_cov", d, config)
    assert torch.equal(first[1], again[1])
    n = float((d["mask"] * (d["labels"] != IGNORE)).sum())
    assert float(first[3]["clip_fraction"]) == pytest.approx(int(0.02 * n) / n, abs=1e-15)


def test_gspo_token_and_the_sequence_ratio_agree_on_a_sequence_advantage() -> None:
    """loss_mode 'gspo' (veRL's GSPO-token) and RatioLevel.SEQUENCE (the paper's GSPO)
    differ in gradient only where the advantage varies within a sequence."""
    d = _mode_problem(seed=5, b=6)
    d["adv"] = d["adv"][:, :1].expand(6, S).clone()
    token = PolicyLossConfig(loss_mode="gspo", clip_low=3e-3, clip_high=4e-3,
                             aggregation="seq-mean-token-mean")  # fmt: skip
    sequence = PolicyLossConfig.gspo(clip_low=3e-3, clip_high=4e-3)
    a, b = _our_mode_loss("gspo", d, token), _our_mode_loss("gspo", d, sequence)
    for x, y in zip(a[:3], b[:3], strict=True):
        torch.testing.assert_close(x, y, **TOL)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_data_parallel_counts_equal_verls_up_to_its_dp_size_factor(verl: Any, mode: str) -> None:
    """Under data parallelism veRL divides by ``batch_num_tokens`` / ``global_batch_size`` and
    multiplies by ``dp_size`` (DDP averages the ranks' gradients); ours take the same counts
    as ``global_tokens`` / ``global_sequences`` and do not multiply (the ranks' losses sum)."""
    g = torch.Generator().manual_seed(7)
    loss = torch.randn(B, S, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, S, generator=g) > 0.3).double()
    segments = torch.arange(B)[:, None].expand(B, S)
    dp, tokens, sequences = 4, 97.0, 23.0
    counts = {"token-mean": {"global_tokens": tokens}, "token-sum": {}}
    ours_counts = counts.get(mode, {"global_sequences": sequences})
    weights = aggregation_weights(mask, segments, B, mode, **ours_counts)
    theirs = verl.core_algos.agg_loss(
        loss, mask, mode, dp_size=dp, batch_num_tokens=tokens, global_batch_size=sequences
    )
    tol = {"rtol": 1e-7, "atol": 1e-12} if mode == "seq-mean-token-mean" else TOL
    torch.testing.assert_close((weights * loss).sum() * dp, theirs, **tol)


TP2_MODES = tuple(MODES)


def _tp2_modes(rank: int, d: dict[str, Any], truths: dict[str, Any]) -> None:
    from megatron.core import parallel_state

    from hookspec import ParallelLayout
    from torch_impl import TorchCollectives

    group = parallel_state.get_tensor_model_parallel_group()
    coll = TorchCollectives(group, sequence_parallel=False)
    b, v = d["h"].shape[1], d["w"].shape[0]
    shard = slice(rank * v // 2, (rank + 1) * v // 2)
    for name in TP2_MODES:
        ours_kw, _, mode = MODES[name]
        config = PolicyLossConfig(loss_mode=name, aggregation=mode, **ours_kw)
        counts = {"global_sequences": float(b)} if name == "geo_mean" else {}
        batch = PolicyBatch(old_logprobs=d["old"], advantages=d["adv"], mask=d["mask"], **counts)
        h, w = d["h"].clone().requires_grad_(), d["w"][shard].clone().requires_grad_()
        ctx = OutputContext(
            hidden_states=h, labels=d["labels"], vocab_weight=w,
            vocab=VocabShard(shard.start, shard.stop, v), context=batch, collectives=coll,
            parallel=ParallelLayout(tp_size=2, tp_rank=rank),
        )  # fmt: skip
        out = policy_loss(config, tile_rows=5, tile_cols=7)(ctx)
        out["loss"].backward()
        loss, dh, dw = truths[name]
        tol = {"rtol": 1e-7, "atol": 1e-9} if name in EPSILON_MODES else TOL
        torch.testing.assert_close(out["loss"].detach(), loss, **tol)
        torch.testing.assert_close(h.grad, dh, **tol)
        torch.testing.assert_close(w.grad, dw[shard], **tol)


def _tp2_actor_losses(rank: int, problems: dict[str, Any], truths: dict[str, Any]) -> None:
    """Each KL estimator and aggregation of :data:`ACTOR_LOSSES`, fused and autograd, on
    this rank's half of the vocabulary against veRL's loss on the whole one."""
    from megatron.core import parallel_state

    from hookspec import ParallelLayout
    from torch_impl import TorchCollectives

    group = parallel_state.get_tensor_model_parallel_group()
    coll = TorchCollectives(group, sequence_parallel=False)
    for name, d in problems.items():
        v = d["w"].shape[0]
        shard = slice(rank * v // 2, (rank + 1) * v // 2)
        batch = PolicyBatch(
            old_logprobs=d["old"], advantages=d["adv"], mask=d["mask"], ref_logprobs=d["ref"]
        )
        loss, kl, dh, dw = truths[name]
        for fused in (True, False):
            h, w = d["h"].clone().requires_grad_(), d["w"][shard].clone().requires_grad_()
            ctx = OutputContext(
                hidden_states=h, labels=d["labels"], vocab_weight=w,
                vocab=VocabShard(shard.start, shard.stop, v), context=batch, collectives=coll,
                parallel=ParallelLayout(tp_size=2, tp_rank=rank),
            )  # fmt: skip
            out = policy_loss(_actor_config(name, fused), tile_rows=5, tile_cols=7)(ctx)
            out["loss"].backward()
            torch.testing.assert_close(out["loss"].detach(), loss, **TOL)
            torch.testing.assert_close(out["kl"].detach(), kl, **TOL)
            torch.testing.assert_close(h.grad, dh, **TOL)
            torch.testing.assert_close(w.grad, dw[shard], **TOL)


@pytest.mark.slow
def test_kl_estimators_and_aggregations_at_tp2_equal_verls(verl: Any) -> None:
    """Two gloo ranks, each half of the vocabulary: every KL estimator (veRL's names, the
    straight-through form) and aggregation of the actor losses (one pair of processes)."""
    problems = {name: _actor_problem(name, v=30) for name in ACTOR_LOSSES}
    truths = {name: _verl_actor_loss(verl, name, d) for name, d in problems.items()}
    run_distributed(_tp2_actor_losses, problems, truths, tp=2)


@pytest.mark.slow
def test_loss_modes_at_tp2_equal_verls(verl: Any) -> None:
    """Two gloo ranks, each half of the vocabulary: fused and autograd modes against veRL's
    losses on the whole vocabulary's materialised logits (one pair of processes)."""
    d = _mode_problem(seed=21, b=6, v=30)  # an even vocabulary, split in two
    truths = {}
    for name in TP2_MODES:
        ours_kw, _, mode = MODES[name]
        config = PolicyLossConfig(loss_mode=name, aggregation=mode, **ours_kw)
        truths[name] = _verl_mode_loss(verl, name, d, config)[:3]
    run_distributed(_tp2_modes, d, truths, tp=2)
