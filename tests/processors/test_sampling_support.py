"""Sampling replay (``SamplingSupport``): both forms against float64 autograd through the
materialised logits, the kept set of the parametric form against vLLM's rule written out
on those logits (its ascending sort, cumulative mass ``<= 1 - p`` removed, a tie group
kept where any member is), on both backends, at tp=1 and tp=2; ties; a label outside
the support; the unrestricted support against ``linear_logprobs``; bf16 compute beside
the naive bf16 path; bad inputs; the processor; the JAX reference and the hookcheck check."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
import torch

from hookspec import ContractError, OutputContext, ParallelLayout, VocabShard
from tests.support.backend_support import skip_fp64_triton
from tests.support.distributed import run_distributed
from tests.support.host_reads_support import HostRead, HostReads
from torch_impl.processors import (
    LinearOptions,
    SamplingSupport,
    linear_logprobs,
    selected_logprobs,
)

pytestmark = pytest.mark.release_independent  # no Megatron release in the outcome

IGNORE = -100
N, H, V = 31, 6, 131
F64 = torch.float64


# ---------------------------------------------------------------- the truth


def vllm_rule(z: torch.Tensor, top_k: Any = None, top_p: Any = None, min_p: Any = None) -> Any:
    """The kept set ``[n, V]`` of vLLM's sampler on materialised tempered logits, its
    steps as vLLM writes them (min-p in probabilities; top-k by the k-th of an ascending
    sort; top-p by the ascending cumulative mass ``<= 1 - p``, the last position kept),
    then each tie group closed (kept where vLLM's stable sort keeps any member)."""
    n, v = z.shape
    keep = torch.ones_like(z, dtype=torch.bool)
    if min_p is not None:
        probs = torch.softmax(z, 1)
        floor = (
            probs.amax(1, keepdim=True) * torch.as_tensor(min_p, dtype=z.dtype).expand(n)[:, None]
        )
        keep &= ~(probs < floor)
    if top_k is not None:
        k = torch.as_tensor(top_k).expand(n).clamp(max=v)
        zk = torch.where(keep, z, -torch.inf)
        kth = zk.sort(dim=1).values.gather(1, (v - k)[:, None])
        keep &= ~(zk < kth)
    if top_p is not None:
        p = torch.as_tensor(top_p, dtype=z.dtype).expand(n)
        ascending = torch.where(keep, z, -torch.inf).sort(dim=1, stable=True).values
        removed = ascending.softmax(1).cumsum(1) <= 1 - p[:, None]
        removed[:, -1] = False
        first_kept = (~removed).to(torch.int8).argmax(1, keepdim=True)
        keep &= z >= ascending.gather(1, first_kept)
    return keep


def truth(p: dict[str, torch.Tensor], mask: torch.Tensor, dtype: Any = F64) -> dict[str, Any]:
    """Float64 autograd through the materialised logits of ``p`` (or of its inputs in
    ``dtype``: bf16, the naive path, fp32 maths on bf16 logits), renormalised over ``mask``;
    the gradient of ``sum(g_lp * logprobs (where finite) + g_h * entropy)``."""
    h = p["h"].to(dtype, copy=True).requires_grad_()
    w = p["w"].to(dtype, copy=True).requires_grad_()
    b = p["b"].clone().requires_grad_() if "b" in p else None
    z = h @ w.T if b is None else h @ w.T + b
    if "cap" in p:
        z = p["cap"] * torch.tanh(z / p["cap"])
    z = (z.float() if dtype == torch.bfloat16 else z) / p["t"].to(z.dtype)[:, None]
    zm = torch.where(mask, z, z.detach().min() - 1e4)  # exp(-1e4) = 0: outside the support
    lp_all = torch.log_softmax(zm, 1)
    y = p["y"]
    in_support = mask.gather(1, y.clamp(min=0)[:, None]).squeeze(1)
    lp = lp_all.gather(1, y.clamp(min=0)[:, None]).squeeze(1)
    lp = torch.where(y == IGNORE, 0.0, torch.where(in_support, lp, -torch.inf))
    ent = -(lp_all.exp() * lp_all).sum(1)
    ent = torch.where(mask.any(1), ent, 0.0)
    loss = (torch.where(torch.isfinite(lp), lp, 0.0) * p["g_lp"]).sum() + (ent * p["g_h"]).sum()
    dh, dw, *db = torch.autograd.grad(loss, (h, w) if b is None else (h, w, b))
    kept_lse = torch.logsumexp(torch.where(mask, z, -torch.inf), 1)
    return {"lp": lp.detach(), "ent": ent.detach(), "dh": dh, "dw": dw,
            "mass": (kept_lse - torch.logsumexp(z, 1)).detach(),
            **dict(zip(["db"], db))}  # fmt: skip


def ours(
    p: dict[str, torch.Tensor], support: SamplingSupport, dtype: Any = F64, **options: Any
) -> dict[str, Any]:
    """``linear_logprobs(support=)`` on ``p`` in ``dtype``, the same loss's gradient."""
    h = p["h"].to(dtype, copy=True).requires_grad_()
    w = p["w"].to(dtype, copy=True).requires_grad_()
    b = p["b"].to(dtype, copy=True).requires_grad_() if "b" in p else None
    t = p["t"].to(dtype if dtype == F64 else torch.float32)
    opts = LinearOptions(temperature=t, softcap=p.get("cap"), **options)
    r = linear_logprobs(h, w, p["y"], options=opts, with_entropy=True, support=support, bias=b)
    assert r.entropy is not None and r.kept_logmass is not None
    lp = r.logprobs
    loss = (torch.where(torch.isfinite(lp), lp, 0.0) * p["g_lp"]).sum() + (
        r.entropy * p["g_h"]
    ).sum()
    dh, dw, *db = torch.autograd.grad(loss, (h, w) if b is None else (h, w, b))
    return {"lp": lp.detach(), "ent": r.entropy.detach(), "dh": dh, "dw": dw,
            "mass": r.kept_logmass, **dict(zip(["db"], db))}  # fmt: skip


def problem(seed: int, *, ties: bool = False, n: int = N, v: int = V) -> dict[str, torch.Tensor]:
    """Float64 rows, a vocabulary, a per-token temperature and two cotangents; with
    ``ties`` small integers and T = 1 (every logit exact in any order: many ties)."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        h = torch.randint(-2, 3, (n, H), generator=g).double()
        w = torch.randint(-2, 3, (v, H), generator=g).double()
        t = torch.ones(n, dtype=F64)
    else:
        h = torch.randn(n, H, generator=g, dtype=F64) * 1.5
        w = torch.randn(v, H, generator=g, dtype=F64)
        t = (torch.rand(n, generator=g, dtype=F64) + 0.5).float().double()  # exact in fp32
    return {"h": h, "w": w, "t": t, "g_lp": torch.randn(n, generator=g, dtype=F64),
            "g_h": torch.randn(n, generator=g, dtype=F64)}  # fmt: skip


def with_labels(p: dict[str, torch.Tensor], mask: torch.Tensor, seed: int) -> dict[str, Any]:
    """Labels: sampled from the support at even rows, anywhere at odd rows (some outside
    it), row 3 ignored."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, mask.shape[1], (mask.shape[0],), generator=g)
    sampled = torch.multinomial(mask.double() + 1e-300, 1, generator=g).squeeze(1)
    y[::2] = sampled[::2]
    y[3] = IGNORE
    return {**p, "y": y}


def logits(p: dict[str, Any]) -> torch.Tensor:
    """The tempered logits ``[n, V]`` of ``p`` in float64 (its bias and softcap, where given)."""
    u = p["h"] @ p["w"].T + (p["b"] if "b" in p else 0.0)
    return (p["cap"] * torch.tanh(u / p["cap"]) if "cap" in p else u) / p["t"][:, None]


def assert_matches(got: dict[str, Any], want: dict[str, Any], tol: float) -> None:
    """Equal -inf patterns, then values and gradients within ``tol`` of the largest entry."""
    assert torch.equal(torch.isinf(got["lp"]), torch.isinf(want["lp"])), (got["lp"], want["lp"])
    finite = torch.isfinite(want["lp"])
    pairs = [("lp", finite), ("ent", None), ("dh", None), ("dw", None)]
    pairs += [("db", None)] if "db" in want else []
    for key, where in pairs:
        a, b = got[key].double(), want[key]
        a, b = (a[where], b[where]) if where is not None else (a, b)
        scale = max(float(b.abs().max()), 1.0)
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * scale, msg=key)


