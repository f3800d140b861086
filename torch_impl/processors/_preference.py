"""The preference-loss processor: :func:`preference_loss` over pairs of sequences (chosen,
rejected) packed in the batch, its :class:`PreferenceConfig` (DPO, IPO, SimPO) and its user
context :class:`PreferenceBatch`, on the formulas of ``hookspec.conventions``. Each
sequence's logprob is a masked sum of :func:`~._logprobs.linear_logprobs` (the logits are
never formed), made whole over the context-parallel group (``docs/processors.md``).
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Callable, Mapping
from typing import Any, Never

import torch

from hookspec import ContractError, OutputContext, Processor, SingleProcessCollectives, processor

from ..value_checks import (
    check_condition_deferred,
    check_finite_deferred,
    check_indices_deferred,
    checked_call,
)
from ._checks import (
    check_bool,
    check_enum,
    check_finite_number,
    check_floating,
    check_instance,
    check_shape,
    describe_tensor,
)
from ._inputs import counted_mask, factory_tiles, hook_inputs, sequence_ids, to_tokens
from ._logprobs import linear_logprobs
from ._loss_math import segment_sum, weighted_sum

__all__ = [
    "PairTerms",
    "PreferenceBatch",
    "PreferenceConfig",
    "PreferenceMethod",
    "pair_terms",
    "preference_loss",
]


class PreferenceMethod(enum.StrEnum):
    """The preference losses of :class:`PreferenceConfig` (``hookspec.conventions``)."""

    DPO = "dpo"
    """``-(1 - eps) logsigmoid(beta m) - eps logsigmoid(-beta m)``: DPO, conservative DPO
    with label smoothing ``eps`` (TRL's ``loss_type="sigmoid"``, NeMo RL's DPO)."""
    IPO = "ipo"
    """``(m - 1 / (2 beta)) ** 2`` (IPO's eq. 17, TRL's ``"ipo"``)."""
    SIMPO = "simpo"
    """``-logsigmoid(beta (lp_c - lp_r) - gamma)`` on length-normalised logprobs, no
    reference (SimPO; TRL's ``CPOTrainer(loss_type="simpo")``), with label smoothing."""


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    """The preference loss of a pair ``(c, r)`` (chosen, rejected) of sequences::

        lp = S / n if length_normalized else S      # S: the sequence's masked logprob sum
        ref = S_ref / n if length_normalized else S_ref   # over its n counted tokens
        m = (lp_c - ref_c) - (lp_r - ref_r)         # ref = 0 for SimPO
        dpo:    L = -(1 - eps) * logsigmoid(beta * m) - eps * logsigmoid(-beta * m)
        ipo:    L = (m - 1 / (2 * beta)) ** 2
        simpo:  L = -(1 - eps) * logsigmoid(beta * m - gamma) - eps * logsigmoid(gamma - beta * m)

    ``beta > 0``; ``label_smoothing`` ``eps`` in ``[0, 0.5]`` (DPO and SimPO; IPO defines
    none); ``gamma``: SimPO's target margin (0 for the others). ``length_normalized``:
    ``None`` takes the method's own (DPO: sums, as its paper, TRL and NeMo RL; IPO: per-token
    means, as TRL, where the IPO paper writes sums; SimPO: always means). Checked at
    construction (``ContractError``); :meth:`dpo`, :meth:`ipo`, :meth:`simpo` build each.
    """

    method: PreferenceMethod = PreferenceMethod.DPO
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.0
    length_normalized: bool | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        method = check_enum("method", PreferenceMethod, self.method)
        put(self, "method", method)
        put(self, "beta", check_finite_number("beta", self.beta, low=0.0, low_open=True))
        eps = check_finite_number("label_smoothing", self.label_smoothing, low=0.0, high=0.5)
        put(self, "label_smoothing", eps)
        put(self, "gamma", check_finite_number("gamma", self.gamma))
        if method == PreferenceMethod.IPO and eps != 0.0:
            raise ContractError(
                "label_smoothing", expected="0 with method 'ipo' (IPO defines none)", actual=eps
            )
        if method != PreferenceMethod.SIMPO and self.gamma != 0.0:
            raise ContractError(
                "gamma",
                expected=f"0 with method {method.value!r} (SimPO's target margin)",
                actual=self.gamma,
            )
        normalized = self.length_normalized
        if normalized is None:
            normalized = method != PreferenceMethod.DPO
        put(self, "length_normalized", check_bool("length_normalized", normalized))
        if method == PreferenceMethod.SIMPO and not normalized:
            raise ContractError(
                "length_normalized",
                expected="True or None with method 'simpo' (its margin is of per-token means)",
                actual=False,
            )

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads the reference's sums (DPO, IPO; not SimPO)."""
        return self.method != PreferenceMethod.SIMPO

    @classmethod
    def dpo(cls, *, beta: float = 0.1, label_smoothing: float = 0.0, **kw: Any) -> PreferenceConfig:
        """DPO (``label_smoothing > 0``: conservative DPO), on sequence sums by default."""
        return cls(PreferenceMethod.DPO, beta=beta, label_smoothing=label_smoothing, **kw)

    @classmethod
    def ipo(cls, *, beta: float = 0.1, **kw: Any) -> PreferenceConfig:
        """IPO (``beta`` is the paper's ``tau``), on per-token means by default (TRL's)."""
        return cls(PreferenceMethod.IPO, beta=beta, **kw)

    @classmethod
    def simpo(cls, *, beta: float = 2.0, gamma: float = 1.0, **kw: Any) -> PreferenceConfig:
        """SimPO; the defaults are its repository's ``beta = 2``, ``gamma / beta = 0.5``."""
        return cls(PreferenceMethod.SIMPO, beta=beta, gamma=gamma, **kw)


@dataclasses.dataclass(frozen=True)
class PreferenceBatch:
    """The user context of :func:`preference_loss` (pass it as ``output_processor_context``).

    The batch's sequences (a row each, or the packed sequences of ``packed_seq_params``)
    form ``P`` pairs. ``chosen`` and ``rejected``: integer sequence indices ``[P]``; both
    ``None``: sequences ``2i`` and ``2i + 1`` (NeMo RL's interleaved layout; TRL's and
    NeMo-Aligner's halves are ``chosen=arange(P)``, ``rejected=arange(P) + P``). A sequence
    in no pair counts nowhere.

    - ``ref_chosen`` / ``ref_rejected``: ``[P]``, the reference policy's logprob of each
      chosen / rejected sequence, summed over its counted tokens (DPO, IPO; ``None`` for
      SimPO, which refuses them). With ``length_normalized`` they are divided by the same
      token counts as the policy's.
    - ``mask``: which tokens count, as weights (bool, or numbers ``>= 0``), ``[b, s]``;
      ``None``: the model's ``loss_mask``, else every token. Ignored labels never count.
    - ``pair_mask``: ``[P]`` weights ``>= 0`` of the pairs in the mean (0: a padding pair,
      NeMo RL's ``sample_mask``); ``None``: each 1.
    - ``global_pairs``: the pair count of the whole loss split over data-parallel ranks (a
      finite number ``> 0``, not a tensor), replacing ``sum(pair_mask)``.

    A counted pair (weight ``> 0``) whose chosen or rejected sequence counts no token raises
    ``ContractError`` (with ``check_values``); the reference sums are read at counted pairs.
    """

    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    chosen: torch.Tensor | None = None
    rejected: torch.Tensor | None = None
    pair_mask: torch.Tensor | None = None
    global_pairs: float | None = None

    def validate(self, pairs: int, *, need_ref: bool) -> None:
        """Shapes ``[P=pairs]``, dtypes, the references as ``need_ref`` asks, the count.
        Reads no tensor values."""
        want, expected = (pairs,), f"[P={pairs}] (one per pair)"
        for name in ("ref_chosen", "ref_rejected"):
            value = getattr(self, name)
            if need_ref and value is None:
                raise ContractError(f"context.{name}", expected=f"a tensor {expected}", actual=None)
            if not need_ref and value is not None:
                expected_none = "None with method 'simpo' (reference-free)"
                raise ContractError(f"context.{name}", expected=expected_none, actual="a tensor")
            if value is not None:
                check_floating(f"context.{name}", value)
                check_shape(f"context.{name}", value, want, expected)
        if self.pair_mask is not None:
            check_shape("context.pair_mask", self.pair_mask, want, expected)
            if self.pair_mask.is_complex():
                raise ContractError(
                    "context.pair_mask", expected="real weights >= 0", actual="a complex tensor"
                )
        if self.global_pairs is not None:
            check_finite_number("context.global_pairs", self.global_pairs, low=0.0, low_open=True)


def _preference_batch(ctx: OutputContext) -> PreferenceBatch:
    """The user context, a :class:`PreferenceBatch` (a mapping is refused with a hint)."""
    batch = ctx.context
    expected = "a torch_impl.processors.PreferenceBatch (output_processor_context=)"
    hint = "A mapping is not read as one: pass PreferenceBatch(**mapping)"
    hint = hint if isinstance(batch, Mapping) else ""
    check_instance("context", batch, PreferenceBatch, expected, hint)
    return batch


@dataclasses.dataclass(frozen=True)
class Pairs:
    """The pairs as sequence indices ``chosen``, ``rejected`` ``[P]`` (in range: an index
    out of it is clamped, its pair's weight NaN) and their ``weights`` ``[P]`` (NaN where an
    entry of ``pair_mask`` is bad)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    weights: torch.Tensor


def _sequence_count(ctx: OutputContext, count: int) -> tuple[int, str, str]:
    """``(sequences, field, what)``: the batch's sequences (``count`` segments less the
    packed row's tail), the field they come from and how."""
    psp = ctx.packed_seq_params
    if psp is None:
        return count, "labels", f"b={count}: a sequence per row"
    padded = getattr(psp, "cu_seqlens_q_padded", None) is not None
    name = "cu_seqlens_q_padded" if padded else "cu_seqlens_q"
    return count - 1, f"packed_seq_params.{name}", "packed sequences"


def _indices(
    ctx: OutputContext, batch: PreferenceBatch, count: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(chosen, rejected, sequences)``: the pairs' indices ``[P]`` as given (checked for
    type and shape), or the interleaved layout of the batch's sequences (an odd count
    raises), and the count of sequences they index."""
    sequences, field, what = _sequence_count(ctx, count)
    device = typing.cast(torch.Tensor, ctx.hidden_states).device
    if batch.chosen is None and batch.rejected is None:
        if sequences % 2:
            raise ContractError(
                field,
                expected="an even number of sequences, chosen and rejected interleaved "
                "(2i, 2i + 1), or context.chosen and context.rejected",
                actual=f"{sequences} sequences ({what})",
            )
        every = torch.arange(sequences, device=device)
        return every[0::2], every[1::2], sequences
    given = {"chosen": batch.chosen, "rejected": batch.rejected}
    for name, idx in given.items():
        integer = isinstance(idx, torch.Tensor) and not (
            idx.dtype.is_floating_point or idx.is_complex() or idx.dtype == torch.bool
        )
        if not integer or typing.cast(torch.Tensor, idx).dim() != 1:
            other = "rejected" if name == "chosen" else "chosen"
            raise ContractError(
                f"context.{name}",
                expected=f"an integer tensor [P] of sequence indices (beside context.{other})",
                actual=describe_tensor(idx),
            )
    chosen, rejected = (
        typing.cast(torch.Tensor, batch.chosen),
        typing.cast(torch.Tensor, batch.rejected),
    )
    check_shape(
        "context.rejected",
        rejected,
        tuple(chosen.shape),
        f"[P={chosen.shape[0]}] like context.chosen",
    )
    return chosen.to(device), rejected.to(device), sequences


def _weights(
    ctx: OutputContext, batch: PreferenceBatch, chosen: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The pairs' weights ``[P]`` (``chosen``'s shape and device): ``pair_mask`` (NaN where
    an entry is bad), else ones."""
    if batch.pair_mask is None:
        return torch.ones(chosen.shape, dtype=dtype, device=chosen.device)
    if ctx.check_values:
        check_finite_deferred(batch.pair_mask, field="context.pair_mask", nonnegative=True)
    weights = batch.pair_mask.detach().to(device=chosen.device, dtype=dtype)
    return torch.where(torch.isfinite(weights) & (weights >= 0), weights, float("nan"))


