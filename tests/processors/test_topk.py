"""Top-k logprobs against the float64 materialised logits: values, ids (ties to the
smaller id), the label's logprob, the entropy and their gradients; one process
and two gloo ranks (the vocabulary split), through the hook on the tiny GPT."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import hookspec
import torch_impl
from hookspec import ContractError, OutputContext, ParallelLayout, VocabShard
from tests.support.distributed import GlooSequenceParallel, run_distributed
from tests.support.identity_collectives import identity_collectives
from torch_impl.processors import LinearOptions, linear_topk_logprobs, topk_logprobs
from torch_impl.testing.tiny import build_tiny_gpt, tiny_batch

IGNORE = -100
N, H, V = 23, 7, 38


def _problem(seed: int = 0, *, ties: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    if ties:
        # Small integers: every logit exact in any summation order, so equal logits are
        # equal whatever the GEMM's blocking (many ties). Rows 2, 5, 30 and 9, 21, 36
        # equal, and the best of tokens 0 and 1: ties in a tile, across tiles and
        # across the two halves of the vocabulary.
        w = torch.randint(-2, 3, (V, H), generator=g).double()
        h = torch.randint(-2, 3, (N, H), generator=g).double()
        w[[2, 5, 30]] = 3.0
        w[[9, 21, 36]] = -3.0
        h[0], h[1] = 1.0, -1.0
    y = torch.randint(0, V, (N,), generator=g)
    y[[3, 11]] = IGNORE
    return {
        "h": h,
        "w": w,
        "y": y,
        "t": torch.rand(N, generator=g, dtype=torch.float64) + 0.5,
    }


def _truth(
    p: dict[str, torch.Tensor], k: int, cot: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Materialised logits in float64; ids by a stable sort (ties: the smaller id first)."""
    h = p["h"].clone().requires_grad_()
    w = p["w"].clone().requires_grad_()
    lp = ((h @ w.T) / p["t"][:, None]).log_softmax(-1)
    ids = torch.sort(lp.detach(), dim=1, descending=True, stable=True).indices[:, :k]
    top = lp.gather(1, ids)
    y = p["y"]
    lab = torch.where(y == IGNORE, 0.0, lp.gather(1, y.clamp(min=0)[:, None]).squeeze(1))
    ent = -(lp.exp() * lp).sum(-1)
    loss = (top * cot["v"]).sum() + (lab * cot["l"]).sum() + (ent * cot["e"]).sum()
    dh, dw = torch.autograd.grad(loss, (h, w))
    return {
        "values": top.detach(),
        "ids": ids,
        "label": lab.detach(),
        "entropy": ent.detach(),
        "dh": dh,
        "dw": dw,
    }


def _cot(k: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "v": torch.randn(N, k, generator=g, dtype=torch.float64),
        "l": torch.randn(N, generator=g, dtype=torch.float64),
        "e": torch.randn(N, generator=g, dtype=torch.float64),
    }


def _ours(
    p: dict[str, torch.Tensor], k: int, cot: dict[str, torch.Tensor], **kw: Any
) -> dict[str, torch.Tensor]:
    h = p["h"].clone().requires_grad_()
    w = kw.pop("w", p["w"]).clone().requires_grad_()
    options = LinearOptions(temperature=p["t"], **kw)
    r = linear_topk_logprobs(h, w, k=k, labels=p["y"], with_entropy=True, options=options)
    assert r.label_logprobs is not None and r.entropy is not None
    loss = (
        (r.logprobs * cot["v"]).sum()
        + (r.label_logprobs * cot["l"]).sum()
        + (r.entropy * cot["e"]).sum()
    )
    loss.backward()
    return {
        "values": r.logprobs.detach(),
        "ids": r.ids,
        "label": r.label_logprobs.detach(),
        "entropy": r.entropy.detach(),
        "dh": h.grad,
        "dw": w.grad,
    }


