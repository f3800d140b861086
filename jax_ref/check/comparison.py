"""Cross-check a torch processor against a float64 JAX reference: the comparison.

::

    report = cross_check(processor, reference, ctx)   # ctx: hookspec.OutputContext (torch)
    print(report)                                     # a table; report.passed -> bool

Steps: run the processor (either kind of the contract) with its VJPs
(:mod:`jax_ref.check.torch_run`); hand the hidden states, the weight, the labels,
masks and the user context to JAX over DLPack (:mod:`jax_ref.check.dlpack`); run the
reference in float64 under ``jax.vjp``; pull back the same cotangents; compare
each output's value, ``d/d hidden`` and ``d/d weight``.

Tolerance policy, per dtype of the hidden states (:data:`TOLERANCES`): a
compared array passes when ``max|a - r| <= atol + rtol * max|r|``, ``r`` the
float64 reference on the very same (rounded) inputs. The error is measured
against the array's scale, not element by element, so near-zero gradient
entries cannot hide a wrong sign or a missing reduction, and ``rtol`` stays far
below what such bugs cost (a factor 2 or more). A non-finite value where the
reference is finite fails, whatever the tolerance.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from hookspec import ContractError, OutputContext

from .._x64 import computing_in, float64
from ..inputs import ReferenceInputs
from ..sharded import shard_reference, vocab_mesh
from .dlpack import to_jax
from .report import CrossCheckReport, Row
from .torch_run import SINGLE_OUTPUT, TorchRun, processor_name, run_on_context

__all__ = [
    "TOLERANCES",
    "Tolerance",
    "compare",
    "compare_run",
    "cross_check",
    "failing_positions",
    "cross_check_tensor_parallel",
    "logit_scale",
    "logit_softcap",
    "reference_inputs",
    "to_reference_tree",
]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Pass when ``max_abs_error <= atol + rtol * max|reference| + slack * floor``.

    ``floor`` is the error of the plain formula in float32: the reference
    itself evaluated with float32 arithmetic, against its float64 value. It is
    computed only for an array that fails the first two terms, and matters
    where a quantity is tiny against the logits it comes from (the entropy of
    a near one-hot softmax and its gradient, a KL of near-equal policies): a
    processor may be no worse than the textbook float32 computation, within
    ``slack``. A sign error, a wrong reduction or a missing all-reduce costs
    orders of magnitude more.
    """

    rtol: float
    atol: float
    slack: float = 8.0

    def allows(self, max_abs: float, scale: float, floor: float = 0.0) -> bool:
        return max_abs <= self.atol + self.rtol * scale + self.slack * floor


TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(rtol=1e-10, atol=1e-13),
    "float32": Tolerance(rtol=1e-4, atol=1e-7),
    "float16": Tolerance(rtol=5e-3, atol=1e-6),
    "bfloat16": Tolerance(rtol=2e-2, atol=1e-5),
}
"""The default policy, by the dtype of the hidden states: float32 allows ~1000
ulps relative to the array's scale, bf16 and fp16 a few units of the format's
rounding."""


