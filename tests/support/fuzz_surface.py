"""The contract fuzzer's entries beyond the processors and tensor functions: the
constructors of the public classes, ``validate_context``, ``checked_collectives``,
``validate_result`` / ``validate_mtp_result``, the MTP wrappers, the aggregation and
KL helpers, and the tools' in-process ``main`` (test support for the fuzzer)."""

from __future__ import annotations

import contextlib
import io
import os
import random
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator, Mapping
from fractions import Fraction
from typing import Any

import numpy as np
import torch

import hookspec
from hookspec import (
    OutputContext,
    ParallelLayout,
    SingleProcessCollectives,
    VocabShard,
    validate_context,
    validate_mtp_result,
    validate_result,
)
from hookspec.collectives import checked_collectives
from torch_impl import TorchCollectives
from torch_impl.mtp import detached_head, scaled_mtp_gradient
from torch_impl.process_state import registered_process_groups
from torch_impl.processors import (
    DistillConfig,
    LinearOptions,
    PolicyLossConfig,
    aggregation_weights,
    cross_entropy_loss,
    kl_penalty,
)

from .fuzz_support import Case, Draw, close
from .fuzz_truths import aggregation_weights64, kl_estimate64, token_stats64
from .identity_collectives import identity_collectives

__all__ = ["SURFACE_ENTRIES", "SLOW_TOOLS"]

F32, F64 = torch.float32, torch.float64

SLOW_TOOLS = os.environ.get("HOOKSPEC_FUZZ_SLOW", "") == "1"
"""Draw the tools' full runs too (tens of seconds each): the long run's option."""

POSITIVE = [0.5, 2, np.float32(0.7), np.float64(1.3), Fraction(3, 2), np.int64(3), 1e-30, 1e30]
NOT_POSITIVE = [0, -1.0, float("nan"), float("inf"), -float("inf"), True, "1.0", None, 10**400, 1j]
INTS = [1, 7, np.int32(4), np.int64(2)]
NOT_INTS = [0, -1, True, 2.5, "8", None, 2**70]


# ---------------------------------------------------------------- constructors


def _as_float(value: Any) -> float:
    return float(value)


Spec = tuple[list[Any], list[Any], Callable[[Any, Any], bool] | None]
"""(valid values, invalid values, stored(obj_value, given) -> bool or None: not compared)."""


def _same_float(stored: Any, given: Any) -> bool:
    return type(stored) is float and stored == float(given)


CONSTRUCTORS: dict[str, tuple[Callable[..., Any], dict[str, Spec], tuple[str, ...]]] = {
    "LinearOptions": (
        LinearOptions,
        {
            "temperature": (
                [*POSITIVE, torch.tensor([0.5, 2.0])],
                [v for v in NOT_POSITIVE if v is not None],
                None,
            ),
            "logit_scale": (POSITIVE, [*NOT_POSITIVE, torch.tensor(2.0)], _same_float),
            "ignore_index": (
                [-100, 0, 5, np.int64(-1), -(1 << 62)],
                [True, 1.5, "x", None, 2**63, -(1 << 62) - 1],
                None,
            ),
            "vocab": ([None, VocabShard(0, 4, 8)], [(0, 4, 8), {"start": 0}], None),
            "collectives": ([None, SingleProcessCollectives()], [object(), "tp", 3], None),
            "backend": (["auto", "torch", "triton"], ["cuda", None, "Torch", 1], None),
            "compute_dtype": (
                [None, F32, F64, torch.bfloat16, torch.float16],
                [torch.int32, "float32", torch.complex64],
                None,
            ),
            "tile_rows": ([None, *INTS], [v for v in NOT_INTS if v is not None], None),
            "tile_cols": ([None, *INTS], [v for v in NOT_INTS if v is not None], None),
            "check_values": ([True, False], ["yes", 1, None, np.bool_(True)], None),
        },
        (),
    ),
    "PolicyLossConfig": (
        PolicyLossConfig,
        {
            "clip_low": (
                [0.0, 0.2, 1.0, np.float32(0.25), Fraction(1, 5), 0],
                [-0.1, 1.5, float("nan"), True, "0.2", None],
                _same_float,
            ),
            "clip_high": (
                [None, 0.0, 0.28, 5, np.float64(0.3)],
                [-0.1, float("inf"), True, "x"],
                None,
            ),
            "dual_clip": (
                [None, 1.5, 3, np.float32(2.0)],
                [1.0, 0.5, float("nan"), True, "3"],
                None,
            ),
            "kl_coef": (
                [0.0, 0.1, 2, np.float32(0.04)],
                [-0.1, float("inf"), True, None],
                _same_float,
            ),
            "kl_estimator": (["k1", "k2", "k3", hookspec.KLEstimator.K2], ["k4", None, 3], None),
            "entropy_coef": (
                [0.0, -0.02, 0.01, np.float64(0.5)],
                [float("nan"), True, "0", None],
                _same_float,
            ),
            "aggregation": (
                ["token-mean", "seq-mean-token-sum", hookspec.Aggregation.SEQ_MEAN_TOKEN_MEAN],
                ["mean", None, 0],
                None,
            ),
            "log_ratio_clamp": ([None, 20.0, 0.5, 3], [0.0, -1.0, float("inf"), True, "20"], None),
            "fused": ([True, False], ["yes", 1, None], None),
        },
        (),
    ),
    "DistillConfig": (
        DistillConfig,
        {
            "divergence": (
                ["forward-kl", "reverse-kl", "jsd", hookspec.DistillDivergence.JSD],
                ["kl", None, 1],
                None,
            ),
            "beta": (
                [0.5, 0.1, np.float32(0.9), Fraction(1, 3)],
                [0.0, 1.0, -0.5, float("nan"), True, "0.5", None],
                _same_float,
            ),
            "tail": (["renormalize", "bucket", hookspec.TeacherTail.BUCKET], ["drop", None], None),
            "temperature": (POSITIVE, NOT_POSITIVE, _same_float),
            "aggregation": (
                ["token-mean", hookspec.Aggregation.SEQ_MEAN_TOKEN_SUM],
                ["sum", None],
                None,
            ),
        },
        (),
    ),
    "ParallelLayout": (
        ParallelLayout,
        {
            "tp_size": ([1, 2, np.int64(4)], [0, -1, True, 2.0, "2", None], None),
            "cp_size": ([1, 2, np.int32(3)], [0, True, 1.5, None], None),
            "pp_size": ([1, 4], [0, -2, "1"], None),
            "sequence_parallel": ([True, False], ["False", 0, None, np.bool_(False)], None),
        },
        ("parallel.",),
    ),
    "VocabShard": (
        lambda **kw: VocabShard(**{"start": 0, "end": 8, "size": 16, **kw}),
        {
            "start": ([0, 4, np.int64(2)], [-1, 8, 9, True, 1.0, "0", None], None),
            "end": ([8, 16, 1, np.int32(5)], [0, 17, True, 8.0, None], None),
            "size": ([16, 8, 100], [7, True, 16.0, "16"], None),
        },
        ("vocab.", "vocab"),
    ),
    "TorchCollectives": (
        lambda **kw: TorchCollectives(kw.pop("group", None), **{"sequence_parallel": False, **kw}),
        {
            "group": ([None], ["tp", 2, object()], None),
            "sequence_parallel": ([True, False], ["False", 1, None, np.bool_(True)], None),
            "cp_group": ([None], [2, "cp", object()], None),
        },
        (),
    ),
}


