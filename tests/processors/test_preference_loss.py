"""``preference_loss`` (DPO, IPO, SimPO over chosen/rejected pairs) against a float64
implementation on materialised logits written here, from the methods' papers and TRL's
formulas: values, metrics and the gradients of the hidden states and the weight; through
the hook of the tiny GPT; at bf16 compute beside the naive bf16 path; bad inputs; the
JAX reference and its hookcheck checks; tensor and context parallel over gloo.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import re
import types
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from jax.test_util import check_grads

import jax_ref
import torch_impl
from hookspec import ContractError, OutputContext, ParallelLayout, VocabShard
from jax_ref import preference as jax_preference
from jax_ref.check import builtin_processors as B
from jax_ref.check.cases import synthetic_context
from jax_ref.check.comparison import cross_check
from jax_ref.check.hookcheck import BUILTIN_CHECKS, main
from tests.support.distributed import run_distributed
from torch_impl.processors import (
    PreferenceBatch,
    PreferenceConfig,
    PreferenceMethod,
    preference_loss,
)
from torch_impl.testing.cp import padded_cu_seqlens, thd_partition_index
from torch_impl.testing.tiny import build_tiny_gpt, tiny_batch

IGNORE = -100
H, V = 8, 50
METRICS = (
    "rewards_chosen",
    "rewards_rejected",
    "reward_margin",
    "accuracy",
    "logps_chosen",
    "logps_rejected",
    "pairs",
)
CONFIGS: dict[str, PreferenceConfig] = {
    "dpo": PreferenceConfig.dpo(beta=0.3),
    "cdpo": PreferenceConfig.dpo(beta=0.3, label_smoothing=0.2),
    "dpo-means": PreferenceConfig.dpo(beta=0.3, length_normalized=True),
    "ipo": PreferenceConfig.ipo(beta=0.4),
    "ipo-sums": PreferenceConfig.ipo(beta=0.4, length_normalized=False),
    "simpo": PreferenceConfig.simpo(beta=2.0, gamma=0.8, label_smoothing=0.1),
}


# ---------------------------------------------------------------- the float64 truth


Sequences = list[list[tuple[int, int]]]


def _pair_loss(
    cfg: PreferenceConfig, lp_c: Any, lp_r: Any, ref_c: Any, ref_r: Any
) -> tuple[Any, Any, Any]:
    """``(L, r_c, r_r)`` per pair, each method written as its source writes it."""
    beta, eps = cfg.beta, cfg.label_smoothing
    if cfg.method == PreferenceMethod.SIMPO:  # SimPO eq. 6, TRL's CPO "simpo" with smoothing
        logits = lp_c - lp_r - cfg.gamma / beta
        loss = -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
        return loss, beta * lp_c, beta * lp_r
    logits = (lp_c - lp_r) - (ref_c - ref_r)  # TRL's pi_logratios - ref_logratios
    if cfg.method == PreferenceMethod.IPO:  # IPO eq. 17
        loss = (logits - 1 / (2 * beta)) ** 2
    else:  # DPO eq. 7; conservative DPO
        loss = -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
    return loss, beta * (lp_c - ref_c), beta * (lp_r - ref_r)


def _number(x: Any) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def preference_truth(
    h: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    batch: PreferenceBatch,
    cfg: PreferenceConfig,
    sequences: Sequences | None = None,
    loss_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Loss, metrics and the gradients ``dh``, ``dw`` in float64 from the full logits
    ``[b, s, V]``; a sequence's logprob summed token by token in a Python loop."""
    h = h.detach().double().requires_grad_()
    w = w.detach().double().requires_grad_()
    b, s = labels.shape
    logp = torch.einsum("sbh,vh->bsv", h, w).log_softmax(-1)
    lp = torch.where(labels == IGNORE, 0.0, logp.gather(2, labels.clamp(min=0)[..., None])[..., 0])
    mask = batch.mask if batch.mask is not None else loss_mask
    m = (torch.ones(b, s) if mask is None else mask).double() * (labels != IGNORE)
    if sequences is None:
        sequences = [[(i, j) for j in range(s)] for i in range(b)]
    sums = [sum(m[i, j] * lp[i, j] for i, j in seq) for seq in sequences]
    counts = [float(sum(m[i, j] for i, j in seq)) for seq in sequences]
    if batch.chosen is None:
        chosen, rejected = list(range(0, len(sequences), 2)), list(range(1, len(sequences), 2))
    else:
        chosen, rejected = batch.chosen.tolist(), batch.rejected.tolist()
    pm = [1.0] * len(chosen) if batch.pair_mask is None else batch.pair_mask.double().tolist()
    total = batch.global_pairs or sum(pm)
    out: dict[str, Any] = {k: 0.0 for k in ("loss", *METRICS)}
    for i, (c, r) in enumerate(zip(chosen, rejected)):
        if pm[i] == 0:
            continue
        lp_c, lp_r = sums[c], sums[r]
        ref_c = ref_r = 0.0
        if batch.ref_chosen is not None:
            ref_c, ref_r = float(batch.ref_chosen[i]), float(batch.ref_rejected[i])
        if cfg.length_normalized:
            lp_c, lp_r = lp_c / counts[c], lp_r / counts[r]
            ref_c, ref_r = ref_c / counts[c], ref_r / counts[r]
        loss, r_c, r_r = _pair_loss(cfg, lp_c, lp_r, ref_c, ref_r)
        share = pm[i] / total
        out["loss"] = out["loss"] + share * loss
        for key, value in (
            ("rewards_chosen", r_c),
            ("rewards_rejected", r_r),
            ("reward_margin", r_c - r_r),
            ("accuracy", float(r_c > r_r)),
            ("logps_chosen", lp_c),
            ("logps_rejected", lp_r),
        ):
            out[key] = out[key] + share * _number(value)
    out["pairs"] = sum(pm)
    out["loss"].backward()
    result = {k: torch.tensor(_number(v), dtype=torch.float64) for k, v in out.items()}
    return result | {"dh": h.grad, "dw": w.grad}


