"""The policy-loss processor against an independent float64 computation.

The truth here takes the full logits in float64, writes every formula of
``hookspec.conventions`` out directly and aggregates with Python loops over the
sequences; it imports nothing from ``torch_impl.processors`` but the processor
and its two dataclasses. Both paths of the processor are checked: gradients
formed in the forward pass (``fused=True``) and autograd through
``linear_logprobs`` (``fused=False``).
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

import pytest
import torch

from hookspec import ContractError, OutputContext, ParallelLayout, VocabShard
from tests.support.policy_truth import policy_truth
from torch_impl.processors import (
    DistillConfig,
    PolicyBatch,
    PolicyLossConfig,
    RatioLevel,
    cross_entropy_loss,
    distillation_loss,
    policy_loss,
    selected_logprobs,
    topk_logprobs,
)

IGNORE = -100
S, B, H, V = 9, 3, 8, 50


def _data(
    dtype: torch.dtype = torch.float64, *, seed: int = 0, s: int = S, b: int = B
) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(s, b, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.8
    labels = torch.randint(0, V, (b, s), generator=g)
    labels[0, 2] = IGNORE
    mask = (torch.rand(b, s, generator=g) > 0.2).float()
    mask[-1] = 0.0
    mask[-1, :2] = 1.0  # a short sequence
    lp = (
        torch.einsum("sbh,vh->bsv", h, w)
        .log_softmax(-1)
        .gather(2, labels.clamp(min=0)[..., None])
        .squeeze(-1)
    )
    old = (lp + 0.3 * torch.randn(b, s, generator=g, dtype=torch.float64)).detach()
    ref = (lp + 0.2 * torch.randn(b, s, generator=g, dtype=torch.float64)).detach()
    adv = torch.randn(b, s, generator=g, dtype=torch.float64)
    return {
        "h": h.to(dtype),
        "w": w.to(dtype),
        "labels": labels,
        "batch": PolicyBatch(old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref),
    }


def _ctx(
    h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, batch: Any, **kw: Any
) -> OutputContext:
    return OutputContext(
        hidden_states=h,
        labels=labels,
        vocab_weight=w,
        vocab=VocabShard(0, V, V),
        context=batch,
        **kw,
    )


CONFIGS = {
    "ppo": PolicyLossConfig.ppo(),
    "ppo-asym-dual-seqsum": PolicyLossConfig.ppo(
        clip_low=0.2, clip_high=0.28, dual_clip=3.0, aggregation="seq-mean-token-sum"
    ),
    "grpo-k3": PolicyLossConfig.grpo(),
    "grpo-k1": PolicyLossConfig.grpo(kl_estimator="k1", kl_coef=0.1),
    "kl-k2-entropy-token-mean": PolicyLossConfig(kl_coef=0.2, kl_estimator="k2", entropy_coef=0.05),
    "entropy-seq-mean-token-mean": PolicyLossConfig(
        entropy_coef=0.3, aggregation="seq-mean-token-mean"
    ),
    "gspo": PolicyLossConfig.gspo(clip_low=0.05, clip_high=0.08),
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "autograd"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_policy_loss_float64(name: str, fused: bool) -> None:
    cfg = dataclasses.replace(CONFIGS[name], fused=fused)
    d = _data(seed=hash(name) % 1000)
    truth = policy_truth(d["h"], d["w"], d["labels"], d["batch"], cfg)
    h = d["h"].clone().requires_grad_()
    w = d["w"].clone().requires_grad_()
    out = policy_loss(cfg, tile_cols=13, tile_rows=3)(_ctx(h, w, d["labels"], d["batch"]))
    out["loss"].backward()
    tol = {"rtol": 1e-10, "atol": 1e-12}
    torch.testing.assert_close(out["loss"], truth["loss"], **tol)
    torch.testing.assert_close(h.grad, truth["dh"], **tol)
    torch.testing.assert_close(w.grad, truth["dw"], **tol)
    for metric in ("pg_loss", "entropy", "clip_fraction", "approx_kl", "kl", "dual_clip_fraction"):
        if metric in truth:
            torch.testing.assert_close(out[metric], truth[metric], **tol, msg=metric)
    assert set(out) >= {"loss", "pg_loss", "entropy", "clip_fraction", "approx_kl", "kl"}
    assert all(v.shape == () for v in out.values())
    assert float(out["approx_kl"]) >= 0.0
    if cfg.dual_clip is not None:
        assert "dual_clip_fraction" in out


def test_some_tokens_are_clipped() -> None:
    """The cases above exercise both branches of the clip."""
    d = _data(seed=1)
    out = policy_loss(PolicyLossConfig.ppo(clip_low=0.1))(
        _ctx(d["h"], d["w"], d["labels"], d["batch"])
    )
    assert 0.0 < float(out["clip_fraction"]) < 1.0


@pytest.mark.parametrize("name", ["ppo", "grpo-k3", "kl-k2-entropy-token-mean"])
def test_policy_loss_float32_three_way(name: str) -> None:
    """fp32: both paths no worse than the naive fp32 computation plus a slack."""
    cfg = CONFIGS[name]
    d = _data(seed=5)
    truth = policy_truth(d["h"], d["w"], d["labels"], d["batch"], cfg)
    h32, w32 = d["h"].float(), d["w"].float()
    b32 = dataclasses.replace(
        d["batch"],
        old_logprobs=d["batch"].old_logprobs.float(),
        ref_logprobs=d["batch"].ref_logprobs.float(),
        advantages=d["batch"].advantages.float(),
    )
    naive = _truth_in_float32(h32, w32, d["labels"], b32, cfg)
    for fused in (True, False):
        h = h32.clone().requires_grad_()
        w = w32.clone().requires_grad_()
        out = policy_loss(dataclasses.replace(cfg, fused=fused))(_ctx(h, w, d["labels"], b32))
        out["loss"].backward()
        for key, got in (("loss", out["loss"]), ("dh", h.grad), ("dw", w.grad)):
            ours_err = float((got.detach().double() - truth[key]).abs().max())
            naive_err = float((naive[key].double() - truth[key]).abs().max())
            assert ours_err <= naive_err + 1e-5 * max(1.0, float(truth[key].abs().max())), (
                key,
                fused,
            )


def _truth_in_float32(
    h: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    batch: PolicyBatch,
    cfg: PolicyLossConfig,
) -> dict[str, torch.Tensor]:
    """The naive path in fp32: full logits, log_softmax, the same formulas."""
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    logp_all = torch.einsum("sbh,vh->bsv", h, w).log_softmax(-1)
    lp = torch.where(
        labels == IGNORE, 0.0, logp_all.gather(2, labels.clamp(min=0)[..., None]).squeeze(-1)
    )
    ent = -(logp_all.exp() * logp_all).sum(-1)
    m = batch.mask * (labels != IGNORE)
    ratio = torch.exp(torch.where(m > 0, lp - batch.old_logprobs, 0.0))
    adv = batch.advantages
    pg = torch.maximum(
        -adv * ratio, -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.effective_clip_high)
    )
    r = torch.where(m > 0, batch.ref_logprobs - lp, 0.0)
    kl = {"k1": -r, "k2": r**2 / 2, "k3": torch.exp(r) - r - 1}[cfg.kl_estimator.value]
    per_token = pg + cfg.kl_coef * kl - cfg.entropy_coef * ent
    if cfg.aggregation.value == "token-mean":
        loss = (per_token * m).sum() / m.sum()
    else:
        n_k = m.sum(1)
        live = n_k > 0
        loss = ((per_token * m).sum(1)[live] / n_k[live]).sum() / live.sum()
    loss.backward()
    return {"loss": loss.detach(), "dh": h.grad, "dw": w.grad}


def test_packed_sequences_use_cu_seqlens() -> None:
    """THD: one row of three sequences; seq-mean aggregations follow cu_seqlens."""
    from megatron.core.packed_seq_params import PackedSeqParams

    d = _data(seed=2, s=12, b=1)
    cu = torch.tensor([0, 5, 9, 12], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    sequences = [[(0, j) for j in range(a, z)] for a, z in ((0, 5), (5, 9), (9, 12))]
    for cfg in (
        PolicyLossConfig.grpo(),
        PolicyLossConfig.gspo(clip_low=0.1),
        PolicyLossConfig(aggregation="seq-mean-token-sum"),
    ):
        batch = dataclasses.replace(d["batch"], mask=torch.ones(1, 12))
        truth = policy_truth(d["h"], d["w"], d["labels"], batch, cfg, sequences=sequences)
        h = d["h"].clone().requires_grad_()
        out = policy_loss(cfg)(_ctx(h, d["w"], d["labels"], batch, packed_seq_params=packed))
        out["loss"].backward()
        torch.testing.assert_close(out["loss"], truth["loss"], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(h.grad, truth["dh"], rtol=1e-10, atol=1e-12)
        # Without the packing the row would be one sequence: a different loss.
        rowwise = policy_loss(cfg)(_ctx(d["h"], d["w"], d["labels"], batch))
        assert abs(float(rowwise["loss"]) - float(truth["loss"])) > 1e-6


def test_context_parallel_shares_sum_to_the_loss() -> None:
    """Two context-parallel ranks, each with half of every sequence and the global
    token count: their losses and gradients sum to the whole batch's."""
    d = _data(seed=3, s=10)
    cfg = PolicyLossConfig(kl_coef=0.1)
    whole = policy_loss(cfg)(_ctx(d["h"], d["w"], d["labels"], d["batch"]))
    tokens = float((d["batch"].mask * (d["labels"] != IGNORE)).sum())
    total = torch.zeros((), dtype=torch.float64)
    for rank, part in enumerate((slice(0, 5), slice(5, 10))):
        batch = PolicyBatch(
            old_logprobs=d["batch"].old_logprobs[:, part],
            advantages=d["batch"].advantages[:, part],
            mask=d["batch"].mask[:, part],
            ref_logprobs=d["batch"].ref_logprobs[:, part],
            global_tokens=tokens,
        )
        ctx = _ctx(
            d["h"][part],
            d["w"],
            d["labels"][:, part],
            batch,
            parallel=ParallelLayout(cp_size=2, cp_rank=rank),
        )
        total = total + policy_loss(cfg)(ctx)["loss"]
    torch.testing.assert_close(total, whole["loss"], rtol=1e-12, atol=1e-12)
    # one-rank collectives have no context-parallel sum: what needs it is refused
    # (tests/processors/test_policy_cp.py runs cp=2 with TorchCollectives over two processes)
    ctx = _ctx(d["h"], d["w"], d["labels"], d["batch"], parallel=ParallelLayout(cp_size=2))
    with pytest.raises(
        ContractError, match=r"^collectives: .* for token-mean without context\.global_tokens"
    ):
        policy_loss(cfg)(ctx)
    with pytest.raises(
        ContractError, match=r"^collectives: .*parallel\.cp_size=2.* for GSPO's sequence ratio"
    ):
        policy_loss(PolicyLossConfig.gspo())(ctx)


