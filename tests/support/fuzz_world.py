"""The contract fuzzer's model stand-in: a drawn *world* (shapes, dtypes, a hidden
state and an output weight split over ``tp`` ranks run as threads, labels with the
ignore index, the logit scale, the caller's autocast or grad mode), the
``OutputContext`` of each rank, the invalid mutations of a context, and the harness
that runs a processor on every rank and compares values and gradients with a float64
truth (test support for the fuzzer: ``tests/support/fuzz_support.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from hookspec import OutputContext, ParallelLayout, SingleProcessCollectives, VocabShard

from .fuzz_support import Case, Draw, Fault, ThreadGroup, close, run_spmd
from .fuzz_truths import Precision, unit

__all__ = [
    "CtxMutation",
    "World",
    "ctx_mutations",
    "draw_world",
    "processor_case",
]

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


@dataclasses.dataclass
class World:
    """What a model would hand a processor, on every rank."""

    d: Draw
    tp: int
    sp: bool
    b: int
    s: int
    h: int
    vl: int
    dtype: torch.dtype
    wdtype: torch.dtype
    hidden: torch.Tensor  # [s, b, h] (the whole sequence), dtype
    weight: torch.Tensor  # [V, h] (every shard), wdtype
    labels: torch.Tensor  # [b, s]
    ignore_index: int
    scale: float  # the logit scale c
    scale_kind: str  # "none", "identity", "mul", "mup"
    state: str  # the caller's mode: "plain", "no_grad", "autocast", "inference"
    requires_grad: bool
    check_values: bool
    labels_checked: bool
    exact: bool = False  # small integers: every logit exact, equal rows give equal logits
    faults: dict[str, Fault] = dataclasses.field(default_factory=dict)

    @property
    def V(self) -> int:
        return self.tp * self.vl

    @property
    def n(self) -> int:
        return self.b * self.s

    @property
    def wide(self) -> torch.dtype:
        """The dtype of values and metrics: float64 where an input is (torch's promotion)."""
        return F64 if F64 in (self.dtype, self.wdtype) else F32

    def shard(self, r: int) -> VocabShard:
        return VocabShard(start=r * self.vl, end=(r + 1) * self.vl, size=self.V)

    def local_hidden(self, r: int) -> torch.Tensor:
        if not self.sp:
            return self.hidden
        rows = self.s // self.tp
        return self.hidden[r * rows : (r + 1) * rows]

    def group(self) -> ThreadGroup | None:
        if self.tp == 1 and not self.faults:
            return None
        return ThreadGroup(self.tp, sequence_parallel=self.sp, faults=self.faults)

    def grads_wanted(self) -> bool:
        return self.requires_grad and self.state in ("plain", "autocast")

    def mode(self) -> contextlib.AbstractContextManager[Any]:
        if self.state == "no_grad":
            return torch.no_grad()
        if self.state == "autocast":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        if self.state == "inference":
            return torch.inference_mode()
        return contextlib.nullcontext()

    def precision(self, inv: Any, compute: torch.dtype | None = None) -> Precision:
        """The logits' error bound for the factor ``inv = c / T`` (a number or ``[b, s]``)."""
        compute = compute or (F64 if self.wide == F64 else F32)
        gemm = F64 if compute == F64 else F32
        h_abs = self.hidden.double().abs().transpose(0, 1)  # [b, s, h]
        prec = Precision.of(h_abs, self.weight.double().abs(), inv, compute=compute, acc=gemm)
        # masks, weights and counts are formed in the inputs' precision whatever the GEMMs'
        return dataclasses.replace(prec, acc=unit(gemm if self.wide == F64 else F32))


def draw_world(d: Draw, *, tp_weights: tuple[int, int, int] = (6, 3, 1)) -> World:
    tp = d.pick("tp", [1, 2, 3], tp_weights)
    sp = tp > 1 and d.chance("sp", 0.4)
    b = d.int("b", 1, 3)
    s = d.int("s", 1, 4) * (tp if sp else 1)
    h = d.int("h", 1, 6)
    vl = d.int("V_local", 1, 6 if tp == 1 else 4)
    dtype = d.pick("dtype", [F32, F64, BF16, F16], [6, 2, 2, 1])
    wdtype = dtype
    if d.chance("mixed_fp64", 0.1):
        wdtype = F64 if dtype != F64 else F32
        d.note("wdtype", wdtype)
    exact = d.chance("exact_integers", 0.1)
    if exact:  # integers in [-2, 2]: products and sums exact in every dtype, ties exact
        hidden = d.randint(-2, 3, (s, b, h)).to(dtype)
        weight = d.randint(-2, 3, (tp * vl, h)).to(wdtype)
    else:
        sigma = d.pick("sigma", [0.3, 1.0, 2.5])
        hidden = d.randn(s, b, h, dtype=dtype, scale=sigma)
        weight = d.randn(tp * vl, h, dtype=wdtype, scale=sigma)
    V = tp * vl
    if V >= 2 and d.chance("tied_rows", 0.12):  # equal logits: ties
        i, j = d.rng.sample(range(V), 2)
        weight[j] = weight[i]
    ignore_index = d.pick("ignore_index", [-100, -1, 0, V], [6, 1, 1, 1])
    lab = d.randint(0, V, (b, s))
    ignored = d.rand(b, s) < 0.2
    lab = torch.where(ignored, ignore_index, lab)
    scale_kind = d.pick("scale_logits", ["none", "identity", "mul", "mup"], [5, 2, 2, 1])
    scale = 1.0
    if scale_kind in ("mul", "mup"):
        scale = d.pick("logit_scale", [0.5, 2.0, 0.125] if exact else [0.5, 2.0, 0.125, 3.0])
    state = d.pick("caller", ["plain", "no_grad", "autocast", "inference"], [16, 2, 2, 1])
    return World(
        d=d,
        tp=tp,
        sp=sp,
        b=b,
        s=s,
        h=h,
        vl=vl,
        dtype=dtype,
        wdtype=wdtype,
        hidden=hidden,
        weight=weight,
        labels=lab,
        ignore_index=ignore_index,
        scale=scale,
        scale_kind=scale_kind,
        state=state,
        requires_grad=not d.chance("no_requires_grad", 0.1),
        check_values=not d.chance("check_values_off", 0.08),
        labels_checked=d.chance("labels_checked", 0.1),
        exact=exact,
    )


# ---------------------------------------------------------------- contexts


def base_kwargs(
    w: World, r: int, coll: Any
) -> tuple[dict[str, Any], tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``r``'s ``OutputContext`` keywords and its leaves ``(hidden, weight)``."""
    h_leaf = w.local_hidden(r).detach().clone().requires_grad_(w.requires_grad)
    w_leaf = w.weight[r * w.vl : (r + 1) * w.vl].detach().clone().requires_grad_(w.requires_grad)
    kw: dict[str, Any] = dict(
        hidden_states=h_leaf,
        vocab_weight=w_leaf,
        labels=w.labels.clone(),
        vocab=w.shard(r),
        parallel=ParallelLayout(tp_size=w.tp, tp_rank=r, sequence_parallel=w.sp),
        ignore_index=w.ignore_index,
        check_values=w.check_values,
        labels_checked=w.labels_checked,
    )
    if coll is not None:
        kw["collectives"] = coll
    c = w.scale
    if w.scale_kind == "identity":
        kw["scale_logits"] = lambda z: z
    elif w.scale_kind == "mul":
        kw["scale_logits"] = lambda z: z * c
    elif w.scale_kind == "mup":
        kw["config"] = types.SimpleNamespace(use_mup=True, mup_output_mult=c)
    return kw, (h_leaf, w_leaf)


@dataclasses.dataclass(frozen=True)
class CtxMutation:
    """An invalid change to a rank's context keywords (the same on every rank)."""

    fields: tuple[str, ...]
    apply: Callable[[dict[str, Any], int], None]


class _Sized:
    """Collectives that say their group has ``size`` ranks (or ``cp_size``, or
    ``sequence_parallel``), delegating the methods."""

    def __init__(self, inner: Any, **attrs: Any) -> None:
        self._inner = inner
        self.size = getattr(inner, "size", 1)
        self.sequence_parallel = getattr(inner, "sequence_parallel", False)
        for k, v in attrs.items():
            setattr(self, k, v)

    def __repr__(self) -> str:
        return f"_Sized(size={self.size})"

    def all_reduce_sum(self, x: Any, /) -> Any:
        return self._inner.all_reduce_sum(x)

    def all_reduce_max(self, x: Any, /) -> Any:
        return self._inner.all_reduce_max(x)

    def gather_hidden_states(self, x: Any, /) -> Any:
        return self._inner.gather_hidden_states(x)

    def all_gather(self, x: Any, /) -> Any:
        return self._inner.all_gather(x)


class _Partial:
    """An object with two of the three required collectives."""

    def all_reduce_sum(self, x: Any, /) -> Any:
        return x

    def gather_hidden_states(self, x: Any, /) -> Any:
        return x


FAULTS: dict[str, Fault] = {
    "unsqueezed": lambda x, y: y[None],
    "list": lambda x, y: [y],
    "float64": lambda x, y: y.to(torch.float64 if y.dtype != torch.float64 else torch.float32),
    "numpy": lambda x, y: y.detach().float().numpy(),
    "first_row_only": lambda x, y: y[:1] if y.dim() >= 1 and y.shape[0] != 1 else y[None],
    "flattened": lambda x, y: y.reshape(-1) if y.dim() != 1 else y[None],
}


def ctx_mutations(
    w: World,
    *,
    name: str,
    needs_labels: bool,
    reads_mask: bool,
    reads_temperature: bool,
    collective_methods: tuple[str, ...] = (
        "all_reduce_sum",
        "all_reduce_max",
        "gather_hidden_states",
    ),
) -> dict[str, CtxMutation]:
    """The invalid changes to a processor's context that the contract says it refuses,
    each with the fields its ``ContractError`` may name. ``reads_mask``: the processor
    reads ``loss_mask``'s values; ``reads_temperature``: the user context's."""
    d, V, b, s = w.d, w.V, w.b, w.s
    out: dict[str, CtxMutation] = {}

    def put(key: str, fields: tuple[str, ...], fn: Callable[[dict[str, Any], int], None]) -> None:
        out[key] = CtxMutation(fields, fn)

    bad_id = V + 3 if V + 3 != w.ignore_index else V + 5
    values = w.check_values
    if values and not w.labels_checked:
        put(
            "labels_out_of_range",
            ("labels",),
            lambda kw, r: kw["labels"].__setitem__((0, 0), bad_id),
        )
        neg = -7 if w.ignore_index != -7 else -8
        put(
            "labels_negative",
            ("labels",),
            lambda kw, r: kw["labels"].__setitem__((b - 1, s - 1), neg),
        )
    put("labels_float", ("labels",), lambda kw, r: kw.__setitem__("labels", kw["labels"].double()))
    put("labels_bool", ("labels",), lambda kw, r: kw.__setitem__("labels", kw["labels"] > 0))
    put(
        "labels_shape",
        ("labels",),
        lambda kw, r: kw.__setitem__("labels", torch.zeros(b, s + 1, dtype=torch.long)),
    )
    if needs_labels:
        put("labels_missing", ("labels",), lambda kw, r: kw.__setitem__("labels", None))
    put(
        "hidden_int",
        ("hidden_states",),
        lambda kw, r: kw.__setitem__("hidden_states", kw["hidden_states"].long()),
    )
    put(
        "hidden_2d",
        ("hidden_states",),
        lambda kw, r: kw.__setitem__("hidden_states", kw["hidden_states"].reshape(-1, w.h)),
    )
    put(
        "hidden_list",
        ("hidden_states",),
        lambda kw, r: kw.__setitem__("hidden_states", kw["hidden_states"].tolist()),
    )
    put(
        "weight_wrong_h",
        ("vocab_weight",),
        lambda kw, r: kw.__setitem__("vocab_weight", torch.zeros(w.vl, w.h + 1, dtype=w.wdtype)),
    )
    put(
        "weight_wrong_rows",
        ("vocab_weight", "vocab"),
        lambda kw, r: kw.__setitem__("vocab_weight", torch.zeros(w.vl + 1, w.h, dtype=w.wdtype)),
    )
    put("weight_missing", ("vocab_weight",), lambda kw, r: kw.__setitem__("vocab_weight", None))
    put(
        "weight_int",
        ("vocab_weight",),
        lambda kw, r: kw.__setitem__("vocab_weight", kw["vocab_weight"].long()),
    )
    put("vocab_missing", ("vocab",), lambda kw, r: kw.__setitem__("vocab", None))
    if w.tp > 1:
        put(
            "vocab_other_rank",
            ("vocab",),
            lambda kw, r: kw.__setitem__("vocab", w.shard((r + 1) % w.tp)),
        )
    else:
        put(
            "vocab_size_wrong",
            ("vocab",),
            lambda kw, r: kw.__setitem__("vocab", VocabShard(start=0, end=w.vl, size=w.vl + 1)),
        )
    put(
        "loss_mask_shape",
        ("loss_mask",),
        lambda kw, r: kw.__setitem__("loss_mask", torch.ones(b, s + 1)),
    )
    if reads_mask and values:
        bad = d.pick("bad_mask_value", [-1.0, float("nan"), float("inf")])

        def mask_bad(kw: dict[str, Any], r: int) -> None:
            m = torch.ones(b, s)
            m[0, 0] = bad
            kw["loss_mask"] = m

        put("loss_mask_value", ("loss_mask",), mask_bad)
    # a tensor on the meta device (a shape without values), wherever it enters
    put(
        "hidden_meta",
        ("hidden_states", "vocab_weight"),
        lambda kw, r: kw.update(
            {
                k: kw[k].detach().to("meta")
                for k in ("hidden_states", "vocab_weight")
                if torch.is_tensor(kw[k])
            }
        ),
    )
    put(
        "labels_meta",
        ("labels",),
        lambda kw, r: kw.__setitem__("labels", torch.zeros(b, s, dtype=torch.long, device="meta")),
    )
    put(
        "loss_mask_meta",
        ("loss_mask",),
        lambda kw, r: kw.__setitem__("loss_mask", torch.ones(b, s, device="meta")),
    )
    put("ignore_index_bool", ("ignore_index",), lambda kw, r: kw.__setitem__("ignore_index", True))
    put(
        "ignore_index_float",
        ("ignore_index",),
        lambda kw, r: kw.__setitem__("ignore_index", float(w.ignore_index)),
    )
    put("ignore_index_huge", ("ignore_index",), lambda kw, r: kw.__setitem__("ignore_index", 2**63))
    put("mtp_depth_negative", ("mtp_depth",), lambda kw, r: kw.__setitem__("mtp_depth", -1))
    put("check_values_str", ("check_values",), lambda kw, r: kw.__setitem__("check_values", "yes"))
    put(
        "labels_checked_int", ("labels_checked",), lambda kw, r: kw.__setitem__("labels_checked", 1)
    )
    put("parallel_dict", ("parallel",), lambda kw, r: kw.__setitem__("parallel", {"tp_size": w.tp}))
    put(
        "parallel_tp_zero",
        ("parallel.tp_size",),
        lambda kw, r: kw.__setitem__("parallel", ParallelLayout(tp_size=0)),
    )
    put(
        "collectives_missing_method",
        ("collectives",),
        lambda kw, r: kw.__setitem__("collectives", _Partial()),
    )
    put(
        "collectives_size",
        ("collectives",),
        lambda kw, r: kw.__setitem__(
            "collectives", _Sized(kw.get("collectives", SingleProcessCollectives()), size=w.tp + 1)
        ),
    )
    put(
        "collectives_cp_size",
        ("collectives",),
        lambda kw, r: kw.__setitem__(
            "collectives", _Sized(kw.get("collectives", SingleProcessCollectives()), cp_size=3)
        ),
    )
    if w.tp > 1:
        put(
            "single_process_at_tp",
            ("collectives",),
            lambda kw, r: kw.__setitem__("collectives", SingleProcessCollectives()),
        )
        put(
            "collectives_sp_mismatch",
            ("collectives",),
            lambda kw, r: kw.__setitem__(
                "collectives", _Sized(kw["collectives"], sequence_parallel=not w.sp)
            ),
        )
        for method in collective_methods:
            put(f"fault_{method}", (f"collectives.{method}",), lambda kw, r: None)
    put(
        "scale_clamp",
        ("scale_logits",),
        lambda kw, r: kw.__setitem__("scale_logits", lambda z: z.clamp(-5, 5)),
    )
    put(
        "scale_offset",
        ("scale_logits",),
        lambda kw, r: kw.__setitem__("scale_logits", lambda z: z + 1),
    )
    put(
        "scale_negative",
        ("scale_logits",),
        lambda kw, r: kw.__setitem__("scale_logits", lambda z: -z),
    )

    def raising(z: Any) -> Any:
        raise RuntimeError("a scaling that fails")

    put("scale_raises", ("scale_logits",), lambda kw, r: kw.__setitem__("scale_logits", raising))
    put(
        "scale_list",
        ("scale_logits",),
        lambda kw, r: kw.__setitem__("scale_logits", lambda z: z.tolist()),
    )
    mult = d.pick("bad_mup_mult", [0.0, -1.0, float("nan"), "2"])

    def mup_bad(kw: dict[str, Any], r: int) -> None:
        kw.pop("scale_logits", None)
        kw["config"] = types.SimpleNamespace(use_mup=True, mup_output_mult=mult)

    put("mup_mult_bad", ("config.mup_output_mult",), mup_bad)
    put(
        "softcapping",
        ("config.output_logit_softcapping",),
        lambda kw, r: kw.__setitem__(
            "config", types.SimpleNamespace(output_logit_softcapping=30.0)
        ),
    )
    if reads_temperature:
        t_bad = d.pick(
            "bad_context_temperature",
            ["negative", "zero", "nan", "bool", "str", "shape", "tensor_nan", "tensor_zero"],
        )

        def temp(kw: dict[str, Any], r: int) -> None:
            value: Any = {
                "negative": -1.0,
                "zero": 0.0,
                "nan": float("nan"),
                "bool": True,
                "str": "1.0",
            }.get(t_bad)
            if t_bad == "shape":
                value = torch.ones(b, s + 1)
            elif t_bad.startswith("tensor"):
                value = torch.ones(b, s)
                value[0, 0] = float("nan") if t_bad == "tensor_nan" else 0.0
            kw["context"] = {"temperature": value}

        if values or not t_bad.startswith("tensor"):
            put("context_temperature", ("context.temperature",), temp)
    put(
        f"not_a_context:{name}",
        (f"processor {name!r}",),
        lambda kw, r: kw.__setitem__("__dict__", True),
    )
    return out


def apply_mutations(
    w: World, muts: dict[str, tuple[str, ...]], table: dict[str, CtxMutation]
) -> tuple[list[Callable[[dict[str, Any], int], None]], bool]:
    """The mutations' apply functions (those of ``table``) and whether the processor
    is to be called with something other than a context. Faults go into ``w.faults``."""
    fns = []
    not_ctx = False
    for key in muts:
        if key.startswith("fault_"):
            method = key.removeprefix("fault_")
            fault = w.d.pick(f"fault[{method}]", sorted(FAULTS))
            w.faults[method] = FAULTS[fault]
        elif key.startswith("not_a_context"):
            not_ctx = True
        elif key in table:
            fns.append(table[key].apply)
    return fns, not_ctx


# ---------------------------------------------------------------- the harness


Truth = Callable[[torch.Tensor, torch.Tensor], tuple[Any, ...]]
"""``(H [s, b, h], W [V, h]) -> (values, z, inv[, extras])``: float64 values from the
leaves ``H`` and ``W`` (differentiable), the tempered logits ``z`` ``[b, s, V]`` they
were formed from, the factor ``inv = c / T`` (a number or ``[b, s]``), and optionally
further rounded inputs as ``(tensor requiring grad, its error bound)`` pairs."""


class Bounds:
    """The tolerance of each truth value, from its float64 sensitivity to what the
    implementation rounds: ``|delta v| <= sum |dv/dx| * err_x`` over the logits ``z``
    (``err_z = zerr + u_a |z|``) and any ``extras`` (a teacher's logits, its logprobs),
    first order, times 4, plus the rounding of ``v`` itself. A per-token value
    ``[b, s]`` gets one bound per token."""

    def __init__(
        self,
        values: dict[str, torch.Tensor],
        z: torch.Tensor,
        prec: Precision,
        extras: list[tuple[torch.Tensor, torch.Tensor]] = (),  # type: ignore[assignment]
    ) -> None:
        self.values, self.prec = values, prec
        err = prec.zerr[..., None] + 64 * prec.acc * (1 + z.detach().abs())
        self.leaves = [(z, err), *extras]
        self.zabs = (
            z.detach().abs().amax(-1)
        )  # [b, s]: a value formed from the logits rounds at their size

    def __call__(self, key: str) -> torch.Tensor:
        v = self.values[key]
        zabs = self.zabs if v.dim() == 2 else self.zabs.max()
        own = 64 * self.prec.acc * (1 + v.detach().abs() + (zabs if v.dim() in (0, 2) else 0.0))
        if not v.requires_grad:
            return own
        grads = torch.autograd.grad(
            v.sum(), [x for x, _ in self.leaves], retain_graph=True, allow_unused=True
        )
        total = torch.zeros(v.shape, dtype=torch.float64)
        for g, (_x, err) in zip(grads, self.leaves, strict=True):
            if g is None:
                continue
            moved = torch.where(
                err == 0, 0.0, g.abs() * err
            )  # an exact input (err 0) moves nothing
            spread = moved.reshape(*v.shape, -1).sum(-1) if v.dim() else moved.sum()
            total = total + spread
        return 4 * total + own


@dataclasses.dataclass
class Compare:
    """How a rank's result is compared with the truth: ``tols`` per key (``None``:
    exactly), ``dtypes`` the expected dtype per key, ``extra`` further checks."""

    tols: dict[str, Any]
    dtypes: dict[str, torch.dtype]
    extra: Callable[[dict[str, Any]], list[str]] | None = None


def processor_case(
    entry: str,
    w: World,
    make_processor: Callable[[], Any],
    *,
    context: Callable[[int], Any] | None,
    muts: dict[str, tuple[str, ...]],
    table: dict[str, CtxMutation],
    truth: Truth | None,
    compare: Callable[[dict[str, torch.Tensor], Bounds], Compare] | None,
    grad_keys: tuple[str, ...] = (),
    tensor_result: bool = False,
    compute: torch.dtype | None = None,
    extra_kwargs: Callable[[dict[str, Any], int], None] | None = None,
    cot_shapes: dict[str, tuple[int, ...]] | None = None,
) -> Case:
    """The case of one processor call on every rank of ``w``: invalid where ``muts``
    is not empty (the fields of every mutation may be named), else compared with
    ``truth`` (values on every rank, and gradients of ``sum(cot * result)`` in the
    hidden states and the weight where the world has them)."""
    fns, not_ctx = apply_mutations(w, muts, table)
    refuse = tuple(f for fields in muts.values() for f in fields)
    cots: dict[str, torch.Tensor] = {}
    if not muts:  # cotangents drawn before the call, the same on every rank
        for key in grad_keys:
            shape = (w.b, w.s) if key != "loss" or tensor_result else ()
            shape = (cot_shapes or {}).get(key, shape)
            cots[key] = w.d.randn(*shape, dtype=torch.float64)

    def call() -> Any:
        proc = make_processor()
        group = w.group()

        def run_rank(r: int) -> Any:
            coll = group.rank(r) if group is not None else None
            kw, leaves = base_kwargs(w, r, coll)
            if context is not None:
                kw["context"] = context(r)
            if extra_kwargs is not None:
                extra_kwargs(kw, r)
            for fn in fns:
                fn(kw, r)
            arg: Any = dict(kw) if not_ctx else OutputContext(**kw)
            with w.mode():
                out = proc(arg)
            grads = None
            if w.grads_wanted() and cots:
                grads = _grads(out, leaves, grad_keys, cots, tensor_result)
            return detached(out), grads, weakref.ref(leaves[0])

        outs = run_spmd(w.tp, run_rank, group)
        # every rank's thread has ended (its frames and autograd state gone): only a
        # reference cycle keeps an input alive now
        leaks = kept_alive_all([probe for _, _, probe in outs])
        return [(out, grads, leak) for (out, grads, _), leak in zip(outs, leaks, strict=True)]

    if muts or truth is None or compare is None:
        return Case(entry, call, refuse=refuse)
    truth_fn, compare_fn = truth, compare

    def check(outs: list[Any]) -> list[str]:
        H = w.hidden.detach().double().clone().requires_grad_()
        W = w.weight.detach().double().clone().requires_grad_()
        values, z, inv, *extras = truth_fn(H, W)
        prec = w.precision(inv, compute)
        pairs = extras[0] if extras else []
        cmp = compare_fn(values, Bounds(values, z, prec, pairs))
        if pairs:  # other rounded inputs (a teacher's logits) move the gradients as the logits do
            worst = max(float(err.max()) for _, err in pairs)
            prec = dataclasses.replace(prec, zerr=prec.zerr + worst)
        grads = None
        if w.grads_wanted() and grad_keys:
            scalar = sum((values[k] * cots[k]).sum() for k in grad_keys if k in values)
            dH, dW = torch.autograd.grad(scalar, (H, W), retain_graph=True, allow_unused=True)
            cot_scale = sum(
                float(cots[k].abs().max()) for k in grad_keys if k in cots and cots[k].numel()
            )
            floor = 256 * prec.acc * cot_scale * max(1.0, float(torch.as_tensor(inv).abs().max()))
            grads = (dH, dW, magnitudes(H, W, z, inv, scalar), floor)
        plain = {k: v.detach() for k, v in values.items()}
        problems: list[str] = []
        for r, (out, got_grads, leaked) in enumerate(outs):
            where = f"rank {r}: " if w.tp > 1 else ""
            if leaked:
                problems.append(f"{where}{LEAK}")
            if tensor_result and not isinstance(out, torch.Tensor):
                return [f"{where}expected a tensor, got {type(out).__name__}"]
            result = {"loss": out} if tensor_result else out
            if not isinstance(result, dict):
                return [f"{where}expected a dict, got {type(result).__name__}"]
            if set(result) != set(cmp.tols):
                problems.append(f"{where}keys {sorted(result)}, expected {sorted(cmp.tols)}")
                continue
            for key, tol in cmp.tols.items():
                got = result[key]
                want = cmp.dtypes.get(key)
                if want is not None and isinstance(got, torch.Tensor) and got.dtype != want:
                    problems.append(f"{where}{key}: dtype {got.dtype}, expected {want}")
                if tol is None:
                    if not isinstance(got, torch.Tensor) or not torch.equal(got.cpu(), plain[key]):
                        problems.append(f"{where}{key}: not equal to the truth")
                    continue
                problems += close(f"{where}{key}", got, plain[key], atol=tol)
            if cmp.extra is not None:
                problems += [where + p for p in cmp.extra(result)]
            if grads is not None and got_grads is not None:
                problems += compare_grads(w, r, got_grads, grads, prec, where)
        return problems

    return Case(entry, call, check)


LEAK = (
    "the hidden states stay alive after the result and its gradients are dropped "
    "(a reference cycle through the autograd graph keeps the inputs, the weight and "
    "the collectives' process group)"
)


def detached(out: Any) -> Any:
    """``out`` (a tensor, a mapping or a dataclass of tensors) with each tensor detached:
    what a check reads, without the autograd graph."""
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, dict):
        return {k: detached(v) for k, v in out.items()}
    return out


def kept_alive(probe: Any) -> bool:
    """Whether ``probe``'s tensor outlives every reference to it but the graph's (a
    Python cycle is collected first; one through torch's autograd nodes is not)."""
    return kept_alive_all([probe])[0]


def kept_alive_all(probes: list[Any]) -> list[bool]:
    """:func:`kept_alive` of each probe: the young generations collected first (cheap:
    a case's own cycles are young), the whole heap only where a tensor is still alive."""
    if any(p() is not None for p in probes):
        gc.collect(1)
    if any(p() is not None for p in probes):
        gc.collect()
    return [p() is not None for p in probes]


def _grads(
    out: Any,
    leaves: tuple[torch.Tensor, torch.Tensor],
    keys: tuple[str, ...],
    cots: dict[str, torch.Tensor],
    tensor_result: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    result = {"loss": out} if tensor_result else out
    terms = [
        (result[k].double() * cots[k]).sum()
        for k in keys
        if k in cots
        and isinstance(result, dict)
        and isinstance(result.get(k), torch.Tensor)
        and result[k].requires_grad
    ]
    if not terms:
        return (None, None)
    gh, gw = torch.autograd.grad(torch.stack(terms).sum(), leaves, allow_unused=True)
    return gh, gw


def magnitudes(
    H: torch.Tensor, W: torch.Tensor, z: torch.Tensor, inv: Any, scalar: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(|dL/dz_raw| @ |W|, |dL/dz_raw|.T @ |H|)``: the sums of the gradients' terms,
    with ``z_raw = H @ W.T`` (the scale of each gradient's rounding)."""
    (dz,) = torch.autograd.grad(scalar, z, retain_graph=True, allow_unused=True)
    if dz is None:
        return torch.zeros_like(H), torch.zeros_like(W)
    inv_t = torch.as_tensor(inv, dtype=torch.float64)
    dz_raw = (dz * (inv_t[..., None] if inv_t.dim() else inv_t)).abs()  # [b, s, V]
    mag_h = torch.einsum("bsv,vh->sbh", dz_raw, W.detach().abs())
    mag_w = torch.einsum("bsv,sbh->vh", dz_raw, H.detach().abs())
    return mag_h, mag_w


def compare_grads(
    w: World, r: int, got: tuple[Any, Any], truth: tuple[Any, Any, Any], prec: Precision, where: str
) -> list[str]:
    dH, dW, (mag_h, mag_w), floor = truth
    problems: list[str] = []
    gh, gw = got
    rows = slice(r * w.vl, (r + 1) * w.vl)
    if w.sp:
        srows = slice(r * (w.s // w.tp), (r + 1) * (w.s // w.tp))
        th, mh = (dH[srows] if dH is not None else None), mag_h[srows]
    else:
        th, mh = dH, mag_h
    tw, mw = (dW[rows] if dW is not None else None), mag_w[rows]
    h_max, w_max = float(w.hidden.double().abs().max()), float(w.weight.double().abs().max())
    for name, g, t, m, dtype, scale in (
        ("d hidden", gh, th, mh, w.dtype, w_max),
        ("d weight", gw, tw, mw, w.wdtype, h_max),
    ):
        if t is None:
            continue
        if g is None:
            if bool((t != 0).any()):
                problems.append(f"{where}{name}: no gradient where the truth has one")
            continue
        if g.dtype != dtype:
            problems.append(f"{where}{name}: dtype {g.dtype}, expected the input's {dtype}")
        tol = prec.grad_tol(m, dtype, t, floor=floor * scale)
        problems += close(f"{where}{name}", g, t, atol=tol)
    return problems
