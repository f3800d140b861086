"""TorchCollectives at tp=2 over gloo, with strided inputs and gradients, which
Megatron Core 0.16's mappings silently leave unreduced."""

from __future__ import annotations

import pytest
import torch

import hookspec
from tests.support.distributed import run_distributed
from torch_impl import TorchCollectives


def _rank(rank: int) -> None:
    from megatron.core import parallel_state

    coll = TorchCollectives(
        parallel_state.get_tensor_model_parallel_group(), sequence_parallel=False
    )
    assert isinstance(coll, hookspec.Collectives) and coll.size == 2
    base = torch.arange(6.0).reshape(2, 3) + 10 * rank  # rank 0: 0..5, rank 1: 10..15

    # all_reduce_sum: a transposed (strided) view is reduced, the input untouched,
    # backward identity.
    x = base.clone().requires_grad_(True)
    view = x.t()
    assert not view.is_contiguous()
    total = coll.all_reduce_sum(view)
    expected = (torch.arange(6.0).reshape(2, 3) * 2 + 10).t()
    assert torch.equal(total, expected)
    assert torch.equal(x.detach(), base)
    total.sum().backward()
    assert torch.equal(x.grad, torch.ones(2, 3))

    # all_reduce_max: elementwise max over ranks, detached.
    m = coll.all_reduce_max(base.t().requires_grad_(True))
    assert torch.equal(m, (torch.arange(6.0).reshape(2, 3) + 10).t()) and not m.requires_grad

    # gather_hidden_states without SP: forward identity, backward all-reduce, also of a
    # non-contiguous gradient (the gradient of a transpose).
    h = torch.ones(4, 2, 3, requires_grad=True)
    full = coll.gather_hidden_states(h)
    assert torch.equal(full, h)
    (full.transpose(0, 2) * (rank + 1)).sum().backward()
    assert torch.equal(h.grad, torch.full((4, 2, 3), 3.0))  # 1 + 2 over the two ranks


@pytest.mark.slow
def test_collectives_reduce_strided_tensors_and_gradients_at_tp2() -> None:
    run_distributed(_rank, tp=2)
