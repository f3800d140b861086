"""``cross_entropy_loss(reduction="sum" | "mean")``: the reduced cross entropy through
``fused_token_loss``, against float64 materialised logits (values, hidden-state and
weight gradients), on both backends and in bf16/fp16/fp32/fp64; empty masks, ignored
labels, per-token temperature, logit scale, ``global_tokens``; through the hook on the
tiny GPT against Megatron's own loss, at tp=1 and tp=2 (gloo)."""

from __future__ import annotations

import math
import typing
from typing import Any

import pytest
import torch

import torch_impl
from hookspec import ContractError, OutputContext, VocabShard
from tests.support.backend_support import force_backend
from tests.support.distributed import run_distributed
from torch_impl.processors import cross_entropy_loss

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

B, S, H, V = 3, 7, 10, 53  # n = 21 tokens
IGNORE = -100
SCALE = 0.7  # the model's logit scale, x -> 0.7 x


def _problem(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, (B, S), generator=g)
    y[0, 2] = y[2, 5] = IGNORE
    y[1, 0], y[1, 1] = 0, V - 1
    mask = (torch.rand(B, S, generator=g) > 0.3).double()
    mask[0, 0] = 0.5  # a fractional weight
    mask[0, 2] = 1.0  # counted by the mask, but the label is ignored
    return {
        "h": torch.randn(S, B, H, generator=g, dtype=torch.float64),  # [s, b, h]
        "w": torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5,
        "y": y,
        "mask": mask,
        # per token, exact in fp32 (the context holds it in fp32)
        "t": (torch.rand(B, S, generator=g, dtype=torch.float64) + 0.5).float().double(),
    }


def _truth(
    p: dict[str, torch.Tensor],
    reduction: str,
    *,
    dtype: torch.dtype = torch.float64,
    count: float | None = None,
    scale: float = SCALE,
) -> dict[str, torch.Tensor]:
    """Float64 from materialised logits of the inputs rounded to ``dtype``."""
    h = p["h"].to(dtype).double().clone().requires_grad_()
    w = p["w"].to(dtype).double().clone().requires_grad_()
    z = torch.einsum("sbh,vh->bsv", h, w) * scale / p["t"][..., None]
    logp = z.log_softmax(-1)
    y = p["y"]
    lp = torch.where(y == IGNORE, 0.0, logp.gather(2, y.clamp(min=0)[..., None]).squeeze(-1))
    m = torch.where(y == IGNORE, 0.0, p["mask"])
    loss = -(m * lp).sum()
    if reduction == "mean":
        total = m.sum() if count is None else torch.tensor(count, dtype=torch.float64)
        loss = loss / (total if float(total) != 0 else 1.0)
    loss.backward()
    assert h.grad is not None and w.grad is not None
    return {"loss": loss.detach(), "dh": h.grad, "dw": w.grad, "tokens": m.sum()}


def _ctx(
    h: torch.Tensor, w: torch.Tensor, p: dict[str, torch.Tensor], context: Any = None, **kw: Any
) -> OutputContext:
    return OutputContext(
        hidden_states=h,
        labels=p["y"],
        vocab_weight=w,
        vocab=VocabShard(0, V, V),
        loss_mask=kw.pop("loss_mask", p["mask"].float()),
        context={"temperature": p["t"].float()} if context is None else context,
        scale_logits=lambda x: x * SCALE,
        **kw,
    )