# ---------------------------------------------------------------- problems


def _problem(b: int, s: int, seed: int = 0) -> dict[str, Any]:
    """Float64 hidden states ``[s, b, H]``, a weight ``[V, H]``, labels with ignored
    entries and a mask of weights with zeros (every row keeps counted tokens)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (b, s), generator=g)
    labels[0, 2] = labels[-1, -1] = IGNORE
    mask = torch.rand(b, s, generator=g, dtype=torch.float64) + 0.5
    mask[:, 0] = 0.0
    mask[-1, 3:5] = 0.0
    return {
        "h": torch.randn(s, b, H, generator=g, dtype=torch.float64),
        "w": torch.randn(V, H, generator=g, dtype=torch.float64) * 0.8,
        "labels": labels,
        "mask": mask,
        "g": g,
    }


def _references(p: dict[str, Any], pairs: int) -> dict[str, torch.Tensor]:
    """Reference sums ``[P]`` near ``-3`` per token (the policy's are near ``-log V``)."""
    g, s = p["g"], p["labels"].shape[1]
    return {
        k: -3.5 * s + torch.randn(pairs, generator=g, dtype=torch.float64) * 2.0
        for k in ("ref_chosen", "ref_rejected")
    }


def _context(p: dict[str, Any], batch: PreferenceBatch, **kw: Any) -> OutputContext:
    return OutputContext(
        hidden_states=p["h"].clone().requires_grad_(),
        labels=p["labels"],
        vocab_weight=p["w"].clone().requires_grad_(),
        vocab=VocabShard(0, V, V),
        context=batch,
        **kw,
    )


def _run(proc: Any, ctx: OutputContext) -> dict[str, torch.Tensor]:
    out = proc(ctx)
    out["loss"].backward()
    return {k: v.detach() for k, v in out.items()} | {
        "dh": ctx.hidden_states.grad,
        "dw": ctx.vocab_weight.grad,  # type: ignore[union-attr]
    }


def _assert_equal(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], **tol: float
) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for key, value in want.items():
        torch.testing.assert_close(got[key].double(), value, **tol, msg=key)


F64 = {"rtol": 1e-10, "atol": 1e-12}


# ---------------------------------------------------------------- values and gradients


