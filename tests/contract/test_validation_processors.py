"""Bad input to the processors (issue 12): each class of input that used to give a
finite wrong answer or an unrelated exception.

1. A NaN is never read as "empty": a non-finite or negative mask entry, or a
   non-finite batch value at a counted token, raises ``ContractError`` (on a GPU
   from a deferred check); with ``check_values=False`` it makes the loss and
   every metric NaN. Non-finite counts raise.
2. Every numeric option is a finite number in its range, checked where it enters.
4. The user context is read by key (a mapping) as by attribute; a temperature the
   processor takes none of is refused.
5. A processor called directly (not through the hook) checks the shapes it reads.

The truth is written here with full float64 logits; nothing but the public names
of ``torch_impl.processors`` is imported.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
import torch

from hookspec import ContractError, OutputContext, VocabShard
from torch_impl.processors import (
    LinearOptions,
    PolicyBatch,
    PolicyLossConfig,
    aggregation_weights,
    cross_entropy_loss,
    distillation_loss,
    kl_penalty,
    linear_logprobs,
    policy_loss,
    selected_logprobs,
)

IGNORE = -100
S, B, H, V = 9, 3, 8, 50
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
NAN, INF = float("nan"), float("inf")


def _data(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.8
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, 2] = IGNORE
    mask = torch.ones(B, S, dtype=torch.float64)
    mask[1, 4] = 0.0
    lp = _truth_logprobs(h, w, labels, 1.0)
    batch = PolicyBatch(
        old_logprobs=lp + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64),
        advantages=torch.randn(B, S, generator=g, dtype=torch.float64),
        mask=mask,
        ref_logprobs=lp + 0.2 * torch.randn(B, S, generator=g, dtype=torch.float64),
    )
    return {"h": h, "w": w, "labels": labels, "batch": batch}


def _truth_logprobs(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, t: Any) -> torch.Tensor:
    z = torch.einsum("sbh,vh->bsv", h.double(), w.double())
    z = z / (t.double()[..., None] if isinstance(t, torch.Tensor) else t)
    lp = z.log_softmax(-1).gather(2, labels.clamp(min=0)[..., None]).squeeze(-1)
    return torch.where(labels == IGNORE, 0.0, lp)


def _ctx(
    h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, context: Any = None, **kw: Any
) -> OutputContext:
    return OutputContext(
        hidden_states=h,
        labels=labels,
        vocab_weight=w,
        vocab=VocabShard(0, V, V),
        context=context,
        **kw,
    )


# ---------------------------------------------------------------- 1. a NaN is never "empty"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "autograd"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("bad", [NAN, INF, -1.0], ids=["nan", "inf", "negative"])
@pytest.mark.parametrize("where", [(1, 5), (0, 2)], ids=["counted-token", "ignored-label"])
def test_bad_mask_entry_makes_loss_and_every_metric_nan(
    fused: bool, aggregation: str, bad: float, where: tuple[int, int]
) -> None:
    """One NaN, inf or negative mask entry, even at a token whose label is the
    ignore index: ``ContractError`` naming ``context.mask`` (it used to give a NaN
    loss, and before that take the empty-mask branch and give 0). Unchecked
    (``check_values=False``), the loss and every metric are NaN, and so is the
    gradient of that token's hidden state when it has one."""
    d = _data(seed=1)
    mask = d["batch"].mask.clone()
    mask[where] = bad
    batch = dataclasses.replace(d["batch"], mask=mask)
    h = d["h"].clone().requires_grad_()
    cfg = PolicyLossConfig(aggregation=aggregation, fused=fused, kl_coef=0.1, dual_clip=3.0)
    with pytest.raises(
        ContractError,
        match=rf"^context\.mask: expected finite values >= 0, got 1 values outside it, "
        rf"in \[{bad}, ",
    ):
        policy_loss(cfg)(_ctx(h, d["w"], d["labels"], batch))
    out = policy_loss(cfg)(_ctx(h, d["w"], d["labels"], batch, check_values=False))
    out["loss"].backward()
    assert set(out) >= {
        "loss",
        "pg_loss",
        "kl",
        "entropy",
        "clip_fraction",
        "approx_kl",
        "dual_clip_fraction",
    }
    for key, value in out.items():
        assert bool(torch.isnan(value)), key
    if where == (1, 5):  # a counted token has a gradient, now NaN (an ignored label has none)
        assert bool(torch.isnan(h.grad[5, 1]).all())