@pytest.fixture(params=["torch", "triton"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    return force_backend(monkeypatch, request.param)


# (rtol, atol as a fraction of the largest |truth|): the logit gradient is rounded to
# the input dtype before the dh and dW GEMMs, an error relative to the largest entry
TOL = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (2e-5, 2e-6),
    torch.bfloat16: (2e-2, 1e-2),
    torch.float16: (4e-3, 2e-3),
}


def _run(
    p: dict[str, torch.Tensor], dtype: torch.dtype, reduction: Any, context: Any = None, **kw: Any
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    h = p["h"].to(dtype).clone().requires_grad_()
    w = p["w"].to(dtype).clone().requires_grad_()
    out = cross_entropy_loss(reduction=reduction, tile_rows=4)(_ctx(h, w, p, context, **kw))
    out["loss"].backward()
    assert h.grad is not None and w.grad is not None
    return out, h.grad, w.grad


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str
)
def test_values_and_gradients_against_float64(
    reduction: str, dtype: torch.dtype, backend: str
) -> None:
    """Ignored labels, a fractional and a partly empty mask, per-token temperature,
    logit scale, six tiles of 4 rows (the last one short)."""
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the Triton kernels take fp32/bf16/fp16")
    p = _problem()
    truth = _truth(p, reduction, dtype=dtype)
    out, dh, dw = _run(p, dtype, reduction)
    rtol, atol = TOL[dtype]
    assert set(out) == {"loss", "tokens"}
    assert out["loss"].dim() == 0 and out["tokens"].dim() == 0
    for got, want in ((out["loss"], truth["loss"]), (dh, truth["dh"]), (dw, truth["dw"])):
        scale = float(want.abs().max())
        torch.testing.assert_close(got.detach().double(), want, rtol=rtol, atol=atol * scale)
    assert float(out["tokens"]) == float(truth["tokens"])
    assert dh.dtype == dtype and dw.dtype == dtype


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_empty_mask_is_zero_with_zero_gradient(reduction: str, backend: str) -> None:
    """A mask summing to exactly 0 (all zeros, or nonzero only at ignored labels):
    loss 0 and zero gradients, never NaN."""
    p = _problem(1)
    for mask in (torch.zeros(B, S), (p["y"] == IGNORE).float()):
        out, dh, dw = _run(p, torch.float32, reduction, loss_mask=mask)
        assert float(out["loss"].detach()) == 0.0 and float(out["tokens"]) == 0.0
        assert torch.equal(dh, torch.zeros_like(dh)) and torch.equal(dw, torch.zeros_like(dw))


def test_global_tokens_replaces_the_count() -> None:
    p = _problem(2)
    truth = _truth(p, "mean", count=40.0)
    context = {"temperature": p["t"], "global_tokens": 40}
    out, dh, dw = _run(p, torch.float64, "mean", context)
    torch.testing.assert_close(out["loss"], truth["loss"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dh, truth["dh"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, truth["dw"], rtol=1e-12, atol=1e-12)
    assert float(out["tokens"]) == float(truth["tokens"])  # the local count, not global_tokens


def test_no_mask_and_scalar_temperature_option() -> None:
    """``loss_mask=None``: every token with a label counts; ``temperature=`` a number."""
    p = _problem(3)
    p2 = dict(
        p,
        mask=torch.ones(B, S, dtype=torch.float64),
        t=torch.full((B, S), 0.8, dtype=torch.float64),
    )
    truth = _truth(p2, "mean")
    h = p["h"].clone().requires_grad_()
    w = p["w"].clone().requires_grad_()
    out = cross_entropy_loss(reduction="mean", temperature=0.8)(_ctx(h, w, p, {}, loss_mask=None))
    out["loss"].backward()
    torch.testing.assert_close(out["loss"], truth["loss"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, truth["dh"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, truth["dw"], rtol=1e-12, atol=1e-12)
    assert float(out["tokens"]) == float((p["y"] != IGNORE).sum())


def test_unreduced_takes_the_temperature_option_and_still_refuses_the_contexts() -> None:
    p = _problem(4)
    h, w = p["h"], p["w"]
    z = torch.einsum("sbh,vh->bsv", h, w) * SCALE / 0.6
    y = p["y"]
    want = torch.where(
        y == IGNORE, 0.0, -z.log_softmax(-1).gather(2, y.clamp(min=0)[..., None]).squeeze(-1)
    )
    got = cross_entropy_loss(temperature=0.6)(_ctx(h, w, p, {}))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ContractError, match=r"^context\.temperature: expected none"):
        cross_entropy_loss()(_ctx(h, w, p))


def test_nan_in_hidden_states_at_an_uncounted_token_makes_the_loss_nan() -> None:
    p = _problem(5)
    h = p["h"].clone()
    h[2, 0] = float("nan")  # token (b=0, s=2): its label is ignored
    out = cross_entropy_loss(reduction="sum")(_ctx(h, p["w"], p))
    assert math.isnan(float(out["loss"]))


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"reduction": "avg"}, "reduction"),
        ({"reduction": None}, "reduction"),
        ({"reduction": 1}, "reduction"),
        ({"reduction": "mean", "tile_rows": 0}, "tile_rows"),
        ({"reduction": "mean", "tile_rows": 2**63}, "tile_rows"),
        ({"reduction": "mean", "temperature": float("nan")}, "temperature"),
    ],
)
def test_options_checked_where_they_enter(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ContractError, match=rf"^{field}: expected"):
        cross_entropy_loss(**kw)