def _layouts(p: dict[str, Any], b: int) -> dict[str, PreferenceBatch]:
    """Interleaved (the default), TRL's halves with a padding pair whose rows count
    nothing and a global count, and explicit pairs leaving a row out."""
    mask = p["mask"]
    empty = mask.clone()
    empty[4:6] = 0.0  # rows 4, 5: the padding pair (weight 0) counts no token
    return {
        "interleaved": PreferenceBatch(mask=mask, **_references(p, b // 2)),
        "halves": PreferenceBatch(
            mask=empty,
            chosen=torch.tensor([0, 1, 4]),
            rejected=torch.tensor([2, 3, 5]),
            pair_mask=torch.tensor([1.0, 0.5, 0.0]),
            global_pairs=2.5,
            **_references(p, 3),
        ),
        "explicit": PreferenceBatch(
            mask=mask,
            chosen=torch.tensor([3, 0]),
            rejected=torch.tensor([1, 3]),
            pair_mask=torch.tensor([True, True]),
            **_references(p, 2),
        ),
    }


@pytest.mark.parametrize("layout", ["interleaved", "halves", "explicit"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_values_and_gradients_against_materialised_logits(name: str, layout: str) -> None:
    cfg = CONFIGS[name]
    p = _problem(6, 9)
    batch = _layouts(p, 6)[layout]
    if cfg.method == PreferenceMethod.SIMPO:
        batch = dataclasses.replace(batch, ref_chosen=None, ref_rejected=None)
    truth = preference_truth(p["h"], p["w"], p["labels"], batch, cfg)
    got = _run(preference_loss(cfg, tile_rows=5, tile_cols=16), _context(p, batch))
    _assert_equal(got, truth, **F64)
    assert float(truth["loss"]) > 0.0 and truth["dh"].abs().max() > 1e-3


def test_fp32_on_both_backends(backend: str) -> None:
    """The fp32 inputs on each backend (Triton interpreted on a CPU), against float64."""
    p = _problem(4, 7, seed=3)
    batch = PreferenceBatch(mask=p["mask"], **_references(p, 2))
    cfg = CONFIGS["cdpo"]
    truth = preference_truth(p["h"], p["w"], p["labels"], batch, cfg)
    p32 = p | {"h": p["h"].float(), "w": p["w"].float()}
    got = _run(preference_loss(cfg, tile_rows=5, tile_cols=16), _context(p32, batch))
    for key, want in truth.items():
        scale = float(want.abs().max())
        torch.testing.assert_close(
            got[key].double(), want, rtol=2e-5, atol=2e-5 * scale + 1e-7, msg=key
        )


def test_packed_sequences_and_the_loss_mask() -> None:
    """One packed row (THD) of six sequences, interleaved into three pairs, tokens past
    the last boundary in none; the model's ``loss_mask`` where the context has none."""
    p = _problem(1, 30, seed=4)
    cu = torch.tensor([0, 4, 9, 15, 18, 24, 27], dtype=torch.int32)
    loss_mask = torch.ones(1, 30, dtype=torch.float64)
    loss_mask[0, [0, 4, 9, 15, 18, 24]] = 0.0  # each sequence's first token
    batch = PreferenceBatch(**_references(p, 3))
    sequences = [[(0, j) for j in range(int(a), int(z))] for a, z in itertools.pairwise(cu)]
    for cfg in (CONFIGS["dpo"], CONFIGS["ipo"]):
        truth = preference_truth(
            p["h"], p["w"], p["labels"], batch, cfg, sequences=sequences, loss_mask=loss_mask
        )
        psp = types.SimpleNamespace(cu_seqlens_q=cu, cu_seqlens_q_padded=None)
        ctx = _context(p, batch, loss_mask=loss_mask, packed_seq_params=psp)
        _assert_equal(_run(preference_loss(cfg, tile_rows=7), ctx), truth, **F64)


def test_nan_in_an_uncounted_row_makes_the_loss_nan() -> None:
    p = _problem(4, 6, seed=5)
    p["h"][2, 3] = float("nan")
    batch = PreferenceBatch(mask=torch.zeros(4, 6).index_fill_(1, torch.tensor([0, 1]), 1.0))
    batch = dataclasses.replace(batch, **_references(p, 2))
    out = preference_loss(CONFIGS["dpo"])(_context(p, batch))
    assert torch.isnan(out["loss"]) and torch.isfinite(out["accuracy"])


# ---------------------------------------------------------------- through the hook


def _hook_batch(lp: torch.Tensor, mask: torch.Tensor) -> PreferenceBatch:
    """Reference sums near the model's own (the margins of either sign)."""
    g = torch.Generator().manual_seed(7)
    sums = (lp * mask).sum(-1).double()
    noise = torch.randn(sums.shape, generator=g, dtype=torch.float64)
    return PreferenceBatch(
        ref_chosen=(sums[0::2] + noise[0::2]).float(),
        ref_rejected=(sums[1::2] + noise[1::2]).float(),
        mask=mask,
    )


@pytest.mark.usefixtures("megatron_single")
@pytest.mark.parametrize("name", ["cdpo", "ipo", "simpo"])
def test_through_the_hook_equals_the_stock_logits(name: str) -> None:
    """The tiny GPT: ours through the hook against the stock model's logits, the loss
    formed in float64 from them, every parameter's gradient."""
    cfg = CONFIGS[name]
    model = build_tiny_gpt()
    data = tiny_batch(4, 8, 64, seed=8)
    data["labels"][2, 5] = IGNORE
    mask = torch.ones(4, 8)
    mask[:, :2] = 0.0  # the prompt
    args = (data["input_ids"], data["position_ids"], None)
    logits = model(*args).double()  # [b, s, V]
    lp = logits.log_softmax(-1).gather(2, data["labels"].clamp(min=0)[..., None])[..., 0]
    lp = torch.where(data["labels"] == IGNORE, 0.0, lp)
    batch = _hook_batch(lp.detach(), mask * (data["labels"] != IGNORE))
    if cfg.method == PreferenceMethod.SIMPO:
        batch = dataclasses.replace(batch, ref_chosen=None, ref_rejected=None)
    # the truth: the logits as hidden states [s, b, V] through an identity weight
    eye = torch.eye(64, dtype=torch.float64)
    hidden = logits.transpose(0, 1)
    truth = preference_truth(hidden, eye, data["labels"], batch, cfg)
    hidden.backward(truth["dh"])
    expected = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
    model.zero_grad(set_to_none=True)
    torch_impl.enable_output_processor(model)
    out = model(
        *args,
        labels=data["labels"],
        output_processor=preference_loss(cfg, tile_cols=24),
        output_processor_context=batch,
    )
    out["loss"].backward()
    torch.testing.assert_close(out["loss"].double(), truth["loss"], rtol=1e-6, atol=1e-7)
    for key in METRICS:
        torch.testing.assert_close(out[key].double(), truth[key], rtol=1e-6, atol=1e-6, msg=key)
    got = {n: q.grad for n, q in model.named_parameters() if q.grad is not None}
    assert set(got) == set(expected)
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=1e-6, msg=n)


# ---------------------------------------------------------------- bf16 compute

BF16 = torch.bfloat16


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def _bf16_run(p: dict[str, Any], batch: Any, cfg: Any, how: str, dtype: Any) -> dict[str, Any]:
    """Values and ``dh``, ``dw``: ``how`` "ours" on the bf16 inputs (bf16 compute
    forced); "materialised": the logits ``h @ w.T`` formed in ``dtype`` (bf16: the naive
    path, fp32 maths on bf16 logits; float64: the truth), an identity weight after."""
    h = p["h"].to(dtype).requires_grad_()
    w = p["w"].to(dtype).requires_grad_()
    if how == "ours":
        ctx = OutputContext(
            hidden_states=h, labels=p["labels"], vocab_weight=w,
            vocab=VocabShard(0, p["v"], p["v"]), context=batch,
        )  # fmt: skip
    else:
        z = torch.einsum("sbh,vh->sbv", h, w)
        z = z.float() if dtype == BF16 else z
        eye = torch.eye(p["v"], dtype=z.dtype)
        ctx = OutputContext(
            hidden_states=z, labels=p["labels"], vocab_weight=eye,
            vocab=VocabShard(0, p["v"], p["v"]), context=batch,
        )  # fmt: skip
    out = preference_loss(cfg)(ctx)
    dh, dw = torch.autograd.grad(out["loss"], (h, w))
    return {"loss": out["loss"].detach(), "logps": out["logps_chosen"], "dh": dh, "dw": dw}


@pytest.mark.parametrize("name", ["cdpo", "ipo", "simpo"])
def test_at_bf16_compute_beside_the_naive_path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 inputs: ours (bf16 GEMM operands, as on CUDA), the naive bf16 logits, and
    float64 of the same inputs; ours within a third of the naive error, or twice the
    bf16 rounding of the float64 result."""
    cfg = CONFIGS[name]
    g = torch.Generator().manual_seed(9)
    b, s, h, v = 4, 24, 64, 2048
    labels = torch.randint(0, v, (b, s), generator=g)
    labels[0, ::5] = IGNORE
    p = {
        "h": (torch.randn(s, b, h, generator=g) * 1.5).to(BF16),
        "w": (torch.randn(v, h, generator=g) * 0.3).to(BF16),
        "labels": labels,
        "v": v,
    }
    mask = (torch.rand(b, s, generator=g) > 0.2).float()
    refs = {
        k: -8.0 * s + torch.randn(b // 2, generator=g) * 3 for k in ("ref_chosen", "ref_rejected")
    }
    batch = PreferenceBatch(mask=mask, **({} if cfg.method == PreferenceMethod.SIMPO else refs))
    truth = _bf16_run(p, batch, cfg, "materialised", torch.float64)
    naive = _bf16_run(p, batch, cfg, "materialised", BF16)
    monkeypatch.setattr(
        "torch_impl.processors._options.resolve_compute_dtype",
        lambda device, dtype, override: torch.float64 if dtype == torch.float64 else BF16,
    )
    ours = _bf16_run(p, batch, cfg, "ours", BF16)
    for key, want in truth.items():
        err, naive_err = _rel(ours[key], want), _rel(naive[key], want)
        rounding = _rel(want.to(BF16), want)
        assert err <= max(naive_err / 3, 2 * rounding), (key, err, naive_err, rounding)


# ---------------------------------------------------------------- bad inputs


def _bad(batch: PreferenceBatch, cfg: PreferenceConfig | None = None, **kw: Any) -> str:
    p = kw.pop("problem", None) or _problem(4, 6, seed=11)
    with pytest.raises(ContractError) as info:
        preference_loss(cfg or CONFIGS["dpo"])(_context(p, batch, **kw))
    return str(info.value)


REFS2 = {"ref_chosen": torch.full((2,), -20.0), "ref_rejected": torch.full((2,), -21.0)}


def test_unpaired_sequences_are_refused() -> None:
    message = _bad(PreferenceBatch(**REFS2), problem=_problem(3, 6))
    assert message.startswith("labels: expected an even number of sequences"), message
    assert "got 3 sequences (b=3: a sequence per row)" in message
    psp = types.SimpleNamespace(cu_seqlens_q=torch.tensor([0, 2, 4, 6], dtype=torch.int32))
    message = _bad(PreferenceBatch(**REFS2), problem=_problem(1, 6), packed_seq_params=psp)
    assert message.startswith("packed_seq_params.cu_seqlens_q: expected an even number"), message


@pytest.mark.parametrize(
    ("given", "field"),
    [
        ({"mask": torch.ones(4, 6).index_fill_(0, torch.tensor([3]), 0.0)}, "context.mask"),
        ({}, "loss_mask"),
    ],
)
def test_a_counted_pair_with_an_empty_sequence_is_refused(given: dict, field: str) -> None:
    loss_mask = torch.ones(4, 6)
    loss_mask[1] = 0.0
    batch = PreferenceBatch(**REFS2, **given)
    message = _bad(batch, loss_mask=loss_mask)
    assert message.startswith(f"{field}: expected a counted token"), message
    assert "1 pairs outside it" in message
    # the same pair with weight 0 (a padding pair) is not read
    padded = dataclasses.replace(
        batch,
        pair_mask=torch.tensor([1.0, 0.0]) if field == "context.mask" else torch.tensor([0.0, 1.0]),
    )
    out = preference_loss(CONFIGS["dpo"])(
        _context(_problem(4, 6, seed=11), padded, loss_mask=loss_mask)
    )
    assert torch.isfinite(out["loss"]) and float(out["pairs"]) == 1.0


def _pb(**fields: Any) -> PreferenceBatch:
    """A context of two pairs: ``REFS2`` and ``fields`` over them."""
    return PreferenceBatch(**(REFS2 | fields))


T = torch.tensor
BAD_CONTEXTS: list[tuple[PreferenceBatch, str, str]] = [
    (_pb(ref_chosen=torch.zeros(3)), "context.ref_chosen", "shape [P=2]"),
    (_pb(ref_rejected=None), "context.ref_rejected", "a tensor [P=2]"),
    (_pb(ref_chosen=torch.zeros(2, dtype=torch.long)), "context.ref_chosen", "a floating"),
    (_pb(mask=torch.ones(4, 5)), "context.mask", "shape [b=4, s=6]"),
    (_pb(chosen=T([0, 1])), "context.rejected", "an integer tensor [P]"),
    (_pb(chosen=T([0.0, 1.0]), rejected=T([2, 3])), "context.chosen", "an integer tensor [P]"),
    (_pb(chosen=T([0, 1]), rejected=T([2, 3, 1])), "context.rejected", "shape [P=2] like"),
    (_pb(chosen=T([0, 4]), rejected=T([2, 3])), "context.chosen", "indices in [0, 4)"),
    (_pb(pair_mask=torch.ones(3)), "context.pair_mask", "shape [P=2]"),
    (_pb(pair_mask=T([1.0, -1.0])), "context.pair_mask", "finite values >= 0"),
    (_pb(ref_chosen=T([-20.0, float("nan")])), "context.ref_chosen", "finite values where"),
    (_pb(global_pairs=0.0), "context.global_pairs", "a finite number > 0"),
]


@pytest.mark.parametrize(("batch", "field", "expected"), BAD_CONTEXTS)
def test_bad_contexts_name_their_field(batch: PreferenceBatch, field: str, expected: str) -> None:
    message = _bad(batch)
    assert message.startswith(f"{field}: expected {expected}"), message


def test_a_nan_reference_of_a_padding_pair_is_not_read() -> None:
    batch = PreferenceBatch(
        ref_chosen=torch.tensor([-20.0, float("nan")]), ref_rejected=torch.zeros(2),
        pair_mask=torch.tensor([1.0, 0.0]),
    )  # fmt: skip
    out = preference_loss(CONFIGS["dpo"])(_context(_problem(4, 6, seed=11), batch))
    assert all(torch.isfinite(v) for v in out.values())


def test_simpo_refuses_references_and_the_context_must_be_a_preference_batch() -> None:
    message = _bad(PreferenceBatch(**REFS2), CONFIGS["simpo"])
    assert message.startswith("context.ref_chosen: expected None with method 'simpo'"), message
    p = _problem(4, 6)
    pattern = r"^context: expected a torch_impl.processors.PreferenceBatch.*PreferenceBatch\(\*\*"
    with pytest.raises(ContractError, match=pattern):
        preference_loss()(_context(p, dict(REFS2)))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "field", "expected"),
    [
        ({"beta": 0.0}, "beta", "a finite number > 0"),
        ({"beta": float("inf")}, "beta", "a finite number > 0"),
        ({"label_smoothing": 0.6}, "label_smoothing", "a finite number in [0, 0.5]"),
        ({"method": "ipo", "label_smoothing": 0.1}, "label_smoothing", "0 with method 'ipo'"),
        ({"gamma": 0.5}, "gamma", "0 with method 'dpo' (SimPO's target margin)"),
        ({"method": "simpo", "length_normalized": False}, "length_normalized", "True or None"),
        ({"length_normalized": 1}, "length_normalized", "True or False"),
        ({"method": "kto"}, "method", "one of ['dpo', 'ipo', 'simpo']"),
    ],
)  # fmt: skip
def test_bad_configs_name_their_field(kwargs: dict, field: str, expected: str) -> None:
    with pytest.raises(ContractError) as info:
        PreferenceConfig(**kwargs)
    assert str(info.value).startswith(f"{field}: expected {expected}"), str(info.value)


def test_config_defaults_and_constructors() -> None:
    assert PreferenceConfig().length_normalized is False
    assert PreferenceConfig(method="ipo").length_normalized is True
    assert PreferenceConfig.simpo() == PreferenceConfig("simpo", beta=2.0, gamma=1.0)
    assert PreferenceConfig.ipo().method is PreferenceMethod.IPO
    with pytest.raises(TypeError, match="chunk_size"):
        preference_loss(chunk_size=8)  # type: ignore[call-arg]
    with pytest.raises(ContractError, match=r"^config: expected a PreferenceConfig"):
        preference_loss({"beta": 0.1})  # type: ignore[arg-type]


def test_context_parallel_without_the_cp_sum_is_refused() -> None:
    from hookspec import SingleProcessCollectives

    p = _problem(4, 6)
    ctx = _context(p, PreferenceBatch(**REFS2), parallel=ParallelLayout(cp_size=2, cp_rank=0),
                   collectives=SingleProcessCollectives())  # fmt: skip
    with pytest.raises(
        ContractError, match=r"^collectives: expected all_reduce_sum_context_parallel"
    ):
        preference_loss()(ctx)


# ---------------------------------------------------------------- the JAX reference

# module-level references, for hookcheck's --reference module:attr
DPO_REF = jax_preference.preference_loss(B.PREFERENCE_DPO_CONFIG)
SIMPO_REF = jax_preference.preference_loss(B.PREFERENCE_SIMPO_CONFIG)


def _synthetic(kind: str, cfg: PreferenceConfig) -> OutputContext:
    """A synthetic case of four rows, two interleaved pairs, reference sums near -3.5
    per counted token (none for SimPO)."""
    ctx = synthetic_context(kind, batch=4)
    refs = {}
    if cfg.needs_reference:
        g = torch.Generator().manual_seed(12)
        refs = {
            k: -28.0 + 2.0 * torch.randn(2, generator=g) for k in ("ref_chosen", "ref_rejected")
        }
    return ctx.replace(context=PreferenceBatch(**refs))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_jax_reference_equals_ours(name: str) -> None:
    cfg = CONFIGS[name]
    with jax_ref.float64():
        report = cross_check(
            preference_loss(cfg, tile_rows=5, tile_cols=16),
            jax_preference.preference_loss(cfg),
            _synthetic("random", cfg),
        )
    assert report.passed, str(report)


def test_the_jax_reference_catches_a_wrong_normalisation() -> None:
    """IPO on sums held to IPO's reference on means: the loss fails, value and VJPs."""
    cfg = CONFIGS["ipo"]
    with jax_ref.float64():
        report = cross_check(
            preference_loss(dataclasses.replace(cfg, length_normalized=False)),
            jax_preference.preference_loss(cfg),
            _synthetic("random", cfg),
        )
    failed = {(r.output, r.quantity) for r in report.failures()}
    assert {("loss", "value"), ("loss", "d/d hidden"), ("loss", "d/d weight")} <= failed, failed


@pytest.mark.parametrize("method", jax_preference.METHODS)
def test_pair_losses_gradients_and_formulas(method: str) -> None:
    """``pair_losses``' gradients by finite differences, its values against the
    formulas of this module (torch, float64)."""
    cfg = {"dpo": CONFIGS["cdpo"], "ipo": CONFIGS["ipo"], "simpo": CONFIGS["simpo"]}[method]
    rng = torch.Generator().manual_seed(13)
    lp_c, lp_r, ref_c, ref_r = torch.randn(4, 5, generator=rng, dtype=torch.float64) * 2
    ref = cfg.needs_reference
    kw = {
        "method": method,
        "beta": cfg.beta,
        "label_smoothing": cfg.label_smoothing,
        "gamma": cfg.gamma,
    }
    with jax_ref.float64():
        args = [jnp.asarray(x.numpy()) for x in (lp_c, lp_r, ref_c, ref_r)]
        if not ref:
            args[2:] = [None, None]

        def loss(a: jax.Array, b: jax.Array) -> jax.Array:
            return jax_preference.pair_losses(a, b, *args[2:], **kw)["loss"].sum()

        check_grads(loss, tuple(args[:2]), order=2, modes=("rev",))
        got = jax_preference.pair_losses(*args, **kw)
        want = _pair_loss(cfg, lp_c, lp_r, ref_c if ref else 0.0, ref_r if ref else 0.0)
        for key, value in zip(("loss", "reward_chosen", "reward_rejected"), want):
            torch.testing.assert_close(
                torch.tensor(got[key].tolist(), dtype=torch.float64), value, **F64, msg=key
            )


@pytest.mark.release_independent  # hookcheck over the preference processors: torch and JAX alone
def test_hookcheck_builtin_checks_pass() -> None:
    """The two built-in checks, run as ``hookcheck`` runs them (the tiny GPT in fp32 and
    bf16, tied, and the awkward case, whose masked row leaves one pair)."""
    names = {c.name: c for c in BUILTIN_CHECKS}
    assert names["preference_loss(dpo, label smoothing)"].processor.endswith(":PREFERENCE_DPO")
    assert names["preference_loss(simpo)"].processor.endswith(":PREFERENCE_SIMPO")
    b, t = "jax_ref.check.builtin_processors", "tests.processors.test_preference_loss"
    out, err = io.StringIO(), io.StringIO()
    code = main(
        [
            "--dtype", "float32", "--dtype", "bfloat16", "--case", "awkward", "--quiet",
            "--processor", f"{b}:PREFERENCE_DPO", "--reference", f"{t}:DPO_REF",
            "--context", f"{b}:preference_context",
            "--processor", f"{b}:PREFERENCE_SIMPO", "--reference", f"{t}:SIMPO_REF",
            "--context", f"{b}:reference_free_context",
        ],
        out=out,
        err=err,
    )  # fmt: skip
    assert code == 0, out.getvalue() + err.getvalue()
    rows = re.findall(r"^(PREFERENCE_\w+)\s+(\S+)\s+(\w+)\s.*\s(ok.*)$", out.getvalue(), re.M)
    assert len(rows) == 2 * 4, out.getvalue()  # gpt fp32, bf16, gpt-tied fp32, awkward


# ---------------------------------------------------------------- tensor and context parallel

CP = 2
LENGTHS = (5, 3, 11, 8, 6, 2)  # padded to multiples of 2 * CP: 8, 4, 12, 8, 8, 4


def _thd() -> dict[str, Any]:
    """One packed row of six sequences (three interleaved pairs), each padded to a
    multiple of ``2 CP`` (padding: ignored labels), an ignored label inside one."""
    cu, cu_padded = padded_cu_seqlens(LENGTHS, 2 * CP)
    t = int(cu_padded[-1])
    p = _problem(1, t, seed=14)
    real = torch.zeros(t, dtype=torch.bool)
    for k, n in enumerate(LENGTHS):
        real[int(cu_padded[k]) : int(cu_padded[k]) + n] = True
    p["labels"][0, ~real] = IGNORE
    p["labels"][0, int(cu_padded[2]) + 4] = IGNORE
    p["mask"] = torch.ones(1, t, dtype=torch.float64)
    sequences = [[(0, j) for j in range(int(a), int(z))] for a, z in itertools.pairwise(cu_padded)]
    return p | {"cu": cu, "cu_padded": cu_padded, "sequences": sequences}


def _parallel_truths(p: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    truths = {}
    for name in ("cdpo", "ipo", "simpo"):
        cfg = CONFIGS[name]
        refs = {} if not cfg.needs_reference else _references(p, 3)
        p[f"batch-{name}"] = PreferenceBatch(mask=p["mask"], **refs)
        truths[name] = preference_truth(
            p["h"], p["w"], p["labels"], p[f"batch-{name}"], cfg, sequences=p["sequences"]
        )
    return truths


class _Model(torch.nn.Module):
    """What ``build_output_context`` reads off a model: its config and process groups."""

    def __init__(self, cp_group: Any, tp_group: Any) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(sequence_parallel=False)
        self.pg_collection = types.SimpleNamespace(tp=tp_group, cp=cp_group, pp=None)


def _group_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    y = x.detach().clone()
    torch.distributed.all_reduce(y, group=group)
    return y


def _tp2_cp2(rank: int, p: dict[str, Any], truths: dict[str, dict[str, torch.Tensor]]) -> None:
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    from torch_impl import build_output_context

    tp_group = parallel_state.get_tensor_model_parallel_group()
    cp_group = parallel_state.get_context_parallel_group()
    tp_rank, cp_rank = (torch.distributed.get_rank(g) for g in (tp_group, cp_group))
    half = V // 2
    shard = slice(tp_rank * half, (tp_rank + 1) * half)
    index = thd_partition_index(p["cu_padded"], CP, cp_rank)
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=p["cu"], cu_seqlens_kv=p["cu"],
        cu_seqlens_q_padded=p["cu_padded"], cu_seqlens_kv_padded=p["cu_padded"],
    )  # fmt: skip
    for name, truth in truths.items():
        batch = p[f"batch-{name}"]
        h = p["h"][index].clone().requires_grad_()
        w = p["w"][shard].clone().requires_grad_()
        local = dataclasses.replace(batch, mask=batch.mask[:, index])
        kwargs = {"hidden_states": h, "labels": p["labels"][:, index], "output_weight": w}
        ctx = build_output_context(
            _Model(cp_group, tp_group), kwargs | {"packed_seq_params": psp, "context": local}
        )
        assert (ctx.parallel.tp_size, ctx.parallel.cp_size) == (2, CP), ctx.parallel
        out = preference_loss(CONFIGS[name], tile_rows=5, tile_cols=9)(ctx)
        out["loss"].backward()
        msg = f"{name} (tp rank {tp_rank}, cp rank {cp_rank})"
        for key in ("loss", *METRICS):  # each rank's share, summed over the CP group
            got = _group_sum(out[key], cp_group)
            torch.testing.assert_close(got, truth[key], **F64, msg=f"{key}: {msg}")
        torch.testing.assert_close(h.grad, truth["dh"][index], **F64, msg=msg)
        torch.testing.assert_close(_group_sum(w.grad, cp_group), truth["dw"][shard], **F64, msg=msg)


@pytest.mark.slow
@pytest.mark.release_independent  # the processor's maths; Megatron's CP split: test_policy_cp
def test_tp2_cp2_packed_pairs_against_float64() -> None:
    """tp=2 x cp=2 over four gloo processes: the vocabulary split over tensor parallel,
    every packed sequence split over context parallel (a pair's sums made whole by one
    collective), three methods; each rank's shares sum to the whole batch's loss and
    metrics, its hidden-state gradient is the whole loss's at its tokens."""
    p = _thd()
    truths = _parallel_truths(p)
    del p["g"]  # a generator does not cross to the spawned ranks
    run_distributed(_tp2_cp2, p, truths, tp=2, cp=CP)
