"""Sampling replay: the logprob and entropy of the distribution a rollout engine sampled
from, renormalised over the tokens its sampler kept (:class:`SamplingSupport`), on the
engine's vocabulary sweep, never materialising the logits (``linear_logprobs(...,
support=)``; the rule is ``hookspec.conventions``' "Sampling support").

Two forms. Kept ids: each tile gathers the rows' kept logits into ``[n, K]`` (-inf where
not kept or not on this shard), one all-reduce max combines the shards, and the backward
is the engine's with the gradient at the kept ids as its sparse terms. Parameters (vLLM's
min-p, top-k, top-p): the kept set of a row is ``{j : z_j >= tau}`` for one threshold
``tau`` per row, found exactly from the sweep's top-k candidates (with a top-k bound) or by
a radix select on the logits' bit patterns (without one); the backward masks each
recomputed tile at ``tau`` (``docs/processors.md``, "Sampling replay": the ties, the costs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from hookspec import ContractError, OutputContext
from hookspec.arrays import format_shape

from ..value_checks import check_condition_deferred
from ._checks import check_finite_number, check_int, context_field, describe_tensor
from ._engine import (
    Coefficients,
    Engine,
    Recomputed,
    Stats,
    TileSetup,
    logit_grad_coefficients,
)
from ._gemm import gemm_into, no_autocast
from ._inputs import to_tokens
from ._options import prologue

__all__ = [
    "SamplingSupport",
    "check_instance_support",
    "context_support",
    "factory_support",
    "support_logprobs",
]

_PARAMETERS = ("top_k", "top_p", "min_p")
_DIGITS = {32: (11, 11, 10), 64: (11, 11, 11, 11, 10, 10)}
"""The radix select's digits of an fp32 or fp64 key, the top one first: a sweep each,
2048 buckets a row at most."""
_INF = float("inf")


# ---------------------------------------------------------------- the user's object


@dataclasses.dataclass(frozen=True)
class SamplingSupport:
    """The tokens a rollout engine's sampler kept, in one of two forms (checked at
    construction, ``ContractError``; shapes and per-token values at the call):

    - ``kept_ids``: global token ids, ``[n, K]`` (``linear_logprobs``) or ``[b, s, K]``
      (a processor's user context), of an integer dtype, padded with -1, in any order;
      an id repeated in a row counts once. What vLLM records per sampled token.
    - ``top_k``, ``top_p``, ``min_p``: vLLM's sampler's parameters, each a number or a
      tensor per token (``[n]``, or ``[b, s]`` in a user context); ``None``: not applied.
      ``top_k`` an int ``>= 1`` (``>= V``: no bound), ``top_p`` in ``(0, 1]``, ``min_p``
      in ``[0, 1]``. Applied to the tempered logits ``z`` (the options' temperature), in
      vLLM's order::

          K = {j : z_j >= max(z) + log(min_p)}                    # min-p
          K = {j in K : z_j >= kth_largest(z[K], top_k)}          # top-k: ties at the k-th kept
          above_j = sum(softmax(z[K])[i] for i in K if z_i > z_j)
          K = {j in K : above_j < top_p}                          # top-p

      A tie group at the top-p boundary is kept whole: vLLM sorts ascending and removes
      each position whose cumulative mass is ``<= 1 - top_p``, so within a tie group its
      (unstable) sort decides which members go; here a group stays where vLLM keeps any
      of its members, and the largest logit (all its ties) always stays. Replay vLLM's
      exact tokens with ``kept_ids``.

    ``SamplingSupport()`` keeps every token. A per-token ``top_k`` is read on the host
    once per call (the width of the top-k candidates, and whether a row has no bound).
    """

    kept_ids: torch.Tensor | None = None
    top_k: int | torch.Tensor | None = None
    top_p: float | torch.Tensor | None = None
    min_p: float | torch.Tensor | None = None

    def __post_init__(self) -> None:
        given = [name for name in _PARAMETERS if getattr(self, name) is not None]
        if self.kept_ids is not None:
            if given:
                raise ContractError(
                    "kept_ids",
                    expected="either kept_ids or the parameters top_k, top_p, min_p",
                    actual=f"kept_ids and {', '.join(given)}",
                )
            ids = self.kept_ids
            if not isinstance(ids, torch.Tensor) or ids.dim() not in (2, 3):
                expected = "a tensor [n, K] (or [b, s, K] in a user context) of token ids"
                raise ContractError("kept_ids", expected=expected, actual=describe_tensor(ids))
            if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
                raise ContractError("kept_ids", expected="an integer dtype", actual=str(ids.dtype))
        put = object.__setattr__
        bounds: dict[str, dict[str, Any]] = {
            "top_p": {"low": 0.0, "high": 1.0, "low_open": True},
            "min_p": {"low": 0.0, "high": 1.0},
        }
        for name in given:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                _check_parameter_tensor(name, value)
            elif name == "top_k":
                put(self, name, check_int("top_k", value, low=1))
            else:
                put(self, name, check_finite_number(name, value, **bounds[name]))

    def of_tokens(self, b: int, s: int, field: str) -> SamplingSupport:
        """The same support as rows (``s``-major, as the hidden states): ``[b, s, K]``
        ids or ``[b, s]`` parameters checked and reshaped; numbers as they are."""
        if self.kept_ids is not None:
            ids = self.kept_ids
            if ids.dim() != 3 or tuple(ids.shape[:2]) != (b, s):
                expected = f"a tensor [b={b}, s={s}, K] like the labels"
                raise ContractError(
                    f"{field}.kept_ids", expected=expected, actual=format_shape(ids.shape)
                )
            return SamplingSupport(kept_ids=to_tokens(ids))
        rows = {}
        for name in _PARAMETERS:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                if tuple(value.shape) != (b, s):
                    expected = f"a number or a tensor [b={b}, s={s}] like the labels"
                    raise ContractError(
                        f"{field}.{name}", expected=expected, actual=format_shape(value.shape)
                    )
                value = to_tokens(value)
            rows[name] = value
        return SamplingSupport(**rows)

    @property
    def tensors(self) -> list[str]:
        """The names of the fields holding tensors."""
        names = ("kept_ids", *_PARAMETERS)
        return [name for name in names if isinstance(getattr(self, name), torch.Tensor)]


def _check_parameter_tensor(name: str, value: torch.Tensor) -> None:
    integer = not (value.dtype.is_floating_point or value.dtype == torch.bool or value.is_complex())
    want_integer = name == "top_k"
    if value.dim() not in (1, 2) or integer != want_integer:
        kind = "an integer" if want_integer else "a floating"
        expected = f"a number or {kind} tensor [n] (or [b, s] in a user context)"
        raise ContractError(name, expected=expected, actual=describe_tensor(value))


def factory_support(support: Any) -> SamplingSupport | None:
    """A processor factory's ``support=``: ``None`` or a :class:`SamplingSupport` of numbers
    (per-token tensors belong to one batch: they come through the user context)."""
    if support is None or not check_instance_support(support).tensors:
        return support
    raise ContractError(
        f"support.{support.tensors[0]}",
        expected="a number (per-token tensors come through the user context's sampling_support)",
        actual="a tensor",
    )


def context_support(
    given: SamplingSupport | None, ctx: OutputContext, b: int, s: int
) -> SamplingSupport | None:
    """A processor's support as rows: its factory's ``support=`` (numbers only), else the
    user context's ``sampling_support`` (a :class:`SamplingSupport` of ``[b, s, K]`` ids or
    ``[b, s]`` parameters; a mapping's key or an attribute), else ``None``; both raise."""
    from_context = context_field(ctx.context, "sampling_support")
    if given is not None and from_context is not None:
        raise ContractError(
            "support",
            expected="one source: the processor's support= or the context's sampling_support",
            actual="both",
        )
    if from_context is None:
        return given
    if not isinstance(from_context, SamplingSupport):
        raise ContractError(
            "context.sampling_support",
            expected="a torch_impl.processors.SamplingSupport",
            actual=type(from_context).__name__,
        )
    return from_context.of_tokens(b, s, "context.sampling_support")


# ---------------------------------------------------------------- the checked rows


@dataclasses.dataclass(frozen=True)
class _Parameters:
    """The parametric form as rows ``[n]`` (acc dtype, ``top_k`` int64 with ``V`` where
    unbounded) and the passes they need, decided on the host."""

    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    width: int  # the candidates' width: the largest bound below V (0: no row bounded)
    passes: str  # "none", "sums" (min-p without a bound) or "radix" (top-p without one)
    min_p_given: bool  # min-p may remove a token


def _row_values(
    name: str, value: Any, n: int, setup: TileSetup, check: bool, *, default: float
) -> torch.Tensor:
    """A parameter as ``[n]`` on the rows' device (a number broadcast), its values
    checked against the constructor's rule where ``check``."""
    device = setup.labels_local.device
    dtype = torch.long if name == "top_k" else setup.acc_dtype
    if value is None:
        value = default
    if not isinstance(value, torch.Tensor):
        return torch.full((n,), value, dtype=dtype, device=device)
    if tuple(value.shape) != (n,):
        expected = f"a number or a tensor [n={n}] (one per gathered row)"
        raise ContractError(name, expected=expected, actual=format_shape(value.shape))
    rows = value.detach().to(device=device, dtype=dtype)
    if check:
        rules = {
            "top_k": (rows < 1, "top_k >= 1"),
            "top_p": ((rows <= 0) | (rows > 1) | rows.isnan(), "top_p in (0, 1]"),
            "min_p": ((rows < 0) | (rows > 1) | rows.isnan(), "min_p in [0, 1]"),
        }
        bad, expected = rules[name]
        check_condition_deferred(bad, rows, field=name, expected=expected, noun="tokens")
    return rows


def _parameters(support: SamplingSupport, n: int, setup: TileSetup, check: bool) -> _Parameters:
    """The checked parameters and the passes they need; ``None`` where nothing is removed."""
    v = setup.vocab_size
    k = _row_values("top_k", support.top_k, n, setup, check, default=v).clamp(max=v)
    top_p = _row_values("top_p", support.top_p, n, setup, check, default=1.0)
    min_p = _row_values("min_p", support.min_p, n, setup, check, default=0.0)
    if isinstance(support.top_k, torch.Tensor) and n:  # one host read: the width and the rest
        width, unbounded = torch.stack([torch.where(k < v, k, 0).max(), (k >= v).sum()]).tolist()
    else:
        width = 0 if support.top_k is None or support.top_k >= v or not n else int(support.top_k)
        unbounded = n if width == 0 else 0
    passes = "none"
    if unbounded and _restricts(support.top_p, 1.0):
        passes = "radix"
    elif unbounded and _restricts(support.min_p, 0.0):
        passes = "sums"
    given = _restricts(support.min_p, 0.0)
    return _Parameters(
        top_k=k, top_p=top_p, min_p=min_p, width=width, passes=passes, min_p_given=given
    )


def _restricts(value: Any, neutral: float) -> bool:
    """Whether a parameter may remove a token (a tensor: any of its values may)."""
    return value is not None and (isinstance(value, torch.Tensor) or value != neutral)


def _kept_ids(support: SamplingSupport, n: int, setup: TileSetup, check: bool) -> torch.Tensor:
    """The kept ids ``[n, K]`` int64 on the rows' device, checked in ``[-1, V)``, each
    row's repeats and padding as -1 (sorted: the order of a row does not matter)."""
    ids = support.kept_ids
    assert ids is not None
    if ids.dim() != 2 or int(ids.shape[0]) != n:
        expected = f"a tensor [n={n}, K] (one row per gathered row)"
        raise ContractError("kept_ids", expected=expected, actual=format_shape(ids.shape))
    rows = ids.detach().to(device=setup.labels_local.device, dtype=torch.long)
    if check:
        v = setup.vocab_size
        bad = (rows < -1) | (rows >= v)
        expected = f"ids in [-1, {v}) (-1: padding)"
        check_condition_deferred(bad, rows, field="kept_ids", expected=expected, noun="entries")
    rows = torch.sort(rows.clamp(min=-1), dim=1).values
    repeat = torch.zeros_like(rows, dtype=torch.bool)
    repeat[:, 1:] = rows[:, 1:] == rows[:, :-1]
    return torch.where(repeat, -1, rows)


# ---------------------------------------------------------------- kept ids


def _renormalised(
    u: torch.Tensor, at_label: torch.Tensor, ignored: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """From the kept logits ``u [n, K]`` (-inf: not kept) and where the label is among
    them, ``(logprobs, entropy, m, log_s, q, log_q, in_support)``::

        m = max(u);  q = softmax(u);  logprobs = u[label] - logsumexp(u)  (-inf: not kept)
        entropy = -sum(q * log_q)     # 0 for an empty row
    """
    kept = u > -_INF
    m = u.amax(1)
    m = torch.where(torch.isfinite(m), m, 0.0)
    d = torch.where(kept, u - m[:, None], 0.0)
    e = torch.where(kept, torch.exp(d), 0.0)
    s = e.sum(1)
    log_s = torch.log(s)
    q = e / torch.where(s > 0, s, 1.0)[:, None]
    log_q = torch.where(kept, d - log_s[:, None], 0.0)
    entropy = torch.where(s > 0, -(q * log_q).sum(1), 0.0)
    in_support = at_label.any(1) & ~ignored
    zy = torch.where(at_label, d, 0.0).sum(1)
    logprobs = torch.where(in_support, zy - log_s, -_INF)
    return torch.where(ignored, 0.0, logprobs), entropy, m, log_s, q, log_q, in_support


def _kept_run(
    ids: torch.Tensor, labels: torch.Tensor, with_entropy: bool, eng: Engine
) -> tuple[Any, ...]:
    """:class:`~._engine.Recomputed`'s run of the kept-ids form: each tile's kept logits
    gathered into ``[n, K]``, then the outputs and their gradient's sparse terms::

        d logprob / dz_j = [j == y] - q_j;   d entropy / dz_j = -q_j (log q_j + H)   # j kept
        d lse / dz_j = p_j;   d vocab_logprob / dz_j = [j == y] - p_j   # the engine's dense term
    """
    setup, acc = eng.setup, eng.setup.acc_dtype
    local = ids - setup.vocab_start
    cols = torch.where((ids >= 0) & (local >= 0) & (local < eng.local), local, -1)
    picked = torch.full(ids.shape, -_INF, dtype=acc, device=ids.device)

    def on_tile(z: torch.Tensor, rows: slice, tile: slice) -> None:
        at = cols[rows] - tile.start  # -1 (elsewhere) stays negative
        hit = (at >= 0) & (at < z.shape[1])
        values = eng.logits_of(z.gather(1, at.clamp(0, z.shape[1] - 1)), rows)
        picked[rows] = torch.where(hit, values, picked[rows])

    stats = eng.forward_stats(with_entropy=False, on_tile=on_tile)
    u = setup.reduce_max(picked)  # each id lives in one shard
    at_label = (ids == labels[:, None]) & (u > -_INF)
    lp, ent, m, log_s, q, log_q, in_support = _renormalised(u, at_label, setup.ignored)
    kept_logmass = m + log_s - stats.lse
    slope = eng.cap_slope_of(torch.where(u > -_INF, u, 0.0), slice(None))
    full = stats.detached()

    def grad_of(g_lp: Any, g_h: Any, g_lse: Any, _g_mass: Any, g_vocab: Any) -> Any:
        g_h = g_h if with_entropy else None
        if g_lp is None and g_h is None and g_lse is None and g_vocab is None:
            return None
        g = torch.zeros_like(m) if g_lp is None else torch.where(in_support, g_lp.to(acc), 0.0)
        terms = g[:, None] * (at_label.to(acc) - q)
        if g_h is not None:
            terms = terms - g_h.to(acc)[:, None] * q * (log_q + ent[:, None])
        whole = logit_grad_coefficients(full, g_vocab, None, setup.ignored, acc, g_lse=g_lse)
        return full, whole, (cols, terms * slope)

    empty = lp.new_empty(0)
    outputs = (lp, ent if with_entropy else empty, stats.lse, kept_logmass, stats.logprobs)
    return outputs, (outputs[3],) + (() if with_entropy else (outputs[1],)), grad_of


# ---------------------------------------------------------------- parameters: the first sweep


class _Candidates:
    """The running ``width`` largest tempered logits of each row (values only, descending)
    and ``beyond``: how many entries seen so far equal the smallest of them without being
    among them (a tie group cut by the width), so that ties at the k-th are all counted."""

    def __init__(self, n: int, width: int, acc: torch.dtype, device: torch.device) -> None:
        self.values = torch.full((n, width), -_INF, dtype=acc, device=device)
        self.beyond = torch.zeros(n, dtype=acc, device=device)

    def fold(self, z: torch.Tensor, rows: slice) -> None:
        """Fold the tempered tile ``z [r, c]`` into the rows' candidates::

        new = topk(concat(old, topk(z))); c = min(new)
        seen = count of c in old (+ beyond where c is old's min) + count of c in z
        beyond = seen - count of c in new
        """
        old, width = self.values[rows], self.values.shape[1]
        tile = torch.topk(z, min(width, z.shape[1]), dim=1).values
        new = torch.topk(torch.cat([old, tile], 1), width, dim=1).values
        c, c_old = new[:, -1:], old[:, -1:]
        same = (c == c_old).squeeze(1)
        from_old = torch.where(same, self.beyond[rows] + (old == c_old).sum(1), (old == c).sum(1))
        seen = from_old + torch.count_nonzero(z == c, dim=1)
        self.values[rows] = new
        self.beyond[rows] = torch.where(torch.isinf(c[:, 0]), 0.0, seen - (new == c).sum(1))

    def merged(self, setup: TileSetup, gather: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values [n, width], beyond [n])`` over every shard: one all-gather of the
        values, one all-reduce sum of each shard's count of the global smallest value."""
        if gather is None:
            return self.values, self.beyond
        n, width = self.values.shape
        every = gather(self.values).permute(1, 0, 2).reshape(n, -1)
        values = torch.topk(every, width, dim=1).values
        c = values[:, -1:]
        here = (self.values == c).sum(1) + torch.where(
            self.values[:, -1:] == c, self.beyond[:, None], 0.0
        ).squeeze(1)
        return values, setup.reduce_sum(here) - (values == c).sum(1)


@dataclasses.dataclass
class _Sweep:
    """What the first sweep gathers beside the engine's statistics: each row's largest
    tempered logit ``m`` and its label's ``zy`` (-inf where ignored), both as the tiles give
    them (the engine's kernels may round a capped maximum differently), and the candidates."""

    m: torch.Tensor
    zy: torch.Tensor
    candidates: _Candidates | None

    def on_tile(self, eng: Engine) -> Callable[[torch.Tensor, slice, slice], None]:
        labels = eng.setup.labels_local

        def fold(z: torch.Tensor, rows: slice, cols: slice) -> None:
            zt = eng.logits_of(z, rows)  # Triton's tiles are untempered: a copy
            torch.maximum(self.m[rows], zt.amax(1), out=self.m[rows])
            at = labels[rows] - cols.start
            hit = (labels[rows] >= 0) & (at >= 0) & (at < zt.shape[1])
            picked = zt.gather(1, at.clamp(0, zt.shape[1] - 1)[:, None]).squeeze(1)
            self.zy[rows] = torch.where(hit, picked, self.zy[rows])
            if self.candidates is not None:
                self.candidates.fold(zt, rows)

        return fold


# ---------------------------------------------------------------- parameters: the threshold


@dataclasses.dataclass(frozen=True)
class _Threshold:
    """A row's kept set ``{j : z_j >= tau}`` and its sums ``s = sum exp(z_j - m)``,
    ``t = sum exp(z_j - m) (z_j - m)`` over it, ``[n]`` each (``m``: the rows' max)."""

    tau: torch.Tensor
    s: torch.Tensor
    t: torch.Tensor

    def where(self, rows: torch.Tensor, other: _Threshold) -> _Threshold:
        return _Threshold(
            *(torch.where(rows, a, b) for a, b in zip(self.fields, other.fields, strict=True))
        )

    @property
    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tau, self.s, self.t


def _nucleus(
    values: torch.Tensor, beyond: torch.Tensor, m: torch.Tensor, tau1: torch.Tensor, p: torch.Tensor
) -> _Threshold:
    """Top-p over the candidates ``values [n, width]`` (descending) restricted to
    ``z >= tau1`` (a top-k or min-p bound at or above the smallest candidate), the ``beyond``
    ties of the smallest counted at its value::

        G(v) = sum of exp(z - m) over kept z >= v       # a tie group whole
        tau = max{v kept : G(v) >= p * G(tau1)}          # the top-p threshold
    """
    smallest = values[:, -1:]
    d = values - m[:, None]
    w = torch.where(values >= tau1[:, None], torch.exp(d), 0.0)
    tied = beyond[:, None] * torch.exp(smallest - m[:, None])
    extra = torch.where(tau1[:, None] == smallest, tied, 0.0)
    last = torch.searchsorted(-values, -values, right=True) - 1  # each tie group's last index
    at_smallest = values == smallest
    g = w.cumsum(1).gather(1, last) + torch.where(at_smallest, extra, 0.0)
    extra_t = torch.where(at_smallest, extra * (smallest - m[:, None]), 0.0)
    gt = (w * d).cumsum(1).gather(1, last) + extra_t
    total = g[:, -1]  # G at the smallest candidate: the whole kept mass
    ok = (values >= tau1[:, None]) & (g >= (p * total)[:, None])
    first = torch.argmax(ok.to(torch.int8), dim=1, keepdim=True)
    pick = (x.gather(1, first).squeeze(1) for x in (values, g, gt))
    return _Threshold(*pick)


def _sortable(z: torch.Tensor) -> torch.Tensor:
    """An integer key per value (int32 for fp32, int64 for fp64), ordered as the values
    are (``-0.0`` as ``0.0``): the bit pattern, the magnitude bits of a negative value
    flipped."""
    bits = (z + 0.0).view(torch.int64 if z.dtype == torch.float64 else torch.int32)
    sign = bits >> (bits.element_size() * 8 - 1)  # -1 where negative, else 0
    return bits ^ (sign & torch.iinfo(bits.dtype).max)


def _from_sortable(key: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The value of a :func:`_sortable` key (the same flip undoes it)."""
    bits = key.to(torch.int64 if dtype == torch.float64 else torch.int32)
    sign = bits >> (bits.element_size() * 8 - 1)
    return (bits ^ (sign & torch.iinfo(bits.dtype).max)).view(dtype)


def _histograms(
    eng: Engine,
    m: torch.Tensor,
    tau1: torch.Tensor | None,
    prefix: torch.Tensor | None,
    digit_at: tuple[int, int],
    *,
    with_t: bool,
) -> torch.Tensor:
    """One sweep (one GEMM): of each row's entries ``z >= tau1`` (``None``: every entry)
    whose key (:func:`_sortable`) has the digits ``prefix`` above ``shift`` (``None``: the
    top digit, signed), the sums of ``exp(z - m)`` (and, ``with_t``, of ``exp(z - m) (z -
    m)``) by their digit of ``width`` bits at ``shift`` (``digit_at``): ``[2, n, 2**width]``,
    summed over the shards."""
    shift, width = digit_at
    buckets = 1 << width
    hist = torch.zeros(2, eng.n, buckets, dtype=eng.setup.acc_dtype, device=eng.hs.device)
    for rows, _, _, z in eng.vocab_tiles():
        z = eng.logits_of(z, rows, inplace=True)
        high = _sortable(z) >> shift
        keep = None if tau1 is None else z >= tau1[rows, None]
        if prefix is None:
            digit = (high + buckets // 2).long()
        else:
            match = (high >> width) == prefix[rows, None]
            keep = match if keep is None else keep & match
            digit = (high & (buckets - 1)).long()
        d = z.sub_(m[rows, None])
        w = torch.exp(d) if keep is None else torch.where(keep, torch.exp(d), 0.0)
        hist[0, rows].scatter_add_(1, digit, w)
        if with_t:
            hist[1, rows].scatter_add_(1, digit, w.mul_(d))
    if with_t:
        return eng.setup.reduce_sum(hist)
    hist[:1] = eng.setup.reduce_sum(hist[:1])  # the second stays 0: half the all-reduce
    return hist


def _descend(
    hist: torch.Tensor, above: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(digit [n, 1], above [2, n])``: the largest digit whose bucket holds the top-p
    threshold (``above + mass of the buckets at and above it >= target``, clamped to the
    non-empty buckets), and the sums of the buckets above it added to ``above``."""
    upper = torch.zeros_like(hist)
    upper[..., :-1] = hist[..., 1:].flip(-1).cumsum(-1).flip(-1)  # the buckets above each
    reach = above[0][:, None] + upper[0] + hist[0]
    digit = (reach >= target[:, None]).sum(1, keepdim=True) - 1
    nonempty = (hist[0] > 0).to(torch.int8)
    low = torch.argmax(nonempty, 1, keepdim=True)
    high = nonempty.shape[1] - 1 - torch.argmax(nonempty.flip(1), 1, keepdim=True)
    digit = torch.minimum(torch.maximum(digit, low), high)
    return digit, above + upper.gather(2, digit.expand(2, -1, -1)).squeeze(2)


def _radix(
    eng: Engine,
    m: torch.Tensor,
    tau1: torch.Tensor,
    p: torch.Tensor,
    *,
    descend: bool,
    bounded: bool,
    with_t: bool,
) -> tuple[_Threshold, _Threshold]:
    """``(bounded, nucleus)`` of rows without a top-k bound: the kept set ``z >= tau1``
    (``bounded``: a min-p bound; else every entry) with its sums, and with ``descend`` its
    top-p threshold, exact on the keys' bits: one sweep a digit (:data:`_DIGITS`: 3 for
    fp32 logits, 6 for fp64); ``with_t``: the entropy's sums too::

        tau = max{v : sum of exp(z - m) over z >= max(v, tau1)  >=  p * that over z >= tau1}
    """
    acc = eng.setup.acc_dtype
    bits, key = (64, torch.int64) if acc == torch.float64 else (32, torch.int32)
    floor, widths = (tau1 if bounded else None), _DIGITS[bits]
    shifts = [bits - sum(widths[: i + 1]) for i in range(len(widths))]
    hist = _histograms(eng, m, floor, None, (shifts[0], widths[0]), with_t=with_t)
    whole = hist.sum(2)
    kept = _Threshold(tau1, whole[0], whole[1])
    if not descend:
        return kept, kept
    target, above = p * whole[0], torch.zeros_like(whole)
    prefix = torch.zeros_like(m, dtype=torch.long)
    for level, (shift, width) in enumerate(zip(shifts, widths, strict=True)):
        if level:
            at_digit = (shift, width)
            hist = _histograms(eng, m, floor, prefix.to(key), at_digit, with_t=with_t)
        digit, above = _descend(hist, above, target)
        signed = digit[:, 0] - (1 << (width - 1)) if level == 0 else digit[:, 0]
        prefix = prefix * (1 << width) + signed
    at = hist.gather(2, digit.expand(2, -1, -1)).squeeze(2)
    tau = _from_sortable(prefix, acc)
    return kept, _Threshold(tau, above[0] + at[0], above[1] + at[1])


def _select(
    eng: Engine,
    params: _Parameters,
    stats: Stats,
    m: torch.Tensor,
    merged: tuple[torch.Tensor, torch.Tensor] | None,
) -> _Threshold:
    """Each row's :class:`_Threshold` by vLLM's rule: rows with a top-k bound from the
    candidates (:func:`_nucleus`), the others by :func:`_radix` where a parameter bounds
    them, else the whole vocabulary (the engine's statistics, in ``m``'s frame)."""
    s_full = stats.sumexp * torch.exp(stats.max - m)
    h = stats.entropy
    t_full = torch.zeros_like(m) if h is None else s_full * (torch.log(s_full) - h)
    sel = _Threshold(torch.full_like(m, -_INF), s_full, t_full)
    tau_min = m + torch.log(params.min_p)  # min-p: z >= m + log(min_p); -inf at 0
    if params.passes != "none":
        descend, floor = params.passes == "radix", params.min_p_given
        kept, nucleus = _radix(
            eng, m, tau_min, params.top_p, descend=descend, bounded=floor, with_t=h is not None
        )
        sel = kept.where(params.top_p >= 1.0, nucleus)
    if merged is not None:
        values, beyond = merged
        at = (params.top_k - 1).clamp(0, values.shape[1] - 1)[:, None]
        tau1 = torch.maximum(tau_min, values.gather(1, at).squeeze(1))
        nucleus = _nucleus(values, beyond, m, tau1, params.top_p)
        sel = nucleus.where(params.top_k < eng.setup.vocab_size, sel)
    return sel


# ---------------------------------------------------------------- parameters: the gradient


@dataclasses.dataclass(frozen=True)
class _MaskedGrad:
    """The logit gradient of the parametric form, per tile::

    dz_j = [z_j >= tau] * -e_j (a + b (z_j - m)) - e_j a_w + (g + g_w) [j == y]
    e_j = exp(z_j - m)

    (``a, b, g``: :func:`~._engine.logit_grad_coefficients` of the kept distribution;
    ``a_w, g_w``: of the whole vocabulary in ``m``'s frame, the terms of ``lse`` and of the
    whole vocabulary's logprob; ``whole`` None: none)."""

    m: torch.Tensor
    tau: torch.Tensor
    coef: Coefficients
    whole: Coefficients | None

    def tile(self, eng: Engine, z: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
        """The gradient of the tempered tile ``z`` (a softcap's slope applied), in place::

        gz = exp(z - m) * -([z >= tau] (a + b (z - m)) + a_w);  gz[y] += g + g_w
        """
        c = self.coef.of_rows(rows)
        w = None if self.whole is None else self.whole.of_rows(rows)
        slope = eng.cap_slope_of(z, rows)  # of the capped values, before z is shifted
        keep = z >= self.tau[rows, None]
        d = z.sub_(self.m[rows, None])
        if c.b is None:
            f = torch.where(keep, c.a[:, None], 0.0)
        else:
            f = torch.mul(d, c.b[:, None], out=eng.like("e", d)).add_(c.a[:, None]).mul_(keep)
        f = f if w is None else f.add_(w.a[:, None])
        gz = d.exp_().mul_(f.neg_())
        g = c.g if w is None else c.g + w.g
        labels = eng.setup.labels_local[rows]
        at = labels - cols.start
        hit = (at >= 0) & (at < gz.shape[1])  # -1 (elsewhere) is negative
        gz.scatter_add_(1, at.clamp(0, gz.shape[1] - 1)[:, None], torch.where(hit, g, 0.0)[:, None])
        return gz if isinstance(slope, float) else gz.mul_(slope)


def _masked_backward(
    eng: Engine, grad: _MaskedGrad, *, need_dh: bool, need_dw: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The vocabulary sweep's backward with :class:`_MaskedGrad`'s tiles (three GEMMs)::

    gz = tile(logits(rows, cols));  dh[rows] += gz @ W[cols];  dW[cols] += gz.T @ h[rows]
    """
    setup, hid = eng.setup, eng.hs.shape[1]
    acc, device = setup.acc_dtype, eng.hs.device
    dh = torch.empty((eng.n, hid), dtype=acc, device=device) if need_dh else None
    dw = torch.empty((eng.local, hid), dtype=acc, device=device) if need_dw else None
    if eng.n == 0 or eng.local == 0:  # no tile: nothing writes them
        dh, dw = (None if x is None else x.zero_() for x in (dh, dw))
    for rows, cols, wc, z in eng.vocab_tiles():
        z = eng.logits_of(z, rows, inplace=True)
        gz = eng.untempered_grad(grad.tile(eng, z, rows, cols), rows).to(setup.compute_dtype)
        if dh is not None:  # each accumulator written by its first GEMM
            gemm_into(dh[rows], gz, wc, first=cols.start == 0)
        if dw is not None:
            gemm_into(dw[cols], gz.T, eng.hs[rows], first=rows.start == 0)
        eng.bias_grad_(gz, rows, cols)
    return eng.unfold_dh(dh), None if dw is None else dw.to(eng.w_dtype)


class _Thresholded(Recomputed):
    """:class:`~._engine.Recomputed` whose ``grad_of`` gives a :class:`_MaskedGrad`,
    recomputed by :func:`_masked_backward` in place of the engine's backward."""

    @staticmethod
    def backward(ctx: Any, *cotangents: Any) -> tuple[Any, ...]:
        cotangents = Recomputed.checked_cotangents(ctx, cotangents)
        h, w, b = ctx.saved_tensors
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        if not (need_dh or need_dw or need_db) or (grad := ctx.grad_of(*cotangents)) is None:
            return None, None, None, None, None, None
        with no_autocast(h):
            eng = Engine(h, w, ctx.setup, need_db=need_db)
            dh, dw = _masked_backward(eng, grad, need_dh=need_dh, need_dw=need_dw)
        db = None if eng.db is None else eng.db.to(b.dtype)
        return (None if dh is None else dh.to(h.dtype)), dw, db, None, None, None


def _threshold_run(
    params: _Parameters, gather: Any, with_entropy: bool, eng: Engine
) -> tuple[Any, ...]:
    """:class:`_Thresholded`'s run: the first sweep (statistics, each row's max and
    label, the candidates), the thresholds (:func:`_select`; more sweeps where
    :func:`_radix` runs), and the outputs of the kept set ``z >= tau``::

        logprobs = z_y - m - log(s)  (-inf where z_y < tau);  entropy = log(s) - t / s
    """
    setup, n, acc = eng.setup, eng.n, eng.setup.acc_dtype
    width, device = params.width, eng.hs.device
    candidates = _Candidates(n, width, acc, device) if width else None
    lowest = torch.full((2, n), -_INF, dtype=acc, device=device)
    sweep = _Sweep(lowest[0], lowest[1], candidates)
    stats = eng.forward_stats(with_entropy=with_entropy, on_tile=sweep.on_tile(eng))
    m, zy = setup.reduce_max(lowest).unbind(0)
    merged = None if candidates is None else candidates.merged(setup, gather)
    sel = _select(eng, params, stats, m, merged)
    log_s, ignored = torch.log(sel.s), setup.ignored
    in_support = (zy >= sel.tau) & ~ignored
    lp = torch.where(in_support, zy - m - log_s, -_INF)
    lp = torch.where(ignored, 0.0, lp)
    ent = log_s - sel.t / sel.s
    kept_logmass = m + log_s - stats.lse
    lse_frame = torch.exp(stats.lse - m)  # the whole vocabulary's sum of exp(z - m)

    def grad_of(g_lp: Any, g_h: Any, g_lse: Any, _g_mass: Any, g_vocab: Any) -> Any:
        g_h = g_h if with_entropy else None
        if g_lp is None and g_h is None and g_lse is None and g_vocab is None:
            return None
        g = torch.zeros_like(m) if g_lp is None else torch.where(in_support, g_lp.to(acc), 0.0)
        kept = Stats(max=m, sumexp=sel.s, logprobs=lp, entropy=None if g_h is None else ent)
        coef = logit_grad_coefficients(kept, g, g_h, ignored, acc)
        whole = None
        if g_lse is not None or g_vocab is not None:
            frame = Stats(max=m, sumexp=lse_frame, logprobs=stats.logprobs, entropy=None)
            whole = logit_grad_coefficients(frame, g_vocab, None, ignored, acc, g_lse=g_lse)
        return _MaskedGrad(m, sel.tau, coef, whole)

    empty = lp.new_empty(0)
    outputs = (lp, ent if with_entropy else empty, stats.lse, kept_logmass, stats.logprobs)
    return outputs, (outputs[3],) + (() if with_entropy else (outputs[1],)), grad_of


# ---------------------------------------------------------------- the entry


def _gather(setup: TileSetup, local: int, collectives: Any) -> Any:
    """``collectives.all_gather`` where the vocabulary is split (the candidates of the
    shards merged), else None; refused by name where it is missing."""
    if local == setup.vocab_size:
        return None
    gather = getattr(collectives, "all_gather", None)
    if not callable(gather):
        raise ContractError(
            "collectives.all_gather",
            expected="a Collectives with all_gather (spec 1.2) to merge the top-k candidates "
            "of the vocab shards",
            actual=f"{type(collectives).__name__} without all_gather",
        )
    return gather


def support_logprobs(
    hidden: Any,
    weight: Any,
    labels: Any,
    support: Any,
    options: Any,
    unexpected: dict[str, Any],
    *,
    bias: Any,
    with_entropy: bool,
    with_mean: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear_logprobs(..., support=)``: ``(logprobs, entropy, lse, kept_logmass,
    vocab_logprobs)`` ``[n]`` (``entropy`` None unless ``with_entropy``; ``kept_logmass``
    detached), after
    the prologue (not folded for the parametric form: its threshold compares the tempered
    logits, equal logits stay equal). A mean logit (``with_mean``) is refused."""
    check_instance_support(support)
    if with_mean:
        expected = "False and no mean_logit_weights with a support (a mean of the whole vocabulary)"
        raise ContractError("with_mean_logit", expected=expected, actual="a mean logit asked for")
    name, fold = "linear_logprobs", support.kept_ids is not None
    options, h, setup = prologue(
        name, hidden, weight, labels, options, unexpected, bias=bias, fold=fold
    )
    n, check = int(h.shape[0]), options.check_values
    if support.kept_ids is not None:
        ids = _kept_ids(support, n, setup, check)
        y = labels.to(device=ids.device, dtype=torch.long)

        def run(eng: Engine) -> Any:
            return _kept_run(ids, y, with_entropy, eng)

        function: Any = Recomputed
    else:
        params = _parameters(support, n, setup, check)
        gather = _gather(setup, int(weight.shape[0]), options.collectives) if params.width else None

        def run(eng: Engine) -> Any:
            return _threshold_run(params, gather, with_entropy, eng)

        function = _Thresholded
    lp, ent, lse, mass, vocab = function.apply(h, weight, setup.bias, name, setup, run)
    return lp, ent if with_entropy else None, lse, mass, vocab


def check_instance_support(support: Any) -> SamplingSupport:
    """``support`` a :class:`SamplingSupport` (``ContractError`` naming ``support``)."""
    if not isinstance(support, SamplingSupport):
        raise ContractError(
            "support",
            expected="None or a torch_impl.processors.SamplingSupport",
            actual=type(support).__name__,
        )
    return support