def test_mask_of_bool_and_integer_dtypes_is_taken_as_the_float_mask() -> None:
    """The mask's value check refuses nothing a mask may hold: a bool or integer
    mask (every value finite, >= 0) gives the float mask's loss, bitwise."""
    d = _data(seed=11)
    cfg = PolicyLossConfig.grpo()
    want = policy_loss(cfg)(_ctx(d["h"], d["w"], d["labels"], d["batch"]))["loss"]
    for mask in (d["batch"].mask.bool(), d["batch"].mask.long(), d["batch"].mask.to(torch.uint8)):
        batch = dataclasses.replace(d["batch"], mask=mask)
        assert torch.equal(policy_loss(cfg)(_ctx(d["h"], d["w"], d["labels"], batch))["loss"], want)


def test_value_checks_on_a_cpu_raise_at_once_naming_the_values() -> None:
    from torch_impl.value_checks import (
        check_finite_deferred,
        check_multiple_deferred,
        pending_checks,
    )

    nan, inf = float("nan"), float("inf")
    check_finite_deferred(torch.tensor([0.0, 2.5]), field="context.mask", nonnegative=True)
    check_finite_deferred(torch.tensor([True, False]), field="context.mask", nonnegative=True)
    with pytest.raises(
        ContractError,
        match=r"^context\.mask: expected finite values >= 0, got 1 values outside it, "
        r"in \[-1\.0, -1\.0\]$",
    ):
        check_finite_deferred(
            torch.tensor([0.0, -1.0, 1.0]), field="context.mask", nonnegative=True
        )
    with pytest.raises(
        ContractError,
        match=r"^x: expected finite values >= 0, got 2 values outside it, in \[nan, nan\]$",
    ):
        check_finite_deferred(torch.tensor([nan, inf, 1.0]), field="x", nonnegative=True)
    counted = torch.tensor([True, False, True])
    check_finite_deferred(torch.tensor([-2.0, nan, 3.0]), field="context.advantages", where=counted)
    with pytest.raises(
        ContractError,
        match=r"^context\.advantages: expected finite values where it is read, "
        r"got 1 values outside it, in \[-inf, -inf\]$",
    ):
        check_finite_deferred(
            torch.tensor([-inf, nan, 3.0]), field="context.advantages", where=counted
        )
    check_multiple_deferred(torch.tensor([0, 4, 12], dtype=torch.int32), 4, field="cu")
    with pytest.raises(
        ContractError, match=r"^cu: expected multiples of 4, got 2 values outside it, in \[5, 7\]$"
    ):
        check_multiple_deferred(torch.tensor([0, 5, 7, 8], dtype=torch.int32), 4, field="cu")
    assert pending_checks() == 0