def kept_ids_of(mask: torch.Tensor, seed: int, pad: int = 3) -> torch.Tensor:
    """The ids of ``mask`` ``[n, K]`` in random order, padded with -1 (and ``pad`` more),
    one id repeated in row 0."""
    g = torch.Generator().manual_seed(seed)
    width = int(mask.sum(1).max()) + pad
    ids = torch.full((mask.shape[0], width), -1, dtype=torch.long)
    for i, row in enumerate(mask):
        where = row.nonzero().squeeze(1)
        ids[i, : where.numel()] = where[torch.randperm(where.numel(), generator=g)]
    ids = ids[:, torch.randperm(width, generator=g)]
    ids[0, (ids[0] == -1).nonzero()[0]] = ids[0][ids[0] >= 0][0]  # a repeat: counted once
    return ids


def random_support(seed: int, n: int = N, v: int = V, k: int = 12) -> torch.Tensor:
    """A random kept set of ``k`` tokens a row, row 5 empty."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, v, dtype=torch.bool)
    mask.scatter_(1, torch.rand(n, v, generator=g).argsort(1)[:, :k], True)
    mask[5] = False
    return mask


# ---------------------------------------------------------------- both forms, one process

PARAMETERS = {
    "top_k": {"top_k": 7},
    "top_p": {"top_p": 0.8},
    "min_p": {"min_p": 0.1},
    "all": {"top_k": 20, "top_p": 0.7, "min_p": 0.05},
    "per-token": {"top_k": "tensor", "top_p": "tensor"},
    "top_p+min_p per token": {"top_p": "tensor", "min_p": 0.02},
}


def parameters(name: str, n: int = N, v: int = V) -> dict[str, Any]:
    """The case's parameters; a per-token ``top_k`` has rows at and beyond ``V`` (no bound)."""
    g = torch.Generator().manual_seed(len(name))
    out = dict(PARAMETERS[name])
    if out.get("top_k") == "tensor":
        out["top_k"] = torch.randint(1, 12, (n,), generator=g)
        out["top_k"][[1, 4]] = torch.tensor([v, v + 9])
    if out.get("top_p") == "tensor":
        out["top_p"] = torch.rand(n, generator=g, dtype=F64) * 0.9 + 0.1
    return out


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=str)
def test_kept_ids_against_float64(dtype: torch.dtype, backend: str) -> None:
    """Random kept sets in any order, padded, a repeated id, an empty row; labels in and
    out of them, one ignored; several tiles each way."""
    skip_fp64_triton(backend, dtype)
    mask = random_support(1)
    p = with_labels(problem(0), mask, seed=2)
    want = truth(p, mask)
    got = ours(p, SamplingSupport(kept_ids=kept_ids_of(mask, 3)), dtype, tile_rows=16,
               tile_cols=48)  # fmt: skip
    assert got["lp"][3] == 0.0 and got["lp"][5] == -torch.inf and got["ent"][5] == 0.0
    assert_matches(got, want, 1e-12 if dtype == F64 else 2e-5)
    finite = torch.isfinite(want["mass"])
    torch.testing.assert_close(
        got["mass"][finite].double(), want["mass"][finite], rtol=2e-5, atol=2e-5
    )