def _pairs(
    ctx: OutputContext,
    batch: PreferenceBatch,
    count: int,
    dtype: torch.dtype,
    config: PreferenceConfig,
) -> Pairs:
    """:class:`Pairs` of ``batch`` over the ``count`` segments of :func:`sequence_ids`,
    ``batch`` validated for ``config``; the values read (indices, weights, the reference's
    sums at counted pairs) checked with ``ctx.check_values``."""
    chosen, rejected, sequences = _indices(ctx, batch, count)
    batch.validate(int(chosen.shape[0]), need_ref=config.needs_reference)
    weights = _weights(ctx, batch, chosen, dtype)
    top = max(sequences - 1, 0)
    for name, idx in (("chosen", chosen), ("rejected", rejected)):
        if ctx.check_values and batch.chosen is not None:
            check_indices_deferred(idx, sequences, field=f"context.{name}")
        weights = torch.where((idx >= 0) & (idx <= top), weights, float("nan"))
    for name in ("ref_chosen", "ref_rejected"):
        if ctx.check_values and (value := getattr(batch, name)) is not None:
            check_finite_deferred(value, field=f"context.{name}", where=weights != 0)
    return Pairs(chosen.clamp(0, top), rejected.clamp(0, top), weights)


def _check_nonempty(pairs: Pairs, tokens: torch.Tensor, field: str) -> None:
    """Both sequences of every counted pair count a token (``tokens``: each sequence's)."""
    n = torch.minimum(tokens[pairs.chosen], tokens[pairs.rejected])
    check_condition_deferred(
        (pairs.weights != 0) & (n == 0),
        n,
        field=field,
        expected="a counted token (mask > 0, label not ignore_index) in both sequences "
        "of every counted pair",
        noun="pairs",
    )