@pytest.mark.parametrize(
    "count",
    [float("nan"), float("inf"), 0, -3.0, True, "40", 10**400, torch.tensor(40.0)],
    ids=repr,
)
def test_bad_global_tokens(count: Any) -> None:
    p = _problem(6)
    ctx = _ctx(p["h"], p["w"], p, {"global_tokens": count})
    with pytest.raises(
        ContractError, match=r"^context\.global_tokens: expected a finite number > 0"
    ):
        cross_entropy_loss(reduction="mean")(ctx)


def test_global_tokens_refused_with_sum_and_temperature_from_both_sources() -> None:
    p = _problem(7)
    with pytest.raises(
        ContractError, match=r"^context\.global_tokens: expected None with reduction='sum'"
    ):
        cross_entropy_loss(reduction="sum")(_ctx(p["h"], p["w"], p, {"global_tokens": 5}))
    with pytest.raises(ContractError, match=r"^temperature: expected one source"):
        cross_entropy_loss(reduction="sum", temperature=0.5)(_ctx(p["h"], p["w"], p))


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_bad_loss_mask_entry_raises(bad: float) -> None:
    p = _problem(8)
    mask = p["mask"].float().clone()
    mask[2, 6] = bad
    with pytest.raises(ContractError, match=r"^loss_mask: expected finite values >= 0"):
        cross_entropy_loss(reduction="mean")(_ctx(p["h"], p["w"], p, loss_mask=mask))


# ---------------------------------------------------------------- through the hook


def _model_check(reduction: Any, tied: bool) -> None:
    """The tiny GPT's reduced loss and every parameter gradient against Megatron's own
    per-token loss, masked and reduced here."""
    from torch_impl.testing.tiny import build_tiny_gpt, tiny_batch

    model = build_tiny_gpt(share_embeddings_and_output_weights=tied)
    batch = tiny_batch(2, 8, 64, seed=11)
    labels = typing.cast(torch.Tensor, batch["labels"])
    labels[0, 3] = IGNORE
    mask = torch.ones(2, 8)
    mask[1, 5:] = 0.0
    args = (batch["input_ids"], batch["position_ids"], None)
    stock = model(*args, labels=batch["labels"])
    m = torch.where(labels == IGNORE, 0.0, mask)
    want = (torch.where(m > 0, stock, 0.0) * m).sum()
    if reduction == "mean":
        want = want / m.sum()
    want.backward()
    expected = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
    model.zero_grad(set_to_none=True)
    torch_impl.enable_output_processor(model)
    out = model(
        *args,
        labels=batch["labels"],
        loss_mask=mask,
        output_processor=cross_entropy_loss(reduction=reduction, tile_rows=5),
    )
    out["loss"].backward()
    got = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
    torch.testing.assert_close(out["loss"], want.detach(), rtol=1e-6, atol=1e-6)
    assert float(out["tokens"]) == float(m.sum())
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.usefixtures("megatron_single")
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_hook_on_tiny_gpt_equals_megatron_loss(reduction: str) -> None:
    _model_check(reduction, tied=False)


def _tp2(rank: int) -> None:
    _model_check("mean", tied=False)
    _model_check("sum", tied=True)


def test_tp2_vocab_parallel_equals_megatron_loss() -> None:
    """tp=2 over gloo: each rank holds half the vocabulary; the loss and every
    parameter gradient equal Megatron's vocab-parallel cross entropy, reduced."""
    run_distributed(_tp2, tp=2)
