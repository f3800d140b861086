"""Sampling replay by kept ids (``linear_logprobs(support=SamplingSupport(kept_ids))``):
values and gradients against float64 autograd through materialised logits renormalised
over the kept tokens, on both backends (Triton under the interpreter), several tiles, a
temperature, padding, repeated ids, ignored labels and labels outside the support; bf16
compute beside the naive bf16 path; bad ids refused by name."""

from __future__ import annotations

import pytest
import torch

from hookspec import ContractError
from torch_impl.processors import LinearOptions, SamplingSupport, linear_logprobs

pytestmark = pytest.mark.release_independent  # the engine's maths; no Megatron in it

N, H, V, K, T, IGNORE = 13, 8, 53, 7, 1.3, -100


def _problem(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[3] = IGNORE
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])
    ids[:, 0] = labels.clamp(min=0)  # the sampled token is kept
    ids[2, 3] = -1  # padding
    ids[4, 5] = ids[4, 1]  # a repeated id counts once
    ids[5] = torch.where(ids[5] == labels[5], (labels[5] + 1) % V, ids[5])  # label not kept
    return {"hidden": hidden, "weight": weight, "labels": labels, "ids": ids}


def _truth(d: dict[str, torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor):
    z = hidden @ weight.T / T
    keep = torch.zeros(N, V, dtype=torch.bool)
    rows = torch.arange(N)[:, None].expand(N, K)
    keep[rows[d["ids"] >= 0], d["ids"][d["ids"] >= 0]] = True
    lse = torch.logsumexp(z.masked_fill(~keep, -torch.inf), 1)
    y = d["labels"].clamp(min=0)
    kept_label = keep.gather(1, y[:, None]).squeeze(1)
    lp = torch.where(kept_label, z.gather(1, y[:, None]).squeeze(1) - lse, -torch.inf)
    lp = torch.where(d["labels"] == IGNORE, 0.0, lp)
    log_p = torch.where(keep, z - lse[:, None], 0.0)
    p = torch.where(keep, torch.exp(log_p), 0.0)
    return lp, -(p * log_p).sum(1)


def _ours(d, hidden, weight, backend: str, **options):
    opts = LinearOptions(temperature=T, tile_rows=4, tile_cols=11, backend=backend, **options)
    support = SamplingSupport(kept_ids=d["ids"])
    r = linear_logprobs(
        hidden, weight, d["labels"], options=opts, with_entropy=True, support=support
    )
    return r.logprobs, r.entropy


def _loss(lp: torch.Tensor, entropy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.where(torch.isfinite(lp), lp.double(), 0.0) * w).sum() + (
        entropy.double() * w
    ).sum()


@pytest.mark.parametrize(
    ("backend", "dtype", "tol"),
    [
        ("torch", torch.float64, 1e-12),
        ("torch", torch.float32, 3e-6),
        ("triton", torch.float32, 3e-6),
    ],
)
def test_kept_ids_against_float64_materialised_logits(
    backend: str, dtype: torch.dtype, tol: float
) -> None:
    d = _problem()
    h, w = (d[k].detach().clone().to(dtype).requires_grad_() for k in ("hidden", "weight"))
    h64, w64 = (d[k].clone().requires_grad_() for k in ("hidden", "weight"))
    lp, entropy = _ours(d, h, w, backend)
    lp64, entropy64 = _truth(d, h64, w64)
    assert torch.equal(torch.isfinite(lp), torch.isfinite(lp64))  # -inf: the label not kept
    assert float(lp[5].detach()) == -torch.inf and float(lp[3].detach()) == 0.0
    finite = torch.isfinite(lp64)
    torch.testing.assert_close(lp.double()[finite], lp64[finite], rtol=0, atol=tol)
    torch.testing.assert_close(entropy.double(), entropy64, rtol=0, atol=tol)
    weights = torch.rand(N, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    _loss(lp, entropy, weights).backward()
    _loss(lp64, entropy64, weights).backward()
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=0, atol=10 * tol)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=0, atol=10 * tol)


def test_every_id_kept_is_the_plain_logprob() -> None:
    """A support of the whole vocabulary renormalises nothing: the plain logprob."""
    d = _problem(seed=2)
    d["ids"] = torch.arange(V).expand(N, V).clone()
    opts = LinearOptions(temperature=T, tile_rows=4, tile_cols=11)
    kept = linear_logprobs(
        d["hidden"], d["weight"], d["labels"], options=opts, support=SamplingSupport(d["ids"])
    )
    plain = linear_logprobs(d["hidden"], d["weight"], d["labels"], options=opts)
    torch.testing.assert_close(kept.logprobs, plain.logprobs, rtol=0, atol=1e-12)


def test_bf16_compute_beside_naive_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the GPU's compute dtype (bf16 operands, forced on the CPU as in test_precision):
    no further from float64 than the naive bf16 path (bf16 logits, fp32 renormalisation)."""
    d = _problem(seed=3)
    truth, _ = _truth(d, d["hidden"], d["weight"])
    monkeypatch.setattr(
        "torch_impl.processors._options.resolve_compute_dtype",
        lambda device, dtype, override: torch.float64 if dtype == torch.float64 else torch.bfloat16,
    )
    h16, w16 = d["hidden"].bfloat16(), d["weight"].bfloat16()
    ours, _ = _ours(d, h16, w16, "torch")
    monkeypatch.undo()
    naive, _ = _truth(d, h16.float(), w16.float())  # the bf16-rounded operands, fp32 maths
    finite = torch.isfinite(truth)
    ours_err = (ours.double() - truth)[finite].abs().max()
    naive_err = (naive.double() - truth)[finite].abs().max()
    assert float(ours_err) <= float(naive_err) + 2**-8


@pytest.mark.parametrize(
    ("ids", "field"),
    [
        (torch.zeros(N, K), "kept_ids"),  # float
        (torch.zeros(N, dtype=torch.long), "kept_ids"),  # one dim
        (torch.zeros(N + 1, K, dtype=torch.long), "kept_ids"),  # rows
        (torch.full((N, K), V, dtype=torch.long), "kept_ids"),  # out of range
        (torch.full((N, K), -2, dtype=torch.long), "kept_ids"),
    ],
)
def test_bad_kept_ids_are_refused_by_name(ids: torch.Tensor, field: str) -> None:
    d = _problem()
    with pytest.raises(ContractError) as info:
        linear_logprobs(d["hidden"], d["weight"], d["labels"], support=SamplingSupport(ids))
    assert info.value.field == field