CpSum = Callable[[torch.Tensor], torch.Tensor]


def _context_parallel_sum(ctx: OutputContext) -> CpSum | None:
    """``ctx.collectives.all_reduce_sum_context_parallel`` at ``cp_size > 1`` (every pair's
    sequence sums span the group's ranks), ``None`` at 1; a collectives object without it,
    or of one rank, raises ``ContractError``."""
    cp = ctx.parallel.cp_size
    if cp == 1:
        return None
    coll = ctx.collectives
    method = getattr(coll, "all_reduce_sum_context_parallel", None)
    one_rank = isinstance(coll, SingleProcessCollectives) or getattr(coll, "cp_size", None) == 1
    if callable(method) and not one_rank:
        return typing.cast(CpSum, method)
    raise ContractError(
        "collectives",
        expected=f"all_reduce_sum_context_parallel over the context-parallel group "
        f"(parallel.cp_size={cp}; hookspec.Collectives, spec 1.2): each sequence's logprob "
        "sums its tokens over the ranks",
        actual=f"{coll!r}, which has none" if not callable(method) else f"{coll!r} (one rank)",
        hint="torch_impl builds it from Megatron's context-parallel group",
    )


def sequence_logprobs(
    logp: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor, count: int, cp_sum: CpSum | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S, n)`` ``[count]``: each sequence's masked logprob sum and counted tokens, from
    ``logp`` ``[rows]`` and ``mask``, ``segments`` ``[b, s]``, over the whole sequence::

        S = segment_sum(M * logp)       # logp not read where M == 0
        n = segment_sum(M)
        S, n = cp_sum(stack([S, n]))    # context parallel: one collective
    """
    m = to_tokens(mask).to(logp.dtype)
    seg = to_tokens(segments)
    total = segment_sum(torch.where(m > 0, logp, 0.0) * m, seg, count)
    tokens = segment_sum(m, seg, count)
    if cp_sum is None:
        return total, tokens
    total, tokens = cp_sum(torch.stack([total, tokens])).unbind(0)
    return total, tokens.detach()


@dataclasses.dataclass(frozen=True)
class PairTerms:
    """Per pair ``[P]``: the ``loss`` ``L``, the implicit rewards ``reward_chosen`` /
    ``reward_rejected`` (``beta * (lp - ref)``; SimPO's ``beta * lp``) and the policy's
    (length-normalised where configured) sequence logprobs ``logp_chosen`` / ``logp_rejected``."""

    loss: torch.Tensor
    reward_chosen: torch.Tensor
    reward_rejected: torch.Tensor
    logp_chosen: torch.Tensor
    logp_rejected: torch.Tensor


def pair_terms(
    lp_c: torch.Tensor,
    lp_r: torch.Tensor,
    ref_c: torch.Tensor | None,
    ref_r: torch.Tensor | None,
    config: PreferenceConfig,
) -> PairTerms:
    """:class:`PairTerms` of the sequence logprobs ``lp_c``, ``lp_r`` and the reference's
    ``ref_c``, ``ref_r`` ``[P]`` (``None``: 0, SimPO), all normalised or all sums, by
    :class:`PreferenceConfig`'s formula (``u = beta * m - gamma``, ``gamma`` 0 but SimPO)::

        sigmoid (dpo, simpo): L = -(1 - eps) * logsigmoid(u) - eps * logsigmoid(-u)
        ipo:                  L = (m - 1 / (2 * beta)) ** 2
    """
    beta, eps = config.beta, config.label_smoothing
    m_c = lp_c if ref_c is None else lp_c - ref_c
    m_r = lp_r if ref_r is None else lp_r - ref_r
    margin = m_c - m_r
    if config.method == PreferenceMethod.IPO:
        loss = (margin - 1.0 / (2.0 * beta)).square()
    else:
        u = beta * margin - config.gamma
        loss = -torch.nn.functional.logsigmoid(u)
        if eps != 0.0:
            loss = (1.0 - eps) * loss - eps * torch.nn.functional.logsigmoid(-u)
    return PairTerms(
        loss=loss,
        reward_chosen=beta * m_c,
        reward_rejected=beta * m_r,
        logp_chosen=lp_c,
        logp_rejected=lp_r,
    )


def _per_token(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``values / n``, 0 where ``n == 0``."""
    return torch.where(tokens == 0, 0.0, values / torch.where(tokens == 0, 1.0, tokens))


def _terms(
    total: torch.Tensor,
    tokens: torch.Tensor,
    pairs: Pairs,
    batch: PreferenceBatch,
    config: PreferenceConfig,
) -> PairTerms:
    """:class:`PairTerms` of the pairs from the sequences' sums ``total`` and counts ``tokens``."""
    sides = []
    for index, ref in ((pairs.chosen, batch.ref_chosen), (pairs.rejected, batch.ref_rejected)):
        lp, n = total[index], tokens[index]
        ref_t = None if ref is None else ref.detach().to(device=lp.device, dtype=lp.dtype)
        if ref_t is not None:  # read at counted pairs only
            ref_t = torch.where(pairs.weights != 0, ref_t, 0.0)
        if config.length_normalized:
            lp = _per_token(lp, n)
            ref_t = None if ref_t is None else _per_token(ref_t, n)
        sides.append((lp, ref_t))
    (lp_c, ref_c), (lp_r, ref_r) = sides
    return pair_terms(lp_c, lp_r, ref_c, ref_r, config)


def _metrics(
    t: PairTerms, pairs: Pairs, global_pairs: float | None, shares: int, logp: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The loss and the detached metrics, each a weighted mean over the pairs, divided by
    ``shares`` (the context-parallel size: each rank returns its share)."""
    w = pairs.weights.to(t.loss.dtype)
    total = (
        w.sum()
        if global_pairs is None
        else torch.tensor(float(global_pairs), dtype=w.dtype, device=w.device)
    )
    w = w / torch.where(total == 0, 1.0, total) / shares
    r_c, r_r = t.reward_chosen.detach(), t.reward_rejected.detach()
    return {
        # + 0 * sum(logp): NaN where a hidden state or the weight holds NaN/inf, even uncounted
        "loss": weighted_sum(t.loss, w) + 0.0 * logp.detach().sum(),
        "rewards_chosen": weighted_sum(r_c, w),
        "rewards_rejected": weighted_sum(r_r, w),
        "reward_margin": weighted_sum(r_c - r_r, w),
        "accuracy": weighted_sum((r_c > r_r).to(w.dtype), w),
        "logps_chosen": weighted_sum(t.logp_chosen.detach(), w),
        "logps_rejected": weighted_sum(t.logp_rejected.detach(), w),
        "pairs": pairs.weights.to(w.dtype).sum() / shares,
    }


def preference_loss(
    config: PreferenceConfig | None = None,
    /,
    *,
    tile_rows: int | None = None,
    tile_cols: int | None = None,
    **unexpected: Never,
) -> Processor:
    """A processor returning the preference loss of the batch's pairs and its metrics,
    each a scalar (the user context: :class:`PreferenceBatch`)::

        {"loss", "rewards_chosen", "rewards_rejected", "reward_margin", "accuracy",
         "logps_chosen", "logps_rejected", "pairs"}

        logp = linear_logprobs(hidden_states, vocab_weight, labels)    # [b, s], no logits
        S, n = segment sums of M * logp and M per sequence           # over the CP group
        L = PreferenceConfig's formula per pair [P]                     # pair_terms
        w = pair_mask / (global_pairs or sum(pair_mask))
        loss = sum(w * L)                      # rewards_*, reward_margin, accuracy, logps_*: alike

    ``M``: ``PreferenceBatch.mask`` (else ``loss_mask``, else ones), 0 at ignored labels.
    The metrics (no gradient) are TRL's: the rewards ``beta * (lp - ref)`` (SimPO:
    ``beta * lp``), their margin ``r_c - r_r``, ``accuracy = mean(r_c > r_r)``, the policy's
    sequence logprobs (per-token means where length-normalised); ``pairs = sum(pair_mask)``.
    Under context parallel every output is this rank's share, ``1 / cp_size`` of the
    micro-batch's, and its gradient the loss's at this rank's tokens. Autograd through
    :func:`linear_logprobs` (tiles of ``tile_rows`` x ``tile_cols``; ``None``: the
    device's default), four GEMM-equivalents ``2 n h V`` in all.
    """
    config = PreferenceConfig() if config is None else config
    check_instance("config", config, PreferenceConfig, "a PreferenceConfig")
    tile = factory_tiles("preference_loss", unexpected, None, tile_rows, tile_cols)

    @checked_call()
    def fn(ctx: OutputContext) -> dict[str, torch.Tensor]:
        # 1. the inputs, the mask, the sequences and their pairs, checked
        inputs = hook_inputs(ctx, "preference_loss")
        batch = _preference_batch(ctx)
        given, field = (
            (ctx.loss_mask, "loss_mask") if batch.mask is None else (batch.mask, "context.mask")
        )
        mask = counted_mask(ctx, inputs, given, field)
        segments, count = sequence_ids(ctx, inputs.b, inputs.s, mask.device)
        pairs = _pairs(ctx, batch, count, inputs.acc_dtype, config)
        cp_sum = _context_parallel_sum(ctx)
        # 2. the token logprobs (autograd recomputes the logits in backward), the sequences'
        lp = linear_logprobs(
            inputs.hidden, inputs.weight, inputs.token_labels, options=inputs.tensor_options(tile)
        )
        total, tokens = sequence_logprobs(lp.logprobs, mask, segments, count, cp_sum)
        if ctx.check_values:
            _check_nonempty(pairs, tokens, field)
        # 3. the pairs' terms, the loss and the metrics
        terms = _terms(total, tokens, pairs, batch, config)
        return _metrics(terms, pairs, batch.global_pairs, ctx.parallel.cp_size, lp.logprobs)

    return processor(fn, name="preference_loss")