@pytest.mark.parametrize("name", list(PARAMETERS))
def test_parameters_against_float64(name: str) -> None:
    """vLLM's rule on the materialised logits, float64, the torch backend: values, the
    -inf of labels outside the set, gradients; tiles of 17 x 8 across the rows and V."""
    kw = parameters(name)
    p = problem(0)
    mask = vllm_rule(logits(p), **kw)
    p = with_labels(p, mask, seed=4)
    want = truth(p, mask)
    got = ours(p, SamplingSupport(**kw), tile_rows=8, tile_cols=17)
    assert_matches(got, want, 1e-12)
    torch.testing.assert_close(got["mass"], want["mass"], rtol=1e-12, atol=1e-12)
    opts = LinearOptions(temperature=p["t"], tile_rows=8, tile_cols=17)
    alone = linear_logprobs(p["h"], p["w"], p["y"], options=opts, support=SamplingSupport(**kw))
    assert alone.entropy is None and torch.equal(alone.logprobs, got["lp"])


@pytest.mark.parametrize("form", ["kept ids", "top_k+top_p", "top_p", "min_p"])
def test_the_whole_vocabulary_beside_the_support(form: str, backend: str) -> None:
    """``vocab_logprobs`` (``z_y - lse``, finite where the label is outside the support)
    and ``lse`` are the whole vocabulary's, and their gradients join the kept
    distribution's: ``sum(g_lp * logprobs + g_v * vocab_logprobs + g_l * lse)`` against
    float64 autograd through the materialised logits, fp32 compute, several tiles."""
    p = problem(7)
    kw = {"top_k": 9, "top_p": 0.7} if form == "top_k+top_p" else dict(PARAMETERS.get(form, {}))
    mask = random_support(5) if form == "kept ids" else vllm_rule(logits(p), **kw)
    p = with_labels(p, mask, seed=8)
    support = SamplingSupport(kept_ids=kept_ids_of(mask, 9)) if form == "kept ids" else (
        SamplingSupport(**kw))  # fmt: skip
    g = torch.Generator().manual_seed(3)
    g_v, g_l = (torch.randn(N, generator=g, dtype=F64) for _ in range(2))

    def loss(lp: torch.Tensor, vocab: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        lp = torch.where(torch.isfinite(lp), lp, 0.0)
        return (lp * p["g_lp"]).sum() + (vocab * g_v).sum() + (lse * g_l).sum()

    h, w = (p[k].clone().requires_grad_() for k in ("h", "w"))
    z = (h @ w.T) / p["t"][:, None]
    kept_lp = torch.log_softmax(torch.where(mask, z, z.detach().min() - 1e4), 1)
    y, ignored = p["y"].clamp(min=0)[:, None], p["y"] == IGNORE
    in_support = mask.gather(1, y).squeeze(1) & ~ignored
    lp = torch.where(in_support, kept_lp.gather(1, y).squeeze(1), -torch.inf)
    lp = torch.where(ignored, 0.0, lp)
    vocab = torch.where(ignored, 0.0, torch.log_softmax(z, 1).gather(1, y).squeeze(1))
    lse = torch.logsumexp(z, 1)
    want = [vocab.detach(), *torch.autograd.grad(loss(lp, vocab, lse), (h, w))]

    h32, w32 = (p[k].float().requires_grad_() for k in ("h", "w"))
    opts = LinearOptions(temperature=p["t"].float(), tile_rows=8, tile_cols=29, backend=backend)
    r = linear_logprobs(h32, w32, p["y"], options=opts, support=support)
    assert r.vocab_logprobs is not None
    got = [r.vocab_logprobs, *torch.autograd.grad(loss(r.logprobs, r.vocab_logprobs, r.lse),
                                                  (h32, w32))]  # fmt: skip
    assert bool(torch.isfinite(r.vocab_logprobs).all()) and bool(torch.isinf(r.logprobs).any())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", ["top_p", "all"])
def test_parameters_on_triton(name: str, backend: str) -> None:
    """The same at fp32 on both backends: with a top-k bound (the candidates) and without
    one (the radix select over the untempered Triton tiles)."""
    kw = parameters(name)
    p = problem(0)
    mask = vllm_rule(logits(p), **kw)
    p = with_labels(p, mask, seed=4)
    got = ours(p, SamplingSupport(**kw), torch.float32, tile_rows=16, tile_cols=48)
    assert_matches(got, truth(p, mask), 2e-5)


@pytest.mark.parametrize("form", ["kept ids", "top_k+top_p", "top_p"])
def test_softcap_and_bias(form: str, backend: str) -> None:
    """A final-logit softcap (the slope at the kept tokens) and an output bias (its
    gradient) on both backends, fp32, against float64."""
    p = problem(44)
    g = torch.Generator().manual_seed(45)
    p = {**p, "b": torch.randn(V, generator=g, dtype=F64), "cap": 2.5}
    kw = {"top_k": 9, "top_p": 0.8} if form == "top_k+top_p" else {"top_p": 0.7}
    mask = random_support(46) if form == "kept ids" else vllm_rule(logits(p), **kw)
    p = with_labels(p, mask, seed=47)
    support = SamplingSupport(kept_ids=kept_ids_of(mask, 48)) if form == "kept ids" else (
        SamplingSupport(**kw))  # fmt: skip
    got = ours(p, support, torch.float32, tile_rows=16, tile_cols=48)
    assert_matches(got, truth(p, mask), 2e-5)


@pytest.mark.parametrize(
    "kw",
    [{"top_k": 1}, {"top_k": 3}, {"top_k": 10}, {"top_p": 0.5}, {"top_p": 0.05},
     {"top_k": 5, "top_p": 0.6}, {"min_p": 0.3}, {"min_p": 1.0}],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("tile_cols", [7, 200])
def test_ties(kw: dict[str, Any], tile_cols: int) -> None:
    """Small-integer logits (exact: many ties): ties at the k-th all kept, even past the
    candidates' width and across tiles; a top-p tie group kept whole; min-p at 1 keeps
    the largest logit's ties."""
    p = problem(5, ties=True)
    mask = vllm_rule(logits(p), **kw)
    if "top_k" in kw:
        assert (mask.sum(1) > kw["top_k"]).any()  # ties beyond k
    p = with_labels(p, mask, seed=6)
    got = ours(p, SamplingSupport(**kw), tile_rows=8, tile_cols=tile_cols)
    assert_matches(got, truth(p, mask), 1e-12)


@pytest.mark.parametrize("name", ["top_p", "all", "per-token"])
def test_parameters_equal_the_kept_ids_of_the_rule(name: str) -> None:
    """The parametric form equals the kept-ids form given the ids the rule keeps."""
    kw = parameters(name)
    p = problem(8)
    mask = vllm_rule(logits(p), **kw)
    p = with_labels(p, mask, seed=9)
    by_rule = ours(p, SamplingSupport(**kw), tile_rows=8, tile_cols=17)
    by_ids = ours(p, SamplingSupport(kept_ids=kept_ids_of(mask, 10)), tile_rows=8, tile_cols=17)
    assert_matches(by_rule, by_ids, 1e-12)


@pytest.mark.parametrize(
    "support",
    [SamplingSupport(), SamplingSupport(top_k=V + 3, top_p=1.0, min_p=0.0),
     SamplingSupport(top_k=V), "every id"],
    ids=["empty", "neutral", "k=V", "every id"],
)  # fmt: skip
def test_no_restriction_equals_linear_logprobs(support: Any) -> None:
    p = with_labels(problem(11), torch.ones(N, V, dtype=torch.bool), seed=12)
    if support == "every id":
        support = SamplingSupport(kept_ids=torch.arange(V).flip(0).expand(N, V))
    h, w = p["h"].clone().requires_grad_(), p["w"].clone().requires_grad_()
    opts = LinearOptions(temperature=p["t"], tile_rows=8, tile_cols=17)
    plain = linear_logprobs(h, w, p["y"], options=opts, with_entropy=True)
    assert plain.entropy is not None
    loss = (plain.logprobs * p["g_lp"] + plain.entropy * p["g_h"]).sum()
    want = {"lp": plain.logprobs.detach(), "ent": plain.entropy.detach(),
            **dict(zip(("dh", "dw"), torch.autograd.grad(loss, (h, w)), strict=True))}  # fmt: skip
    got = ours(p, support, tile_rows=8, tile_cols=17)
    assert_matches(got, want, 1e-12)
    torch.testing.assert_close(got["mass"], torch.zeros(N, dtype=F64), rtol=0, atol=1e-14)


def test_a_label_outside_the_support_is_minus_inf_with_no_gradient() -> None:
    """-inf, and a cotangent there (even NaN-free 1.0) changes no gradient: the row's
    logprob has none; its entropy still has its own."""
    kw = {"top_k": 4}
    p = problem(13)
    mask = vllm_rule(logits(p), **kw)
    p = with_labels(p, mask, seed=14)
    outside = (~mask.gather(1, p["y"].clamp(min=0)[:, None]).squeeze(1)) & (p["y"] != IGNORE)
    assert outside.any() and (~outside).any()
    for support in (SamplingSupport(**kw), SamplingSupport(kept_ids=kept_ids_of(mask, 15))):
        h, w = p["h"].clone().requires_grad_(), p["w"].clone().requires_grad_()
        opts = LinearOptions(temperature=p["t"], tile_cols=17)
        r = linear_logprobs(h, w, p["y"], options=opts, support=support)
        assert torch.equal(r.logprobs == -torch.inf, outside)
        g = torch.where(outside, 1.0, p["g_lp"])
        dh, dw = torch.autograd.grad(r.logprobs, (h, w), grad_outputs=g)
        dh0, dw0 = torch.autograd.grad(
            linear_logprobs(h, w, p["y"], options=opts, support=support).logprobs,
            (h, w),
            grad_outputs=torch.where(outside, 0.0, p["g_lp"]),
        )
        assert torch.equal(dh, dh0) and torch.equal(dw, dw0)


def test_kept_ids_changed_in_place_after_the_forward_change_nothing() -> None:
    """The ids are read once, in the forward (the backward uses the forward's copy): an
    in-place change before the backward leaves the gradient of the forward's ids."""
    mask = random_support(16)
    p = with_labels(problem(17), mask, seed=18)
    ids = kept_ids_of(mask, 19)
    want = ours(p, SamplingSupport(kept_ids=ids.clone()))
    h, w = p["h"].clone().requires_grad_(), p["w"].clone().requires_grad_()
    r = linear_logprobs(h, w, p["y"], options=LinearOptions(temperature=p["t"]),
                        with_entropy=True, support=SamplingSupport(kept_ids=ids))  # fmt: skip
    assert r.entropy is not None
    ids.fill_(0)
    loss = (torch.where(torch.isfinite(r.logprobs), r.logprobs, 0.0) * p["g_lp"]).sum()
    dh, dw = torch.autograd.grad(loss + (r.entropy * p["g_h"]).sum(), (h, w))
    torch.testing.assert_close(dh, want["dh"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, want["dw"], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "support",
    [SamplingSupport(kept_ids=torch.arange(12).expand(N, 12) * 3 - 1),
     SamplingSupport(top_k=9, top_p=0.8, min_p=0.01), SamplingSupport(top_p=0.8, min_p=0.01)],
    ids=["kept ids", "top-k bound", "radix"],
)  # fmt: skip
def test_no_host_read(support: SamplingSupport, backend: str) -> None:
    """Forward and backward read no device value on the host
    (``tests/processors/test_host_reads.py``'s detector), scalar parameters and kept ids
    alike; a per-token ``top_k`` is read once
    (its candidates' width), documented."""
    p = with_labels(problem(49), torch.ones(N, V, dtype=torch.bool), seed=50)
    h, w = p["h"].float().requires_grad_(), p["w"].float().requires_grad_()
    opts = LinearOptions(check_values=False, tile_rows=16, tile_cols=48)
    with HostReads().watching():
        r = linear_logprobs(h, w, p["y"], options=opts, with_entropy=True, support=support)
        assert r.entropy is not None
        lp = torch.where(torch.isfinite(r.logprobs), r.logprobs, 0.0)
        (lp.sum() + r.entropy.sum()).backward()
    per_token = SamplingSupport(top_k=torch.full((N,), 9))
    with pytest.raises(HostRead), HostReads().watching():
        linear_logprobs(h, w, p["y"], options=opts, support=per_token)


# ---------------------------------------------------------------- bf16 compute


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    finite = torch.isfinite(want)
    got, want = got.double()[finite], want[finite]
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


@pytest.mark.parametrize("form", ["kept ids", "top_k"])
def test_bf16_compute_beside_the_naive_path(form: str) -> None:
    """bf16 inputs, bf16 GEMM operands: ours against float64 of the same inputs, within
    a third of the naive path's error (bf16 logits, fp32 maths) or twice the bf16 rounding
    of the float64 result."""
    g = torch.Generator().manual_seed(20)
    n, v = 40, 300
    p = {"h": (torch.randn(n, 64, generator=g) * 1.5).bfloat16().double(),
         "w": (torch.randn(v, 64, generator=g) * 0.3).bfloat16().double(),
         "t": torch.ones(n, dtype=F64), "g_lp": torch.randn(n, generator=g, dtype=F64),
         "g_h": torch.randn(n, generator=g, dtype=F64)}  # fmt: skip
    kw = {"top_k": 6}
    mask = vllm_rule(logits(p), **kw) if form == "top_k" else random_support(21, n, v, k=20)
    p = with_labels(p, mask, seed=22)
    support = (
        SamplingSupport(**kw)
        if form == "top_k"
        else SamplingSupport(kept_ids=kept_ids_of(mask, 23))
    )
    want = truth(p, mask)
    naive = truth(p, mask, torch.bfloat16)
    got = ours(p, support, torch.bfloat16, compute_dtype=torch.bfloat16, tile_cols=64)
    assert torch.equal(torch.isinf(got["lp"]), torch.isinf(want["lp"]))
    for key in ("lp", "ent", "dh", "dw"):
        err, naive_err = _rel(got[key], want[key]), _rel(naive[key], want[key])
        rounding = _rel(want[key].bfloat16(), want[key])
        assert err <= max(naive_err / 3, 2 * rounding), (key, err, naive_err, rounding)


# ---------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kept_ids": torch.zeros(3, 2, dtype=torch.long), "top_k": 2}, "kept_ids"),
        ({"kept_ids": torch.zeros(3, 2)}, "kept_ids"),
        ({"kept_ids": torch.zeros(3, dtype=torch.long)}, "kept_ids"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": torch.ones(3)}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": torch.ones(3, dtype=torch.long)}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
    ],
)
def test_bad_support_at_construction(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ContractError) as info:
        SamplingSupport(**kwargs)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("support", "field"),
    [
        (SamplingSupport(kept_ids=torch.zeros(N + 1, 2, dtype=torch.long)), "kept_ids"),
        (SamplingSupport(kept_ids=torch.full((N, 2), V)), "kept_ids"),
        (SamplingSupport(kept_ids=torch.full((N, 2), -2)), "kept_ids"),
        (SamplingSupport(top_k=torch.ones(N + 1, dtype=torch.long)), "top_k"),
        (SamplingSupport(top_k=torch.zeros(N, dtype=torch.long)), "top_k"),
        (SamplingSupport(top_p=torch.zeros(N, dtype=F64)), "top_p"),
        (SamplingSupport(min_p=torch.full((N,), 2.0)), "min_p"),
        ("top_p=0.9", "support"),
    ],
)
def test_bad_support_at_the_call(support: Any, field: str) -> None:
    p = with_labels(problem(24), torch.ones(N, V, dtype=torch.bool), seed=25)
    with pytest.raises(ContractError) as info:
        linear_logprobs(p["h"], p["w"], p["y"], support=support)
    assert info.value.field == field