@pytest.mark.gpu
def test_cuda_mask_and_value_checks_defer_without_a_host_read() -> None:
    """On a GPU each check makes no host read (sync debug mode "error") and its
    result is read later, naming the field and the values."""
    from torch_impl.value_checks import (
        check_finite_deferred,
        check_multiple_deferred,
        raise_pending_errors,
    )

    cuda = torch.device("cuda")
    mask = torch.tensor([1.0, -1.0, 0.0], device=cuda)  # inputs made before the mode is on
    old, counted = (
        torch.tensor([float("inf"), float("nan")], device=cuda),
        torch.tensor([True, False], device=cuda),
    )
    cu = torch.tensor([0, 6], device=cuda)
    checks = [
        (
            lambda: check_finite_deferred(mask, field="context.mask", nonnegative=True),
            r"^context\.mask: expected finite values >= 0, got 1 values outside it, "
            r"in \[-1\.0, -1\.0\]",
        ),
        (
            lambda: check_finite_deferred(old, field="context.old_logprobs", where=counted),
            r"^context\.old_logprobs: expected finite values where it is read, "
            r"got 1 values outside it",
        ),
        (
            lambda: check_multiple_deferred(cu, 4, field="cu"),
            r"^cu: expected multiples of 4, got 1 values outside it, in \[6, 6\]",
        ),
    ]
    for check, message in checks:
        raise_pending_errors(wait=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            check()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        with pytest.raises(ContractError, match=message):
            raise_pending_errors(wait=True)


@pytest.mark.gpu
def test_cuda_policy_loss_reports_a_negative_mask_entry() -> None:
    """Through the processor on a GPU: the bad entry is reported by name, in this
    call (when an earlier check of it has landed) or at the next read."""
    from torch_impl.value_checks import raise_pending_errors

    raise_pending_errors(wait=True)
    d = _data(seed=12)
    mask = d["batch"].mask.clone()
    mask[1, 3] = -1.0
    batch = dataclasses.replace(
        d["batch"],
        mask=mask.cuda(),
        old_logprobs=d["batch"].old_logprobs.cuda(),
        advantages=d["batch"].advantages.cuda(),
        ref_logprobs=d["batch"].ref_logprobs.cuda(),
    )
    ctx = _ctx(d["h"].float().cuda(), d["w"].float().cuda(), d["labels"].cuda(), batch)
    with pytest.raises(
        ContractError, match=r"^context\.mask: expected finite values >= 0, got 1 values"
    ):
        policy_loss(PolicyLossConfig.grpo())(ctx)
        raise_pending_errors(wait=True)


def test_mask_defaults_to_loss_mask_then_to_every_token() -> None:
    d = _data(seed=4)
    batch = dataclasses.replace(d["batch"], mask=None)
    cfg = PolicyLossConfig(entropy_coef=0.1)
    loss_mask = (torch.arange(S) % 2).float().expand(B, S)
    out = policy_loss(cfg)(_ctx(d["h"], d["w"], d["labels"], batch, loss_mask=loss_mask))
    truth = policy_truth(d["h"], d["w"], d["labels"], batch, cfg, loss_mask=loss_mask)
    torch.testing.assert_close(out["loss"], truth["loss"], rtol=1e-10, atol=1e-12)
    out = policy_loss(cfg)(_ctx(d["h"], d["w"], d["labels"], batch))
    truth = policy_truth(d["h"], d["w"], d["labels"], batch, cfg)
    torch.testing.assert_close(out["loss"], truth["loss"], rtol=1e-10, atol=1e-12)


def test_per_token_temperature_from_the_batch() -> None:
    d = _data(seed=6)
    t = torch.rand(B, S, dtype=torch.float64) + 0.5
    batch = dataclasses.replace(d["batch"], temperature=t)
    for fused in (True, False):
        cfg = PolicyLossConfig.grpo(fused=fused)
        truth = policy_truth(d["h"], d["w"], d["labels"], batch, cfg)
        h = d["h"].clone().requires_grad_()
        out = policy_loss(cfg)(_ctx(h, d["w"], d["labels"], batch))
        out["loss"].backward()
        torch.testing.assert_close(out["loss"], truth["loss"], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(h.grad, truth["dh"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "autograd"])
def test_empty_mask_is_zero_with_zero_gradient(fused: bool) -> None:
    d = _data(seed=7)
    batch = dataclasses.replace(d["batch"], mask=torch.zeros(B, S))
    for agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        h = d["h"].clone().requires_grad_()
        out = policy_loss(PolicyLossConfig(aggregation=agg, fused=fused, kl_coef=0.1))(
            _ctx(h, d["w"], d["labels"], batch)
        )
        out["loss"].backward()
        assert float(out["loss"].detach()) == 0.0
        assert torch.equal(h.grad, torch.zeros_like(h))
        assert all(bool(torch.isfinite(v)) for v in out.values())


def test_fused_forms_no_gradient_without_grad_mode() -> None:
    d = _data(seed=8)
    h = d["h"].clone().requires_grad_()
    with torch.no_grad():
        out = policy_loss(PolicyLossConfig())(_ctx(h, d["w"], d["labels"], d["batch"]))
    assert not out["loss"].requires_grad
    truth = policy_truth(d["h"], d["w"], d["labels"], d["batch"], PolicyLossConfig())
    torch.testing.assert_close(out["loss"], truth["loss"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "autograd"])
def test_nan_hidden_state_makes_the_loss_nan(fused: bool) -> None:
    d = _data(seed=9)
    h = d["h"].clone()
    h[1, 0, 3] = float("nan")  # token s=1 of sequence 0, counted by the mask
    batch = dataclasses.replace(d["batch"], mask=torch.ones(B, S))
    out = policy_loss(PolicyLossConfig(fused=fused))(_ctx(h, d["w"], d["labels"], batch))
    assert bool(torch.isnan(out["loss"])) and bool(torch.isnan(out["entropy"]))


# ---------------------------------------------------------------- bad input


def test_mismatched_context_shapes_raise() -> None:
    d = _data()
    b = d["batch"]
    cases = {
        "context.old_logprobs": dataclasses.replace(b, old_logprobs=b.old_logprobs[:, :-1]),
        "context.advantages": dataclasses.replace(b, advantages=b.advantages.T),
        "context.mask": dataclasses.replace(b, mask=torch.ones(B, S + 1)),
        "context.ref_logprobs": dataclasses.replace(b, ref_logprobs=b.ref_logprobs[:1]),
        "context.temperature": dataclasses.replace(b, temperature=torch.ones(B, S - 1)),
        "context.global_tokens": dataclasses.replace(b, global_tokens=0),
    }
    for field, batch in cases.items():
        with pytest.raises(ContractError, match=field.replace(".", r"\.")):
            policy_loss(PolicyLossConfig.grpo())(_ctx(d["h"], d["w"], d["labels"], batch))
    with pytest.raises(ContractError, match=r"context\.ref_logprobs: expected a tensor"):
        policy_loss(PolicyLossConfig.grpo())(
            _ctx(d["h"], d["w"], d["labels"], dataclasses.replace(b, ref_logprobs=None))
        )
    with pytest.raises(
        ContractError, match=r"context: expected a torch_impl\.processors\.PolicyBatch"
    ):
        policy_loss()(_ctx(d["h"], d["w"], d["labels"], {"old_logprobs": b.old_logprobs}))
    with pytest.raises(ContractError, match=r"context\.temperature"):
        policy_loss()(_ctx(d["h"], d["w"], d["labels"], dataclasses.replace(b, temperature=0.0)))
    bad_labels = d["labels"].clone()
    bad_labels[0, 0] = V
    with pytest.raises(ContractError, match="labels"):
        policy_loss()(_ctx(d["h"], d["w"], bad_labels, b))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_high": float("nan")}, "clip_high"),
        ({"aggregation": "mean"}, "aggregation"),
        ({"ratio": "seq"}, "ratio"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"kl_coef": float("inf")}, "kl_coef"),
        ({"log_ratio_clamp": 0.0}, "log_ratio_clamp"),
    ],
)
def test_bad_config_raises(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ContractError, match=field):
        PolicyLossConfig(**kwargs)


