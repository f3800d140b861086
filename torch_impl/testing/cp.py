"""Megatron's context-parallel split of a batch, written out for tests.

Under context parallel (``cp`` ranks) Megatron balances the causal attention work
by cutting each sequence into ``2 cp`` equal chunks and giving rank ``r`` chunks
``r`` and ``2 cp - 1 - r``, in that order:

- not packed (``[b, s]``, ``s`` a multiple of ``2 cp``): every row is cut so, by
  ``megatron.core.utils.get_batch_on_this_cp_rank`` (tested equal to
  :func:`cp_chunk_index`);
- packed (THD, one row of sequences at ``cu_seqlens_padded``, each a multiple of
  ``2 cp``): every sequence is cut so and rank ``r``'s parts are concatenated,
  sequence after sequence. Megatron's ``get_thd_batch_on_this_cp_rank`` takes
  these indices from Transformer Engine's ``thd_get_partitioned_indices``, which
  has no CPU build; :func:`thd_partition_index` writes the same layout out (each
  sequence's part tested equal to Megatron's non-packed split of that sequence).
  Each rank keeps the global ``cu_seqlens``; its own boundaries are ``cu / cp``.

Used by ``tests/processors/test_policy_cp.py``; nothing in the library imports it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

__all__ = [
    "cp_chunk_index",
    "padded_cu_seqlens",
    "thd_partition_index",
]


def cp_chunk_index(length: int, cp: int, rank: int) -> torch.Tensor:
    """The positions ``[length / cp]`` rank ``rank`` holds of one sequence of
    ``length`` (a multiple of ``2 cp``)::

        c = length // (2 * cp)
        cat([arange(rank * c, (rank + 1) * c),
             arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])
    """
    if length % (2 * cp):
        raise ValueError(f"length {length} is not a multiple of 2 * cp = {2 * cp}")
    c = length // (2 * cp)
    mirror = 2 * cp - 1 - rank
    return torch.cat(
        [torch.arange(rank * c, (rank + 1) * c), torch.arange(mirror * c, (mirror + 1) * c)]
    )


def thd_partition_index(cu_seqlens_padded: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """The packed positions ``[T / cp]`` rank ``rank`` holds, ``T = cu[-1]``: each
    sequence ``[cu[k], cu[k + 1])`` split by :func:`cp_chunk_index`, in order."""
    cu = [int(v) for v in cu_seqlens_padded.tolist()]
    parts = [start + cp_chunk_index(end - start, cp, rank) for start, end in itertools.pairwise(cu)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def padded_cu_seqlens(lengths: Sequence[int], multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens, cu_seqlens_padded)`` (int32) of sequences of ``lengths``, each
    padded at its end to a multiple of ``multiple`` (``2 cp``). ``cu_seqlens``
    counts the real tokens only; sequence ``k``'s real tokens sit at
    ``[cu_seqlens_padded[k], cu_seqlens_padded[k] + lengths[k])``."""
    padded = [-(-n // multiple) * multiple for n in lengths]

    def cumsum(xs: Sequence[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(list(xs)).cumsum(0).tolist()], dtype=torch.int32)

    return cumsum(lengths), cumsum(padded)
