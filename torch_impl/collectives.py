"""``hookspec.Collectives`` over a Megatron tensor-parallel process group."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

__all__ = ["TorchCollectives"]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous.

    Megatron Core 0.13 to 0.18 all-reduces ``grad.contiguous()`` in
    ``copy_to_tensor_model_parallel_region``'s backward and returns the
    *unreduced* gradient when it was not contiguous (an einsum's gradient often
    is not), silently leaving each rank with its own partial hidden-state
    gradient. Placing this after the mapping hands it a contiguous gradient.
    (``tensor_parallel/mappings.py::_reduce``; fixed in 0.19. See
    ``docs/upstream.md``.)
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class TorchCollectives:
    """The contract's collectives over ``group``, Megatron's own autograd mappings.

    - ``all_reduce_sum``: ``reduce_from_tensor_model_parallel_region`` (forward
      all-reduce, backward identity) on a contiguous copy: ``x`` is never
      modified, and a strided ``x`` is reduced too (Megatron < 0.17 returns a
      strided input unreduced).
    - ``all_reduce_max``: ``torch.distributed.all_reduce(op=MAX)`` on a detached
      copy; no gradient.
    - ``gather_hidden_states``: ``gather_from_sequence_parallel_region(...,
      tensor_parallel_output_grad=True)`` under sequence parallel (backward
      reduce-scatter), else ``copy_to_tensor_model_parallel_region`` (forward
      identity, backward all-reduce), so the hidden-state gradient is whole; its
      gradient is made contiguous first (see ``_ContiguousGrad``).
    """

    def __init__(self, group: Any, *, sequence_parallel: bool) -> None:
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.size = torch.distributed.get_world_size(group) if group is not None else 1

    def all_reduce_sum(self, x: torch.Tensor, /) -> torch.Tensor:
        if self.size == 1:
            return x
        # A contiguous copy: Megatron 0.13 to 0.18 reduces a contiguous copy of a strided
        # input in place and returns the unreduced original.
        return reduce_from_tensor_model_parallel_region(
            x.clone(memory_format=torch.contiguous_format), group=self.group
        )

    def all_reduce_max(self, x: torch.Tensor, /) -> torch.Tensor:
        y = x.detach().clone()
        if self.size > 1:
            torch.distributed.all_reduce(y, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return y

    def gather_hidden_states(self, x: torch.Tensor, /) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.sequence_parallel:
            full = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=self.group)
        else:
            full = copy_to_tensor_model_parallel_region(x, group=self.group)
        return _ContiguousGrad.apply(full)

    def __repr__(self) -> str:
        return f"TorchCollectives(size={self.size}, sequence_parallel={self.sequence_parallel})"
