"""The processors under tensor parallel 2 (gloo, two processes) against float64 truth.

Each rank holds half of the vocabulary. Without sequence parallel both ranks hold
every hidden row, and the hidden-state gradient must hold both shards'
contributions (``TorchCollectives.gather_hidden_states`` all-reduces it); with
sequence parallel each rank holds half of the rows (a test-local gloo gather
stands in for Megatron's, whose buffers need CUDA; the Megatron one runs in the
GPU test).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hookspec import VocabShard
from tests.support.distributed import GlooSequenceParallel, run_distributed
from torch_impl.processors import LinearOptions, fused_token_loss, linear_logprobs

IGNORE = -100
N, H, V = 24, 8, 70


def _problem() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, V, (N,), generator=g)
    y[[2, 9]] = IGNORE
    y[0], y[1] = 0, V - 1
    return {
        "h": torch.randn(N, H, generator=g, dtype=torch.float64),
        "w": torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7,
        "y": y,
        "t": torch.rand(N, generator=g, dtype=torch.float64) + 0.5,
        "c_lp": torch.randn(N, generator=g, dtype=torch.float64),
        "c_ent": torch.randn(N, generator=g, dtype=torch.float64),
    }


def _token_loss(c_lp: torch.Tensor, c_ent: torch.Tensor) -> Any:
    def loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
        return (c_lp[rows] * lp + c_ent[rows] * ent**2).sum()

    return loss


def _truth(p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    h = p["h"].clone().requires_grad_()
    w = p["w"].clone().requires_grad_()
    z = (h @ w.T) / p["t"][:, None]
    logp = z.log_softmax(-1)
    y = p["y"]
    lp = torch.where(y == IGNORE, 0.0, logp.gather(1, y.clamp(min=0)[:, None]).squeeze(1))
    ent = -(logp.exp() * logp).sum(-1)
    loss = (p["c_lp"] * lp + p["c_ent"] * ent**2).sum()
    loss.backward()
    return {
        "lp": lp.detach(),
        "ent": ent.detach(),
        "loss": loss.detach(),
        "dh": h.grad,
        "dw": w.grad,
    }


def _tp2_functions(rank: int, p: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> None:
    from megatron.core import parallel_state

    from torch_impl import TorchCollectives

    group = parallel_state.get_tensor_model_parallel_group()
    coll = TorchCollectives(group, sequence_parallel=False)
    half = V // 2
    shard = slice(rank * half, (rank + 1) * half)
    tol = {"rtol": 0.0, "atol": 1e-10}
    shard_rows = VocabShard(rank * half, (rank + 1) * half, V)
    kw = {"temperature": p["t"], "vocab": shard_rows, "tile_cols": 16, "tile_rows": 5}

    # 1. logprobs and entropy, autograd through the recomputing backward
    h = p["h"].clone().requires_grad_()
    w = p["w"][shard].clone().requires_grad_()
    r = linear_logprobs(
        h, w, p["y"], with_entropy=True, options=LinearOptions(collectives=coll, **kw)
    )
    assert r.entropy is not None
    (p["c_lp"] * r.logprobs + p["c_ent"] * r.entropy**2).sum().backward()
    torch.testing.assert_close(r.logprobs, truth["lp"], **tol)
    torch.testing.assert_close(r.entropy, truth["ent"], **tol)
    torch.testing.assert_close(h.grad, truth["dh"], **tol)  # both shards' contributions
    torch.testing.assert_close(w.grad, truth["dw"][shard], **tol)

    # 2. the fused loss: gradients formed in the forward pass, one all-reduce per tile
    h = p["h"].clone().requires_grad_()
    w = p["w"][shard].clone().requires_grad_()
    f = fused_token_loss(
        h,
        w,
        p["y"],
        _token_loss(p["c_lp"], p["c_ent"]),
        options=LinearOptions(
            temperature=p["t"],
            collectives=coll,
            vocab=VocabShard(rank * half, (rank + 1) * half, V),
            tile_rows=max(1, 7 * half // w.shape[0]),
        ),
    )
    f.loss.backward()
    torch.testing.assert_close(f.loss, truth["loss"], **tol)
    torch.testing.assert_close(h.grad, truth["dh"], **tol)
    torch.testing.assert_close(w.grad, truth["dw"][shard], **tol)

    # 2b. the single pass (no gradient through the entropy): each shard's exp(z - c)
    # relative to its own max, the loss called once per gradient buffer
    want = _truth(dict(p, c_ent=torch.zeros_like(p["c_ent"])))
    h = p["h"].clone().requires_grad_()
    w = p["w"][shard].clone().requires_grad_()
    f = fused_token_loss(
        h,
        w,
        p["y"],
        lambda lp, ent, rows: (p["c_lp"][rows] * lp).sum(),
        options=LinearOptions(temperature=p["t"], collectives=coll, vocab=shard_rows, tile_rows=5),
        entropy_grad=False,
    )
    (f.loss * 0.7).backward()
    torch.testing.assert_close(f.loss, want["loss"], **tol)
    torch.testing.assert_close(f.entropy, want["ent"], **tol)
    torch.testing.assert_close(h.grad, 0.7 * want["dh"], **tol)
    torch.testing.assert_close(w.grad, 0.7 * want["dw"][shard], **tol)

    # 3. sequence parallel: each rank holds half of the rows
    rows = slice(rank * N // 2, (rank + 1) * N // 2)
    h_local = p["h"][rows].clone().requires_grad_()
    w = p["w"][shard].clone().requires_grad_()
    sp = GlooSequenceParallel(coll, group)
    r = linear_logprobs(
        h_local, w, p["y"], with_entropy=True, options=LinearOptions(collectives=sp, **kw)
    )
    assert r.entropy is not None
    (p["c_lp"] * r.logprobs + p["c_ent"] * r.entropy**2).sum().backward()
    torch.testing.assert_close(r.logprobs, truth["lp"], **tol)
    torch.testing.assert_close(h_local.grad, truth["dh"][rows], **tol)
    torch.testing.assert_close(w.grad, truth["dw"][shard], **tol)


def _tp2_model(rank: int, batch: dict[str, Any], cotangent: torch.Tensor, tied: bool) -> None:
    import torch_impl
    from torch_impl.processors import cross_entropy_loss, selected_logprobs
    from torch_impl.testing.tiny import build_tiny_gpt

    model = build_tiny_gpt(share_embeddings_and_output_weights=tied)
    args = (batch["input_ids"], batch["position_ids"], None)
    stock = model(*args, labels=batch["labels"])
    (stock * cotangent).sum().backward()
    stock_grads = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    torch_impl.enable_output_processor(model)
    ours = model(
        *args,
        labels=batch["labels"],
        output_processor=cross_entropy_loss(tile_cols=7, tile_rows=5),
    )
    (ours * cotangent).sum().backward()
    torch.testing.assert_close(ours, stock, rtol=1e-6, atol=1e-6)
    for name, q in model.named_parameters():
        torch.testing.assert_close(q.grad, stock_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    out = model(*args, labels=batch["labels"], output_processor=selected_logprobs(entropy=True))
    torch.testing.assert_close(out["logprobs"], -stock.detach(), rtol=1e-6, atol=1e-6)
    assert bool((out["entropy"] >= 0).all())


def _tp2_all(
    rank: int,
    p: dict[str, torch.Tensor],
    truth: dict[str, torch.Tensor],
    batch: dict[str, Any],
    cot: torch.Tensor,
) -> None:
    _tp2_functions(rank, p, truth)
    _tp2_model(rank, batch, cot, tied=False)
    _tp2_model(rank, batch, cot, tied=True)


def test_tp2_against_float64_and_megatron() -> None:
    """One pair of processes (each start costs seconds) for:

    - ``linear_logprobs``, ``fused_token_loss`` and sequence-parallel rows
      against float64 truth (values, whole hidden-state gradient, weight shard
      gradient);
    - the tiny GPT at tp=2, untied and tied: ``cross_entropy_loss``'s loss and
      every parameter gradient equal Megatron's own output layer and
      vocab-parallel cross entropy (tied: the embedding takes both gradients).
    """
    from torch_impl.testing.tiny import tiny_batch

    p = _problem()
    batch = tiny_batch(2, 8, 64, seed=3)
    cotangent = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    run_distributed(_tp2_all, p, _truth(p), batch, cotangent, tp=2)


def _tp2_megatron_sequence_parallel(
    rank: int, p: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]
) -> None:
    from megatron.core import parallel_state

    from torch_impl import TorchCollectives

    torch.cuda.set_device(0)
    coll = TorchCollectives(
        parallel_state.get_tensor_model_parallel_group(), sequence_parallel=True
    )
    half = V // 2
    shard = slice(rank * half, (rank + 1) * half)
    rows = slice(rank * N // 2, (rank + 1) * N // 2)
    h_local = p["h"][rows].cuda().requires_grad_()
    w = p["w"][shard].cuda().requires_grad_()
    r = linear_logprobs(
        h_local,
        w,
        p["y"].cuda(),
        with_entropy=True,
        options=LinearOptions(
            temperature=p["t"].cuda(),
            collectives=coll,
            vocab=VocabShard(rank * half, (rank + 1) * half, V),
        ),
    )
    assert r.entropy is not None
    (p["c_lp"].cuda() * r.logprobs + p["c_ent"].cuda() * r.entropy**2).sum().backward()
    tol = {"rtol": 0.0, "atol": 1e-10}
    torch.testing.assert_close(r.logprobs.cpu(), truth["lp"], **tol)
    torch.testing.assert_close(h_local.grad.cpu(), truth["dh"][rows], **tol)
    torch.testing.assert_close(w.grad.cpu(), truth["dw"][shard], **tol)


@pytest.mark.gpu
def test_tp2_megatron_sequence_parallel_gather_on_gpu() -> None:
    p = _problem()
    run_distributed(_tp2_megatron_sequence_parallel, p, _truth(p), tp=2)
