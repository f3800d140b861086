"""Silent wrong answers found by probing the 0.2.0 features, each pinned against an
independent computation: the softcap's precision at any cap on both backends (the
Triton kernels' tanh) and caps at the dtype's limits (no overflow into 0 * inf), against
float64 through materialised logits beside the naive path in the test dtype."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import hookspec.conventions as hookspec_conventions
from hookspec import ContractError, OutputContext, VocabShard, processor
from jax_ref.check.comparison import cross_check
from jax_ref.check.examples import logprobs_entropy_reference, vocab_parallel_logprobs
from tests.support.backend_support import close_to_float64, skip_fp64_triton, token_problem
from torch_impl.processors import (
    DenseTeacher,
    DistillConfig,
    LinearOptions,
    SamplingSupport,
    cross_entropy_loss,
    distillation_loss,
    fused_token_loss,
    linear_distillation_loss,
    linear_logprobs,
    linear_topk_logprobs,
    policy_loss,
    selected_logprobs,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

ROOT = Path(__file__).resolve().parents[2]
IGNORE = -100
N, H, V, K = 13, 6, 29, 4
SCALE = 0.7
FORMS = ("linear", "single pass", "two-pass", "top-k")


def _problem(seed: int = 0) -> dict[str, torch.Tensor]:
    # |u| up to ~20; one cotangent per output
    p = token_problem(seed, N, H, V, scale=3.0, coefficients=("c_lp", "c_ent", "c_lse", "c_m"))
    p["c_k"] = torch.randn(N, K, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return p


def _capped(u: torch.Tensor, cap: float | None, t: Any) -> torch.Tensor:
    """The convention, written independently: ``s * tanh(u * logit_scale / s) / T`` (``u *
    logit_scale / T`` without a cap)."""
    return u * SCALE / t if cap is None else cap * torch.tanh(u * (SCALE / cap)) / t


def _loss_terms(form: str, p: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> Any:
    """The scalar each form differentiates: the label's logprob always; the entropy in
    the linear, two-pass and top-k forms; lse**2 and the mean logit in the linear form;
    the top-k values in the top-k form."""
    loss = (p["c_lp"] * out["lp"]).sum()
    if form != "single pass":
        loss = loss + (p["c_ent"] * out["ent"]).sum()
    if form == "linear":
        loss = loss + (p["c_lse"] * out["lse"] ** 2 + p["c_m"] * out["mean"]).sum()
    if form == "top-k":
        loss = loss + (p["c_k"] * out["top"]).sum()
    return loss


def _materialised(
    p: dict[str, torch.Tensor],
    cap: float | None,
    dtype: torch.dtype,
    form: str,
    ids: Any = None,
    *,
    inputs: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Every output and ``dh``, ``dW`` by autograd through the ``[n, V]`` logits in
    ``dtype`` (float64: the truth; the test dtype: the naive path), of the inputs
    rounded to ``inputs``; the top-k values at ``ids``."""
    h, w = (p[k].to(inputs).to(dtype).clone().requires_grad_() for k in ("h", "w"))
    z = _capped(h @ w.T, cap, p["t"].to(dtype)[:, None])
    logp = z.log_softmax(-1)
    y = p["y"]
    out = {
        "lp": torch.where(y == IGNORE, 0.0, logp.gather(1, y.clamp(min=0)[:, None]).squeeze(1)),
        "ent": -(logp.exp() * logp).sum(-1),
        "lse": torch.logsumexp(z, -1),
        "mean": z.mean(-1),
    }
    if ids is not None:
        out["top"] = logp.gather(1, ids)
    _loss_terms(form, p, out).backward()
    return {k: v.detach() for k, v in out.items()} | {"dh": h.grad, "dw": w.grad}