def test_bad_entry_in_the_models_loss_mask_gives_nan_too() -> None:
    d = _data(seed=2)
    loss_mask = torch.ones(B, S)
    loss_mask[2, 3] = NAN
    batch = dataclasses.replace(d["batch"], mask=None)
    with pytest.raises(
        ContractError, match=r"^loss_mask: expected finite values >= 0, got 1 values"
    ):
        policy_loss(PolicyLossConfig.gspo())(
            _ctx(d["h"], d["w"], d["labels"], batch, loss_mask=loss_mask)
        )
    out = policy_loss(PolicyLossConfig.gspo())(
        _ctx(d["h"], d["w"], d["labels"], batch, loss_mask=loss_mask, check_values=False)
    )
    assert all(bool(torch.isnan(v)) for v in out.values())


def test_exactly_zero_mask_is_still_zero_with_zero_gradient() -> None:
    """The empty-mask rule holds for a sum of exactly 0, also with a NaN
    advantage or old logprob at the (masked-out) tokens."""
    d = _data(seed=3)
    adv = d["batch"].advantages.clone()
    adv[0, 0] = NAN
    batch = dataclasses.replace(d["batch"], mask=torch.zeros(B, S), advantages=adv)
    for agg in AGGREGATIONS:
        h = d["h"].clone().requires_grad_()
        out = policy_loss(PolicyLossConfig(aggregation=agg, kl_coef=0.1))(
            _ctx(h, d["w"], d["labels"], batch)
        )
        out["loss"].backward()
        assert float(out["loss"].detach()) == 0.0
        assert torch.equal(h.grad, torch.zeros_like(h))


@pytest.mark.parametrize("field", ["global_tokens", "global_sequences"])
@pytest.mark.parametrize("value", [NAN, INF, -INF, 0, -2.0, True, "3", torch.tensor(3.0)], ids=repr)
def test_non_finite_or_non_positive_global_count_raises(field: str, value: Any) -> None:
    d = _data()
    batch = dataclasses.replace(d["batch"], **{field: value})
    with pytest.raises(
        ContractError, match=rf"^context\.{field}: expected a finite number > 0"
    ) as err:
        policy_loss()(_ctx(d["h"], d["w"], d["labels"], batch))
    assert err.value.field == f"context.{field}"


def test_global_counts_of_other_number_types_are_taken() -> None:
    import numpy as np

    d = _data()
    tokens = float((d["batch"].mask * (d["labels"] != IGNORE)).sum())
    want = policy_loss()(_ctx(d["h"], d["w"], d["labels"], d["batch"]))["loss"]
    for value in (tokens, np.float64(tokens), int(tokens)):
        batch = dataclasses.replace(d["batch"], global_tokens=value)
        got = policy_loss()(_ctx(d["h"], d["w"], d["labels"], batch))["loss"]
        assert torch.equal(got, want), type(value)


@pytest.mark.parametrize(
    ("aggregation", "field"),
    [
        ("token-mean", "global_sequences"),
        ("seq-mean-token-sum", "global_tokens"),
        ("seq-mean-token-mean", "global_tokens"),
    ],
)
def test_a_count_the_aggregation_never_reads_is_refused(aggregation: str, field: str) -> None:
    """Given, it would be ignored: GRPO's seq-mean-token-mean with global_tokens used to
    give the local mean silently."""
    d = _data()
    batch = dataclasses.replace(d["batch"], **{field: 12.0})
    with pytest.raises(
        ContractError, match=rf"^context\.{field}: expected None with aggregation"
    ) as err:
        policy_loss(PolicyLossConfig(aggregation=aggregation))(
            _ctx(d["h"], d["w"], d["labels"], batch)
        )
    assert err.value.actual == "12.0"
    segments = torch.arange(2)[:, None].expand(2, 3)
    with pytest.raises(ContractError, match=rf"^{field}: expected None with aggregation"):
        aggregation_weights(torch.ones(2, 3), segments, 2, aggregation, **{field: 12.0})


