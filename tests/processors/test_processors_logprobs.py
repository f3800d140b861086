"""``linear_logprobs`` against a float64 ground truth, three ways.

Ground truth: the full logits in float64 from the very inputs under test (upcast),
``log_softmax`` and a gather. Naive: the same code a user writes, in the test
dtype. Ours may be no worse than the naive one plus a small slack per dtype, for
values and for the gradients of the hidden states and the weight.
"""

from __future__ import annotations

import pytest
import torch

from hookspec import ContractError, VocabShard
from tests.support.identity_collectives import identity_collectives
from torch_impl.processors import LinearOptions, linear_logprobs

IGNORE = -100
SLACK = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 5e-4}


def reference(
    h: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    temperature: float | torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs and entropy with the full logits, computed in ``dtype``."""
    z = h.to(dtype) @ w.to(dtype).T
    t = temperature.to(dtype)[:, None] if isinstance(temperature, torch.Tensor) else temperature
    z = z / t
    logp_all = z.log_softmax(-1)
    lp = logp_all.gather(1, y.clamp(min=0)[:, None]).squeeze(1)
    lp = torch.where(y == IGNORE, torch.zeros((), dtype=lp.dtype), lp)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return lp, entropy


Errors = dict[str, tuple[float, float, float]]


def three_way(
    h: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    with_entropy: bool = True,
    **kwargs: object,
) -> Errors:
    """``{quantity: (our error, naive error, max |truth|)}`` against float64, for the
    values and the gradients."""
    g = torch.Generator().manual_seed(7)
    n = h.shape[0]
    c_lp = torch.randn(n, generator=g, dtype=torch.float64).to(h.device)
    c_ent = torch.randn(n, generator=g, dtype=torch.float64).to(h.device)

    def run(fn: object) -> dict[str, torch.Tensor]:
        hh = h.detach().clone().requires_grad_()
        ww = w.detach().clone().requires_grad_()
        lp, ent = fn(hh, ww)  # type: ignore[operator]
        loss = (lp.double() * c_lp).sum() + ((ent.double() * c_ent).sum() if with_entropy else 0.0)
        loss.backward()
        out = {"logprobs": lp.detach().double(), "dh": hh.grad.double(), "dw": ww.grad.double()}
        if with_entropy:
            out["entropy"] = ent.detach().double()
        return out

    truth = run(lambda a, b: reference(a, b, y, temperature, torch.float64))
    naive = run(lambda a, b: reference(a, b, y, temperature, h.dtype))

    def ours_fn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        options = LinearOptions(temperature=temperature, **kwargs)  # type: ignore[arg-type]
        r = linear_logprobs(a, b, y, with_entropy=with_entropy, options=options)
        return r.logprobs, r.entropy

    ours = run(ours_fn)
    return {
        k: (
            float((ours[k] - truth[k]).abs().max()),
            float((naive[k] - truth[k]).abs().max()),
            float(truth[k].abs().max()),
        )
        for k in truth
    }


def assert_no_worse(errors: Errors, dtype: torch.dtype) -> None:
    """Ours within the naive error plus ``SLACK[dtype]`` times the quantity's scale."""
    for name, (ours, naive, scale) in errors.items():
        assert ours == ours, f"{name}: NaN error"
        slack = SLACK[dtype] * max(1.0, scale)
        assert ours <= naive + slack, f"{name}: ours {ours:.3g} > naive {naive:.3g} + {slack:.3g}"


def _inputs(
    n: int, hidden: int, vocab: int, dtype: torch.dtype, *, seed: int = 0, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * (scale / hidden**0.5)
    y = torch.randint(0, vocab, (n,), generator=g)
    return h.to(dtype), w.to(dtype), y


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "hidden", "vocab", "chunks"),
    [
        (1, 1, 2, (1, 1)),
        (37, 13, 203, (50, 8)),  # chunks divide nothing
        (252, 23, 507, (123, 100)),  # awkward, CCE-style
        (64, 16, 1024, (256, 64)),  # round
    ],
)
def test_three_way_shapes(
    dtype: torch.dtype, n: int, hidden: int, vocab: int, chunks: tuple[int, int]
) -> None:
    h, w, y = _inputs(n, hidden, vocab, dtype, scale=3.0)
    errors = three_way(h, w, y, tile_cols=chunks[0], tile_rows=chunks[1])
    assert_no_worse(errors, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_three_way_temperature_per_token_and_ignored(dtype: torch.dtype) -> None:
    h, w, y = _inputs(45, 17, 301, dtype, seed=1, scale=4.0)
    y[::5] = IGNORE
    t = (torch.rand(45, generator=torch.Generator().manual_seed(3)) + 0.3).to(dtype)
    errors = three_way(h, w, y, temperature=t, tile_cols=64, tile_rows=16)
    assert_no_worse(errors, dtype)
    errors = three_way(h, w, y, temperature=0.7, tile_cols=64, tile_rows=16)
    assert_no_worse(errors, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_three_way_on_gpu(dtype: torch.dtype) -> None:
    """On a GPU the matmuls run in the input dtype (fp32 out where cuBLAS allows)."""
    h, w, y = _inputs(300, 64, 5000, dtype, seed=12, scale=3.0)
    y[::7] = IGNORE
    errors = three_way(h.cuda(), w.cuda(), y.cuda(), tile_cols=1024, tile_rows=128)
    assert_no_worse(errors, dtype)


def test_ignored_tokens_are_zero_with_zero_gradient() -> None:
    h, w, y = _inputs(12, 8, 50, torch.float32, seed=2)
    y[[0, 5, 11]] = IGNORE
    hh = h.clone().requires_grad_()
    r = linear_logprobs(hh, w, y, options=LinearOptions(tile_cols=16, tile_rows=5))
    assert torch.equal(r.logprobs[[0, 5, 11]], torch.zeros(3))
    assert r.entropy is None
    r.logprobs.sum().backward()
    assert torch.equal(hh.grad[[0, 5, 11]], torch.zeros(3, 8))
    assert bool((hh.grad[1].abs() > 0).all())


def test_custom_ignore_index_inside_the_vocabulary() -> None:
    h, w, y = _inputs(10, 8, 50, torch.float64, seed=3)
    y[2] = 7
    r = linear_logprobs(h, w, y, options=LinearOptions(ignore_index=7))
    truth, _ = reference(h, w, torch.where(y == 7, IGNORE, y), 1.0, torch.float64)
    torch.testing.assert_close(r.logprobs, truth, rtol=0, atol=1e-12)


def test_float64_gradcheck() -> None:
    h, w, y = _inputs(6, 4, 23, torch.float64, seed=4)
    y[1] = IGNORE
    t = torch.rand(6, dtype=torch.float64) + 0.5

    def fn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = linear_logprobs(
            a,
            b,
            y,
            with_entropy=True,
            options=LinearOptions(temperature=t, tile_cols=5, tile_rows=4),
        )
        assert r.entropy is not None
        return r.logprobs, r.entropy

    assert torch.autograd.gradcheck(fn, (h.requires_grad_(), w.requires_grad_()))


def test_only_inputs_needing_grads_get_them() -> None:
    h, w, y = _inputs(9, 6, 40, torch.float32, seed=5)
    hh = h.clone().requires_grad_()
    linear_logprobs(hh, w, y, with_entropy=True).logprobs.sum().backward()
    assert hh.grad is not None and w.grad is None
    ww = w.clone().requires_grad_()
    linear_logprobs(h, ww, y).logprobs.sum().backward()
    assert ww.grad is not None and h.grad is None
    # Entropy alone: the label terms vanish, the entropy's gradient does not.
    hh = h.clone().requires_grad_()
    r = linear_logprobs(hh, w, y, with_entropy=True)
    assert r.entropy is not None
    r.entropy.sum().backward()
    assert float(hh.grad.abs().sum()) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_logits_strongly_negative(dtype: torch.dtype) -> None:
    """Every logit near -1e4 (veRL's kernel started its running max at 0 and
    returned -inf/NaN here): the logprobs are those of the shifted logits."""
    h, w, y = _inputs(20, 8, 300, torch.float64, seed=6)
    h = torch.cat([h, torch.ones(20, 1, dtype=torch.float64)], 1)
    w = torch.cat([w, torch.full((300, 1), -1e4, dtype=torch.float64)], 1)
    h, w = h.to(dtype), w.to(dtype)
    r = linear_logprobs(
        h, w, y, with_entropy=True, options=LinearOptions(tile_cols=64, tile_rows=7)
    )
    assert bool(torch.isfinite(r.logprobs).all()) and bool((r.logprobs <= 0).all())
    truth_lp, truth_ent = reference(h, w, y, 1.0, torch.float64)
    naive_lp, _ = reference(h, w, y, 1.0, dtype)
    err = float((r.logprobs.double() - truth_lp).abs().max())
    assert err <= float((naive_lp.double() - truth_lp).abs().max()) + SLACK[dtype] * 1e4
    assert float((r.entropy.double() - truth_ent).abs().max()) < 0.05
    assert bool((r.entropy >= 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_up_to_1e4_and_peaked(dtype: torch.dtype) -> None:
    h, w, y = _inputs(30, 8, 400, torch.float64, seed=7)
    w = w * (1e4 / float((h @ w.T).abs().max()))  # |logit| up to 1e4
    h[:10] = w[y[:10]] / w[y[:10]].norm(dim=1, keepdim=True) * 5.0  # planted peaks at the label
    errors = three_way(h.to(dtype), w.to(dtype), y, tile_cols=96, tile_rows=8)
    assert_no_worse(errors, dtype)


def test_entropy_is_non_negative_and_logprobs_non_positive() -> None:
    h, w, y = _inputs(64, 16, 500, torch.float32, seed=8, scale=30.0)
    r = linear_logprobs(
        h, w, y, with_entropy=True, options=LinearOptions(tile_cols=77, tile_rows=9)
    )
    assert r.entropy is not None
    assert bool((r.entropy >= 0).all()) and bool((r.logprobs <= 0).all())


def test_vocab_262144() -> None:
    h, w, y = _inputs(16, 8, 262144, torch.float32, seed=9, scale=3.0)
    y[3] = IGNORE
    y[0], y[1] = 0, 262143
    errors = three_way(h, w, y)
    assert_no_worse(errors, torch.float32)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_hidden_states_give_nan_never_finite(bad: float) -> None:
    h, w, y = _inputs(10, 8, 60, torch.float32, seed=10)
    h[4, 2] = bad
    hh = h.clone().requires_grad_()
    r = linear_logprobs(
        hh, w, y, with_entropy=True, options=LinearOptions(tile_cols=16, tile_rows=3)
    )
    assert r.entropy is not None
    assert bool(torch.isnan(r.logprobs[4])) and bool(torch.isnan(r.entropy[4]))
    others = torch.arange(10) != 4
    assert bool(torch.isfinite(r.logprobs[others]).all())
    truth, _ = reference(h[others], w, y[others], 1.0, torch.float64)
    torch.testing.assert_close(r.logprobs[others].double(), truth, rtol=0, atol=1e-5)
    r.logprobs.sum().backward()
    assert bool(torch.isnan(hh.grad[4]).any())


def test_nonfinite_weight_gives_nan() -> None:
    h, w, y = _inputs(5, 4, 30, torch.float32, seed=11)
    w[17, 1] = float("nan")
    r = linear_logprobs(h, w, y, options=LinearOptions(tile_cols=8))
    assert bool(torch.isnan(r.logprobs).all())


def test_empty_input() -> None:
    h, w, _ = _inputs(1, 4, 30, torch.float32)
    hh = h[:0].clone().requires_grad_()
    r = linear_logprobs(hh, w, torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert r.logprobs.shape == (0,)
    r.logprobs.sum().backward()
    assert hh.grad.shape == (0, 4)


# ---------------------------------------------------------------- bad input


def test_labels_outside_the_global_vocabulary_raise() -> None:
    h, w, y = _inputs(6, 4, 30, torch.float32)
    for bad in (30, 31, -1, -101):
        y2 = y.clone()
        y2[2] = bad
        with pytest.raises(ContractError, match=r"labels: expected token ids in \[0, 30\)"):
            linear_logprobs(h, w, y2)


# Collectives of a group whose other ranks contribute nothing (the identity): enough to
# check what a shard accepts, not what it computes.
_OtherRanksAbsent = identity_collectives("_OtherRanksAbsent", "all_reduce_sum_context_parallel")


def test_labels_outside_the_shard_but_inside_the_vocabulary_are_fine() -> None:
    """A shard of rows [30, 60) of a vocabulary of 90: label 5 lives elsewhere."""
    h, w, y = _inputs(4, 4, 30, torch.float32)
    shard = LinearOptions(vocab=VocabShard(30, 60, 90), collectives=_OtherRanksAbsent())
    r = linear_logprobs(h, w, torch.tensor([5, 35, 89, IGNORE]), options=shard)
    assert r.logprobs.shape == (4,)
    with pytest.raises(ContractError, match="labels"):
        linear_logprobs(h, w, torch.tensor([5, 35, 90, 0]), options=shard)
    with pytest.raises(ContractError, match=r"vocab: expected a shard of V_local = 30 rows"):
        linear_logprobs(
            h,
            w,
            y,
            options=LinearOptions(vocab=VocabShard(30, 50, 90), collectives=_OtherRanksAbsent()),
        )


@pytest.mark.parametrize(
    "temperature",
    [0.0, -1.0, float("nan"), float("inf"), torch.tensor([1.0, 0.0, 1.0, 1.0]), True, "1"],
)
def test_bad_temperature_raises(temperature: object) -> None:
    h, w, y = _inputs(4, 4, 30, torch.float32)
    with pytest.raises(ContractError, match="temperature"):
        linear_logprobs(
            h,
            w,
            y,
            options=LinearOptions(temperature=temperature),  # type: ignore[arg-type]
        )


def test_bad_shapes_and_dtypes_raise() -> None:
    h, w, y = _inputs(4, 4, 30, torch.float32)
    with pytest.raises(ContractError, match=r"labels: expected shape \[n=4\]"):
        linear_logprobs(h, w, y[:3])
    with pytest.raises(ContractError, match="labels: expected an integer dtype"):
        linear_logprobs(h, w, y.float())
    with pytest.raises(ContractError, match=r"weight: expected shape \[V_local, h=4\]"):
        linear_logprobs(h, w[:, :3], y)
    with pytest.raises(ContractError, match="hidden: expected 2 dims"):
        linear_logprobs(h[None], w, y)
    with pytest.raises(ContractError, match="hidden: expected a floating dtype"):
        linear_logprobs(h.long(), w, y)
    with pytest.raises(ContractError, match="temperature"):
        linear_logprobs(h, w, y, options=LinearOptions(temperature=torch.ones(5)))
    with pytest.raises(ContractError, match="tile_cols"):
        linear_logprobs(h, w, y, options=LinearOptions(tile_cols=0))