def _ours(p: dict[str, torch.Tensor], cap: float, dtype: torch.dtype, form: str) -> dict[str, Any]:
    h, w = (p[k].to(dtype).clone().requires_grad_() for k in ("h", "w"))
    opts = LinearOptions(
        temperature=p["t"].to(dtype), logit_scale=SCALE, softcap=cap, tile_rows=4, tile_cols=8
    )
    out: dict[str, Any] = {}
    if form == "linear":
        r = linear_logprobs(h, w, p["y"], with_entropy=True, with_mean_logit=True, options=opts)
        out = {"lp": r.logprobs, "ent": r.entropy, "lse": r.lse, "mean": r.mean_logit}
        _loss_terms(form, p, out).backward()
    elif form == "top-k":
        r = linear_topk_logprobs(h, w, k=K, labels=p["y"], options=opts, with_entropy=True)
        out = {"lp": r.label_logprobs, "ent": r.entropy, "top": r.logprobs, "ids": r.ids}
        _loss_terms(form, p, out).backward()
    else:
        two = form == "two-pass"

        def token_loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
            return _loss_terms(form, {k: v[rows] for k, v in p.items()}, {"lp": lp, "ent": ent})

        f = fused_token_loss(h, w, p["y"], token_loss, options=opts, entropy_grad=two)
        f.loss.backward()
        out = {"lp": f.logprobs, "ent": f.entropy, "lse": f.lse}
    return out | {"dh": h.grad, "dw": w.grad}


def _at_precision(
    got: torch.Tensor, naive: torch.Tensor, want: torch.Tensor, scale: float, what: str
) -> None:
    """fp32 ``got`` no worse than the naive fp32 path's error, twice over, plus eight
    ulp of ``scale``."""
    err = float((got.detach().double() - want).abs().max())
    naive_err = float((naive.double() - want).abs().max())
    slack = 8 * torch.finfo(torch.float32).eps * scale
    assert err <= 2 * naive_err + slack, f"{what}: error {err:.3g}, naive {naive_err:.3g}"


CAPS = (1e-3, 0.1, 1.0, 30.0, 1e3, 1e4, 1e6)


