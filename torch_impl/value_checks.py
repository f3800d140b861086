"""Value checks that do not stall the GPU: the label range, a positive temperature,
finite (and non-negative) masks and per-token values, index and multiple ranges.

``hookspec.check_labels`` reads the labels' range on the host: on a GPU that is one
device synchronisation per call, which stalls the pipeline and cannot be captured
in a CUDA graph. The checks here make no host read on CUDA:

- the count, min and max of the bad values are reduced on the device and copied,
  non-blocking, into pinned host memory, behind a CUDA event;
- under CUDA-graph capture, where no host copy may be recorded, the check is
  ``torch._assert_async`` (a device-side assert: fatal to the process, as every
  device-side assert is, and the only check a captured graph can carry).

On a CPU there is nothing to stall: the checks read the values at once and raise
inside the call.

**When a deferred error surfaces** (the one rule; nothing else reads a result):

1. A *checked call* is a processor call, a call of a tensor function (``linear_logprobs``,
   ``linear_topk_logprobs``, ``fused_token_loss``, ``linear_distillation_loss``), one call
   of the hook, or a block under :func:`checked_call`; a check made outside all of them is
   a checked call of its own. Checked calls nest; only the outermost one counts (per
   thread).
2. At the **entry** of a checked call, every earlier check whose copy has landed is
   read, oldest first, and the first that found bad values raises
   :class:`hookspec.ContractError` (field, expected range, the values found, "found by
   the deferred check of an earlier call"). Nothing is read anywhere else inside the
   call, so a call never raises for its own values, nor for an earlier call's in its
   middle: its outputs (NaN where a value was bad) always come back.
3. A copy has landed once the host has synchronised with the device after the call
   that recorded it (``torch.cuda.synchronize()``, ``float(loss)``, ``.item()``,
   ``.cpu()`` of any result). So after such a synchronisation, the next checked call
   raises at its entry, always. Without one, it raises at the first entry after the
   copy lands, which depends on timing.
4. :func:`raise_pending_errors` reads the landed checks now; ``wait=True`` waits for
   every copy (one synchronisation on their events) and so always raises for a bad
   value of any earlier call. Call it where a training loop synchronises anyway (say,
   before logging a step).

Each check is read once. Pending checks are kept per process, oldest first.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import torch

from hookspec import ContractError, check_labels
from hookspec.validation import IGNORE_INDEX_OF_A_CONTEXT, labels_expected

__all__ = [
    "check_condition_deferred",
    "checked_call",
    "check_finite_deferred",
    "check_indices_deferred",
    "check_labels_deferred",
    "check_multiple_deferred",
    "check_positive_deferred",
    "pending_checks",
    "raise_pending_errors",
    "refuse_meta",
]


@dataclasses.dataclass(frozen=True)
class _Pending:
    event: Any  # torch.cuda.Event
    host: torch.Tensor  # pinned [3]: count, min, max of the bad values
    field: str
    expected: str
    noun: str  # what the bad values are called in the message: "ids", "values"


_PENDING: collections.deque[_Pending] = collections.deque()


class _Depth(threading.local):
    open = 0  # how many checked calls this thread has open (rule 1: only the outermost reads)


_DEPTH = _Depth()


@contextlib.contextmanager
def checked_call() -> Iterator[None]:
    """One checked call (rule 1 of the module docstring); usable as a decorator. The
    outermost entry reads the landed results of earlier calls and raises for the first
    bad one (rule 2); the checks inside it only record."""
    if _DEPTH.open == 0:
        raise_pending_errors()
    _DEPTH.open += 1
    try:
        yield
    finally:
        _DEPTH.open -= 1


def _entry() -> None:
    """Where each check starts: a check outside every checked call is a call of its own
    and reads at its entry (rule 1); inside one it reads nothing (rule 2)."""
    if _DEPTH.open == 0:
        raise_pending_errors()


def pending_checks() -> int:
    """How many deferred checks have not been read yet."""
    return len(_PENDING)


def _error(
    field: str, expected: str, noun: str, count: int, lo: float, hi: float, *, late: bool
) -> ContractError:
    when = " (found by the deferred check of an earlier call)" if late else ""
    return ContractError(
        field, expected=expected, actual=f"{count} {noun} outside it, in [{lo}, {hi}]{when}"
    )


def raise_pending_errors(*, wait: bool = False) -> None:
    """Read the deferred checks whose copy has landed (all of them with ``wait``, which
    synchronises on their events), oldest first; raise for the first that found bad
    values. Each check is read once."""
    while _PENDING:
        p = _PENDING[0]
        if not wait and not p.event.query():
            return
        p.event.synchronize()
        _PENDING.popleft()
        count, lo, hi = p.host.tolist()
        if count:
            raise _error(p.field, p.expected, p.noun, int(count), lo, hi, late=True)


def _defers(values: torch.Tensor) -> bool:
    """Whether a check of ``values`` is deferred (CUDA) rather than read at once."""
    return values.device.type == "cuda"


def _check(
    bad: torch.Tensor, values: torch.Tensor, *, field: str, expected: str, noun: str = "values"
) -> None:
    """Raise (CPU) or record (CUDA) the count, min and max of ``values[bad]``."""
    refuse_meta(values, field=field)
    if not _defers(values):
        if bool(bad.any()):
            picked = values[bad]
            lo, hi = picked.min().item(), picked.max().item()
            raise _error(field, expected, noun, int(bad.sum()), lo, hi, late=False)
        return
    if torch.cuda.is_current_stream_capturing():
        torch._assert_async(~bad.any(), f"{field}: values outside {expected}")
        return
    dtype = torch.float64 if values.dtype.is_floating_point else torch.int64
    big = torch.finfo(dtype).max if dtype == torch.float64 else torch.iinfo(dtype).max
    v = values.to(dtype)
    stats = torch.stack(
        [bad.sum().to(dtype), torch.where(bad, v, big).min(), torch.where(bad, v, -big).max()]
    )
    host, event = _copy_behind_event(stats)
    _PENDING.append(_Pending(event, host, field, expected, noun))


def _copy_behind_event(stats: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``stats`` copied, non-blocking, into pinned host memory, and the CUDA event
    recorded behind the copy: the host copy is valid once the event has completed."""
    host = torch.empty(3, dtype=stats.dtype, pin_memory=True)
    host.copy_(stats, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def refuse_meta(values: Any, *, field: str) -> None:
    """A tensor on the ``meta`` device has a shape and no values: a value check (or any
    computation) cannot read it. ``ContractError`` naming ``field``."""
    if isinstance(values, torch.Tensor) and values.device.type == "meta":
        raise ContractError(
            field,
            expected="a tensor with values (on a CPU or an accelerator)",
            actual="a tensor on meta",
        )


def check_labels_deferred(
    labels: Any,
    vocab_size: int,
    *,
    ignore_index: int,
    field: str = "labels",
    set_by: str = IGNORE_INDEX_OF_A_CONTEXT,
) -> None:
    """``hookspec.check_labels`` without a host read on CUDA (see the module docstring);
    ``set_by``: where the caller sets ``ignore_index``, named in the error.

    Raises at once for a wrong type or dtype; outside a checked call, also for the bad
    values of an earlier deferred check whose result has landed (rule 2).
    """
    _entry()
    refuse_meta(labels, field=field)
    if not isinstance(labels, torch.Tensor) or not _defers(labels):
        check_labels(labels, vocab_size, ignore_index=ignore_index, field=field, set_by=set_by)
        return
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        check_labels(labels, vocab_size, ignore_index=ignore_index, field=field)  # names the dtype
    if labels.numel() == 0:
        return
    bad = ((labels < 0) | (labels >= vocab_size)) & (labels != ignore_index)
    _check(
        bad,
        labels,
        field=field,
        expected=labels_expected(vocab_size, ignore_index, set_by),
        noun="ids",
    )


def check_positive_deferred(values: torch.Tensor, *, field: str) -> None:
    """Every value of the floating tensor ``values`` finite and ``> 0`` (a per-token
    temperature), without a host read on CUDA. A NaN is bad, never skipped: it is
    counted, and the min and max found are then NaN."""
    _entry()
    if values.numel() == 0:
        return
    bad = ~(torch.isfinite(values) & (values > 0))
    _check(bad, values.detach(), field=field, expected="finite values > 0")


def check_indices_deferred(indices: torch.Tensor, size: int, *, field: str) -> None:
    """Every value of the integer tensor ``indices`` in ``[0, size)`` (say, each token's
    sequence index), without a host read on CUDA."""
    _entry()
    if indices.numel() == 0:
        return
    bad = (indices < 0) | (indices >= size)
    _check(bad, indices, field=field, expected=f"indices in [0, {size})")


def check_finite_deferred(
    values: torch.Tensor,
    *,
    field: str,
    nonnegative: bool = False,
    where: torch.Tensor | None = None,
) -> None:
    """Every value of ``values`` finite (and ``>= 0`` with ``nonnegative``: a mask
    of weights), at the tokens where ``where`` is True (every token when ``None``;
    ``where`` has the shape of ``values``), without a host read on CUDA. A bool or
    integer tensor is finite. A NaN is bad, never skipped."""
    _entry()
    if values.numel() == 0:
        return
    v = values.detach()
    ok = torch.isfinite(v) if v.dtype.is_floating_point else torch.ones_like(v, dtype=torch.bool)
    if nonnegative and v.dtype != torch.bool:
        ok = ok & (v >= 0)
    bad = ~ok if where is None else where.to(device=v.device) & ~ok
    expected = "finite values >= 0" if nonnegative else "finite values"
    if where is not None:
        expected += " where it is read"
    _check(bad, v, field=field, expected=expected)


def check_multiple_deferred(
    values: torch.Tensor, multiple: int, *, field: str, why: str = ""
) -> None:
    """Every value of the integer tensor ``values`` a multiple of ``multiple`` (say,
    packed sequence boundaries under context parallel), without a host read on CUDA."""
    _entry()
    if values.numel() == 0:
        return
    bad = values.remainder(multiple) != 0
    _check(bad, values, field=field, expected=f"multiples of {multiple}{why}")


def check_condition_deferred(
    bad: torch.Tensor, values: torch.Tensor, *, field: str, expected: str, noun: str = "values"
) -> None:
    """No entry of the bool tensor ``bad`` set (a rule of several values, such as a
    sparse teacher's distinct ids), without a host read on CUDA; the error counts
    the bad entries and gives the min and max of ``values`` (``bad``'s shape) there."""
    _entry()
    if bad.numel() == 0:
        return
    _check(bad, values.detach(), field=field, expected=expected, noun=noun)