def test_a_mean_logit_is_refused_with_a_support() -> None:
    p = with_labels(problem(24), torch.ones(N, V, dtype=torch.bool), seed=25)
    with pytest.raises(ContractError) as info:
        linear_logprobs(p["h"], p["w"], p["y"], with_mean_logit=True, support=SamplingSupport())
    assert info.value.field == "with_mean_logit"


# ---------------------------------------------------------------- the processor


def _context(p: dict[str, Any], b: int, s: int, user: Any = None) -> OutputContext:
    """The rows of ``p`` as ``[s, b, h]`` hidden states (row ``i`` is token ``(i % b, i // b)``)."""
    return OutputContext(
        hidden_states=p["h"].reshape(s, b, -1),
        labels=p["y"].reshape(s, b).T,
        vocab_weight=p["w"],
        vocab=VocabShard(0, V, V),
        context=user,
    )


def test_the_processor_reads_the_support_from_its_factory_or_the_user_context() -> None:
    """Kept ids ``[b, s, K]`` and per-token parameters ``[b, s]`` through the user
    context's ``sampling_support``, numbers through ``support=``: each equal to
    ``linear_logprobs`` on the rows; both sources, or a tensor in the factory, raise."""
    b, s = 2, 15
    mask = random_support(26, b * s)
    p = with_labels({**problem(27, n=b * s), "t": torch.ones(b * s, dtype=F64)}, mask, seed=28)
    ids = kept_ids_of(mask, 29)
    top_p = torch.rand(b * s, dtype=F64) * 0.5 + 0.3
    cases = [
        (selected_logprobs(entropy=True), {"sampling_support": SamplingSupport(
            kept_ids=ids.reshape(s, b, -1).transpose(0, 1))}, SamplingSupport(kept_ids=ids)),
        (selected_logprobs(entropy=True), {"sampling_support": SamplingSupport(
            top_p=top_p.reshape(s, b).T, top_k=9)}, SamplingSupport(top_p=top_p, top_k=9)),
        (selected_logprobs(entropy=True, support=SamplingSupport(min_p=0.2)), None,
         SamplingSupport(min_p=0.2)),
    ]  # fmt: skip
    for proc, user, rows in cases:
        out = proc(_context(p, b, s, user))
        want = linear_logprobs(p["h"], p["w"], p["y"], with_entropy=True, support=rows)
        torch.testing.assert_close(out["logprobs"], want.logprobs.reshape(s, b).T)
        torch.testing.assert_close(out["entropy"], want.entropy.reshape(s, b).T)
    both = selected_logprobs(support=SamplingSupport(top_k=3))
    with pytest.raises(ContractError) as info:
        both(_context(p, b, s, {"sampling_support": SamplingSupport(top_k=3)}))
    assert info.value.field == "support"
    with pytest.raises(ContractError) as info:
        selected_logprobs(support=SamplingSupport(top_k=torch.ones(3, dtype=torch.long)))
    assert info.value.field == "support.top_k"
    bad = {"sampling_support": SamplingSupport(kept_ids=ids)}  # rows, not [b, s, K]
    with pytest.raises(ContractError) as info:
        selected_logprobs()(_context(p, b, s, bad))
    assert info.value.field == "context.sampling_support.kept_ids"
    with pytest.raises(ContractError) as info:
        selected_logprobs()(_context(p, b, s, {"sampling_support": ids}))
    assert info.value.field == "context.sampling_support"


