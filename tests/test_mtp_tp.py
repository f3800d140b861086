"""The MTP processors under tensor parallelism 2 (two gloo processes).

A whole MTP model cannot run tp=2 on a CPU: the MTP layer's projection gathers
its output into a CUDA buffer. These tests run the vocab-parallel parts of the
MTP processors on shards of known global arrays instead, against float64 and
single-process references.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.distributed import run_distributed

V, H = 64, 8


def _shard_ctx(rank: int, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> Any:
    from megatron.core import parallel_state

    import hookspec
    from hookspec import OutputContext
    from torch_impl.collectives import TorchCollectives

    group = parallel_state.get_tensor_model_parallel_group()
    rows = slice(32 * rank, 32 * (rank + 1))
    return OutputContext(
        hidden_states=hidden,
        labels=labels,
        vocab_weight=weight[rows],
        parallel=hookspec.ParallelLayout(tp_size=2, tp_rank=rank),
        vocab=hookspec.VocabShard(rows.start, rows.stop, V),
        collectives=TorchCollectives(group, sequence_parallel=False),
    )


def _tp2_rank(rank: int, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    from torch_impl.mtp import _top1_accepted, chunked_mtp_loss

    # chunked cross entropy against float64 on the global arrays
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    ctx = _shard_ctx(rank, h, w, labels)
    loss = chunked_mtp_loss(chunk_tokens=3)(ctx)  # [b, s]
    cot = torch.linspace(-1.0, 2.0, loss.numel()).reshape(loss.shape)
    (loss * cot).sum().backward()
    h64 = hidden.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    logits = torch.einsum("sbh,vh->bsv", h64, w64)
    want = -torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (want * cot.double()).sum().backward()
    tol = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(loss.double(), want.detach(), **tol)
    torch.testing.assert_close(h.grad.double(), h64.grad, **tol)  # both shards' parts
    rows = slice(32 * rank, 32 * (rank + 1))
    torch.testing.assert_close(w.grad[rows].double(), w64.grad[rows], **tol)
    assert torch.equal(w.grad[32 * (1 - rank) : 32 * (2 - rank)], torch.zeros(32, H))

    # top-1 acceptance over the two shards, with a tie across them: the first index wins
    z = torch.einsum("sbh,vh->sbv", hidden, weight)
    z[0, 0, 5] = z[0, 0, 40] = 100.0
    chosen = labels.clone()
    chosen[0, 0] = 5
    chosen[1, 1] = 40
    want_accepted = z.argmax(-1).transpose(0, 1) == chosen
    accepted = _top1_accepted(_shard_ctx(rank, hidden, weight, chosen), z[..., rows])
    assert torch.equal(accepted, want_accepted)
    assert bool(accepted[0, 0]) and not bool(accepted[1, 1])


def test_mtp_processors_under_tp2() -> None:
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(5, 2, H, generator=g)  # [s, b, h]
    weight = torch.randn(V, H, generator=g) * 2.0
    labels = torch.randint(0, V, (2, 5), generator=g)
    run_distributed(_tp2_rank, hidden, weight, labels, tp=2)