def _assert_equal(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = 1e-11
) -> None:
    assert torch.equal(got["ids"], want["ids"]), (got["ids"], want["ids"])
    for key in ("values", "label", "entropy", "dh", "dw"):
        torch.testing.assert_close(got[key], want[key], rtol=tol, atol=tol, msg=key)


@pytest.mark.parametrize("k", [1, 4, V])
@pytest.mark.parametrize(("vocab_chunk", "token_chunk"), [(7, 5), (V, N), (1, 1)])
def test_against_float64(k: int, vocab_chunk: int, token_chunk: int) -> None:
    p, cot = _problem(), _cot(k)
    got = _ours(p, k, cot, tile_cols=vocab_chunk, tile_rows=token_chunk)
    _assert_equal(got, _truth(p, k, cot))
    assert bool((got["values"][:, :-1] >= got["values"][:, 1:]).all())


@pytest.mark.parametrize("vocab_chunk", [4, 7, V])
def test_ties_go_to_the_smaller_id(vocab_chunk: int) -> None:
    p = _problem(2, ties=True)  # token 0's best ids: 2, 5, 30, all equal
    cot = _cot(6)
    got = _ours(p, 6, cot, tile_cols=vocab_chunk, tile_rows=4)
    assert got["ids"][0, :3].tolist() == [2, 5, 30]
    _assert_equal(got, _truth(p, 6, cot))


