"""The teachers of :func:`~torch_impl.processors.distillation_loss`, the user contexts of
its two forms, each checking its own tensors by the rules of ``hookspec.conventions``:
:class:`SparseTeacher` (top-k per token), :class:`DenseTeacher` (hidden states, weight)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from hookspec import Collectives, ContractError, VocabShard
from hookspec.arrays import format_shape

from ..value_checks import check_condition_deferred, check_indices_deferred
from ._checks import check_finite_number, check_floating, check_shape

__all__ = ["DenseTeacher", "SparseTeacher", "check_rows"]


def check_rows(
    field: str, value: Any, lead: tuple[int, ...], what: str, *, integer: bool = False
) -> torch.Tensor:
    """``value`` a tensor ``what`` (``"[n=4, k]"``: as many dims as it names) whose
    leading dims are ``lead``; of an integer dtype where ``integer``."""
    dims = what.count(",") + 1
    if (
        not isinstance(value, torch.Tensor)
        or value.dim() != dims
        or tuple(value.shape[: len(lead)]) != lead
    ):
        actual = (
            format_shape(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        )
        raise ContractError(field, expected=f"a tensor {what}", actual=actual)
    if integer and (
        value.dtype.is_floating_point or value.dtype == torch.bool or value.is_complex()
    ):
        raise ContractError(field, expected="an integer dtype", actual=str(value.dtype))
    return value


@dataclasses.dataclass(frozen=True)
class SparseTeacher:
    """The user context of the sparse form: the teacher's top-k per token (say,
    ``topk_logprobs(k)`` of a teacher, cached), ``[b, s, k]`` each.

    ``ids``: distinct global token ids, the first the teacher's top-1;
    ``logprobs``: its logprobs there, at the distillation temperature, by the rules
    of ``hookspec.conventions`` (``-inf`` is probability 0; checked at counted
    tokens). ``mask``: ``[b, s]`` weights (``None``: the model's ``loss_mask``, else
    every token; tokens labelled ``ignore_index`` never count). ``global_tokens`` /
    ``global_sequences``: as :class:`PolicyBatch`'s. Read at counted tokens only.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    mask: torch.Tensor | None = None
    global_tokens: float | None = None
    global_sequences: float | None = None

    def prepare(
        self,
        b: int,
        s: int,
        counted: torch.Tensor,
        vocab_size: int,
        *,
        dtype: torch.dtype,
        check_values: bool,
        field: str = "context",
    ) -> SparseTeacher:
        """The checked teacher as detached rows of the gathered tokens, ``ids``, ``logprobs``
        ``[n, k]`` (at an uncounted token, ``k`` distinct ids of mass ``1 / (k + 1)`` each:
        every term finite); ``counted`` ``[n]`` bool, the tokens it is read at; ``field``:
        what errors call it."""
        ids = check_rows(f"{field}.ids", self.ids, (b, s), f"[b={b}, s={s}, k]", integer=True)
        k = int(ids.shape[2])
        if k < 1:
            raise ContractError(f"{field}.ids", expected="k >= 1 ids per token", actual="k = 0")
        check_floating(f"{field}.logprobs", self.logprobs)
        check_shape(
            f"{field}.logprobs", self.logprobs, (b, s, k), f"[b={b}, s={s}, k={k}] like ids"
        )
        device = counted.device
        ids = ids.transpose(0, 1).reshape(-1, k).to(device=device, dtype=torch.long)
        lp = self.logprobs.detach().transpose(0, 1).reshape(-1, k).to(device=device)
        if check_values:
            _check_sparse_values(ids, lp, counted, vocab_size, field)
        stand_in = torch.arange(k, device=device) % vocab_size
        return dataclasses.replace(
            self,
            ids=torch.where(counted[:, None], ids, stand_in),
            logprobs=torch.where(counted[:, None], lp.to(dtype), -math.log(k + 1)),
        )