# --------------------------------------------------------- names (issue 11): one release of aliases


def test_ratio_is_an_enum_and_the_old_strings_warn() -> None:
    assert PolicyLossConfig().ratio is RatioLevel.TOKEN
    assert PolicyLossConfig.gspo().ratio is RatioLevel.SEQUENCE
    with pytest.warns(
        DeprecationWarning, match=r"ratio='sequence'.*pass RatioLevel\.SEQUENCE"
    ) as rec:
        cfg = PolicyLossConfig(ratio="sequence")  # type: ignore[arg-type]
    assert rec[0].filename == __file__  # the warning points at the caller
    assert cfg.ratio is RatioLevel.SEQUENCE and cfg == PolicyLossConfig(ratio=RatioLevel.SEQUENCE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dataclasses.replace(cfg, fused=False)
        PolicyLossConfig.grpo(ratio=RatioLevel.TOKEN)
    with pytest.raises(
        ContractError, match=r"^ratio: expected RatioLevel\.TOKEN or RatioLevel\.SEQUENCE"
    ):
        PolicyLossConfig(ratio="seq")  # type: ignore[arg-type]


def test_eps_high_is_a_deprecated_alias_of_effective_clip_high() -> None:
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28)
    assert cfg.effective_clip_high == 0.28
    assert PolicyLossConfig(clip_low=0.1).effective_clip_high == 0.1
    with pytest.warns(DeprecationWarning, match="effective_clip_high"):
        assert cfg.eps_high == 0.28