def constructor_case(d: Draw) -> Case:
    cls_name = d.pick("class", sorted(CONSTRUCTORS))
    ctor, fields, prefixes = CONSTRUCTORS[cls_name]
    field = d.pick("field", sorted(fields))
    valid, invalid, stored = fields[field]
    bad = d.mutate({"bad_value": (field,)}, p=0.5)
    value = d.pick("value", invalid if bad else valid)
    names = (
        field,
        *(p + field for p in prefixes if p.endswith(".")),
        *(p for p in prefixes if not p.endswith(".")),
    )

    def call() -> Any:
        return ctor(**{field: value})

    if bad:
        return Case(f"{cls_name}()", call, refuse=names)

    def check(obj: Any) -> list[str]:
        got = (
            getattr(obj, field, None)
            if cls_name != "TorchCollectives" or field != "group"
            else obj.group
        )
        if stored is not None and not stored(got, value):
            return [f"{field}: stored {got!r} ({type(got).__name__}) for {value!r}"]
        if cls_name == "TorchCollectives":
            x = torch.arange(6.0).reshape(2, 3)
            y = obj.all_gather(x)
            if (
                tuple(y.shape) != (1, 2, 3)
                or not torch.equal(y[0], x)
                or y.data_ptr() == x.data_ptr()
            ):
                return ["all_gather at one rank: not a new [1, *x.shape] copy of x"]
            if obj.size != 1 or obj.cp_size != 1:
                return [f"size {obj.size}, cp_size {obj.cp_size} at one rank"]
        return []

    return Case(f"{cls_name}()", call, check)


def processor_ctor_case(d: Draw) -> Case:
    kind = d.pick("processor_arg", ["callable", "not_callable", "name"])
    bad = d.mutate({"bad": ("processor", "processor name")}, p=0.6)
    fn: Any = (
        (lambda ctx: ctx) if kind != "not_callable" or not bad else d.pick("fn", [3, "f", None])
    )
    name: Any = None
    if kind == "name":
        name = d.pick("name", [5, b"x", ("a",)] if bad else ["mine", "x"])
    elif bad:
        fn = d.pick("fn", [3, "f", None, object()])

    def call() -> Any:
        return hookspec.processor(fn, name=name)

    if bad:
        return Case("processor()", call, refuse=("processor", "processor name"))
    return Case(
        "processor()",
        call,
        lambda p: (
            [] if isinstance(p, hookspec.Processor) and isinstance(p.name, str) else [f"{p!r}"]
        ),
    )


# ---------------------------------------------------------------- validate_context


class _Coll(identity_collectives("_IdentityCollectives")):
    """A user's collectives stand-in (the identity); ``attrs`` become its attributes."""

    def __init__(self, **attrs: Any) -> None:
        for k, v in attrs.items():
            setattr(self, k, v)