# ---------------------------------------------------------------- the JAX reference and hookcheck


def test_the_jax_reference_against_float64() -> None:
    """``jax_ref.sampling``: its kept set equals the rule's (random and tied logits), and
    its values and VJPs equal the float64 truth, for both forms."""
    import jax
    import jax.numpy as jnp

    from jax_ref import float64
    from jax_ref.sampling import kept_mask, linear_sampling_logprobs

    with float64():
        for ties in (False, True):
            p = problem(30, ties=ties)
            z = logits(p)
            for kw in (parameters("all"), {"top_p": 0.5}, parameters("per-token")):
                jkw = {k: jnp.asarray(v.numpy()) if isinstance(v, torch.Tensor) else v
                       for k, v in kw.items()}  # fmt: skip
                got = torch.tensor(kept_mask(jnp.asarray(z.numpy()), **jkw).tolist())
                assert torch.equal(got, vllm_rule(z, **kw)), kw
        p = problem(31)
        kw = parameters("all")
        mask = vllm_rule(logits(p), **kw)
        p = with_labels(p, mask, seed=32)
        want = truth(p, mask)
        for form in (kw, {"kept_ids": jnp.asarray(kept_ids_of(mask, 33).numpy())}):

            def f(h: Any, w: Any, form: dict[str, Any] = form) -> Any:
                r = linear_sampling_logprobs(h, w, jnp.asarray(p["y"].numpy()),
                                             temperature=jnp.asarray(p["t"].numpy()),
                                             ignore_index=IGNORE, **form)  # fmt: skip
                lp = jnp.where(jnp.isfinite(r.logprobs), r.logprobs, 0.0)
                loss = jnp.sum(lp * p["g_lp"].numpy() + r.entropy * p["g_h"].numpy())
                return loss, (r.logprobs, r.entropy, r.kept_logmass)

            (_, (lp, ent, mass)), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
                jnp.asarray(p["h"].numpy()), jnp.asarray(p["w"].numpy())
            )
            got = {k: torch.tensor(v.tolist(), dtype=F64) for k, v in
                   (("lp", lp), ("ent", ent), ("dh", grads[0]), ("dw", grads[1]))}  # fmt: skip
            assert_matches(got, want, 1e-12)
            torch.testing.assert_close(torch.tensor(mass.tolist(), dtype=F64), want["mass"])