def to_reference_tree(obj: Any, /, *, field: str = "context") -> Any:
    """``obj`` with every torch tensor replaced by a JAX array over DLPack.

    Floating tensors become float64. A dataclass is rebuilt with
    ``dataclasses.replace`` (or, when its checks refuse JAX arrays, a
    ``types.SimpleNamespace`` with the same attributes); a mapping becomes a
    dict; tuples and lists keep their type; anything else passes unchanged.
    """
    if isinstance(obj, torch.Tensor):
        with float64():
            a = to_jax(obj, field=field)
            return a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a
    if isinstance(obj, np.ndarray):
        return to_reference_tree(torch.from_numpy(obj), field=field)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = {
            f.name: to_reference_tree(getattr(obj, f.name), field=f"{field}.{f.name}")
            for f in dataclasses.fields(obj)
        }
        try:
            return dataclasses.replace(
                obj, **{k: v for k, v in values.items() if k in _init_fields(obj)}
            )
        except Exception:
            return types.SimpleNamespace(**values)
    if isinstance(obj, Mapping):
        return {k: to_reference_tree(v, field=f"{field}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_reference_tree(v, field=f"{field}[{i}]") for i, v in enumerate(obj))
    return obj


def _init_fields(obj: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(obj) if f.init}


def logit_scale(config: Any) -> float:
    """Megatron's MuP output multiplier when ``config.use_mup``, else 1."""
    if config is not None and getattr(config, "use_mup", False):
        return float(getattr(config, "mup_output_mult", 1.0))
    return 1.0


def logit_softcap(config: Any) -> float | None:
    """The model's final-logit softcap ``config.final_logit_softcapping`` (Gemma's
    name, where a release has the field), None where it is unset, None, 0 or False:
    the rule the built-in processors follow."""
    value = getattr(config, "final_logit_softcapping", None)
    if value is None or value is False or value == 0:
        return None
    return float(value)


def reference_inputs(ctx: OutputContext, /) -> ReferenceInputs:
    """The data of a torch ``OutputContext`` for a reference (inside :func:`float64`)."""
    with float64():

        def opt(name: str) -> Any:
            value = getattr(ctx, name)
            return None if value is None else to_reference_tree(value, field=name)

        vocab = ctx.vocab
        return ReferenceInputs(
            labels=opt("labels"),
            loss_mask=opt("loss_mask"),
            padding_mask=opt("padding_mask"),
            input_ids=opt("input_ids"),
            context=opt("context"),
            vocab_start=0 if vocab is None else vocab.start,
            vocab_size=0 if vocab is None else vocab.size,
            ignore_index=ctx.ignore_index,
            logit_scale=logit_scale(ctx.config),
            softcap=logit_softcap(ctx.config),
            mtp_depth=ctx.mtp_depth,
        )


def _describe(tree: Mapping[str, Any], single: bool) -> str:
    parts = [f"{k} {list(np.shape(v))}" for k, v in sorted(tree.items())]
    return f"one array {parts[0].split(' ', 1)[1]}" if single else "{" + ", ".join(parts) + "}"


def _reference_outputs(out: Any, single: bool, name: str) -> dict[str, Any]:
    if isinstance(out, Mapping):
        if single:
            raise ContractError(
                f"reference {name!r} result",
                expected="one array, as the processor returns",
                actual=f"a mapping with keys {sorted(out)}",
            )
        return dict(out)
    if single and hasattr(out, "shape"):
        return {SINGLE_OUTPUT: out}
    actual = (
        f"one array of shape {list(np.shape(out))}" if hasattr(out, "shape") else type(out).__name__
    )
    raise ContractError(
        f"reference {name!r} result",
        expected="a mapping of arrays, as the processor returns" if not single else "one array",
        actual=actual,
    )


def _np64(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def compare(
    actual: Any, expected: Any, tol: Tolerance, *, reference: str = ""
) -> tuple[float, float, bool, str]:
    """``(max_abs, max_rel, passed, note)`` for two arrays of one shape.
    ``reference``: the reference function's name, for the note where it is the
    reference that is not finite."""
    a, e = _np64(actual), _np64(expected)
    if a.shape != e.shape:
        return math.inf, math.inf, False, f"shape {list(a.shape)} vs reference {list(e.shape)}"
    bad = ~np.isfinite(a) & np.isfinite(e)
    if bad.any():
        return math.nan, math.nan, False, f"non-finite: {int(bad.sum())} of {a.size} values"
    both = np.isfinite(a) & np.isfinite(e)
    diff = np.abs(a - e)[both]
    max_abs = float(diff.max()) if diff.size else 0.0
    if not np.array_equal(np.isfinite(e), np.isfinite(a)):
        n = int((np.isfinite(a) & ~np.isfinite(e)).sum())
        who = f"the reference {reference!r}" if reference else "the reference"
        nans = int(np.isnan(e).sum())
        kind = (
            "NaN"
            if nans == int((~np.isfinite(e)).sum())
            else "NaN or infinite"
            if nans
            else "infinite"
        )
        return (
            max_abs,
            math.inf,
            False,
            f"{who} is {kind} at {n} of {a.size} values where the processor is finite "
            "(a defect of the reference, or of the inputs it reads)",
        )
    scale = float(np.abs(e[both]).max()) if diff.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    return max_abs, max_rel, tol.allows(max_abs, scale), ""


FIRST_POSITIONS = 3
"""How many failing tokens a failing row names."""


def failing_positions(actual: Any, expected: Any, bound: float, quantity: str) -> str:
    """The first :data:`FIRST_POSITIONS` tokens ``(b, s)`` (rows ``v`` of ``d/d weight``)
    where ``|actual - expected| > bound`` or ``actual`` is not finite where ``expected``
    is, each with the entry of the largest error there, ours and the reference's; ``""``
    for a scalar. A value is ``[b, s, ...]``, ``d/d hidden`` ``[s, b, h]``."""
    a, e = _np64(actual), _np64(expected)
    if a.ndim == 0 or a.shape != e.shape:
        return ""
    err = np.where(np.isfinite(a) | ~np.isfinite(e), np.abs(a - e), np.inf)
    err = np.where(np.isnan(err), 0.0, err)  # both NaN, or inf - inf: compared elsewhere
    hidden, weight = quantity == "d/d hidden", quantity == "d/d weight"
    lead = 1 if weight or a.ndim == 1 else 2
    shape = (*a.shape[:lead], -1)
    per, a, e = err.reshape(shape), a.reshape(shape), e.reshape(shape)
    if hidden:  # [s, b, h] -> [b, s, h]: the tokens in order, named as the labels
        per, a, e = (x.transpose(1, 0, 2) for x in (per, a, e))
    parts = []
    for pos in np.argwhere(per.max(-1) > bound)[:FIRST_POSITIONS]:
        at = tuple(int(i) for i in pos)
        j = int(per[at].argmax())
        name = f"v={at[0]}" if weight else f"(b={at[0]}, s={at[1]})" if lead == 2 else f"[{at[0]}]"
        parts.append(f"{name} ours {a[at][j]:.6g} reference {e[at][j]:.6g}")
    return "first failing: " + "; ".join(parts) if parts else ""


def _f64(x: Any, field: str) -> jax.Array:
    if isinstance(x, torch.Tensor):
        return to_jax(x, field=field).astype(jnp.float64)
    return jnp.asarray(x, jnp.float64)


def _pullbacks(
    apply: Callable[..., Any],
    h: jax.Array,
    w: jax.Array,
    inputs: ReferenceInputs,
    run: TorchRun,
    name: str,
    weight_rows: slice | None,
    check: bool = False,
) -> dict[tuple[str, str], jax.Array]:
    """``(output, quantity) -> array`` of the reference at ``(h, w)``."""
    out, pullback = jax.vjp(lambda a, b: apply(a, b, inputs), h, w)
    ref = _reference_outputs(out, run.single, name)
    if check and (
        set(ref) != set(run.outputs)
        or any(tuple(np.shape(ref[k])) != tuple(run.outputs[k].shape) for k in run.outputs)
    ):
        raise ContractError(
            f"reference {name!r} result",
            expected=f"the processor's structure {_describe(run.outputs, run.single)}",
            actual=_describe(ref, not isinstance(out, Mapping)),
        )
    zeros = {k: jnp.zeros(np.shape(v), jnp.result_type(v)) for k, v in ref.items()}
    found: dict[tuple[str, str], jax.Array] = {}
    for key in sorted(run.outputs):
        found[key, "value"] = ref[key]
        if key not in run.cotangents:
            continue
        cot = dict(zeros)
        cot[key] = jnp.asarray(
            _np64(run.cotangents[key]), dtype=jnp.result_type(ref[key])
        )  # uncommitted
        dh, dw = pullback(cot[SINGLE_OUTPUT] if run.single else cot)
        found[key, "d/d hidden"] = dh
        found[key, "d/d weight"] = dw if weight_rows is None else dw[weight_rows]
    return found


def compare_run(
    run: TorchRun,
    reference: Callable[..., Any],
    /,
    *,
    case: str,
    tolerance: Tolerance | None = None,
    inputs: ReferenceInputs | None = None,
    apply: Callable[..., Any] | None = None,
    reference_weight: Any = None,
    weight_rows: slice | None = None,
    processor: str = "",
) -> list[Row]:
    """Compare one :class:`TorchRun` with ``reference`` on the same inputs.

    ``apply(hidden, weight, inputs)`` runs the reference (default: the
    reference itself; the sharded path passes a ``shard_reference``) on
    ``reference_weight`` (default: the run's weight); ``weight_rows`` selects
    this rank's rows of the reference's weight gradient.
    """
    ctx = run.context
    dtype = str(ctx.hidden_states.dtype).removeprefix("torch.")
    tol = tolerance or TOLERANCES.get(dtype, TOLERANCES["float32"])
    name = getattr(reference, "__name__", type(reference).__name__)
    inputs = inputs if inputs is not None else reference_inputs(ctx)
    apply = apply or reference
    got = {}
    for key in sorted(run.outputs):
        got[key, "value"] = run.outputs[key]
        if key in run.cotangents:
            got[key, "d/d hidden"] = run.grad_hidden[key]
            got[key, "d/d weight"] = run.grad_weight[key]
    with float64():
        h = _f64(ctx.hidden_states, "hidden_states")
        w = _f64(ctx.vocab_weight if reference_weight is None else reference_weight, "vocab_weight")
        want = _pullbacks(apply, h, w, inputs, run, name, weight_rows, check=True)
        results = {k: compare(got[k], want[k], tol, reference=name) for k in got}
        floors: dict[tuple[str, str], float] = {}
        if any(not ok and not note for (_, _, ok, note) in results.values()):
            with computing_in(jnp.float32):
                h32, w32 = h.astype(jnp.float32), w.astype(jnp.float32)
                plain = _pullbacks(apply, h32, w32, inputs, run, name, weight_rows)
            for k in got:
                diff = np.abs(_np64(plain[k]) - _np64(want[k]))
                floors[k] = float(diff.max()) if diff.size else 0.0
    rows = []
    for (key, quantity), (max_abs, max_rel, ok, note) in results.items():
        floor, where = 0.0, ""
        ref_np = _np64(want[key, quantity])
        scale = float(np.abs(ref_np[np.isfinite(ref_np)]).max()) if np.isfinite(ref_np).any() else 0
        if not ok and not note and (key, quantity) in floors:
            if tol.allows(max_abs, scale, floors[key, quantity]):
                ok, floor = True, floors[key, quantity]
            else:
                bound = tol.atol + tol.rtol * scale + tol.slack * floors[key, quantity]
                note = (
                    f"(floor {floors[key, quantity]:.1e}: the float32 formula's own error; "
                    f"allowed {tol.atol:.0e} + {tol.rtol:.0e} * {scale:.2e} "
                    f"+ {tol.slack:g} * floor = {bound:.2e})"
                )
        if not ok:
            bound = tol.atol + tol.rtol * scale + tol.slack * floors.get((key, quantity), 0.0)
            where = failing_positions(got[key, quantity], ref_np, bound, quantity)
        rows.append(
            Row(
                case,
                dtype,
                key,
                quantity,
                max_abs,
                max_rel,
                tol.rtol,
                ok,
                note,
                floor,
                processor,
                atol=tol.atol,
                slack=tol.slack,
                where=where,
            )
        )
    return rows


def cross_check(
    processor: Any,
    reference: Callable[..., Any],
    case: OutputContext | TorchRun,
    /,
    *,
    case_name: str = "case",
    tolerance: Tolerance | None = None,
    seed: int = 0,
) -> CrossCheckReport:
    """Values and VJPs of ``processor`` against ``reference`` on one case.

    ``case`` is a torch ``OutputContext`` (the processor runs on it) or a
    :class:`TorchRun` already made, e.g. by
    :func:`jax_ref.check.torch_run.run_through_hook`. Raises :class:`ContractError`
    when the reference's output structure differs from the processor's.
    """
    run = case if isinstance(case, TorchRun) else run_on_context(processor, case, seed=seed)
    rows = compare_run(
        run, reference, case=case_name, tolerance=tolerance, processor=processor_name(processor)
    )
    ref_name = getattr(reference, "__name__", type(reference).__name__)
    return CrossCheckReport(processor_name(processor), ref_name, tuple(rows))


def cross_check_tensor_parallel(
    runs: Sequence[TorchRun],
    reference: Callable[..., Any],
    /,
    *,
    processor: str,
    case: str = "gpt",
    tolerance: Tolerance | None = None,
    sharded: bool | None = None,
) -> tuple[CrossCheckReport, str]:
    """Each rank's run against the reference on the full weight, shard by shard.

    ``runs[r]`` holds rank ``r``'s hidden states (whole: no sequence
    parallel), its weight shard, values, and gradients. The reference runs on
    the gathered weight ``[V, h]``: under :func:`jax_ref.sharded.shard_reference`
    over a mesh of ``tp`` devices when JAX has them (``sharded=None``: when it
    can), else on one device. Rank ``r``'s values and ``d/d hidden`` are
    compared whole, its ``d/d weight`` with rows ``[r*V/tp, (r+1)*V/tp)`` of
    the reference's. Returns the report and a line saying how the reference ran.
    """
    tp = len(runs)
    full = torch.cat(
        [r.context.vocab_weight.detach() for r in runs],  # type: ignore[union-attr]
        dim=0,
    )
    rows_per_rank = full.shape[0] // tp
    can_shard = len(jax.devices()) >= tp
    use_sharded = can_shard if sharded is None else sharded
    f = shard_reference(reference, vocab_mesh(tp)) if use_sharded else reference
    how = (
        f"reference sharded over {tp} JAX devices (shard_map, vocab axis 'tp')"
        if use_sharded
        else (
            "reference on one JAX device with the gathered weight "
            f"(JAX sees {len(jax.devices())} device(s))"
        )
    )
    rows: list[Row] = []
    for rank, run in enumerate(runs):
        rows += compare_run(
            run,
            reference,
            case=f"{case} tp{tp} rank{rank}",
            tolerance=tolerance,
            inputs=reference_inputs(run.context).replace(vocab_start=0),
            apply=f,
            reference_weight=full,
            weight_rows=slice(rank * rows_per_rank, (rank + 1) * rows_per_rank),
            processor=processor,
        )
    ref_name = getattr(reference, "__name__", type(reference).__name__)
    return CrossCheckReport(processor, ref_name, tuple(rows)), how
