"""A label range check that does not stall the GPU.

``hookspec.check_labels`` reads the labels' range on the host: on a GPU that is one
device synchronisation per call, which stalls the pipeline and cannot be captured
in a CUDA graph. :func:`check_labels_deferred` does the same check with no host
read on CUDA:

- the count, min and max of the bad ids are reduced on the device and copied,
  non-blocking, into pinned host memory, behind a CUDA event;
- the result is read when the event has completed: at the next check (the next
  forward), or at :func:`raise_pending_label_errors` (``wait=True`` waits). A bad
  batch raises :class:`hookspec.ContractError` naming the field, the expected
  range and the ids found, one step late at the latest;
- under CUDA-graph capture, where no host copy may be recorded, it is
  ``torch._assert_async`` (a device-side assert: fatal to the process, as every
  device-side assert is, and the only check a captured graph can carry).

On a CPU there is nothing to stall: the check is ``hookspec.check_labels``, at once.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch

from hookspec import ContractError, check_labels

__all__ = ["check_labels_deferred", "pending_label_checks", "raise_pending_label_errors"]

_BIG = torch.iinfo(torch.int64).max


@dataclasses.dataclass(frozen=True)
class _Pending:
    event: Any  # torch.cuda.Event
    host: torch.Tensor  # pinned int64 [3]: count, min, max of the bad ids
    field: str
    vocab_size: int
    ignore_index: int


_PENDING: collections.deque[_Pending] = collections.deque()


def pending_label_checks() -> int:
    """How many deferred checks have not been read yet."""
    return len(_PENDING)


def raise_pending_label_errors(*, wait: bool = False) -> None:
    """Read the deferred checks whose copy has landed (all of them with ``wait``, which
    synchronises on their events), oldest first; raise for the first that found ids
    outside the vocabulary. Each check is read once."""
    while _PENDING:
        p = _PENDING[0]
        if not wait and not p.event.query():
            return
        p.event.synchronize()
        _PENDING.popleft()
        count, lo, hi = (int(v) for v in p.host.tolist())
        if count:
            raise ContractError(
                p.field,
                expected=f"token ids in [0, {p.vocab_size}) or ignore_index={p.ignore_index}",
                actual=f"{count} ids outside it, in [{lo}, {hi}] (found by the deferred check of an "
                "earlier call)",
            )


def check_labels_deferred(labels: Any, vocab_size: int, *, ignore_index: int, field: str = "labels") -> None:
    """``hookspec.check_labels`` without a host read on CUDA (see the module docstring).

    Raises at once for a wrong type or dtype, and for the bad ids of an earlier
    deferred check whose result has landed.
    """
    raise_pending_label_errors()
    if not isinstance(labels, torch.Tensor) or labels.device.type != "cuda":
        check_labels(labels, vocab_size, ignore_index=ignore_index, field=field)
        return
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        check_labels(labels, vocab_size, ignore_index=ignore_index, field=field)  # raises, naming the dtype
    if labels.numel() == 0:
        return
    bad = ((labels < 0) | (labels >= vocab_size)) & (labels != ignore_index)
    if torch.cuda.is_current_stream_capturing():
        torch._assert_async(
            ~bad.any(), f"{field}: token ids outside [0, {vocab_size}) other than ignore_index={ignore_index}"
        )
        return
    ids = labels.to(torch.int64)
    stats = torch.stack(
        [bad.sum(), torch.where(bad, ids, _BIG).min(), torch.where(bad, ids, -_BIG).max()]
    ).to(torch.int64)
    host = torch.empty(3, dtype=torch.int64, pin_memory=True)
    host.copy_(stats, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _PENDING.append(_Pending(event, host, field, vocab_size, ignore_index))