REFERENCE = None


def _reference() -> Any:
    from jax_ref.sampling import selected_logprobs as reference

    return reference(entropy=True)


def test_the_hookcheck_builtin_check() -> None:
    """The built-in check, as ``hookcheck`` runs it, on the tiny GPT (fp32, tied)."""
    from jax_ref.check.hookcheck import BUILTIN_CHECKS, main

    names = {c.name: c for c in BUILTIN_CHECKS}
    check = names["selected_logprobs(entropy, kept ids)"]
    assert check.processor.endswith(":LOGPROBS_SUPPORT")
    global REFERENCE
    REFERENCE = _reference()
    b = "jax_ref.check.builtin_processors"
    out, err = io.StringIO(), io.StringIO()
    code = main(
        ["--dtype", "float32", "--no-synthetic", "--quiet",
         "--processor", f"{b}:LOGPROBS_SUPPORT", "--reference", f"{__name__}:REFERENCE",
         "--context", f"{b}:sampling_context"],
        out=out, err=err,
    )  # fmt: skip
    assert code == 0, out.getvalue() + err.getvalue()
    rows = re.findall(r"^LOGPROBS_SUPPORT\s+(\S+)\s+float32\s.*\s(ok.*)$", out.getvalue(), re.M)
    assert len(rows) == 2, out.getvalue()  # gpt, gpt-tied