_OLD_TILES = [
    ("vocab_chunk_size", "tile_cols"),
    ("token_chunk_size", "tile_rows"),
    ("chunk_size", "tile_cols"),
    ("fused_tile_elements", "tile_rows (= fused_tile_elements // V_local)"),
    ("tile_elements", "tile_rows (= tile_elements // V_local)"),
]


@pytest.mark.parametrize(("old", "new"), _OLD_TILES)
@pytest.mark.parametrize(
    "factory",
    [
        selected_logprobs,
        cross_entropy_loss,
        policy_loss,
        lambda **kw: topk_logprobs(2, **kw),
        lambda **kw: distillation_loss(DistillConfig(), **kw),
    ],
    ids=[
        "selected_logprobs",
        "cross_entropy_loss",
        "policy_loss",
        "topk_logprobs",
        "distillation_loss",
    ],
)
def test_a_factory_tile_keyword_of_the_earlier_signature_names_its_new_name(
    factory: Any, old: str, new: str
) -> None:
    """The factories' tiles took LinearOptions' names (tile_rows, tile_cols): each
    earlier keyword raises TypeError naming where it went, at the factory."""
    with pytest.raises(TypeError, match=re.escape(f"{old}= -> {new}")):
        factory(**{old: 7})
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['tile_row'\]$"):
        factory(tile_row=7)
