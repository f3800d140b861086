"""``hookspec.Collectives`` over a Megatron tensor-parallel process group."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed.nn.functional
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from hookspec import ContractError

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


def _check_group(field: str, group: Any) -> None:
    if group is not None and not isinstance(group, torch.distributed.ProcessGroup):
        raise ContractError(
            field,
            expected="a torch.distributed.ProcessGroup (Megatron's parallel_state groups) or None "
            "(one rank)",
            actual=repr(group) if isinstance(group, (str, int, float)) else type(group).__name__,
        )


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
    - ``all_reduce_sum_context_parallel``: over ``cp_group`` (Megatron's
      context-parallel group, or the micro-batch's ``packed_seq_params.cp_group``),
      ``torch.distributed.nn.functional.all_reduce`` (forward all-reduce, backward
      all-reduce: each rank's loss is its own share); the identity where
      ``cp_group`` is ``None`` or has one rank.
    - ``all_gather``: ``torch.distributed.all_gather`` of a detached copy,
      stacked on a new leading dim in rank order; no gradient. A new tensor
      on every group size (at one rank too, never a view of ``x``).

    ``group`` and ``cp_group`` are ``torch.distributed`` process groups or
    ``None`` (one rank); ``sequence_parallel`` is a bool. Anything else raises
    ``ContractError`` naming the argument. Its results follow the contract by
    construction (``checked_results``: ``hookspec.checked_collectives`` leaves
    it unwrapped).
    """

    checked_results: ClassVar[bool] = True

    def __init__(self, group: Any, *, sequence_parallel: bool, cp_group: Any = None) -> None:
        _check_group("group", group)
        _check_group("cp_group", cp_group)
        if not isinstance(sequence_parallel, bool):
            raise ContractError(
                "sequence_parallel", expected="a bool", actual=repr(sequence_parallel)
            )
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.size = torch.distributed.get_world_size(group) if group is not None else 1
        self.cp_group = cp_group
        self.cp_size = torch.distributed.get_world_size(cp_group) if cp_group is not None else 1

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
            full = gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=True, group=self.group
            )
        else:
            full = copy_to_tensor_model_parallel_region(x, group=self.group)
        return _ContiguousGrad.apply(full)

    def all_gather(self, x: torch.Tensor, /) -> torch.Tensor:
        """``[tp, *x.shape]``: every rank's ``x`` in rank order; no gradient."""
        if self.size == 1:
            return x.detach().clone()[None]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.detach().contiguous(), group=self.group)
        return torch.stack(parts)

    def all_reduce_sum_context_parallel(self, x: torch.Tensor, /) -> torch.Tensor:
        if self.cp_size == 1:
            return x
        return torch.distributed.nn.functional.all_reduce(x, group=self.cp_group)

    def __repr__(self) -> str:
        cp = f", cp_size={self.cp_size}" if self.cp_size > 1 else ""
        return f"TorchCollectives(size={self.size}, sequence_parallel={self.sequence_parallel}{cp})"