def test_aggregation_weights_bad_mask_raises_and_counts_are_checked() -> None:
    segments = torch.arange(2)[:, None].expand(2, 3)
    for bad in (NAN, INF, -1.0):
        mask = torch.tensor([[1.0, bad, 0.0], [1.0, 1.0, 0.0]])
        for how in AGGREGATIONS:
            with pytest.raises(
                ContractError, match=r"^mask: expected finite values >= 0, got 1 values"
            ):
                aggregation_weights(mask, segments, 2, how)
    w = aggregation_weights(torch.zeros(2, 3), segments, 2, "token-mean")
    assert torch.equal(w, torch.zeros(2, 3))
    for field in ("global_tokens", "global_sequences"):
        for value in (NAN, INF, 0.0):
            with pytest.raises(ContractError, match=rf"^{field}: expected a finite number > 0"):
                aggregation_weights(torch.ones(2, 3), segments, 2, "token-mean", **{field: value})
    with pytest.raises(ContractError, match=r"^aggregation: expected one of"):
        aggregation_weights(torch.ones(2, 3), segments, 2, "mean")  # type: ignore[arg-type]


# ---------------------------------------------------------- 2. every option checked where it enters


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"clip_low": 1.5}, "clip_low"),
        ({"clip_low": INF}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"clip_high": INF}, "clip_high"),
        ({"dual_clip": INF}, "dual_clip"),
        ({"dual_clip": NAN}, "dual_clip"),
        ({"kl_coef": -0.1}, "kl_coef"),
        ({"kl_coef": NAN}, "kl_coef"),
        ({"kl_coef": True}, "kl_coef"),
        ({"entropy_coef": -INF}, "entropy_coef"),
        ({"entropy_coef": "0.1"}, "entropy_coef"),
        ({"log_ratio_clamp": NAN}, "log_ratio_clamp"),
        ({"log_ratio_clamp": INF}, "log_ratio_clamp"),
        ({"log_ratio_clamp": -1.0}, "log_ratio_clamp"),
        ({"fused": "no"}, "fused"),
        ({"fused": 0}, "fused"),
    ],
    ids=repr,
)
def test_every_config_number_is_finite_and_in_range(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ContractError, match=rf"^{field}: expected ") as err:
        PolicyLossConfig(**kwargs)
    assert err.value.field == field and err.value.actual == repr(next(iter(kwargs.values())))


def test_config_takes_numpy_numbers_as_floats() -> None:
    import numpy as np

    cfg = PolicyLossConfig(
        clip_low=np.float64(0.1), kl_coef=np.float32(0.5), entropy_coef=np.int64(0)
    )
    assert (cfg.clip_low, cfg.kl_coef, cfg.entropy_coef) == (0.1, 0.5, 0.0)
    assert all(type(x) is float for x in (cfg.clip_low, cfg.kl_coef, cfg.entropy_coef))


def test_temperature_takes_numpy_numbers_like_the_config() -> None:
    import numpy as np

    d = _data()
    h, w, y = d["h"].reshape(-1, H), d["w"], d["labels"].T.reshape(-1)
    want = linear_logprobs(h, w, y, options=LinearOptions(temperature=0.5)).logprobs
    for t in (np.float32(0.5), np.float64(0.5)):
        assert torch.equal(
            linear_logprobs(h, w, y, options=LinearOptions(temperature=t)).logprobs, want
        )
        selected_logprobs(temperature=t)  # accepted where the factory checks it
    with pytest.raises(ContractError, match=r"^temperature: expected a finite number > 0"):
        linear_logprobs(h, w, y, options=LinearOptions(temperature=np.float32("nan")))