@pytest.mark.parametrize(
    ("form", "cap"),
    [("linear", cap) for cap in CAPS]
    + [(form, cap) for form in FORMS[1:] for cap in (1e-3, 1e4, 1e6)],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_softcap_at_the_dtypes_precision_at_any_cap(
    dtype: torch.dtype, form: str, cap: float, backend: str
) -> None:
    """Caps from 1e-3 to 1e6: each value and gradient as close to float64 as the naive
    path in fp32 (the kernels' tanh was ``2 / (1 + exp2(-2x)) - 1``, one fp32 epsilon
    absolute: ``s * 7e-8`` on a capped logit), and to 1e-12 in fp64."""
    skip_fp64_triton(backend, dtype)
    p = _problem(1)
    got = _ours(p, cap, dtype, form)
    ids = got.get("ids")
    truth = _materialised(p, cap, torch.float64, form, ids, inputs=dtype)
    naive = _materialised(p, cap, torch.float32, form, ids, inputs=dtype)
    # a gradient's rounding is that of the slope 1 - tanh**2 in [0, 1]: absolute, so its
    # scale is the uncapped gradient's (a cap of 1e-3 leaves gradients ~1e-7)
    slope_1 = _materialised(p, None, torch.float64, form, ids, inputs=dtype)
    for key, want in truth.items():
        if key not in got:
            continue
        scale = float(want.abs().max())
        if key in ("dh", "dw"):
            scale = max(scale, float(slope_1[key].abs().max()))
        if dtype == torch.float64:
            torch.testing.assert_close(
                got[key].detach(), want, rtol=1e-12, atol=1e-12 * scale, msg=key
            )
        else:
            _at_precision(got[key], naive[key], want, scale, f"{form} {key} at cap {cap:g}")


# ---------------------------------------------------------------- caps at the dtype's limits

F32 = torch.finfo(torch.float32)


@pytest.mark.parametrize(
    "cap",
    [F32.tiny, 1e-30, 1e30, 3.5e38, float(F32.max), 1e39, 1e300, 1e-300],
    ids=lambda c: f"{c:.3g}",
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_caps_at_the_dtypes_limits(dtype: torch.dtype, cap: float, backend: str) -> None:
    """Every finite ``s > 0`` works: a cap whose ``logit_scale / s`` or ``s / logit_scale``
    is past the dtype's range gave ``0 * inf``, NaN everywhere. A huge cap leaves the
    logits as they are, a tiny one makes them ~0 (uniform probabilities, zero slope):
    values and gradients against float64 of the capped logits, to 16 ulp of the same
    quantity's size without a cap (a cap only shrinks logits and slopes)."""
    skip_fp64_triton(backend, dtype)
    p = _problem(2)
    got = _ours(p, cap, dtype, "linear")
    truth = _materialised(p, cap, torch.float64, "linear", inputs=dtype)
    uncapped = _materialised(p, None, torch.float64, "linear", inputs=dtype)
    eps = torch.finfo(dtype).eps
    for key in ("lp", "ent", "lse", "mean", "dh", "dw"):
        g, want = got[key].detach().double(), truth[key]
        assert torch.isfinite(g).all(), key
        scale = max(float(want.abs().max()), float(uncapped[key].abs().max()))
        torch.testing.assert_close(g, want, rtol=0.0, atol=16 * eps * scale, msg=key)


@pytest.mark.parametrize("cap", [1e39, 3.5e38, 1e-300], ids=lambda c: f"{c:.3g}")
def test_a_dense_teachers_cap_at_the_limits(cap: float, backend: str) -> None:
    """``DenseTeacher(softcap=1e39)``: the teacher's own ``s_t / logit_scale`` overflowed fp32
    (NaN loss); now its logits are those of float64 at any cap."""
    p, t = _problem(3), 0.8
    g = torch.Generator().manual_seed(4)
    th, tw = torch.randn(N, 5, generator=g) * 2, torch.randn(V, 5, generator=g)
    h, w = p["h"].float().requires_grad_(), p["w"].float().requires_grad_()
    teacher = DenseTeacher(th, tw, logit_scale=1.3, softcap=cap)
    opts = LinearOptions(tile_rows=4)
    cfg = DistillConfig(temperature=t)
    r = linear_distillation_loss(h, w, p["y"], teacher, options=opts, config=cfg)
    r.loss.backward()
    zt = cap * torch.tanh(th.double() @ tw.double().T * (1.3 / cap)) / t
    h64, w64 = p["h"].float().double().requires_grad_(), p["w"].float().double().requires_grad_()
    log_p, log_q = zt.log_softmax(-1), (h64 @ w64.T / t).log_softmax(-1)
    m = (p["y"] != IGNORE).double()
    want = (m * (log_p.exp() * (log_p - log_q)).sum(-1)).sum() / m.sum()
    want.backward()
    assert math.isfinite(float(r.loss))
    close_to_float64(r.loss, want.detach(), torch.float32)
    assert h.grad is not None and h64.grad is not None
    close_to_float64(h.grad, h64.grad, torch.float32)


# ---------------------------------------------------------------- token_loss on the meta device


@pytest.mark.parametrize(
    "make",
    [
        lambda lp: torch.zeros((), device="meta"),  # a constant: was accepted, a meta result
        lambda lp: (-lp.sum()).to("meta"),  # was "Cannot copy out of meta tensor" in autograd
    ],
    ids=["constant", "moved"],
)
@pytest.mark.parametrize("field", ["token_loss", "lse_loss"])
def test_a_loss_on_another_device_is_refused_by_name(make: Any, field: str) -> None:
    p = _problem(5)
    h = p["h"].float().requires_grad_()

    def token_loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
        return make(lp) if field == "token_loss" else -lp.sum()

    def lse_loss(lse: torch.Tensor, rows: slice) -> torch.Tensor:
        return make(lse)

    with pytest.raises(ContractError) as info:
        fused_token_loss(
            h, p["w"].float(), p["y"], token_loss, lse_loss=lse_loss, entropy_grad=False
        )
    assert info.value.field == field
    assert "on the device of its arguments, cpu" in str(info.value.expected)
    assert "meta" in str(info.value.actual)


# ---------------------------------------------------------------- what an adopter met


def _context(hidden: torch.Tensor, labels: torch.Tensor, **kw: Any) -> OutputContext:
    g = torch.Generator().manual_seed(7)
    return OutputContext(
        hidden_states=hidden,
        labels=labels,
        vocab_weight=torch.randn(V, H, generator=g, dtype=hidden.dtype),
        vocab=VocabShard(0, V, V),
        **kw,
    )


def test_batch_first_hidden_states_are_named_with_the_layout() -> None:
    """``[b, s, h]`` hidden states were refused as "labels: expected shape [b=8, s=2], got
    [2, 8]": now as ``hidden_states``, with the layout they need and the one they have."""
    b, s = 8, 2
    labels = torch.zeros(b, s, dtype=torch.long)
    with pytest.raises(ContractError) as info:
        selected_logprobs()(_context(torch.randn(b, s, H, dtype=torch.float64), labels))
    assert info.value.field == "hidden_states"
    assert str(info.value.expected).startswith("the sequence-first layout [s, b, h] (Megatron's)")
    assert f"[s={s}, b={b}, h={H}] for labels [b={b}, s={s}]" in str(info.value.expected)
    assert info.value.actual == f"[{b}, {s}, {H}], batch-first [b, s, h]"
    assert "transpose(0, 1)" in info.value.hint
    # sequence-first runs; a shape that is neither is still the labels' error
    selected_logprobs()(_context(torch.randn(s, b, H, dtype=torch.float64), labels))
    with pytest.raises(ContractError) as info:
        selected_logprobs()(_context(torch.randn(s, b + 1, H, dtype=torch.float64), labels))
    assert info.value.field == "labels"


def test_labels_padded_with_another_value_say_where_the_ignore_index_is_set() -> None:
    """Labels padded with -1 against the default ignore index -100: the error names where
    a context's ignore index is set, and a tensor function's (``LinearOptions``)."""
    labels = torch.zeros(2, 3, dtype=torch.long)
    labels[1, 2] = -1
    with pytest.raises(ContractError) as info:
        selected_logprobs()(_context(torch.randn(3, 2, H, dtype=torch.float64), labels))
    assert info.value.field == "labels"
    assert "enable_output_processor(model, ignore_index=)" in str(info.value.expected)
    assert "OutputContext(ignore_index=)" in str(info.value.expected)
    with pytest.raises(ContractError) as info:
        linear_logprobs(torch.randn(6, H), torch.randn(V, H), labels.reshape(-1))
    assert "LinearOptions(ignore_index=)" in str(info.value.expected)
    ok = _context(torch.randn(3, 2, H, dtype=torch.float64), labels, ignore_index=-1)
    assert selected_logprobs()(ok)["logprobs"][1, 2] == 0.0  # set there, it is honoured


def test_the_user_context_reading_is_as_documented() -> None:
    """docs/processors.md: a single field (the temperature) is read from a mapping by key;
    ``policy_loss`` and ``distillation_loss`` refuse a mapping by name (the sentence once
    said every processor reads a mapping)."""
    ctx = _context(torch.randn(3, 2, H, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.long))
    t = selected_logprobs()(dataclasses.replace(ctx, context={"temperature": 2.0}))
    want = selected_logprobs(temperature=2.0)(ctx)
    torch.testing.assert_close(t["logprobs"], want["logprobs"])
    for make in (policy_loss, distillation_loss):
        with pytest.raises(ContractError) as info:
            make()(dataclasses.replace(ctx, context={"temperature": 2.0}))
        assert info.value.field == "context"
    doc = " ".join((ROOT / "docs" / "processors.md").read_text().split())
    assert "read one way by every processor: a mapping by key" not in doc
    assert "`policy_loss` and `distillation_loss` read the whole user context" in doc


@processor
def one_token_wrong(ctx: OutputContext) -> dict[str, torch.Tensor]:
    """Wrong on purpose at one token, (b=1, s=2): its entropy doubled."""
    out = vocab_parallel_logprobs(ctx)
    ent = out["entropy"]
    at = torch.zeros_like(ent)
    at[1, 2] = 1.0
    return {"logprobs": out["logprobs"], "entropy": ent * (1.0 + at)}


@pytest.mark.release_independent  # the report's wording: no release enters it
def test_hookcheck_fail_lines_name_the_failing_tokens() -> None:
    """A FAIL line names the first failing ``(b, s)`` (the weight gradient's rows ``v``),
    ours and the reference's values there: one wrong token is found at its place, in the
    value and in ``d/d hidden`` (``[s, b, h]``, named as the labels)."""
    g = torch.Generator().manual_seed(6)
    labels = torch.randint(0, V, (2, 5), generator=g)
    ctx = _context(torch.randn(5, 2, H, generator=g), labels)
    report = cross_check(one_token_wrong, logprobs_entropy_reference, ctx, case_name="tiny")
    fails = {(r.output, r.quantity): r.fail_line() for r in report.failures()}
    assert set(fails) == {("entropy", q) for q in ("value", "d/d hidden", "d/d weight")}
    for quantity in ("value", "d/d hidden"):
        line = fails["entropy", quantity]
        assert line.startswith(f"FAIL one_token_wrong: entropy {quantity} [tiny, float32]: ")
        where = line.split("; first failing: ")[1]
        assert where.startswith("(b=1, s=2) ours ") and ";" not in where, line
    found = re.findall(r"ours (\S+) reference (\S+)", fails["entropy", "value"])
    ours, ref = (float(x) for x in found[0])
    assert ours == pytest.approx(2 * ref, rel=1e-5)
    assert re.search(r"first failing: v=0 ours \S+ reference \S+", fails["entropy", "d/d weight"])


# ---------------------------------------------------------------- losses that are not sums


def test_check_token_sums_names_a_loss_that_is_not_a_sum() -> None:
    """``-lp.mean()`` is a mean per span of rows (the fused loss sums the spans): with
    ``check_token_sums=True`` it is refused by name with both values; a sum passes, and
    so does the same loss's gradient without the check."""
    p = _problem(7)
    h, w = p["h"].float(), p["w"].float()
    opts = LinearOptions(tile_rows=4)

    def run(token_loss: Any, **kw: Any) -> Any:
        return fused_token_loss(
            h.clone().requires_grad_(), w, p["y"], token_loss, options=opts, **kw
        )

    with pytest.raises(ContractError) as info:
        run(lambda lp, ent, rows: -lp.mean(), check_token_sums=True)  # once a tile: 4 spans
    assert info.value.field == "token_loss"
    assert "a sum of per-token terms" in str(info.value.expected)
    whole = -float(run(lambda lp, ent, rows: -lp.sum()).logprobs.mean())
    assert f"{whole:.6g} on all {N} rows" in str(info.value.actual)
    with pytest.raises(ContractError) as info:
        run(
            lambda lp, ent, rows: -lp.sum(),
            lse_loss=lambda lse, rows: lse.mean(),
            check_token_sums=True,
        )
    assert info.value.field == "lse_loss"
    r = run(lambda lp, ent, rows: -lp.sum() + ent.sum(), check_token_sums=True)
    torch.testing.assert_close(r.loss, (r.entropy - r.logprobs).sum())


def test_with_a_mean_logit_loss_the_token_loss_is_called_once_a_tile() -> None:
    """docs/processors.md: ``entropy_grad=False`` calls ``token_loss`` once per gradient
    buffer, except with a ``mean_logit_loss`` (two passes a tile): once a tile."""
    p = _problem(8)
    h, w = p["h"].float().requires_grad_(), p["w"].float()
    for mean, want in ((None, 1), (lambda m, rows: m.sum(), math.ceil(N / 4))):
        spans: list[slice] = []

        def token_loss(
            lp: torch.Tensor, ent: torch.Tensor, rows: slice, spans: list[slice] = spans
        ) -> torch.Tensor:
            spans.append(rows)
            return -lp.sum()

        fused_token_loss(
            h, w, p["y"], token_loss, options=LinearOptions(tile_rows=4), entropy_grad=False,
            mean_logit_loss=mean,
        )  # fmt: skip
        assert len(spans) == want, spans
    doc = " ".join((ROOT / "docs" / "processors.md").read_text().split())
    assert "except with a `mean_logit_loss`, which takes two passes a tile and calls it" in doc


# ---------------------------------------------------------------- inputs changed before backward


def test_mean_logit_weights_changed_before_backward_raise() -> None:
    """float64 contiguous ``mean_logit_weights`` were aliased by the prologue: changed in
    place after the call, the backward used the new values (``dh`` 0). Now it raises as
    autograd does for a saved tensor, naming them; a clone, or a change after backward,
    is fine."""
    g = torch.Generator().manual_seed(9)
    h = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    w, c = torch.randn(V, H, generator=g, dtype=torch.float64), torch.rand(V, generator=g).double()
    y = torch.randint(0, V, (N,), generator=g)
    r = linear_logprobs(h, w, y, with_mean_logit=True, mean_logit_weights=c)
    c.mul_(0)
    with pytest.raises(RuntimeError, match=r"^linear_logprobs: mean_logit_weights, which the "):
        r.mean_logit.sum().backward()
    c2 = torch.rand(V, generator=g)  # float32: converted, so the call reads a copy
    kept = c2.double()
    r = linear_logprobs(h, w, y, with_mean_logit=True, mean_logit_weights=c2)
    c2.mul_(0)
    r.mean_logit.sum().backward()
    # d sum(mean_logit) / dh = sum_j c_j w_j / V per row: of the weights the call read
    want = ((kept @ w) / V).expand(N, H)
    assert h.grad is not None
    torch.testing.assert_close(h.grad, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("changed", ["temperature", "labels", "kept_ids", "class_weights"])
def test_other_inputs_changed_before_backward_change_nothing(changed: str) -> None:
    """The sweep of what the backward reads: a per-token temperature (read as ``1 / T``,
    a new tensor), the labels (their shard columns, new), the kept ids of a sampling
    support (their columns, new) and the class weights (read in the forward pass): each
    changed in place after the call leaves the gradient the unchanged call's, bitwise."""
    g = torch.Generator().manual_seed(10)
    h0, w = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    y0, t0 = torch.randint(0, V, (N,), generator=g), torch.rand(N, generator=g) + 0.5
    ids0 = torch.randint(0, V, (N, 5), generator=g)
    ids0[:, 0] = y0
    cw0 = torch.rand(V, generator=g)

    def grad(mutate: bool) -> torch.Tensor:
        h, y, t, ids, cw = (x.clone() for x in (h0, y0, t0, ids0, cw0))
        h.requires_grad_()
        if changed == "class_weights":
            ctx = OutputContext(
                hidden_states=h.view(N, 1, H), labels=y.view(1, N), vocab_weight=w,
                vocab=VocabShard(0, V, V),
            )  # fmt: skip
            loss = cross_entropy_loss(reduction="sum", class_weights=cw, label_smoothing=0.1)(ctx)[
                "loss"
            ]
        else:
            opts = LinearOptions(temperature=t)
            support = SamplingSupport(kept_ids=ids) if changed == "kept_ids" else None
            loss = linear_logprobs(h, w, y, options=opts, support=support).logprobs.sum()
        if mutate:
            {"temperature": t, "labels": y, "kept_ids": ids, "class_weights": cw}[changed].zero_()
        loss.backward()
        assert h.grad is not None
        return h.grad

    assert torch.equal(grad(True), grad(False))


# ---------------------------------------------------------------- a weighted mean of weight 0


@pytest.mark.parametrize("z_loss", [0.0, 0.1])
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_a_class_weighted_mean_of_weight_zero(
    z_loss: float, backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cross_entropy_loss(reduction="mean", label_smoothing=0.1, class_weights=cw)`` with
    every counted label of weight 0 (PyTorch: NaN): the cross-entropy term, smoothing
    included, is 0 with a zero gradient, the z-loss keeps its mean over the counted
    tokens (``hookspec.conventions``), against float64 materialised logits."""
    from tests.support.backend_support import force_backend

    force_backend(monkeypatch, backend_name)
    g = torch.Generator().manual_seed(11)
    b, s = 2, 4
    y = torch.randint(0, 3, (b, s), generator=g)
    y[0, 1] = IGNORE
    cw = torch.rand(V, generator=g, dtype=torch.float64) + 0.5
    cw[:3] = 0.0  # every label's class
    h = torch.randn(s, b, H, generator=g, dtype=torch.float64) * 2
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    dtype = torch.float64 if backend_name == "torch" else torch.float32
    hh = h.to(dtype).requires_grad_()
    ctx = OutputContext(
        hidden_states=hh, labels=y, vocab_weight=w.to(dtype), vocab=VocabShard(0, V, V)
    )
    out = cross_entropy_loss(
        reduction="mean", label_smoothing=0.1, class_weights=cw.to(dtype), z_loss=z_loss
    )(ctx)
    (got,) = torch.autograd.grad(out["loss"], hh)
    h64 = h.to(dtype).double().requires_grad_()
    lse = torch.logsumexp(torch.einsum("sbh,vh->bsv", h64, w.to(dtype).double()), -1)
    m = (y != IGNORE).double()
    want = z_loss * (m * lse**2).sum() / m.sum()  # the cross-entropy term: 0
    torch.testing.assert_close(out["loss"].double(), want.detach(), rtol=1e-5, atol=1e-6)
    if z_loss == 0.0:
        assert torch.equal(got, torch.zeros_like(got))
    else:
        (want_grad,) = torch.autograd.grad(want, h64)
        close_to_float64(got, want_grad, dtype)
    # the peer's 0 / 0: NaN, the case defined here
    z = torch.einsum("sbh,vh->bsv", h, w)
    peer = torch.nn.functional.cross_entropy(
        z.reshape(-1, V), y.reshape(-1), weight=cw, label_smoothing=0.1
    )
    assert torch.isnan(peer)
    doc = " ".join(hookspec_conventions.__doc__.split())
    assert "A weighted mean whose weight is 0 (``sum(M * cw[y]) == 0``" in doc