def validate_context_case(d: Draw) -> Case:
    lib = d.pick("arrays", ["numpy", "torch"])
    tp = d.pick("tp", [1, 2])
    rank = d.int("tp_rank", 0, tp - 1)
    sp = tp > 1 and d.chance("sp", 0.5)
    b, s, h, vl = d.int("b", 1, 3), d.int("s", 1, 3) * tp, d.int("h", 1, 4), d.int("V_local", 1, 4)
    V = vl * tp

    def arr(shape: tuple[int, ...], kind: str = "f") -> Any:
        if lib == "numpy":
            return np.zeros(shape, np.float32 if kind == "f" else np.int64)
        return torch.zeros(shape, dtype=F32 if kind == "f" else torch.long)

    labels = arr((b, s), "i")
    kw: dict[str, Any] = dict(
        hidden_states=arr((s // tp if sp else s, b, h)),
        labels=labels,
        loss_mask=arr((b, s)) if d.chance("loss_mask", 0.5) else None,
        padding_mask=arr((b, s), "i") > 0 if d.chance("padding_mask", 0.3) else None,
        vocab_weight=arr((vl, h)),
        vocab=VocabShard(rank * vl, (rank + 1) * vl, V),
        parallel=ParallelLayout(tp_size=tp, tp_rank=rank, sequence_parallel=sp),
        collectives=_Coll(size=tp, sequence_parallel=sp)
        if tp > 1 or d.chance("custom", 0.3)
        else SingleProcessCollectives(),
        mtp_depth=d.pick("mtp_depth", [0, 1, np.int64(2)]),
        ignore_index=d.pick("ignore_index", [-100, V, np.int64(-1)]),
        check_values=True,
    )
    cands: dict[str, tuple[str, ...]] = {
        "labels_shape": ("labels",),
        "labels_float": ("labels",),
        "labels_range": ("labels",),
        "loss_mask_shape": ("loss_mask",),
        "padding_mask_shape": ("padding_mask",),
        "hidden_2d": ("hidden_states",),
        "hidden_int": ("hidden_states",),
        "hidden_none": ("hidden_states",),
        "weight_shape": ("vocab_weight",),
        "weight_int": ("vocab_weight",),
        "mtp_depth_negative": ("mtp_depth",),
        "mtp_depth_bool": ("mtp_depth",),
        "ignore_index_float": ("ignore_index",),
        "ignore_index_huge": ("ignore_index",),
        "check_values_str": ("check_values",),
        "labels_checked_str": ("labels_checked",),
        "parallel_dict": ("parallel",),
        "vocab_tuple": ("vocab",),
        "vocab_size": ("vocab",),
        "collectives_partial": ("collectives",),
        "collectives_size": ("collectives",),
        "collectives_cp_size": ("collectives",),
        "not_a_context": ("ctx",),
    }
    if tp > 1:
        cands.update(
            vocab_none=("vocab",),
            vocab_rank=("vocab",),
            single_process=("collectives",),
            collectives_sp=("collectives",),
        )
    muts = d.mutate(cands)
    for key in muts:
        if key == "labels_shape":
            kw["labels"] = arr((b, s + 1), "i")
        elif key == "labels_float":
            kw["labels"] = arr((b, s))
        elif key == "labels_range":
            bad_labels = arr((b, s), "i")
            bad_labels[0, 0] = d.pick(
                "bad_label", [V, -1 if kw["ignore_index"] != -1 else -2, V + 9]
            )
            if bad_labels[0, 0] == kw["ignore_index"]:
                bad_labels[0, 0] = V + 9
            kw["labels"] = bad_labels
        elif key == "loss_mask_shape":
            kw["loss_mask"] = arr((b + 1, s))
        elif key == "padding_mask_shape":
            kw["padding_mask"] = arr((s, b + 1))
        elif key == "hidden_2d":
            kw["hidden_states"] = arr((s, b * h))
        elif key == "hidden_int":
            kw["hidden_states"] = arr(tuple(kw["hidden_states"].shape), "i")
        elif key == "hidden_none":
            kw["hidden_states"] = None
        elif key == "weight_shape":
            kw["vocab_weight"] = arr((vl, h + 1))
        elif key == "weight_int":
            kw["vocab_weight"] = arr((vl, h), "i")
        elif key == "mtp_depth_negative":
            kw["mtp_depth"] = -1
        elif key == "mtp_depth_bool":
            kw["mtp_depth"] = True
        elif key == "ignore_index_float":
            kw["ignore_index"] = -100.0
        elif key == "ignore_index_huge":
            kw["ignore_index"] = 2**64
        elif key == "check_values_str":
            kw["check_values"] = "True"
        elif key == "labels_checked_str":
            kw["labels_checked"] = "no"
        elif key == "parallel_dict":
            kw["parallel"] = {"tp_size": tp}
        elif key == "vocab_tuple":
            kw["vocab"] = (0, vl, V)
        elif key == "vocab_size":
            kw["vocab"] = VocabShard(rank * vl, (rank + 1) * vl, V + 1)
        elif key == "vocab_none":
            kw["vocab"] = None
        elif key == "vocab_rank":
            kw["vocab"] = VocabShard(((rank + 1) % tp) * vl, ((rank + 1) % tp + 1) * vl, V)
        elif key == "single_process":
            kw["collectives"] = SingleProcessCollectives()
        elif key == "collectives_partial":
            kw["collectives"] = types.SimpleNamespace(all_reduce_sum=lambda x: x)
        elif key == "collectives_size":
            kw["collectives"] = _Coll(size=tp + 1, sequence_parallel=sp)
        elif key == "collectives_cp_size":
            kw["collectives"] = _Coll(size=tp, sequence_parallel=sp, cp_size=3)
        elif key == "collectives_sp":
            kw["collectives"] = _Coll(size=tp, sequence_parallel=not sp)

    def call() -> Any:
        if "not_a_context" in muts:
            return validate_context(dict(kw))  # type: ignore[arg-type]
        return validate_context(OutputContext(**kw))

    if muts:
        return Case(
            "validate_context", call, refuse=tuple(f for fields in muts.values() for f in fields)
        )
    return Case("validate_context", call, lambda r: [] if r is None else [f"returned {r!r}"])


# ---------------------------------------------------------------- checked collectives


def collectives_case(d: Draw) -> Case:
    tp = d.pick("tp_size", [1, 2, 3])
    sp = d.pick("sequence_parallel", [None, True, False])
    method = d.pick(
        "method",
        [
            "all_reduce_sum",
            "all_reduce_max",
            "gather_hidden_states",
            "all_gather",
            "all_reduce_sum_context_parallel",
        ],
    )
    lib = d.pick("arrays", ["torch", "numpy"], [3, 1])
    dtype = (
        d.pick("dtype", ["float32", "int64", "bfloat16", "float64"])
        if lib == "torch"
        else d.pick("dtype", ["float32", "int64"])
    )
    shape = tuple(d.int(f"dim{i}", 1, 3) for i in range(d.int("ndim", 1, 3)))
    x: Any = (
        torch.zeros(shape, dtype=getattr(torch, dtype))
        if lib == "torch"
        else np.zeros(shape, dtype=dtype)
    )

    def stack(parts: list[Any]) -> Any:
        return torch.stack(parts) if lib == "torch" else np.stack(parts)

    def cat(parts: list[Any]) -> Any:
        return torch.cat(parts) if lib == "torch" else np.concatenate(parts)

    if method == "all_gather":
        right = stack([x] * tp)
    elif method == "gather_hidden_states" and tp > 1 and sp:
        right = cat([x] * tp)
    else:
        right = x + 0
    faults: dict[str, Callable[[], Any]] = {
        "unsqueezed": lambda: right[None],
        "list": lambda: [right],
        "other_framework": lambda: (
            np.asarray(right.float()) if lib == "torch" else torch.as_tensor(right)
        ),
        "other_dtype": lambda: (
            right.to(torch.float16) if lib == "torch" else right.astype(np.float16)
        ),
        "not_an_array": lambda: 3.0,
    }
    if right.shape[0] > 1:
        faults["first_only"] = lambda: right[:1]
    if method == "all_gather" and tp > 1:
        faults["x_none"] = lambda: x[None]  # one rank's x where the group has tp
    if method == "gather_hidden_states" and tp > 1 and sp:
        faults["not_gathered"] = lambda: x + 0
    muts = d.mutate({f"fault_{k}": (f"collectives.{method}",) for k in faults})
    out = faults[next(iter(muts)).removeprefix("fault_")]() if muts else right
    if muts and len(muts) > 1:
        out = faults[sorted(muts)[0].removeprefix("fault_")]()

    class Custom:
        """A user's collectives whose every method returns ``out``."""

        def all_reduce_sum(self, a: Any, /) -> Any:
            return out

        def all_reduce_max(self, a: Any, /) -> Any:
            return out

        def gather_hidden_states(self, a: Any, /) -> Any:
            return out

        def all_gather(self, a: Any, /) -> Any:
            return out

        def all_reduce_sum_context_parallel(self, a: Any, /) -> Any:
            return out

    def call() -> Any:
        checked = checked_collectives(Custom(), tp_size=tp, sequence_parallel=sp)
        return getattr(checked, method)(x)

    if muts:
        return Case("checked_collectives", call, refuse=(f"collectives.{method}",))
    return Case(
        "checked_collectives",
        call,
        lambda r: [] if r is out else ["the result was not returned as it is"],
    )


# ---------------------------------------------------------------- result validation


class _Map(Mapping[str, Any]):
    def __init__(self, d: dict[str, Any]) -> None:
        self._d = d

    def __getitem__(self, k: str) -> Any:
        return self._d[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


def results_case(d: Draw) -> Case:
    mtp = d.chance("mtp", 0.5)
    b, s = d.int("b", 1, 3), d.int("s", 1, 3)
    lib = d.pick("arrays", ["torch", "numpy"], [3, 1])

    def arr(shape: tuple[int, ...], dtype: str = "float32") -> Any:
        return (
            torch.zeros(shape, dtype=getattr(torch, dtype))
            if lib == "torch"
            else np.zeros(shape, dtype=dtype)
        )

    field = "mtp_processor result" if mtp else "processor result"
    if mtp:
        loss = arr((b, s), d.pick("loss_dtype", ["float32", "float64"]))
        accepted = arr((b, s), "bool") if d.chance("accepted", 0.5) else None
        wrap = d.pick("wrap", ["tensor", "dict", "proxy", "mapping"])
        cands = {
            "loss_shape": (field,),
            "loss_int": (field,),
            "loss_list": (field,),
            "accepted_float": (field,),
            "accepted_shape": (field,),
            "unknown_key": (field,),
            "no_loss_key": (field,),
        }
        muts = d.mutate(cands)
        if "loss_shape" in muts:
            loss = arr((b, s + 1))
        if "loss_int" in muts:
            loss = arr((b, s), "int64")
        if "loss_list" in muts:
            loss = [[0.0] * s] * b
        if "accepted_float" in muts:
            accepted, wrap = arr((b, s)), "dict"
        if "accepted_shape" in muts:
            accepted, wrap = arr((b + 1, s), "bool"), "dict"
        content: dict[str, Any] = {"loss": loss}
        if accepted is not None:
            content["accepted"] = accepted
        if "unknown_key" in muts:
            content["acepted"], wrap = arr((b, s), "bool"), "dict"
        if "no_loss_key" in muts:
            content, wrap = {"losses": loss}, "dict"
        result: Any = {
            "tensor": loss,
            "dict": content,
            "proxy": types.MappingProxyType(content),
            "mapping": _Map(content),
        }[wrap if accepted is None or wrap != "tensor" else "dict"]

        def call() -> Any:
            return validate_mtp_result(result, batch=b, seq=s)

        def check(r: Any) -> list[str]:
            want_acc = result.get("accepted") if isinstance(result, Mapping) else None
            want_loss = result["loss"] if isinstance(result, Mapping) else result
            return (
                []
                if r[0] is want_loss and r[1] is want_acc
                else ["not the loss and accepted given"]
            )

        return Case(
            "validate_mtp_result",
            call,
            check,
            refuse=tuple(f for v in muts.values() for f in v) if muts else (),
        )
    k = d.int("k", 1, 3)
    shapes = {"per_token": (b, s), "topk": (b, s, k), "scalar": ()}
    kinds = [d.pick(f"value{i}", sorted(shapes)) for i in range(d.int("values", 1, 3))]
    dtypes = ["float32", "int64", "bool", "float64"]
    values = {
        f"v{i}": arr(shapes[kind], d.pick(f"dtype{i}", dtypes)) for i, kind in enumerate(kinds)
    }
    wrap = d.pick("wrap", ["single", "dict", "proxy", "mapping"])
    cands = {
        "empty": (field,),
        "int_key": (field,),
        "shape": (field,),
        "list": (field,),
        "complex": (field,),
        "none_value": (field,),
    }
    muts = d.mutate(cands)
    if "shape" in muts:
        values["v0"] = arr((b + 1, s))
    if "complex" in muts:
        values["v0"] = (
            torch.zeros(b, s, dtype=torch.complex64)
            if lib == "torch"
            else np.zeros((b, s), np.complex64)
        )
    if "none_value" in muts:
        values["v0"] = None
    if "list" in muts:
        values["v0"], wrap = [0.0], "single"
    content = dict(values)
    if "empty" in muts:
        content, wrap = {}, "dict"
    if "int_key" in muts:
        content, wrap = {**content, 3: arr((b, s))}, "dict"  # type: ignore[dict-item]
    result = {
        "single": content.get("v0"),
        "dict": content,
        "proxy": types.MappingProxyType(content),
        "mapping": _Map(content),
    }[wrap]

    def call_result() -> Any:
        return validate_result(result, batch=b, seq=s)

    if muts:
        return Case("validate_result", call_result, refuse=(field,))
    return Case("validate_result", call_result, lambda r: [] if r is None else [f"returned {r!r}"])


# ---------------------------------------------------------------- MTP wrappers


GOOD_FACTORS = [
    0.5,
    2,
    3,
    np.float32(0.25),
    np.float64(1.5),
    Fraction(3, 4),
    np.int64(2),
    1e-3,
    1000,
]
BAD_FACTORS = [
    0,
    -1,
    float("nan"),
    float("inf"),
    10**400,
    Fraction(10**400, 3),
    True,
    "2",
    None,
    torch.tensor(2.0),
    1j,
]


def mtp_case(d: Draw) -> Case:
    b, s, h, V = d.int("b", 1, 3), d.int("s", 1, 4), d.int("h", 1, 4), d.int("V", 2, 6)
    dtype = d.pick("dtype", [F32, F64], [3, 1])
    hidden = d.randn(s, b, h, dtype=dtype)
    weight = d.randn(V, h, dtype=dtype)
    labels = d.randint(0, V, (b, s))
    depth = d.int("mtp_depth", 1, 3)
    inner_kind = d.pick(
        "inner",
        [
            "cross_entropy_loss",
            "dict",
            "proxy",
            "mapping",
            "plain_function",
            "callable_object",
            "with_accepted",
        ],
    )
    wrapping = d.pick("wrapping", ["scaled", "detached", "scaled(detached)", "detached(scaled)"])
    factor: Any = d.pick("factor", GOOD_FACTORS)
    cands: dict[str, tuple[str, ...]] = {
        "keyword_style": ("mtp_processor",),
        "not_callable": ("mtp_processor",),
        "bad_result_key": ("mtp_processor result",),
        "result_list": ("mtp_processor result",),
    }
    if "scaled" in wrapping:
        cands["bad_factor"] = ("factor",)
    muts = d.mutate(cands)
    if "bad_factor" in muts:
        factor = d.pick("bad_factor", BAD_FACTORS)
    ce = cross_entropy_loss()

    def per_token(ctx: OutputContext) -> torch.Tensor:
        return ce(ctx)

    def inner_fn(ctx: OutputContext) -> Any:
        loss = per_token(ctx)
        if "bad_result_key" in muts:
            return {"loss": loss, "acceptd": loss > 0}
        if "result_list" in muts:
            return [loss]
        if inner_kind == "dict":
            return {"loss": loss}
        if inner_kind == "proxy":
            return types.MappingProxyType({"loss": loss})
        if inner_kind == "mapping":
            return _Map({"loss": loss})
        if inner_kind == "with_accepted":
            return {"loss": loss, "accepted": torch.zeros(b, s, dtype=torch.bool)}
        return loss

    class CallableObject:
        def __call__(self, ctx: OutputContext) -> Any:
            return inner_fn(ctx)

    inner: Any
    if "keyword_style" in muts:

        def inner(*, hidden_states: Any, **_: Any) -> Any:  # the upstream hook's style
            return hidden_states

    elif "not_callable" in muts:
        inner = d.pick("not_callable", [42, "ce", None])
    elif "bad_result_key" in muts or "result_list" in muts:
        inner = hookspec.processor(inner_fn, name="bad_result")
    elif inner_kind == "cross_entropy_loss":
        inner = ce
    elif inner_kind == "plain_function":
        inner = inner_fn
    elif inner_kind == "callable_object":
        inner = CallableObject()
    else:
        inner = hookspec.processor(inner_fn, name=inner_kind)

    def wrap() -> Any:
        if wrapping == "scaled":
            return scaled_mtp_gradient(inner, factor)
        if wrapping == "detached":
            return detached_head(inner)
        if wrapping == "scaled(detached)":
            return scaled_mtp_gradient(detached_head(inner), factor)
        return detached_head(scaled_mtp_gradient(inner, factor))

    cot = d.randn(b, s, dtype=F64)

    def call() -> Any:
        proc = wrap()
        h_leaf = hidden.clone().requires_grad_()
        w_leaf = weight.clone().requires_grad_()
        ctx = OutputContext(
            hidden_states=h_leaf,
            vocab_weight=w_leaf,
            labels=labels,
            vocab=VocabShard(0, V, V),
            mtp_depth=depth,
        )
        out = proc(ctx)
        loss, accepted = validate_mtp_result(out, batch=b, seq=s, array_kind="a torch.Tensor")
        gh, gw = torch.autograd.grad(
            (loss.double() * cot).sum(), (h_leaf, w_leaf), allow_unused=True
        )
        return loss, accepted, gh, gw

    if muts:
        return Case("mtp wrappers", call, refuse=tuple(f for v in muts.values() for f in v))

    def check(r: Any) -> list[str]:
        loss, _, gh, gw = r
        H, W = (
            hidden.detach().double().clone().requires_grad_(),
            weight.detach().double().clone().requires_grad_(),
        )
        z = torch.einsum("sbh,vh->bsv", H, W)
        _, lp, _ = token_stats64(z, labels, -100)
        assert lp is not None
        truth = -lp
        dH, dW = torch.autograd.grad((truth * cot).sum(), (H, W))
        scale = float(factor) if "scaled" in wrapping else 1.0
        eps = 1e-4 if dtype == F32 else 1e-10
        problems = close("loss", loss, truth, atol=eps * (1 + truth.abs()))
        problems += close("d hidden", gh, scale * dH, atol=eps * (1 + scale * dH.abs().max()))
        if "detached" in wrapping:
            if gw is not None and bool((gw != 0).any()):
                problems.append("d weight: a gradient reached the detached head")
        else:
            problems += close("d weight", gw, scale * dW, atol=eps * (1 + scale * dW.abs().max()))
        return problems

    return Case("mtp wrappers", call, check)


# ---------------------------------------------------------------- helpers


def helpers_case(d: Draw) -> Case:
    if d.pick("helper", ["aggregation_weights", "kl_penalty"]) == "kl_penalty":
        shape = tuple(d.int(f"dim{i}", 1, 3) for i in range(d.int("ndim", 0, 2)))
        dtype = d.pick("dtype", [F32, F64])
        logp, ref = -d.rand(*shape).to(dtype) * 3, -d.rand(*shape).to(dtype) * 3
        estimator: Any = d.pick("estimator", ["k1", "k2", "k3", hookspec.KLEstimator.K3])
        clamp: Any = d.pick("clamp", [None, 20.0, 0.5, 1])
        muts = d.mutate(
            {
                "bad_estimator": ("estimator",),
                "bad_clamp": ("clamp",),
                "logp_int": ("logp",),
                "ref_shape": ("ref",),
                "ref_list": ("ref",),
            }
        )
        if "bad_estimator" in muts:
            estimator = d.pick("bad_estimator", ["k4", None, 1])
        if "bad_clamp" in muts:
            clamp = d.pick("bad_clamp", [0.0, -1.0, float("nan"), True, "20"])
        if "logp_int" in muts:
            logp = logp.long()
        if "ref_shape" in muts:
            ref = torch.zeros(*shape, 2)
        if "ref_list" in muts:
            ref = ref.tolist()

        def call() -> Any:
            return kl_penalty(logp, ref, estimator, clamp=clamp)

        if muts:
            return Case("kl_penalty", call, refuse=tuple(f for v in muts.values() for f in v))
        truth = kl_estimate64(
            logp.double(),
            ref.double(),
            str(getattr(estimator, "value", estimator)),
            None if clamp is None else float(clamp),
        )
        tol = 64 * (1e-7 if dtype == F32 else 1e-16) * (1 + truth.abs() + 10)
        return Case("kl_penalty", call, lambda r: close("kl", r, truth, atol=tol))
    b, s = d.int("b", 1, 3), d.int("s", 1, 4)
    how: Any = d.pick("how", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
    mask: Any = (d.rand(b, s) < 0.6).to(d.pick("mask_dtype", [F32, F64, torch.bool]))
    packed = d.chance("packed", 0.3)
    count = b
    segments: Any = torch.arange(b)[:, None].expand(b, s)
    if packed:
        count = d.int("count", 1, s + 1)
        segments = d.randint(0, count, (b, s))
    gt: Any = (
        d.pick("global_tokens", POSITIVE[:6])
        if how == "token-mean" and d.chance("gt", 0.3)
        else None
    )
    gs: Any = (
        d.pick("global_sequences", POSITIVE[:6])
        if how != "token-mean" and d.chance("gs", 0.3)
        else None
    )
    muts = d.mutate(
        {
            "bad_how": ("aggregation",),
            "mask_list": ("mask",),
            "mask_negative": ("mask",),
            "segments_float": ("segments",),
            "segments_shape": ("segments",),
            "segments_range": ("segments",),
            "bad_count": ("count",),
            "bad_global": ("global_tokens", "global_sequences"),
            "unused_global": ("global_tokens", "global_sequences"),
        }
    )
    if "bad_how" in muts:
        how = d.pick("bad_how", ["mean", None])
    if "mask_list" in muts:
        mask = mask.tolist()
    if "mask_negative" in muts:
        mask = mask.float()
        mask[0, 0] = d.pick("bad_mask", [-1.0, float("nan"), float("inf")])
    if "segments_float" in muts:
        segments = segments.float()
    if "segments_shape" in muts:
        segments = torch.zeros(b, s + 1, dtype=torch.long)
    if "segments_range" in muts:
        segments = segments.clone()
        segments[0, 0] = count + d.int("excess", 0, 2)
    if "bad_count" in muts:
        count = d.pick("bad_count", [-1, True, 1.5, None])
    if "bad_global" in muts:
        bad = d.pick("bad_global_value", [0, -1.0, float("nan"), True, "3"])
        gt, gs = (bad, None) if how == "token-mean" else (None, bad)
    if "unused_global" in muts:
        gt, gs = (None, 3) if how == "token-mean" else (3, None)

    def call() -> Any:
        return aggregation_weights(
            mask, segments, count, how, global_tokens=gt, global_sequences=gs
        )

    if muts:
        return Case("aggregation_weights", call, refuse=tuple(f for v in muts.values() for f in v))
    truth = aggregation_weights64(
        mask.double(), segments, count, how, global_tokens=gt, global_sequences=gs
    )
    want = F64 if mask.dtype == F64 else F32

    def check(r: Any) -> list[str]:
        p = close("weights", r, truth, atol=1e-6 * (1 + truth.abs()))
        return p + ([f"dtype {r.dtype}, expected {want}"] if r.dtype != want else [])

    return Case("aggregation_weights", call, check)


# ---------------------------------------------------------------- tools


def _fd_count() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def state_snapshot() -> dict[str, Any]:
    """What a tool run in process must leave as it found it."""
    numpy_state = np.random.get_state()
    return {
        "torch_rng": torch.random.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": (numpy_state[1].copy(), numpy_state[2]),
        "default_dtype": torch.get_default_dtype(),
        "default_device": torch.get_default_device(),
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "autocast_cpu": torch.is_autocast_enabled("cpu"),
        "environ": dict(os.environ),
        "cwd": os.getcwd(),
        "sys.path": list(sys.path),
        "sys.argv": list(sys.argv),
        "process_groups": len(registered_process_groups()),
        "distributed": torch.distributed.is_available() and torch.distributed.is_initialized(),
        "num_threads": torch.get_num_threads(),
        "stdout": sys.stdout,
        "stderr": sys.stderr,
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and a and isinstance(a[0], np.ndarray):
        return bool(np.array_equal(a[0], b[0])) and a[1:] == b[1:]
    return bool(a == b) if not isinstance(a, (io.IOBase,)) else a is b


def state_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    changed = []
    for key, value in before.items():
        if not _same(value, after[key]):
            shown = (
                ""
                if key in ("torch_rng", "python_rng", "numpy_rng", "environ")
                else f": {value!r} -> {after[key]!r}"
            )
            if key == "environ":
                diff = sorted(set(value.items()) ^ set(after[key].items()))
                shown = f": {diff[:4]}"
            changed.append(f"the caller's {key} changed{shown}")
    return changed


DOCTOR_ARGV: list[tuple[list[str], int, bool]] = [
    (["--help"], 0, False),
    (["-h"], 0, False),
    (["--bogus"], 2, False),
    (["--facts-row", "extra"], 2, False),
    ([""], 2, False),
    (["--facts-row"], 0, True),
    (["--no-checks"], 0, True),
    (["--facts-row", "--no-checks"], 0, True),
    ([], 0, True),  # every check: a tiny model, a minute
]
"""(argv, the status it returns, slow): slow rows are drawn with ``HOOKSPEC_FUZZ_SLOW=1`` only."""
HOOKCHECK_ARGV: list[tuple[list[str], int, bool]] = [
    (["--help"], 0, False),
    (["--bogus"], 2, False),
    (["--tp", "0"], 2, False),
    (["--tp", "-2"], 2, False),
    (["--tp", "x"], 2, False),
    (["--seed", "-1"], 2, False),
    (["--seed", str(2**32)], 2, False),
    (["--dtype", "float64"], 2, False),
    (["--case", "nope"], 2, False),
    (["--case", "ties", "--no-synthetic"], 2, False),
    (["--context", "a:b"], 2, False),
    (["--processor", "torch_impl.processors:selected_logprobs"], 2, False),
    (["--processor", "no_such_module_here:fn", "--reference", "x:y"], 2, False),
    (
        [
            "--processor",
            "torch_impl.processors:selected_logprobs",
            "--reference",
            "jax_ref:no_such_name",
        ],
        2,
        False,
    ),
    (["--tp", "3"], 2, False),
    (["--case", "ties", "--dtype", "float32", "--quiet"], 0, True),
    (["--no-synthetic", "--dtype", "float32", "--quiet"], 0, True),
]
CALLER_STATES = [
    "plain",
    "no_grad",
    "float64_default",
    "inference_mode",
    "autocast",
    "env_and_cwd",
    "rng_used",
    "gloo_group",
]


@contextlib.contextmanager
def caller_state(kind: str) -> Iterator[None]:
    """The caller's state a tool is run under (entered before the snapshot)."""
    with contextlib.ExitStack() as stack:
        if kind == "no_grad":
            stack.enter_context(torch.no_grad())
        elif kind == "inference_mode":
            stack.enter_context(torch.inference_mode())
        elif kind == "autocast":
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        elif kind == "float64_default":
            saved = torch.get_default_dtype()
            torch.set_default_dtype(torch.float64)
            stack.callback(torch.set_default_dtype, saved)
        elif kind == "env_and_cwd":
            old_env = os.environ.get("HOOKSPEC_FUZZ_MARK")
            os.environ["HOOKSPEC_FUZZ_MARK"] = "caller"
            stack.callback(
                lambda: os.environ.pop("HOOKSPEC_FUZZ_MARK", None) if old_env is None else None
            )
            cwd = os.getcwd()
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            os.chdir(tmp)
            stack.callback(os.chdir, cwd)
        elif kind == "gloo_group" and not torch.distributed.is_initialized():
            # the caller's own process group, as a notebook or a script under torchrun has it
            from torch_impl.process_state import free_port

            torch.distributed.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
            )
            stack.callback(torch.distributed.destroy_process_group)
        elif kind == "rng_used":  # a caller who seeded every generator (put back after)
            saved_rng = (torch.random.get_rng_state(), random.getstate(), np.random.get_state())
            torch.manual_seed(1234)
            random.seed(5)
            np.random.seed(6)
            stack.callback(torch.random.set_rng_state, saved_rng[0])
            stack.callback(random.setstate, saved_rng[1])
            stack.callback(np.random.set_state, saved_rng[2])
        yield


def _native_threads() -> int:
    """The process's threads, native ones (gloo's, OpenMP's) included."""
    try:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("Threads:")).split()[1])
    except (OSError, StopIteration, ValueError):
        return -1


def tools_case(d: Draw) -> Case:
    tool = d.pick("tool", ["doctor", "hookcheck"])
    table = DOCTOR_ARGV if tool == "doctor" else HOOKCHECK_ARGV
    options = [row for row in table if SLOW_TOOLS or not row[2]]
    argv, rc, _ = d.pick("argv", options, [1 if row[2] else 8 for row in options])
    state = d.pick("caller", CALLER_STATES)

    def run_tool() -> tuple[Any, str]:
        out, err = io.StringIO(), io.StringIO()
        try:
            if tool == "doctor":
                from torch_impl import doctor

                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    return doctor.main(list(argv)), err.getvalue()
            from jax_ref.check import hookcheck

            return hookcheck.main(list(argv), out=out, err=err), err.getvalue()
        except SystemExit as exc:  # a tool called in process returns its status
            return f"SystemExit({exc.code!r})", err.getvalue()

    def resources() -> tuple[int, int]:
        return _native_threads(), _fd_count()

    def call() -> Any:
        with caller_state(state):
            before = state_snapshot()
            code, err = run_tool()
            changes = state_changes(before, state_snapshot())
            # what a run leaves behind: a second run must not add to it (a first run may
            # start what a process keeps once, as torch's gloo transport does)
            first = resources()
            run_tool()
            for _ in range(20):  # threads and descriptors may take a moment to close
                second = resources()
                if second[0] <= first[0] and second[1] <= first[1]:
                    break
                time.sleep(0.05)
        return code, changes, (second[0] - first[0], second[1] - first[1]), err[-300:]

    def check(r: Any) -> list[str]:
        code, changes, (threads, fds), err = r
        problems = list(changes)
        if code != rc:
            problems.append(f"returned {code!r}, expected {rc} (stderr: {err.strip()[-200:]!r})")
        if threads > 0:
            problems.append(f"{threads} more threads after a second run")
        if fds > 0:
            problems.append(f"{fds} more open file descriptors after a second run")
        return problems

    return Case(f"{tool}.main", call, check)


# ---------------------------------------------------------------- options compared and hashed


def options_compare_case(d: Draw) -> Case:
    """Two ``LinearOptions`` (numbers or tensor temperatures, the same tensor or another
    of equal values, other fields equal or not) compared with ``==`` and ``!=``, hashed,
    put in a set and used as dict keys; the truth: a tensor temperature by identity, the
    other fields by value."""
    from torch_impl.processors import LinearOptions

    n = d.int("n", 1, 6)
    shared = d.rand(n).float()
    pool: dict[str, Any] = {
        "number": 1.5,
        "int": 2,
        "same_float": 2.0,
        "shared": shared,
        "shared_again": shared,
        "copy": shared.clone(),
        "grad": d.rand(n).float().requires_grad_(),
        "float64": d.rand(n),
        "scalar_tensor": torch.tensor(1.5),  # 0-dim: a tensor, compared by identity
    }
    names = [d.pick("temperature_a", sorted(pool)), d.pick("temperature_b", sorted(pool))]
    other = [
        {"tile_rows": d.pick("tile_rows_a", [None, 4])},
        {"tile_rows": d.pick("tile_rows_b", [None, 4])},
    ]
    values = [pool[name] for name in names]

    def key(value: Any) -> Any:  # a tensor, 0-dim included, by identity (the docstring's rule)
        if isinstance(value, torch.Tensor):
            return ("tensor", id(value))
        return ("number", float(value))

    def call() -> Any:
        a, b = (LinearOptions(temperature=v, **o) for v, o in zip(values, other, strict=True))
        return a, b, a == b, a != b, hash(a) == hash(b), len({a, b}), {a: 1, b: 2}[a]

    def check(result: Any) -> list[str]:
        a, _, eq, ne, same_hash, size, first = result
        want = key(values[0]) == key(values[1]) and other[0] == other[1]
        problems = []
        if eq is not want or ne is want:
            problems.append(f"== gave {eq}, != gave {ne}; expected equal: {want}")
        if want and not same_hash:
            problems.append("equal options with different hashes")
        if size != (1 if want else 2) or first != (2 if want else 1):
            problems.append(
                f"a set of both holds {size}; a dict keyed by both gives {first} for the first"
            )
        if a != a or hash(a) != hash(a):
            problems.append("an options object unequal to itself")
        return problems

    return Case("LinearOptions ==", call, check)


SURFACE_ENTRIES = {
    "LinearOptions ==": (options_compare_case, 2),
    "constructors": (constructor_case, 8),
    "processor()": (processor_ctor_case, 1),
    "validate_context": (validate_context_case, 5),
    "checked_collectives": (collectives_case, 5),
    "validate_result": (results_case, 3),
    "mtp wrappers": (mtp_case, 5),
    "helpers": (helpers_case, 3),
    "tools": (tools_case, 2),
}