@pytest.mark.parametrize("collectives", [object(), "tp", 2])
def test_collectives_that_are_not_collectives_are_named(collectives: Any) -> None:
    d = _data()
    with pytest.raises(
        ContractError, match=r"^collectives: expected None or a hookspec.Collectives"
    ) as err:
        linear_logprobs(
            d["h"].reshape(-1, H),
            d["w"],
            d["labels"].T.reshape(-1),
            options=LinearOptions(collectives=collectives),
        )
    assert err.value.actual == type(collectives).__name__


@pytest.mark.parametrize(
    ("factory", "kwargs", "field"),
    [
        (selected_logprobs, {"tile_cols": 0}, "tile_cols"),
        (selected_logprobs, {"tile_cols": 2.5}, "tile_cols"),
        (selected_logprobs, {"tile_rows": -1}, "tile_rows"),
        (selected_logprobs, {"tile_rows": True}, "tile_rows"),
        (selected_logprobs, {"entropy": "yes"}, "entropy"),
        (selected_logprobs, {"temperature": NAN}, "temperature"),
        (selected_logprobs, {"temperature": INF}, "temperature"),
        (cross_entropy_loss, {"tile_cols": 0}, "tile_cols"),
        (cross_entropy_loss, {"tile_rows": INF}, "tile_rows"),
        (policy_loss, {"tile_cols": -4}, "tile_cols"),
        (policy_loss, {"tile_rows": 0}, "tile_rows"),
        (policy_loss, {"tile_rows": NAN}, "tile_rows"),
        (distillation_loss, {"tile_rows": 1.5}, "tile_rows"),
    ],
    ids=lambda v: (
        getattr(v, "__name__", None) or repr(v)
    ),  # no address: the same ids in every process
)
def test_processor_options_are_checked_when_the_processor_is_made(
    factory: Any, kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(ContractError, match=rf"^{field}: expected "):
        factory(**kwargs)


def test_kl_penalty_checks_its_estimator_and_clamp() -> None:
    x = torch.zeros(3)
    with pytest.raises(ContractError, match=r"^estimator: expected one of"):
        kl_penalty(x, x, "k4", clamp=20.0)  # type: ignore[arg-type]
    for clamp in (NAN, INF, 0.0, -1.0):
        with pytest.raises(ContractError, match=r"^clamp: expected a finite number > 0"):
            kl_penalty(x, x, "k3", clamp=clamp)  # type: ignore[arg-type]
    assert torch.equal(
        kl_penalty(x, x + 1, "k1", clamp=None),  # type: ignore[arg-type]
        torch.full((3,), -1.0),
    )


@pytest.mark.parametrize("mult", [INF, NAN, 0.0, -1.0])
def test_mup_output_multiplier_read_from_the_config_is_checked(mult: float) -> None:
    d = _data()
    config = types.SimpleNamespace(use_mup=True, mup_output_mult=mult)
    with pytest.raises(
        ContractError, match=r"^config\.mup_output_mult: expected a finite number > 0"
    ):
        selected_logprobs()(_ctx(d["h"], d["w"], d["labels"], config=config))


@pytest.mark.parametrize("value", ["foo", None, 1.5, True])
def test_ignore_index_of_a_hand_built_context_is_checked(value: Any) -> None:
    d = _data()
    with pytest.raises(ContractError, match=r"^ignore_index: expected an int"):
        selected_logprobs()(_ctx(d["h"], d["w"], d["labels"], ignore_index=value))


# ---------------------------------------------------------- 4. the user context by key or attribute


@dataclasses.dataclass(frozen=True)
class _Sampling:
    temperature: Any


@pytest.mark.parametrize("kind", ["number", "per-token"])
def test_temperature_from_a_mapping_context_is_used(kind: str) -> None:
    d = _data(seed=4)
    t: Any = 0.5 if kind == "number" else torch.rand(B, S, dtype=torch.float64) + 0.5
    truth = _truth_logprobs(d["h"], d["w"], d["labels"], t)
    by_key = selected_logprobs()(_ctx(d["h"], d["w"], d["labels"], {"temperature": t}))["logprobs"]
    by_attr = selected_logprobs()(_ctx(d["h"], d["w"], d["labels"], _Sampling(t)))["logprobs"]
    torch.testing.assert_close(by_key, truth, rtol=1e-12, atol=1e-12)
    assert torch.equal(by_key, by_attr)
    with pytest.raises(ContractError, match=r"^temperature: expected one source"):
        selected_logprobs(temperature=0.7)(_ctx(d["h"], d["w"], d["labels"], {"temperature": t}))
    with pytest.raises(ContractError, match=r"^context\.temperature: expected a finite number > 0"):
        selected_logprobs()(_ctx(d["h"], d["w"], d["labels"], {"temperature": NAN}))


def test_a_context_without_a_temperature_means_t_equal_1() -> None:
    d = _data(seed=5)
    want = selected_logprobs()(_ctx(d["h"], d["w"], d["labels"]))["logprobs"]
    for context in ({}, {"temperature": None}, {"other": 2.0}, _Sampling(None)):
        got = selected_logprobs()(_ctx(d["h"], d["w"], d["labels"], context))["logprobs"]
        assert torch.equal(got, want), context


@pytest.mark.parametrize("name", ["temperature", "global_tokens"])
@pytest.mark.parametrize("form", ["mapping", "PolicyBatch"])
def test_cross_entropy_refuses_a_context_temperature(name: str, form: str) -> None:
    """Megatron's per-token loss takes no temperature and divides by no count: a context
    that holds either is refused, not ignored (``global_tokens`` was ignored without a
    word while ``reduction="sum"`` refused it)."""
    d = _data()
    context: Any = {name: 0.5}
    if form == "PolicyBatch":
        context = dataclasses.replace(d["batch"], **{name: 0.5})
    with pytest.raises(
        ContractError, match=rf"^context\.{name}: expected none: cross_entropy_loss\(\)"
    ):
        cross_entropy_loss()(_ctx(d["h"], d["w"], d["labels"], context))
    cross_entropy_loss()(_ctx(d["h"], d["w"], d["labels"], {name: None}))
    with pytest.raises(ContractError, match=r"^context\.temperature"):
        cross_entropy_loss()(_ctx(d["h"], d["w"], d["labels"], _Sampling(0.5)))  # an attribute


def test_policy_batch_given_as_a_mapping_is_refused_with_the_fix() -> None:
    d = _data()
    as_dict = dataclasses.asdict(d["batch"])
    with pytest.raises(
        ContractError,
        match=r"^context: expected a torch_impl\.processors\.PolicyBatch.*PolicyBatch\(\*\*",
    ):
        policy_loss()(_ctx(d["h"], d["w"], d["labels"], as_dict))


# ------------------------------------------------------- 5. direct calls check the shapes they read


@pytest.mark.parametrize(
    "make", [selected_logprobs, cross_entropy_loss, policy_loss], ids=lambda f: f.__name__
)
def test_direct_call_with_hidden_states_in_batch_major_order_raises(make: Any) -> None:
    """``hidden_states`` ``[b, s, h]`` instead of ``[s, b, h]``: b*s rows either way,
    so only the shape check stops the tokens being paired with the wrong labels; it names
    the layout and the transpose that fixes it."""
    d = _data()
    hidden_bsh = d["h"].transpose(0, 1).contiguous()  # [b, s, h]
    expected = (
        r"^hidden_states: expected the sequence-first layout \[s, b, h\] \(Megatron's\): "
        r"\[s=9, b=3, h=8\] for labels \[b=3, s=9\], got \[3, 9, 8\], batch-first"
    )
    with pytest.raises(ContractError, match=expected):
        make()(_ctx(hidden_bsh, d["w"], d["labels"], d["batch"]))


def test_direct_call_with_a_weight_that_is_not_the_vocab_shard_raises() -> None:
    d = _data()
    with pytest.raises(
        ContractError, match=r"^vocab_weight: expected shape \[V_local=50, h=8\], got \[49, 8\]"
    ):
        selected_logprobs()(_ctx(d["h"], d["w"][:-1], d["labels"]))


def test_direct_call_with_a_broadcastable_loss_mask_raises() -> None:
    d = _data()
    batch = dataclasses.replace(d["batch"], mask=None)
    with pytest.raises(
        ContractError, match=r"^loss_mask: expected shape \[b=3, s=9\], got \[1, 9\]"
    ):
        policy_loss()(_ctx(d["h"], d["w"], d["labels"], batch, loss_mask=torch.ones(1, S)))


# ---------------------------------------------------------------- 8. one rule per kind of input


CLEAN_CONFIGS = {
    "fused": PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0),
    "autograd": PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0, fused=False),
    "gspo": PolicyLossConfig.gspo(kl_coef=0.1, clip_low=0.05),
}