# ---------------------------------------------------------------- tensor parallel


def _tp2(
    rank: int,
    cases: list[tuple[dict[str, Any], Any, dict[str, Any]]],
    processor_case: tuple[dict[str, Any], Any, dict[str, Any]],
) -> None:
    from megatron.core import parallel_state

    from torch_impl import TorchCollectives

    group = parallel_state.get_tensor_model_parallel_group()
    coll = TorchCollectives(group, sequence_parallel=False)
    half = V // 2 + 1  # 66 | 65: unequal shards
    bounds = (0, half) if rank == 0 else (half, V)
    shard = slice(*bounds)
    for p, support, want in cases:
        vocab = VocabShard(bounds[0], bounds[1], V)
        got = ours({**p, "w": p["w"][shard]}, support, tile_rows=8, tile_cols=17,
                   vocab=vocab, collectives=coll)  # fmt: skip
        assert_matches(got, {**want, "dw": want["dw"][shard]}, 1e-12)
        opts = LinearOptions(temperature=p["t"], vocab=vocab, collectives=coll, tile_cols=17)
        alone = linear_logprobs(p["h"], p["w"][shard], p["y"], options=opts, support=support)
        assert torch.equal(alone.logprobs, got["lp"])  # without the entropy's sums
    # the processor (equal shards): kept ids [b=1, s, K] through the user context
    p, support, want = processor_case
    v = p["w"].shape[0]
    shard = slice(rank * v // 2, (rank + 1) * v // 2)
    ctx = OutputContext(
        hidden_states=p["h"][:, None, :],
        vocab_weight=p["w"][shard],
        labels=p["y"][None, :],
        vocab=VocabShard(shard.start, shard.stop, v),
        parallel=ParallelLayout(tp_size=2, tp_rank=rank),
        collectives=coll,
        context={"sampling_support": SamplingSupport(kept_ids=support.kept_ids[None])},
    )
    out = selected_logprobs(entropy=True)(ctx)
    torch.testing.assert_close(out["logprobs"][0], want["lp"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out["entropy"][0], want["ent"], rtol=1e-12, atol=1e-12)


def test_tp2_equals_float64() -> None:
    """Two gloo ranks, the vocabulary split unequally: kept ids; top-k + top-p + min-p on
    tied logits (the candidates and their ties merged over the shards); top-p alone (the
    radix select's histograms summed over the shards)."""
    cases = []
    p = {**problem(34), "t": torch.ones(N, dtype=F64)}
    mask = random_support(35)
    p = with_labels(p, mask, seed=36)
    cases.append((p, SamplingSupport(kept_ids=kept_ids_of(mask, 37)), truth(p, mask)))
    for seed, ties, kw in ((38, True, {"top_k": 3, "top_p": 0.9, "min_p": 0.05}),
                           (39, False, {"top_p": 0.7})):  # fmt: skip
        p = problem(seed, ties=ties)
        mask = vllm_rule(logits(p), **kw)
        p = with_labels(p, mask, seed=seed)
        cases.append((p, SamplingSupport(**kw), truth(p, mask)))
    p = {**problem(40, v=V - 1), "t": torch.ones(N, dtype=F64)}
    mask = random_support(41, v=V - 1)
    p = with_labels(p, mask, seed=42)
    processor_case = (p, SamplingSupport(kept_ids=kept_ids_of(mask, 43)), truth(p, mask))
    run_distributed(_tp2, cases, processor_case, tp=2)
