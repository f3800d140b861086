"""The contract fuzzer's tensor-function entries: ``linear_logprobs``,
``fused_token_loss`` and ``linear_topk_logprobs`` with drawn :class:`LinearOptions`
(temperature a number or per row, logit scale, ignore index, vocab shards over
``tp`` thread ranks, backend, compute dtype, tiles), compared with float64 logits
(test support for the fuzzer)."""

from __future__ import annotations

import weakref
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from hookspec import ContractError, SingleProcessCollectives, VocabShard
from torch_impl.processors import (
    LinearOptions,
    fused_token_loss,
    linear_logprobs,
    linear_topk_logprobs,
)
from torch_impl.processors._backends import triton_available
from torch_impl.processors._geometry import interpreting

from .fuzz_processors import check_topk
from .fuzz_support import Case, Draw, close, run_spmd
from .fuzz_truths import token_stats64
from .fuzz_world import (
    FAULTS,
    LEAK,
    Bounds,
    World,
    compare_grads,
    detached,
    draw_world,
    kept_alive_all,
    magnitudes,
)

__all__ = ["OTHER_LEAF", "TENSOR_ENTRIES"]

REFUSED_LEARNED = "refused: the loss reaches another leaf"
LEARNED_GRAD = "d learned coefficient"
LEARNED_VALUE = 0.75
OTHER_LEAF = "the loss's other leaf (a coefficient it closes over)"

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16

BAD_OPTIONS: dict[str, list[Any]] = {
    "temperature": [0, -1.0, float("nan"), float("inf"), True, "1", None],
    "logit_scale": [0, -2.0, float("nan"), True, "1", torch.tensor(1.0), 10**400],
    "ignore_index": [True, 1.5, "x", 2**63, -(2**62) - 1],
    "vocab": [(0, 4, 4), "vocab"],
    "collectives": [object(), "tp"],
    "backend": ["cuda", None, "Torch"],
    "compute_dtype": [torch.int32, "float32", torch.complex64],
    "tile_rows": [0, -1, True, 2.5],
    "tile_cols": [0, True, "8"],
    "check_values": ["yes", 1, None],
}


def _triton_runs() -> bool:
    return triton_available() and interpreting()