def _run(
    cfg: PolicyLossConfig, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, batch: Any
) -> Any:
    h = h.clone().requires_grad_()
    w = w.clone().requires_grad_()
    out = policy_loss(cfg)(_ctx(h, w, labels, batch))
    out["loss"].backward()
    return out, h.grad, w.grad


@pytest.mark.parametrize("name", list(CLEAN_CONFIGS))
@pytest.mark.parametrize("field", ["old_logprobs", "advantages", "ref_logprobs"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_batch_values_at_uncounted_tokens_are_never_read(name: str, field: str, bad: float) -> None:
    """One rule for the batch's per-token values: at a token that does not count
    (mask 0, or an ignored label) a NaN or inf changes nothing, bitwise. (A NaN
    advantage there used to make the loss NaN while a NaN old or reference
    logprob was neutralised.)"""
    d = _data(seed=6)
    cfg = CLEAN_CONFIGS[name]
    want, want_dh, want_dw = _run(cfg, d["h"], d["w"], d["labels"], d["batch"])
    values = getattr(d["batch"], field).clone()
    values[1, 4] = bad  # mask 0 there
    values[0, 2] = bad  # an ignored label there
    batch = dataclasses.replace(d["batch"], **{field: values})
    got, dh, dw = _run(cfg, d["h"], d["w"], d["labels"], batch)
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert torch.equal(dh, want_dh) and torch.equal(dw, want_dw)


@pytest.mark.parametrize("name", list(CLEAN_CONFIGS))
def test_batch_value_nan_at_a_counted_token_raises(name: str) -> None:
    """At a counted token a NaN or inf raises, naming the field; unchecked
    (``check_values=False``) a NaN makes the loss NaN."""
    d = _data(seed=6)
    for field in ("old_logprobs", "advantages", "ref_logprobs"):
        for bad in (NAN, INF, -INF):
            values = getattr(d["batch"], field).clone()
            values[2, 6] = bad  # counted
            batch = dataclasses.replace(d["batch"], **{field: values})
            with pytest.raises(
                ContractError, match=rf"^context\.{field}: expected finite values where it is read"
            ):
                _run(CLEAN_CONFIGS[name], d["h"], d["w"], d["labels"], batch)
            out = policy_loss(CLEAN_CONFIGS[name])(
                _ctx(d["h"], d["w"], d["labels"], batch, check_values=False)
            )
            if bad != bad:  # NaN (an infinite old or ref logprob is clamped)
                assert bool(torch.isnan(out["loss"])), field


@pytest.mark.parametrize("name", list(CLEAN_CONFIGS))
def test_model_nan_at_an_uncounted_token_makes_the_loss_nan_not_the_metrics(name: str) -> None:
    """The model's outputs are read at every token: a NaN hidden state at a token
    that does not count makes the loss NaN (its weight gradient is NaN: the tile
    products reach every weight row), while the metrics, token means over the
    counted tokens, are unchanged bitwise. (The loss used to stay finite.)"""
    d = _data(seed=7)
    cfg = CLEAN_CONFIGS[name]
    want, _, _ = _run(cfg, d["h"], d["w"], d["labels"], d["batch"])
    h = d["h"].clone()
    h[4, 1, 0] = NAN  # token (b=1, s=4): mask 0
    got, _, dw = _run(cfg, h, d["w"], d["labels"], d["batch"])
    assert bool(torch.isnan(got["loss"]))
    assert not bool(torch.isfinite(dw).all())
    for key in set(want) - {"loss"}:
        assert torch.equal(got[key], want[key]), key


def test_inf_in_the_weight_is_as_documented() -> None:
    """``docs/processors.md``, bad values: an inf weight entry gives logits of
    +-inf in its vocabulary column. Where the logit is -inf (probability 0) the
    logprobs are exact: finite, or -inf at a label whose logit is -inf; where it
    is +inf they are NaN. The entropy is NaN at every token with an infinite
    logit, even where its true value is finite."""
    from torch_impl.processors import linear_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 4, dtype=torch.float64, generator=g)
    h[:, 0] = torch.tensor([-1.0, -0.5, 2.0, -1.0, 3.0])
    w = torch.randn(7, 4, dtype=torch.float64, generator=g)
    w[3, 0] = INF  # column 3: -inf at tokens 0, 1, 3; +inf at tokens 2, 4
    labels = torch.tensor([0, 1, 2, 3, 4])
    res = linear_logprobs(h, w, labels, with_entropy=True)
    keep = torch.tensor([0, 1, 2, 4, 5, 6])  # the vocabulary without column 3
    truth = (h @ w[keep].T).log_softmax(-1)
    torch.testing.assert_close(res.logprobs[:2], truth[[0, 1], [0, 1]], rtol=1e-12, atol=1e-12)
    assert float(res.logprobs[3]) == -INF
    assert bool(torch.isnan(res.logprobs[[2, 4]]).all())
    assert bool(torch.isnan(res.entropy).all())
    true_entropy = -(truth.exp() * truth).sum(-1)
    assert bool(torch.isfinite(true_entropy[[0, 1, 3]]).all())


@pytest.mark.parametrize(
    ("args", "field", "actual"),
    [
        ((torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.long), -1), "count", "-1"),
        ((torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.long), 2.5), "count", "2.5"),
        ((torch.ones(2, 3), torch.zeros(2, 3), 1), "segments", "torch.float32"),
        ((torch.ones(2, 3), torch.zeros(2, 2, dtype=torch.long), 1), "segments", "[2, 2]"),
        (
            (torch.ones(2, 3), torch.tensor([[0, 1, 5], [-1, 0, 0]]), 2),
            "segments",
            "2 values outside it, in [-1, 5]",
        ),
        (([[1.0]], torch.zeros(1, 1, dtype=torch.long), 1), "mask", "list"),
    ],
    ids=[
        "count-negative",
        "count-float",
        "segments-float",
        "segments-shape",
        "segments-range",
        "mask-list",
    ],
)
def test_aggregation_weights_checks_its_inputs(
    args: tuple[Any, ...], field: str, actual: str
) -> None:
    with pytest.raises(ContractError, match=rf"^{field}: expected ") as err:
        aggregation_weights(*args, "seq-mean-token-mean")
    assert actual in str(err.value.actual)


def test_kl_penalty_checks_its_tensors() -> None:
    with pytest.raises(ContractError, match=r"^ref: expected the shape of logp \[3\], got \[4\]"):
        kl_penalty(torch.zeros(3), torch.zeros(4), "k3", clamp=None)
    with pytest.raises(ContractError, match=r"^logp: expected a floating dtype, got int64"):
        kl_penalty(torch.zeros(3, dtype=torch.long), torch.zeros(3), "k3", clamp=None)
