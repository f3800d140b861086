"""The default MTP processor's vocab-parallel part under tensor parallelism 2.

A whole MTP model cannot run tp=2 on a CPU: the MTP layer's projection gathers
its output into a CUDA buffer. The top-1 acceptance that feeds Megatron's
logging runs here on two vocab shards of known logits, against a
single-process argmax (the loss itself is Megatron's vocab-parallel cross
entropy, called as it is).
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
    from torch_impl.mtp import _top1_accepted

    rows = slice(32 * rank, 32 * (rank + 1))
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
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_token_prediction as mtp

    if hasattr(mtp, "_vocab_parallel_argmax"):  # 0.19: Megatron's own rule for its acceptance count
        group = parallel_state.get_tensor_model_parallel_group()
        preds = mtp._vocab_parallel_argmax(z[..., rows].contiguous(), group, 2)
        assert torch.equal(accepted, preds.transpose(0, 1) == chosen)


def test_top1_acceptance_under_tp2() -> None:
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(5, 2, H, generator=g)  # [s, b, h]
    weight = torch.randn(V, H, generator=g) * 2.0
    labels = torch.randint(0, V, (2, 5), generator=g)
    run_distributed(_tp2_rank, hidden, weight, labels, tp=2)