def tensor_case(d: Draw) -> Case:
    fn = d.pick("function", ["linear_logprobs", "fused_token_loss", "linear_topk_logprobs"])
    backend = d.pick("backend", ["auto", "torch", "triton"], [20, 20, 1])
    # Triton's interpreter patches module globals while a kernel runs: one rank (thread) only
    w = draw_world(d, tp_weights=(5, 3, 1) if backend != "triton" else (1, 0, 0))
    # rows: the world's [s, b=?, h] flattened s-major; a tensor function takes [n, h]
    n, V = w.n, w.V
    labels = w.labels.transpose(0, 1).reshape(-1)  # [n], s-major as the hidden rows
    temperature: Any = 1.0
    t_kind = d.pick("temperature_kind", ["default", "number", "tensor"], [3, 2, 2])
    if t_kind == "number":
        temperature = d.pick(
            "temperature",
            [0.5, 2.0, torch.tensor(0.25)]
            if w.exact
            else [0.5, 2.0, np.float32(0.7), Fraction(5, 4), torch.tensor(1.5)],
        )
    elif t_kind == "tensor":
        if w.exact:
            temperature = (2.0 ** d.randint(-1, 2, (n,))).to(F32)
        else:
            temperature = (0.3 + 2 * d.rand(n)).to(d.pick("temperature_dtype", [F32, F64]))
        if d.chance("temperature_requires_grad", 0.2):  # not differentiated: no gradient reaches it
            temperature.requires_grad_()
    scale = d.pick("logit_scale", [1.0, 0.5, 2] if w.exact else [1.0, 0.5, 3, np.float64(1.5)])
    compute = d.pick("compute_dtype", [None, F32, F64, BF16], [8, 1, 1, 1])
    tile_rows = d.int("tile_rows", 1, max(1, n)) if d.chance("tiles", 0.5) else None
    tile_cols = (
        d.int("tile_cols", 1, w.vl) if tile_rows is not None and d.rng.random() < 0.7 else None
    )
    with_entropy = d.chance("with_entropy", 0.5)
    k = d.int("k", 1, V) if fn == "linear_topk_logprobs" else 0
    topk_labels = fn != "linear_topk_logprobs" or not d.chance("no_labels", 0.3)
    kinds = ["weighted", "entropy", "nonlinear", "constant"] + (["learned"] if w.tp == 1 else [])
    # "learned": the loss closes over a tensor that requires grad (a learned coefficient)
    loss_kind = d.pick("token_loss", kinds) if fn == "fused_token_loss" else ""
    entropy_grad = loss_kind == "entropy" or d.chance("entropy_grad", 0.5)
    coef = d.randn(n, dtype=F64) if fn == "fused_token_loss" else None
    learned = torch.tensor(LEARNED_VALUE, dtype=F64, requires_grad=True)

    cands: dict[str, tuple[str, ...]] = {
        "hidden_3d": ("hidden",),
        "hidden_int": ("hidden",),
        "hidden_list": ("hidden",),
        "weight_h": ("weight",),
        "weight_int": ("weight",),
        "weight_1d": ("weight",),
        "options_mapping": ("options",),
        "moved_keyword": ("TypeError",),
        "temperature_numel": ("temperature",),
        "temperature_2d": ("temperature",),
        "temperature_int": ("temperature",),
        "temperature_meta": ("temperature",),
        "hidden_meta": ("hidden",),
        "weight_meta": ("weight",),
        "vocab_rows": ("vocab",),
    }
    if fn != "fused_token_loss":
        cands["with_entropy_str"] = ("with_entropy",)
    if fn != "linear_topk_logprobs" or topk_labels:
        cands.update(
            labels_shape=("labels",),
            labels_float=("labels",),
            labels_list=("labels",),
            labels_meta=("labels",),
        )
    for name in BAD_OPTIONS:
        cands[f"bad_{name}"] = (name,)
    if w.check_values and topk_labels:
        cands["labels_range"] = ("labels",)
    if w.check_values:
        cands["temperature_values"] = ("temperature",)
    if w.tp > 1:
        cands["shard_without_collectives"] = ("collectives",)
        cands["shard_single_process"] = ("collectives",)
        methods = ["all_reduce_sum", "all_reduce_max", "gather_hidden_states"]
        if fn == "linear_topk_logprobs":
            methods.append("all_gather")
        for method in methods:
            cands[f"fault_{method}"] = (f"collectives.{method}",)
    if fn == "linear_topk_logprobs":
        cands["bad_k"] = ("k",)
        cands["k_beyond_vocab"] = ("k",)
    if fn == "fused_token_loss":
        cands.update(
            loss_vector=("token_loss",),
            loss_int=("token_loss",),
            loss_float=("token_loss",),
            loss_not_callable=("token_loss",),
            entropy_grad_str=("entropy_grad",),
            loss_calls_backward=("token_loss",),
        )
        if w.grads_wanted() and loss_kind != "entropy":
            cands["loss_reads_entropy"] = ("token_loss",)
    muts = d.mutate(cands)
    if "loss_reads_entropy" in muts:
        entropy_grad = False
    if "moved_keyword" in muts:  # raised before anything else is looked at: alone
        muts = {"moved_keyword": muts["moved_keyword"]}
    single = w.tp == 1 and d.chance("single_process_collectives", 0.3)
    whole_vocab = w.tp > 1 or d.chance("vocab_shard", 0.5)
    if backend == "triton" and not _triton_runs():
        muts = {**muts, "triton_unavailable": ("backend",)}  # not drawn: this environment's answer
    elif backend == "triton" and (F64 in (w.dtype, w.wdtype) or compute == F64):
        muts = {**muts, "triton_float64": ("backend", "compute_dtype")}
    bad_values = {
        name: d.pick(f"bad_{name}", BAD_OPTIONS[name])
        for name in BAD_OPTIONS
        if f"bad_{name}" in muts
    }
    if "temperature_values" in muts:
        temperature = (0.3 + 2 * d.rand(n)).float()
        temperature[d.rng.randrange(n)] = d.pick(
            "bad_temperature_value", [0.0, -1.0, float("nan"), float("inf")]
        )
    if "temperature_numel" in muts:
        temperature = torch.ones(n + 1)
    if "temperature_2d" in muts:  # n values, another shape: never flattened
        shape = d.pick(
            "temperature_shape",
            [(n, 1), (1, n), (2, n // 2) if n % 2 == 0 and n > 2 else (n, 1, 1)],
        )
        temperature = torch.ones(shape)
    if "temperature_int" in muts:
        temperature = torch.ones(
            n, dtype=d.pick("temperature_int_dtype", [torch.int64, torch.bool])
        )
    if "temperature_meta" in muts:
        temperature = torch.ones(n, device="meta")
    kk: Any = k
    if "bad_k" in muts:
        kk = d.pick("bad_k", [0, -2, True, 1.0, "2", None])
    if "k_beyond_vocab" in muts:
        kk = V + 1
    faults = {
        key.removeprefix("fault_"): FAULTS[d.pick(f"fault[{key}]", sorted(FAULTS))]
        for key in muts
        if key.startswith("fault_")
    }
    w.faults.update(faults)
    cots: dict[str, torch.Tensor] = {}
    if not muts:
        if fn == "linear_logprobs":
            cots = {"logprobs": d.randn(n, dtype=F64), "entropy": d.randn(n, dtype=F64)}
            cots["lse"] = d.randn(n, dtype=F64)
        elif fn == "fused_token_loss":
            cots = {"loss": d.randn(1, dtype=F64)[0]}
        else:
            cots = {
                "logprobs": d.randn(n, k, dtype=F64),
                "label_logprobs": d.randn(n, dtype=F64),
                "entropy": d.randn(n, dtype=F64),
            }

    def token_loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> Any:
        assert coef is not None
        c = coef[rows].to(lp.dtype)
        if "loss_vector" in muts:
            return -(lp * c)
        if "loss_int" in muts:
            return (lp * c).sum().long()
        if "loss_float" in muts:
            return float((lp * c).sum().detach())
        if "loss_reads_entropy" in muts:
            return (ent * c).sum()
        if "loss_calls_backward" in muts:  # the product differentiates the loss itself
            loss = -(lp * c).sum()
            loss.backward(retain_graph=d.rng.random() < 0.5)
            return loss
        if loss_kind == "weighted":
            return -(lp * c).sum()
        if loss_kind == "entropy":
            return (0.5 * ent - lp * c).sum()
        if loss_kind == "nonlinear":
            return (lp.exp() * c).sum()
        if loss_kind == "learned":
            return -(lp * c * learned.to(lp.dtype)).sum()
        return torch.zeros((), dtype=lp.dtype)

    def call() -> Any:
        group = w.group()

        def run_rank(r: int) -> Any:
            coll: Any = group.rank(r) if group is not None else None
            if single and coll is None:
                coll = SingleProcessCollectives()
            vocab: Any = w.shard(r) if whole_vocab else None
            h_leaf = _rows(w, r).detach().clone().requires_grad_(w.requires_grad)
            w_leaf = (
                w.weight[r * w.vl : (r + 1) * w.vl].detach().clone().requires_grad_(w.requires_grad)
            )
            hid: Any = h_leaf
            wt: Any = w_leaf
            lab: Any = labels.clone()
            if "hidden_3d" in muts:
                hid = h_leaf[None]
            if "hidden_int" in muts:
                hid = h_leaf.long()
            if "hidden_list" in muts:
                hid = h_leaf.tolist()
            if "weight_h" in muts:
                wt = torch.zeros(w.vl, w.h + 1)
            if "weight_int" in muts:
                wt = w_leaf.long()
            if "weight_1d" in muts:
                wt = w_leaf.reshape(-1)
            if "hidden_meta" in muts:
                hid, wt = h_leaf.detach().to("meta"), w_leaf.detach().to("meta")
            if "weight_meta" in muts:
                wt = w_leaf.detach().to("meta")
            if "labels_meta" in muts:
                lab = torch.zeros(n, dtype=torch.long, device="meta")
            if "labels_float" in muts:
                lab = lab.float()
            if "labels_list" in muts:
                lab = lab.tolist()
            if "labels_shape" in muts:
                lab = lab[:-1] if n > 1 else torch.zeros(2, dtype=torch.long)
            if "labels_range" in muts:
                lab[0] = V + 2 if V + 2 != w.ignore_index else V + 3
            if "vocab_rows" in muts:
                vocab = (
                    VocabShard(start=0, end=w.vl + 1, size=max(w.V, w.vl + 1))
                    if w.tp == 1
                    else VocabShard(start=0, end=w.vl + 1, size=(w.vl + 1) * w.tp)
                )
            if "shard_without_collectives" in muts:
                coll = None
            if "shard_single_process" in muts:
                coll = SingleProcessCollectives()
            opts: dict[str, Any] = dict(
                temperature=temperature,
                logit_scale=scale,
                ignore_index=w.ignore_index,
                vocab=vocab,
                collectives=coll,
                backend=backend,
                compute_dtype=compute,
                tile_rows=tile_rows,
                tile_cols=tile_cols,
                check_values=w.check_values,
            )
            opts.update(bad_values)
            extra: dict[str, Any] = {}
            if "moved_keyword" in muts:
                extra["temperature"] = 2.0
            with w.mode():
                options: Any = dict(opts) if "options_mapping" in muts else LinearOptions(**opts)
                if fn == "linear_logprobs":
                    we: Any = "yes" if "with_entropy_str" in muts else with_entropy
                    res: Any = linear_logprobs(
                        hid, wt, lab, options=options, with_entropy=we, **extra
                    )
                    out = {"logprobs": res.logprobs, "entropy": res.entropy, "lse": res.lse}
                elif fn == "fused_token_loss":
                    tl: Any = 42 if "loss_not_callable" in muts else token_loss
                    eg: Any = "no" if "entropy_grad_str" in muts else entropy_grad
                    try:
                        res = fused_token_loss(
                            hid, wt, lab, tl, options=options, entropy_grad=eg, **extra
                        )
                    except ContractError as exc:
                        if loss_kind != "learned" or muts or exc.field != "token_loss":
                            raise
                        return (
                            {REFUSED_LEARNED: str(exc)},
                            None,
                            weakref.ref(h_leaf),
                        )  # refusing is allowed
                    out = {"loss": res.loss, "logprobs": res.logprobs, "entropy": res.entropy}
                else:
                    we = "yes" if "with_entropy_str" in muts else with_entropy
                    res = linear_topk_logprobs(
                        hid,
                        wt,
                        k=kk,
                        labels=lab if topk_labels else None,
                        options=options,
                        with_entropy=we,
                        **extra,
                    )
                    out = {
                        "logprobs": res.logprobs,
                        "ids": res.ids,
                        "label_logprobs": res.label_logprobs,
                        "entropy": res.entropy,
                    }
            grads = None
            if w.grads_wanted() and cots:
                terms = [
                    (out[key].double() * cots[key]).sum()
                    for key in cots
                    if isinstance(out.get(key), torch.Tensor) and out[key].requires_grad
                ]
                if terms:
                    leaves = (
                        (h_leaf, w_leaf, learned) if loss_kind == "learned" else (h_leaf, w_leaf)
                    )
                    gh, gw, *g_learned = torch.autograd.grad(
                        torch.stack(terms).sum(), leaves, allow_unused=True
                    )
                    grads = (gh, gw)
                    if g_learned:
                        out[LEARNED_GRAD] = g_learned[0]
            return detached(out), grads, weakref.ref(h_leaf)

        outs = run_spmd(w.tp, run_rank, group)
        # every rank's thread has ended (its frames and autograd state gone): only a
        # reference cycle keeps an input alive now
        leaks = kept_alive_all([probe for _, _, probe in outs])
        return [(out, grads, leak) for (out, grads, _), leak in zip(outs, leaks, strict=True)]

    if "moved_keyword" in muts:  # documented: a keyword of the earlier signature is a TypeError
        return Case(fn, call, raises=TypeError, match="LinearOptions")
    if muts:
        return Case(fn, call, refuse=tuple(f for fields in muts.values() for f in fields))

    def check(outs: list[Any]) -> list[str]:
        H = w.hidden.detach().double().clone().requires_grad_()
        W = w.weight.detach().double().clone().requires_grad_()
        inv: Any = float(scale) / (
            temperature.detach().double()
            if isinstance(temperature, torch.Tensor) and temperature.dim()
            else float(temperature)
        )
        inv_bs = (
            inv.reshape(w.s, w.b).transpose(0, 1) if isinstance(inv, torch.Tensor) else inv
        )  # [b, s]
        zraw = torch.einsum("sbh,vh->bsv", H, W)
        it = torch.as_tensor(inv_bs, dtype=F64)
        z = zraw * (it[..., None] if it.dim() else it)
        logp, lp, ent = token_stats64(z, w.labels, w.ignore_index)
        assert lp is not None
        first = outs[0][0]
        if REFUSED_LEARNED in first:  # refused by name: the contract's other choice
            return []
        values: dict[str, torch.Tensor] = {}
        if fn == "linear_logprobs":
            values["logprobs"] = lp
            values["lse"] = torch.logsumexp(z, -1)  # every token, whatever its label
            if with_entropy:
                values["entropy"] = ent
        elif fn == "fused_token_loss":
            lpt, entt = lp.transpose(0, 1).reshape(-1), ent.transpose(0, 1).reshape(-1)
            assert coef is not None
            loss = {
                "weighted": -(lpt * coef).sum(),
                "entropy": (0.5 * entt - lpt * coef).sum(),
                "nonlinear": (lpt.exp() * coef).sum(),
                "constant": (lpt * 0).sum(),
                "learned": -(lpt * coef).sum() * LEARNED_VALUE,
            }[loss_kind]
            values = {"loss": loss, "logprobs": lp, "entropy": ent}
        else:
            ids = first.get("ids")
            if (
                not isinstance(ids, torch.Tensor)
                or tuple(ids.shape) != (n, k)
                or ids.dtype != torch.long
            ):
                return [
                    f"ids: {type(ids).__name__} {getattr(ids, 'shape', '')} "
                    f"{getattr(ids, 'dtype', '')}"
                ]
            if bool(((ids < 0) | (ids >= V)).any()):
                return [f"ids: outside [0, {V}): {ids.tolist()}"]
            ids_bs = ids.clone().reshape(w.s, w.b, k).transpose(0, 1)  # [b, s, k]
            values = {"logprobs": logp.gather(-1, ids_bs)}
            if topk_labels:
                values["label_logprobs"] = lp
            if with_entropy:
                values["entropy"] = ent
        prec = w.precision(inv_bs, compute)
        bounds = Bounds(values, z, prec)
        problems: list[str] = []
        want_dtype = F64 if (compute if compute is not None else w.wide) == F64 else F32
        for r, (out, got_grads, leaked) in enumerate(outs):
            where = f"rank {r}: " if w.tp > 1 else ""
            if leaked:
                problems.append(f"{where}{LEAK}")
            for key, truth in values.items():
                got = out.get(key)
                if not isinstance(got, torch.Tensor):
                    problems.append(f"{where}{key}: {type(got).__name__}")
                    continue
                if got.dtype != want_dtype:
                    problems.append(f"{where}{key}: dtype {got.dtype}, expected {want_dtype}")
                if key == "loss":
                    problems += close(f"{where}{key}", got, truth, atol=bounds(key))
                    continue
                if fn == "linear_topk_logprobs" and key == "logprobs":
                    tb = truth.transpose(0, 1).reshape(n, k)
                    tol = 8 * prec.zmax + 64 * prec.acc * (
                        1 + tb.abs() + float(z.detach().abs().max())
                    )
                    problems += close(f"{where}{key}", got, tb, atol=tol)
                    continue
                tol = bounds(key).transpose(0, 1).reshape(-1)
                problems += close(
                    f"{where}{key}", got, truth.detach().transpose(0, 1).reshape(-1), atol=tol
                )
            for key in ("entropy", "label_logprobs"):
                if key in out and key not in values and out[key] is not None:
                    problems.append(f"{where}{key}: returned though not asked for")
            if fn == "linear_topk_logprobs":
                got_ids = out["ids"].reshape(w.s, w.b, k).transpose(0, 1)
                got_v = out["logprobs"].reshape(w.s, w.b, k).transpose(0, 1)
                problems += [where + p for p in check_topk(logp.detach(), got_v, got_ids, k, w)]
                if r > 0 and not torch.equal(out["ids"], outs[0][0]["ids"]):
                    problems.append(f"{where}ids differ from rank 0's")
            if loss_kind == "learned" and got_grads is not None and cots:
                want = (
                    -(lpt * coef).sum() * cots["loss"]
                ).detach()  # d (cot * loss) / d coefficient
                got_l = out.get(LEARNED_GRAD)
                if not isinstance(got_l, torch.Tensor):
                    problems.append(
                        f"{where}{OTHER_LEAF}: d coefficient is {got_l!r}, "
                        f"float64 {float(want):.6g}"
                    )
                else:
                    tol_l = bounds("loss") * (1 + abs(float(cots["loss"])) / LEARNED_VALUE)
                    problems += close(
                        f"{where}{OTHER_LEAF}", got_l.double(), want.detach(), atol=tol_l
                    )
            if got_grads is not None and cots:
                scalar = _cot_scalar(fn, values, cots, w, k)
                dH, dW = torch.autograd.grad(scalar, (H, W), retain_graph=True, allow_unused=True)
                cot_scale = sum(float(c.abs().max()) for c in cots.values())
                floor = (
                    256 * prec.acc * cot_scale * max(1.0, float(torch.as_tensor(inv).abs().max()))
                )
                gh, gw = got_grads
                gh = (
                    gh.reshape(-1, w.b, w.h) if gh is not None else None
                )  # rows [s*b, h] -> [s, b, h]
                truth_grads = (dH, dW, magnitudes(H, W, z, inv_bs, scalar), floor)
                problems += compare_grads(w, r, (gh, gw), truth_grads, prec, where)
        return problems

    return Case(fn, call, check)


def _rows(w: World, r: int) -> torch.Tensor:
    """Rank ``r``'s hidden rows ``[n_local, h]`` (s-major; under sequence parallel its
    block of the sequence)."""
    local = w.local_hidden(r)
    return local.reshape(-1, w.h)


def _cot_scalar(
    fn: str, values: dict[str, torch.Tensor], cots: dict[str, torch.Tensor], w: World, k: int
) -> torch.Tensor:
    """``sum(cot * value)`` of the truth, in the rows' order (s-major)."""
    total = torch.zeros((), dtype=F64)
    for key, cot in cots.items():
        if key not in values:
            continue
        v = values[key]
        if key == "loss":
            total = total + v * cot
        elif fn == "linear_topk_logprobs" and key == "logprobs":
            total = total + (v.transpose(0, 1).reshape(-1, k) * cot).sum()
        else:
            total = total + (v.transpose(0, 1).reshape(-1) * cot).sum()
    return total


TENSOR_ENTRIES = {"tensor_functions": (tensor_case, 15)}