def _check_sparse_values(
    ids: torch.Tensor, lp: torch.Tensor, counted: torch.Tensor, vocab_size: int, field: str
) -> None:
    """The sparse teacher's rules at the counted tokens (``hookspec.conventions``), each its
    own error with the values it reads (``eps``: the logprobs' dtype's machine epsilon)."""
    k = ids.shape[1]
    check_indices_deferred(torch.where(counted[:, None], ids, 0), vocab_size, field=f"{field}.ids")
    if k > 1:
        sorted_ids = torch.sort(ids, dim=1).values
        dup = (sorted_ids[:, 1:] == sorted_ids[:, :-1]).any(1) & counted
        check_condition_deferred(
            dup, ids[:, 0], field=f"{field}.ids", expected="k distinct ids per token", noun="tokens"
        )
    eps = torch.finfo(lp.dtype).eps
    wide = lp.double()

    def refuse(bad: torch.Tensor, values: torch.Tensor, expected: str, noun: str) -> None:
        check_condition_deferred(
            counted & bad, values, field=f"{field}.logprobs", expected=expected, noun=noun
        )

    # NaN and +inf are no probability; -inf is probability 0 (a token the teacher masks)
    for bad_value, what in ((torch.isnan(wide), "NaN"), (wide == math.inf, "+inf")):
        expected = f"logprobs in [-inf, 0] (-inf: probability 0), no {what}"
        noun = f"tokens holding {what} (their count of {what})"
        refuse(bad_value.any(1), bad_value.sum(1).double(), expected, noun)
    first = "tokens (their first logprob)"
    expected = "a finite first logprob (ids[0] is the teacher's top-1: probability > 0)"
    refuse(wide[:, 0] == -math.inf, wide[:, 0], expected, first)
    top, total = wide.amax(1), torch.logsumexp(wide, 1)
    refuse(
        top > eps, top, f"logprobs <= 0 (up to eps = {eps:.3g})", "tokens (their largest logprob)"
    )
    expected = f"logprobs whose exp sums to <= 1 (up to k * eps = {k * eps:.3g}) per token"
    refuse(total > math.log1p(k * eps), total.exp(), expected, "tokens (their sum of exp)")
    if k > 1:
        expected = "the first logprob the largest (ids[0] is the teacher's top-1)"
        refuse((lp[:, 1:] > lp[:, :1]).any(1), lp[:, 0], expected, first)


@dataclasses.dataclass(frozen=True)
class DenseTeacher:
    """The user context of the dense form: the teacher's final hidden states and
    its output weight shard.

    ``hidden_states``: ``[s, b, h_t]`` in the layout of the student's
    ``ctx.hidden_states``; ``weight``: ``[V_local, h_t]`` (``h_t`` may differ from
    the student's); ``vocab``: the weight's rows, the student's ``ctx.vocab``
    (required where that is a shard; ``None``: the whole vocabulary).
    ``logit_scale``: the teacher's own factor (MuP): its logits are
    ``hidden_states @ weight.T * logit_scale / T``; ``softcap``: its own final-logit
    cap ``s_t > 0`` (Gemma's; ``None``: none, whatever the student's): ``s_t * tanh(
    hidden_states @ weight.T * logit_scale / s_t) / T``. No gradient reaches them.
    ``mask``, ``global_tokens``, ``global_sequences``: as :class:`SparseTeacher`.
    """

    hidden_states: torch.Tensor
    weight: torch.Tensor
    mask: torch.Tensor | None = None
    global_tokens: float | None = None
    global_sequences: float | None = None
    vocab: VocabShard | None = None
    logit_scale: float = 1.0
    softcap: float | None = None

    def prepare(
        self,
        hidden: torch.Tensor,
        student_vocab: VocabShard,
        collectives: Collectives | None,
        field: str = "context",
    ) -> DenseTeacher:
        """The checked teacher as detached rows of the gathered tokens, ``hidden_states``
        ``[n, h_t]``; ``hidden``: the student's ``[s, b, h]`` (local); ``field``: what
        errors call it."""
        scale = check_finite_number(
            f"{field}.logit_scale", self.logit_scale, low=0.0, low_open=True
        )
        cap = self.softcap
        cap = (
            None
            if cap is None
            else check_finite_number(f"{field}.softcap", cap, low=0.0, low_open=True)
        )
        th = check_floating(f"{field}.hidden_states", self.hidden_states)
        tw = check_floating(f"{field}.weight", self.weight)
        sb = f"[{hidden.shape[0]}, {hidden.shape[1]}, h_t] like ctx.hidden_states"
        check_rows(f"{field}.hidden_states", th, tuple(hidden.shape[:2]), sb)
        local = student_vocab.end - student_vocab.start
        check_rows(
            f"{field}.weight", tw, (local, th.shape[2]), f"[V_local={local}, h_t={th.shape[2]}]"
        )
        whole = student_vocab.start == 0 and student_vocab.end == student_vocab.size
        if self.vocab != student_vocab and (self.vocab is not None or not whole):
            raise ContractError(
                f"{field}.vocab",
                expected=f"the student's {student_vocab}: the VocabShard of the teacher's "
                "weight rows",
                actual=repr(self.vocab),
            )
        t_h = th.detach().to(hidden.device)
        t_h = collectives.gather_hidden_states(t_h) if collectives is not None else t_h
        rows, weight = t_h.reshape(-1, t_h.shape[-1]).detach(), tw.detach().to(hidden.device)
        return dataclasses.replace(
            self, hidden_states=rows, weight=weight, logit_scale=scale, softcap=cap
        )