def test_a_loss_renormalised_over_the_k_needs_no_logits_in_backward() -> None:
    """``log_softmax`` over the k values: the cotangents of a row sum to zero, and the
    backward (the selected rows of W only) must still equal the truth."""
    p = _problem(3)
    h = p["h"].clone().requires_grad_()
    w = p["w"].clone().requires_grad_()
    r = linear_topk_logprobs(h, w, k=5, options=LinearOptions(temperature=p["t"], tile_cols=9))
    g = torch.randn(N, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (r.logprobs.log_softmax(-1) * g).sum().backward()
    hh = p["h"].clone().requires_grad_()
    ww = p["w"].clone().requires_grad_()
    lp = ((hh @ ww.T) / p["t"][:, None]).log_softmax(-1)
    (lp.gather(1, r.ids).log_softmax(-1) * g).sum().backward()
    torch.testing.assert_close(h.grad, hh.grad, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(w.grad, ww.grad, rtol=1e-11, atol=1e-11)


def test_float32_within_float32_error() -> None:
    p, cot = _problem(5), _cot(3)
    got = _ours({**p, "h": p["h"].float(), "w": p["w"].float()}, 3, cot, tile_cols=8)
    want = _truth(p, 3, cot)
    _assert_equal(
        {k: v.double() if v.is_floating_point() else v for k, v in got.items()}, want, tol=2e-5
    )


def test_without_labels_and_nan_rows() -> None:
    p = _problem()
    h = p["h"].clone()
    h[4, 0] = float("nan")
    r = linear_topk_logprobs(h, p["w"], k=3, options=LinearOptions(tile_cols=10))
    assert r.label_logprobs is None and r.entropy is None
    assert bool(r.logprobs[4].isnan().all())
    assert bool(torch.isfinite(r.logprobs[torch.arange(N) != 4]).all())


@pytest.mark.parametrize(("k", "field"), [(0, "k"), (V + 1, "k"), (2.0, "k")])
def test_bad_k(k: Any, field: str) -> None:
    p = _problem()
    with pytest.raises(ContractError) as info:
        linear_topk_logprobs(p["h"], p["w"], k=k)
    assert info.value.field == field


@pytest.mark.parametrize("k", [0, -1, 2.0, True, "3"])
def test_bad_k_in_the_processor_factory(k: Any) -> None:
    """The factory does not know the vocabulary (``k > V`` is refused at the call):
    it refuses what is not an int >= 1."""
    with pytest.raises(ContractError) as info:
        topk_logprobs(k)
    assert info.value.field == "k"


def test_processor_layout_without_labels() -> None:
    g = torch.Generator().manual_seed(0)
    s, b = 5, 2
    hs = torch.randn(s, b, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    ctx = OutputContext(hidden_states=hs, vocab_weight=w, vocab=VocabShard(0, V, V))
    out = topk_logprobs(3, temperature=0.5)(ctx)
    assert set(out) == {"topk_logprobs", "topk_ids"}
    hookspec.validate_result(out, batch=b, seq=s)
    lp = (torch.einsum("sbh,vh->bsv", hs, w) / 0.5).log_softmax(-1)
    want = torch.sort(lp, dim=-1, descending=True, stable=True)
    assert torch.equal(out["topk_ids"], want.indices[..., :3])
    torch.testing.assert_close(out["topk_logprobs"], want.values[..., :3], rtol=1e-12, atol=1e-12)


def test_through_the_hook_on_the_tiny_gpt(megatron_single: None) -> None:
    model = build_tiny_gpt()
    batch = tiny_batch(2, 8, 64, seed=2)
    args = (batch["input_ids"], batch["position_ids"], None)
    logits = model(*args).double()  # [b, s, V]
    torch_impl.enable_output_processor(model)
    out = model(
        *args, labels=batch["labels"], output_processor=topk_logprobs(5, entropy=True, tile_cols=24)
    )
    logp = logits.log_softmax(-1)
    want = torch.sort(logp, dim=-1, descending=True, stable=True)
    assert torch.equal(out["topk_ids"], want.indices[..., :5])
    torch.testing.assert_close(
        out["topk_logprobs"].double(), want.values[..., :5], rtol=0, atol=2e-6
    )
    torch.testing.assert_close(
        out["logprobs"].double(),
        logp.gather(2, batch["labels"][..., None]).squeeze(-1),
        rtol=0,
        atol=2e-6,
    )
    out["topk_logprobs"].sum().backward()
    assert all(q.grad is not None for q in model.parameters() if q.requires_grad)


_OldCollectives = identity_collectives("_OldCollectives")  # written for spec 1.0: no all_gather


def test_old_collectives_work_at_tp1_and_are_refused_by_name_on_a_shard() -> None:
    p = _problem()
    old = _OldCollectives()
    assert isinstance(old, hookspec.Collectives)
    r = linear_topk_logprobs(p["h"], p["w"], k=2, options=LinearOptions(collectives=old))
    assert r.ids.shape == (N, 2)
    with pytest.raises(ContractError) as info:
        linear_topk_logprobs(
            p["h"],
            p["w"][:19],
            k=2,
            options=LinearOptions(collectives=old, vocab=VocabShard(0, 19, V)),
        )
    assert info.value.field == "collectives.all_gather"


# ---------------------------------------------------------------- tensor parallel


def _tp2(
    rank: int,
    p: dict[str, torch.Tensor],
    cases: list[tuple[int, dict, dict]],
    sp: tuple[dict, dict, dict],
) -> None:
    from megatron.core import parallel_state

    from torch_impl import TorchCollectives

    group = parallel_state.get_tensor_model_parallel_group()
    coll = TorchCollectives(group, sequence_parallel=False)
    half = V // 2
    shard = slice(rank * half, (rank + 1) * half)
    for k, cot, want in cases:
        got = _ours(
            p, k, cot, w=p["w"][shard], vocab=VocabShard(rank * half, (rank + 1) * half, V),
            collectives=coll, tile_cols=6, tile_rows=5,
        )  # fmt: skip
        want = {**want, "dw": want["dw"][shard]}
        _assert_equal(got, want)
    # the processor at tp=2: [b, s, k] on each rank
    s, b = N, 1
    ctx = OutputContext(
        hidden_states=p["h"][:, None, :],
        vocab_weight=p["w"][shard],
        labels=p["y"][None, :],
        vocab=VocabShard(rank * half, (rank + 1) * half, V),
        parallel=ParallelLayout(tp_size=2, tp_rank=rank),
        collectives=coll,
    )
    out = topk_logprobs(3)(ctx)
    assert out["topk_ids"].shape == (b, s, 3)
    assert torch.equal(out["topk_ids"][0], cases[0][2]["ids"])
    # sequence parallel: each rank holds half of the rows
    p_sp, cot, want = sp
    rows = slice(rank * 11, (rank + 1) * 11)
    h = p_sp["h"][rows].clone().requires_grad_()
    w = p_sp["w"][shard].clone().requires_grad_()
    r = linear_topk_logprobs(
        h,
        w,
        k=3,
        labels=p_sp["y"],
        with_entropy=True,
        options=LinearOptions(
            temperature=p_sp["t"],
            collectives=GlooSequenceParallel(coll, group),
            tile_cols=7,
            vocab=VocabShard(rank * half, (rank + 1) * half, V),
        ),
    )
    assert r.label_logprobs is not None and r.entropy is not None
    loss = (
        (r.logprobs * cot["v"]).sum()
        + (r.label_logprobs * cot["l"]).sum()
        + (r.entropy * cot["e"]).sum()
    )
    loss.backward()
    assert torch.equal(r.ids, want["ids"])
    torch.testing.assert_close(r.logprobs, want["values"], rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(h.grad, want["dh"][rows], rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(w.grad, want["dw"][shard], rtol=1e-11, atol=1e-11)


@pytest.mark.release_independent
def test_tp2_equals_float64() -> None:
    """k = 3, k = V_local and k > V_local (each shard gives all it has); ties inside
    a shard and across the two halves (ids 2, 5 | 30 and 9 | 21, 36); the processor;
    sequence-parallel rows (a gloo stand-in for Megatron's gather)."""
    p = _problem(6, ties=True)
    p["t"] = torch.ones(N, dtype=torch.float64)
    cases = []
    for k in (3, V // 2, V // 2 + 4):
        cot = _cot(k, seed=k)
        cases.append((k, cot, _truth(p, k, cot)))
    assert cases[0][2]["ids"][0].tolist() == [2, 5, 30] and cases[0][2]["ids"][1].tolist() == [
        9,
        21,
        36,
    ]
    p_sp = {
        **p,
        "h": p["h"][:22],
        "y": p["y"][:22],
        "t": _problem(7)["t"][:22],
    }  # 22 rows: 11 a rank
    cot = {key: c[:22] for key, c in _cot(3, seed=9).items()}
    run_distributed(_tp2, p, cases, (p_sp, cot, _truth(p_sp, 3, cot)), tp=2)


def test_every_optional_collective_is_no_newer_than_the_spec() -> None:
    """Each method a ``Collectives`` may lack says the minor it was added in
    (``.. versionadded::``), and ``SPEC_VERSION`` is at least that: a method added
    without a bump of the minor fails here."""
    from hookspec.collectives import OPTIONAL_COLLECTIVES, REQUIRED_COLLECTIVES

    methods = {n for n in vars(hookspec.Collectives) if not n.startswith("_")}
    assert methods == set(REQUIRED_COLLECTIVES) | set(OPTIONAL_COLLECTIVES)
    for name in OPTIONAL_COLLECTIVES:
        found = re.search(
            r"\.\. versionadded:: (\d+)\.(\d+)", getattr(hookspec.Collectives, name).__doc__
        )
        assert found is not None, name
        assert (int(found[1]), int(found[2])) <= hookspec.SPEC_VERSION, name


def test_gather_of_one_rank_is_the_input_on_a_new_leading_dim() -> None:
    x = torch.arange(6.0).view(2, 3)
    got = hookspec.SingleProcessCollectives().all_gather(x)
    assert got.shape == (1, 2, 3) and torch.equal(got[0], x)
