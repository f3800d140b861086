"""The contract fuzzer's processor entries: ``selected_logprobs``,
``cross_entropy_loss`` (none, sum, mean), ``policy_loss`` (PPO/GRPO/GSPO configs,
fused or not, packed sequences, a context-parallel share), ``topk_logprobs`` and
``distillation_loss`` (sparse and dense teachers), each called on hand-built
``OutputContext``s on ``tp`` thread ranks (test support for the fuzzer).
"""

from __future__ import annotations

import math
import types
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from hookspec import ParallelLayout, VocabShard
from jax_ref.check.builtin_processors import distillation_by_rows
from torch_impl.processors import (
    DenseTeacher,
    DistillConfig,
    PolicyBatch,
    PolicyLossConfig,
    RatioLevel,
    SparseTeacher,
    cross_entropy_loss,
    distillation_loss,
    policy_loss,
    selected_logprobs,
    topk_logprobs,
)

from .fuzz_support import Case, Draw
from .fuzz_truths import (
    Precision,
    aggregation_weights64,
    divergence64,
    kl_estimate64,
    masked_mean64,
    sparse_sets64,
    token_stats64,
    unit,
)
from .fuzz_world import Bounds, Compare, World, ctx_mutations, draw_world, processor_case

__all__ = ["PROCESSOR_ENTRIES"]

F32, F64 = torch.float32, torch.float64

BAD_POSITIVE = [0, -1.0, float("nan"), float("inf"), True, "1.0", None, 10**400]
"""Values a finite number > 0 refuses (``None`` only where the option is not optional)."""
GOOD_POSITIVE = [0.5, 2, np.float32(0.7), np.float64(1.3), Fraction(3, 2), np.int64(3)]
BAD_COUNT = [0, -1.0, float("nan"), float("inf"), True, "4"]
BAD_CHUNK = [0, -3, True, 1.5, "2", 2**70]


def _logits(w: World, H: torch.Tensor, W: torch.Tensor, inv: Any) -> torch.Tensor:
    """``z = einsum(H, W) * inv`` ``[b, s, V]``, float64."""
    z = torch.einsum("sbh,vh->bsv", H, W)
    inv_t = torch.as_tensor(inv, dtype=F64)
    return z * (inv_t[..., None] if inv_t.dim() else inv_t)


def _temperature(d: Draw, w: World, *, number_only: bool = False) -> tuple[str, Any]:
    """``(source, T)``: where the temperature comes from (``none``, ``processor``,
    ``context``, ``attr``) and its value (a number, or ``[b, s]``)."""
    source = d.pick("temperature_from", ["none", "processor", "context", "attr"], [4, 2, 2, 1])
    if source == "none":
        return source, 1.0
    if source != "processor" and not number_only and d.chance("temperature_tensor", 0.5):
        if w.exact:
            return source, (2.0 ** d.randint(-1, 2, (w.b, w.s))).to(F32)
        t = (0.25 + 2 * d.rand(w.b, w.s)).to(d.pick("temperature_dtype", [F32, F64], [3, 1]))
        return source, t
    if w.exact:
        return source, d.pick("temperature", [0.5, 1.0, 2.0])
    return source, d.pick("temperature", [0.5, 0.7, 1.0, 2.0, np.float32(1.5), Fraction(1, 3)])


def _inv(w: World, t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return w.scale / t.double()
    return w.scale / float(t)


def _tiles(d: Draw, w: World, bad: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """A processor's tile options: valid (small, to cut the sweeps into many tiles) or
    the one a mutation breaks."""
    out: dict[str, Any] = {}
    if d.chance("tile_cols", 0.4):
        out["tile_cols"] = d.int("tile_cols", 1, w.V)
    if d.chance("tile_rows", 0.3):
        out["tile_rows"] = d.int("tile_rows", 1, w.n)
    for key in ("tile_cols", "tile_rows"):
        if f"bad_{key}" in bad:
            out[key] = d.pick(f"bad_{key}", BAD_CHUNK)
    return out


def _context(source: str, t: Any, **more: Any) -> Any:
    if source == "attr":
        return types.SimpleNamespace(temperature=t, **more)
    if source == "context" or more:
        return {**({"temperature": t} if source == "context" else {}), **more}
    return None


# ---------------------------------------------------------------- selected_logprobs


def selected_case(d: Draw) -> Case:
    w = draw_world(d)
    source, t = _temperature(d, w)
    entropy = d.chance("entropy", 0.5)
    table = ctx_mutations(
        w, name="selected_logprobs", needs_labels=True, reads_mask=False, reads_temperature=True
    )
    factory = {
        "bad_temperature": ("temperature",),
        "bad_entropy": ("entropy",),
        "bad_tile_cols": ("tile_cols",),
        "bad_tile_rows": ("tile_rows",),
    }
    if source in ("context", "attr"):
        factory["temperature_twice"] = ("temperature",)
    muts = d.mutate({**{k: m.fields for k, m in table.items()}, **factory})
    if "context_temperature" in muts and source == "processor":  # two sources: either is named
        muts["context_temperature"] = ("context.temperature", "temperature")
    tiles = _tiles(d, w, muts)
    kwargs: dict[str, Any] = dict(entropy=entropy, **tiles)
    if source == "processor":
        kwargs["temperature"] = t
    if "bad_temperature" in muts:
        kwargs["temperature"] = d.pick(
            "bad_temperature", [v for v in BAD_POSITIVE if v is not None]
        )
    if "temperature_twice" in muts:
        kwargs["temperature"] = 1.0
    if "bad_entropy" in muts:
        kwargs["entropy"] = d.pick("bad_entropy", ["yes", 1, None])
    ctx_t = _context(source, t) if source in ("context", "attr") else None

    def truth(H: torch.Tensor, W: torch.Tensor) -> Any:
        inv = _inv(w, t)
        z = _logits(w, H, W, inv)
        _, lp, ent = token_stats64(z, w.labels, w.ignore_index)
        values = {"logprobs": lp}
        if entropy:
            values["entropy"] = ent
        return values, z, inv

    def compare(values: dict[str, torch.Tensor], tol: Bounds) -> Compare:
        return Compare({k: tol(k) for k in values}, {k: w.wide for k in values})

    return processor_case(
        "selected_logprobs",
        w,
        lambda: selected_logprobs(**kwargs),
        context=lambda r: ctx_t,
        muts=muts,
        table=table,
        truth=truth,
        compare=compare,
        grad_keys=("logprobs", "entropy") if entropy else ("logprobs",),
    )


# ---------------------------------------------------------------- cross_entropy_loss


def _loss_mask(d: Draw, w: World) -> torch.Tensor | None:
    kind = d.pick(
        "loss_mask", ["none", "ones", "binary", "bool", "weights", "zeros"], [3, 1, 3, 1, 2, 1]
    )
    if kind == "none":
        return None
    if kind == "ones":
        return torch.ones(w.b, w.s)
    if kind == "zeros":
        return torch.zeros(w.b, w.s)
    if kind == "bool":
        return d.rand(w.b, w.s) < 0.6
    if kind == "binary":
        return (d.rand(w.b, w.s) < 0.6).float()
    return (2 * d.rand(w.b, w.s)).to(d.pick("mask_dtype", [F32, F64]))


def _counted(w: World, mask: torch.Tensor | None, labels: bool = True) -> torch.Tensor:
    m = torch.ones(w.b, w.s, dtype=F64) if mask is None else mask.double()
    if labels:
        m = m * (w.labels != w.ignore_index)
    return m


def cross_entropy_case(d: Draw) -> Case:
    w = draw_world(d)
    reduction = d.pick("reduction", ["none", "sum", "mean"])
    reduced = reduction != "none"
    source, t = _temperature(d, w) if reduced else ("none", 1.0)
    if not reduced and d.chance("processor_temperature", 0.3):
        source, t = "processor", d.pick("temperature", [0.5, 2.0, np.float64(0.8)])
    loss_mask = _loss_mask(d, w)
    gt = None
    if reduction == "mean" and d.chance("global_tokens", 0.4):
        gt = d.pick("global_tokens", [*GOOD_POSITIVE, 1000])
    table = ctx_mutations(
        w,
        name="cross_entropy_loss",
        needs_labels=True,
        reads_mask=reduced,
        reads_temperature=reduced,
    )
    factory = {
        "bad_reduction": ("reduction",),
        "bad_temperature": ("temperature",),
        "bad_tile_cols": ("tile_cols",),
        "bad_tile_rows": ("tile_rows",),
        "global_tokens_with": ("context.global_tokens",),
        "bad_z_loss": ("z_loss",),
        "bad_class_weights": ("class_weights",),
        "bad_label_smoothing": ("label_smoothing",),
    }
    if not reduced:
        factory["temperature_in_context"] = ("context.temperature",)
    if reduction == "mean":
        factory.pop("global_tokens_with")
        factory["bad_global_tokens"] = ("context.global_tokens",)
        factory["mean_under_cp"] = ("context.global_tokens",)
    muts = d.mutate({**{k: m.fields for k, m in table.items()}, **factory})
    if "context_temperature" in muts and source == "processor":  # two sources: either is named
        muts["context_temperature"] = ("context.temperature", "temperature")
    tiles = _tiles(d, w, muts)
    kwargs: dict[str, Any] = dict(reduction=reduction, **tiles)
    if source == "processor":
        kwargs["temperature"] = t
    if "bad_reduction" in muts:
        kwargs["reduction"] = d.pick("bad_reduction", ["avg", "None", None, "MEAN"])
    if "bad_temperature" in muts:
        kwargs["temperature"] = d.pick(
            "bad_temperature", [v for v in BAD_POSITIVE if v is not None]
        )
    z_loss = d.pick("z_loss", [0.0, 1e-4, 0.05, np.float32(0.01)], [3, 1, 1, 1])
    if z_loss:
        kwargs["z_loss"] = z_loss
    if "bad_z_loss" in muts:
        kwargs["z_loss"] = d.pick(
            "bad_z_loss", [-1e-3, float("nan"), float("inf"), "0.1", True, None]
        )
    cw: torch.Tensor | None = None
    if gt is None and d.chance("class_weights", 0.3):  # global_tokens with class weights is refused
        cw = (2 * d.rand(w.V)).to(d.pick("class_weights_dtype", [F32, F64]))
        kwargs["class_weights"] = cw
    if "bad_class_weights" in muts:
        kwargs["class_weights"] = d.pick(
            "bad_class_weights",
            [torch.ones(w.V, dtype=torch.long), torch.ones(2, w.V), [1.0] * w.V],
        )
    eps = d.pick("label_smoothing", [0.0, 0.1, 1.0, np.float32(0.3)], [3, 1, 1, 1])
    if eps:
        kwargs["label_smoothing"] = eps
    if "bad_label_smoothing" in muts:
        kwargs["label_smoothing"] = d.pick(
            "bad_label_smoothing", [-0.1, 1.5, float("nan"), "0.1", True, None]
        )
    more: dict[str, Any] = {}
    if gt is not None:
        more["global_tokens"] = gt
    if "global_tokens_with" in muts:
        more["global_tokens"] = 8
    if "bad_global_tokens" in muts:
        more["global_tokens"] = d.pick("bad_global_tokens", [*BAD_COUNT, torch.tensor(4.0)])
    if "temperature_in_context" in muts:
        more["temperature"] = 1.0
    ctx_obj = _context(source if source in ("context", "attr") else "none", t, **more)
    if source in ("context", "attr") and not more:
        ctx_obj = _context(source, t)
    cp = 2 if "mean_under_cp" in muts else 1
    if "mean_under_cp" in muts and ctx_obj is not None:
        (ctx_obj.pop if isinstance(ctx_obj, dict) else lambda *_: None)("global_tokens", None)
        if not isinstance(ctx_obj, dict) and hasattr(ctx_obj, "global_tokens"):
            del ctx_obj.global_tokens

    def extra(kw: dict[str, Any], r: int) -> None:
        kw["loss_mask"] = loss_mask
        if cp > 1:
            kw["parallel"] = ParallelLayout(
                tp_size=w.tp, tp_rank=r, cp_size=cp, sequence_parallel=w.sp
            )

    def truth(H: torch.Tensor, W: torch.Tensor) -> Any:
        inv = _inv(w, t)
        z = _logits(w, H, W, inv)
        _, lp, _ = token_stats64(z, w.labels, w.ignore_index)
        assert lp is not None
        zl = torch.where(
            w.labels == w.ignore_index, 0.0, float(z_loss) * torch.logsumexp(z, -1) ** 2
        )
        ignored = w.labels == w.ignore_index
        cwy = (
            1.0
            if cw is None
            else torch.where(ignored, 0.0, cw.double()[w.labels.clamp(0, w.V - 1)])
        )
        # label smoothing, as F.cross_entropy(weight=cw, label_smoothing=eps) has it
        c = torch.ones(w.V, dtype=F64) if cw is None else cw.double()
        smooth = torch.where(
            ignored, 0.0, (c * (torch.logsumexp(z, -1)[..., None] - z)).sum(-1) / w.V
        )
        ce = -(1 - float(eps)) * cwy * lp + float(eps) * smooth
        if not reduced:
            return {"loss": zl + ce}, z, inv
        m = _counted(w, loss_mask)

        def mean(v: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
            count = float(by.sum()) if gt is None else float(gt)
            return v if reduction == "sum" else (v / count if count != 0 else v * 0)

        weights, mw = mean(m, m * cwy), mean(m, m)
        loss = (torch.where(mw != 0, zl, 0.0) * mw).sum() + (
            torch.where(weights != 0, ce, 0.0) * weights
        ).sum()
        return {"loss": loss, "tokens": m.sum()}, z, inv

    def compare(values: dict[str, torch.Tensor], tol: Bounds) -> Compare:
        dtypes = {"loss": w.wide} if not reduced else {"loss": w.wide, "tokens": F32}
        tols = {k: tol(k) for k in values}
        if reduced:  # a count, documented fp32
            tols["tokens"] = 4 * float(torch.finfo(F32).eps) * (1 + values["tokens"].abs())
        return Compare(tols, dtypes)

    return processor_case(
        "cross_entropy_loss",
        w,
        lambda: cross_entropy_loss(**kwargs),
        context=lambda r: ctx_obj,
        muts=muts,
        table=table,
        truth=truth,
        compare=compare,
        grad_keys=("loss",),
        tensor_result=not reduced,
        extra_kwargs=extra,
    )


# ---------------------------------------------------------------- policy_loss


def _policy_config(d: Draw) -> PolicyLossConfig:
    kind = d.pick("policy", ["ppo", "grpo", "gspo", "custom"])
    fused = d.pick("fused", [True, False], [2, 1])
    if kind == "ppo":
        return PolicyLossConfig.ppo(clip_low=d.pick("clip_low", [0.1, 0.2, 0.3]), fused=fused)
    if kind == "grpo":
        return PolicyLossConfig.grpo(kl_coef=d.pick("kl_coef", [0.0, 0.04, 0.5]), fused=fused)
    if kind == "gspo":
        return PolicyLossConfig.gspo(
            clip_low=d.pick("clip_low", [3e-4, 0.05]), clip_high=d.pick("clip_high", [4e-4, 0.08])
        )
    return PolicyLossConfig(
        clip_low=d.pick("clip_low", [0.0, 0.2, 1.0, np.float32(0.25)]),
        clip_high=d.pick("clip_high", [None, 0.28, 2.0]),
        dual_clip=d.pick("dual_clip", [None, 3.0, 1.5]),
        ratio=d.pick("ratio", list(RatioLevel), [3, 1]),
        kl_coef=d.pick("kl_coef", [0.0, 0.1, 1]),
        kl_estimator=d.pick("kl_estimator", ["k1", "k2", "k3"]),
        entropy_coef=d.pick("entropy_coef", [0.0, 0.01, -0.02]),
        aggregation=d.pick(
            "aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
        ),
        log_ratio_clamp=d.pick("log_ratio_clamp", [None, 20.0, 0.5, 2]),
        fused=fused,
    )


def _segments(w: World, packed: list[int] | None) -> tuple[torch.Tensor, int]:
    """Each token's sequence ``[b, s]`` and the count: a row per sequence, or the
    packed boundaries (tokens past the last one form one more sequence)."""
    if packed is None:
        return torch.arange(w.b)[:, None].expand(w.b, w.s), w.b
    seg = torch.zeros(w.s, dtype=torch.long)
    for j in range(w.s):
        seg[j] = sum(1 for c in packed[1:] if c <= j)
    return seg[None, :], len(packed)


def _policy_values(
    w: World,
    z: torch.Tensor,
    cfg: PolicyLossConfig,
    batch: PolicyBatch,
    m: torch.Tensor,
    seg: torch.Tensor,
    count: int,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The policy loss and metrics (``policy_loss``'s docstring), float64, and the
    per-token margins of its branches (a clip, a dual clip or a clamp taken by less
    than 1e-4 is ambiguous under rounding)."""
    _, lp, ent = token_stats64(z, w.labels, w.ignore_index)
    assert lp is not None
    live = m > 0
    old, adv = batch.old_logprobs.double(), batch.advantages.double()
    C = cfg.log_ratio_clamp
    big = math.inf if C is None else C
    margins = [torch.full_like(m, math.inf)]
    diff = torch.where(live, lp - old, 0.0)
    if cfg.ratio == "token":
        raw = diff
    else:
        num = torch.zeros(count, dtype=F64).index_add(0, seg.reshape(-1), (diff * m).reshape(-1))
        den = torch.zeros(count, dtype=F64).index_add(0, seg.reshape(-1), m.reshape(-1))
        raw = (num / torch.where(den == 0, 1.0, den))[seg]
    margins.append((raw.abs() - big).abs())
    log_ratio = raw.clamp(-big, big)
    ratio = torch.exp(log_ratio)
    a = torch.where(live, adv, 0.0)
    lo, hi = 1 - cfg.clip_low, 1 + cfg.effective_clip_high
    margins += [(ratio - lo).abs(), (ratio - hi).abs()]
    pg1, pg2 = -a * ratio, -a * ratio.clamp(lo, hi)
    pg = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    values: dict[str, torch.Tensor] = {}
    dual = None
    if cfg.dual_clip is not None:
        pg3 = -a * cfg.dual_clip
        dual = (a < 0) & (pg > pg3)
        margins.append(
            torch.where(
                a < 0, (torch.maximum(ratio, ratio.clamp(lo, hi)) - cfg.dual_clip).abs(), math.inf
            )
        )
        pg = torch.where(a < 0, torch.minimum(pg, pg3), pg)
    total = pg
    kl = None
    if batch.ref_logprobs is not None:
        ref = torch.where(live, batch.ref_logprobs.double(), lp.detach())
        margins.append(((ref - lp).abs() - big).abs())
        kl = kl_estimate64(lp, ref, cfg.kl_estimator.value, C)
        if cfg.kl_coef != 0:
            total = total + cfg.kl_coef * kl
    if cfg.entropy_coef != 0:
        total = total - cfg.entropy_coef * ent
    weights = aggregation_weights64(
        m,
        seg,
        count,
        cfg.aggregation.value,
        global_tokens=batch.global_tokens,
        global_sequences=batch.global_sequences,
    )
    nz = weights != 0
    values["loss"] = (torch.where(nz, total, 0.0) * weights).sum()
    values["pg_loss"] = (torch.where(nz, pg, 0.0) * weights).sum()
    if kl is not None:
        values["kl"] = (torch.where(nz, kl, 0.0) * weights).sum()
    values["entropy"] = masked_mean64(ent, m)
    values["clip_fraction"] = masked_mean64(clipped.double(), m)
    # veRL's ppo_kl: the clamped token log ratio's negation (GSPO: the token's own, unclamped)
    values["ppo_kl"] = masked_mean64(-(log_ratio if cfg.ratio == "token" else diff), m)
    if dual is not None:
        values["dual_clip_fraction"] = masked_mean64(dual.double(), m)
    margins.append(((old - lp).abs() - big).abs())
    values["approx_kl"] = masked_mean64(kl_estimate64(lp, old, "k3", C), m)
    margin = torch.stack([torch.where(live, x, math.inf) for x in margins]).amin(0)
    return values, margin


def policy_case(d: Draw) -> Case:
    w = draw_world(d)
    cfg = _policy_config(d)
    source, t = _temperature(d, w)
    if source == "processor":
        source = "context"
    packed: list[int] | None = None
    if w.b == 1 and w.tp == 1 and w.s >= 2 and d.chance("packed", 0.4):
        cuts = sorted(d.rng.sample(range(1, w.s), d.rng.randint(0, min(2, w.s - 1))))
        end = w.s if d.rng.random() < 0.8 else w.s - 1
        packed = [0, *cuts, end]
        d.note("cu_seqlens", packed)
    loss_mask = _loss_mask(d, w)
    own_mask = None
    if d.chance("batch_mask", 0.4):
        own_mask = _loss_mask(d, w)
    m = _counted(w, own_mask if own_mask is not None else loss_mask)
    seg, count = _segments(w, packed)
    # the truth's logprobs place old_logprobs near them (ratios near 1, both clip sides)
    with torch.no_grad():
        z0 = _logits(w, w.hidden.double(), w.weight.double(), _inv(w, t))
        _, lp0, _ = token_stats64(z0, w.labels, w.ignore_index)
    assert lp0 is not None
    sigma = d.pick("old_noise", [0.05, 0.3, 1.0])
    adv = d.randn(w.b, w.s, dtype=F32)
    ref = None
    if cfg.kl_coef != 0 or d.chance("ref_logprobs", 0.3):
        ref = (lp0 + 0.3 * d.randn(w.b, w.s, dtype=F64)).to(F32)
    cp = 1
    gt = gs = None
    if cfg.aggregation == "token-mean" and d.chance("global_tokens", 0.3):
        gt = d.pick("global_tokens", [*GOOD_POSITIVE, 50])
    if cfg.aggregation != "token-mean" and d.chance("global_sequences", 0.3):
        gs = d.pick("global_sequences", [*GOOD_POSITIVE, 7])
    if packed is None and cfg.ratio == "token" and d.chance("cp_share", 0.15):
        if cfg.aggregation == "token-mean":
            gt, cp = gt or 20, 2
        elif cfg.aggregation == "seq-mean-token-sum":
            gs, cp = gs or 5, 2
        if cp > 1:
            d.note("cp_size", cp)
    old = None
    margin = torch.zeros(())
    for _ in range(40):  # rounding must not decide a branch: redraw near-boundary cases
        old = (lp0 + sigma * d.randn(w.b, w.s, dtype=F64)).to(F32)
        batch = PolicyBatch(
            old_logprobs=old, advantages=adv, mask=own_mask, ref_logprobs=ref, temperature=None
        )
        _, margin = _policy_values(w, z0, cfg, batch, m, seg, count)
        if float(margin.min()) > 1e-3:
            break
    ambiguous = float(margin.min()) <= 1e-3
    if ambiguous:
        d.note("ambiguous", True)
    assert old is not None
    temperature = t if source in ("context", "attr") else None

    table = ctx_mutations(
        w,
        name="policy_loss",
        needs_labels=True,
        reads_mask=own_mask is None,
        reads_temperature=False,
    )
    batch_muts: dict[str, tuple[str, ...]] = {
        "context_mapping": ("context",),
        "old_shape": ("context.old_logprobs",),
        "old_int": ("context.old_logprobs",),
        "adv_shape": ("context.advantages",),
        "adv_list": ("context.advantages",),
        "mask_shape": ("context.mask",),
        "mask_list": ("context.mask",),
        "bad_batch_temperature": ("context.temperature",),
        "bad_global_count": ("context.global_tokens", "context.global_sequences"),
        "unused_global_count": ("context.global_tokens", "context.global_sequences"),
        "bad_config": ("config",),
        "bad_tile_rows": ("tile_rows",),
        "bad_tile_cols": ("tile_cols",),
        "cp_without_sum": ("collectives",),
    }
    counted = [(i, j) for i in range(w.b) for j in range(w.s) if m[i, j] > 0]
    if w.check_values and counted:
        batch_muts["old_nan_counted"] = ("context.old_logprobs",)
        batch_muts["adv_inf_counted"] = ("context.advantages",)
        if ref is not None:
            batch_muts["ref_nan_counted"] = ("context.ref_logprobs",)
    if w.check_values:
        batch_muts["mask_negative"] = ("context.mask",)
    if cfg.kl_coef != 0:
        batch_muts["ref_missing"] = ("context.ref_logprobs",)
    if packed is not None:
        batch_muts["packed_not_tensor"] = ("packed_seq_params",)
    elif w.b > 1:
        batch_muts["packed_with_batch"] = ("packed_seq_params",)
    muts = d.mutate({**{k: mm.fields for k, mm in table.items()}, **batch_muts})
    tiles = _tiles(d, w, muts)
    fields: dict[str, Any] = dict(
        old_logprobs=old,
        advantages=adv,
        mask=own_mask,
        ref_logprobs=ref,
        temperature=temperature,
        global_tokens=gt,
        global_sequences=gs,
    )
    if counted:
        ci, cj = counted[d.rng.randrange(len(counted))]
    for key in muts:
        if key == "old_shape":
            fields["old_logprobs"] = torch.zeros(w.b, w.s + 1)
        elif key == "old_int":
            fields["old_logprobs"] = old.long()
        elif key == "adv_shape":
            fields["advantages"] = torch.zeros(w.s, w.b + 1)
        elif key == "adv_list":
            fields["advantages"] = adv.tolist()
        elif key == "mask_shape":
            fields["mask"] = torch.ones(w.b + 1, w.s)
        elif key == "mask_list":
            fields["mask"] = [[1.0] * w.s] * w.b
        elif key == "mask_negative":
            bad = torch.ones(w.b, w.s)
            bad[0, 0] = d.pick("bad_mask", [-1.0, float("nan"), float("-inf")])
            fields["mask"] = bad
        elif key == "bad_batch_temperature":
            fields["temperature"] = d.pick("bad_temperature", [-1.0, 0.0, float("nan"), "2", True])
        elif key == "bad_global_count":
            name = "global_tokens" if cfg.aggregation == "token-mean" else "global_sequences"
            fields[name] = d.pick("bad_count", [*BAD_COUNT, torch.tensor(3.0)])
        elif key == "unused_global_count":
            name = "global_sequences" if cfg.aggregation == "token-mean" else "global_tokens"
            fields[name] = 4
        elif key == "old_nan_counted":
            bad_old = old.clone()
            bad_old[ci, cj] = float("nan")
            fields["old_logprobs"] = bad_old
        elif key == "adv_inf_counted":
            bad_adv = adv.clone()
            bad_adv[ci, cj] = float("inf")
            fields["advantages"] = bad_adv
        elif key == "ref_nan_counted":
            assert ref is not None
            bad_ref = ref.clone()
            bad_ref[ci, cj] = float("nan")
            fields["ref_logprobs"] = bad_ref
        elif key == "ref_missing":
            fields["ref_logprobs"] = None
    batch = PolicyBatch(**fields)
    ctx_obj: Any = dict(fields) if "context_mapping" in muts else batch
    cp_size = 2 if "cp_without_sum" in muts else cp
    if "cp_without_sum" in muts:
        # a loss that needs every rank's part of a sequence, with one-rank collectives
        cfg = (
            PolicyLossConfig.gspo()
            if d.rng.random() < 0.5
            else PolicyLossConfig(aggregation="seq-mean-token-mean")
        )
        if isinstance(ctx_obj, PolicyBatch):
            ctx_obj = PolicyBatch(**{**fields, "global_tokens": None, "global_sequences": None})
    psp = None
    if packed is not None:
        psp = types.SimpleNamespace(cu_seqlens_q=torch.tensor(packed, dtype=torch.int32))
        if "packed_not_tensor" in muts:
            psp = types.SimpleNamespace(cu_seqlens_q=list(packed))
    if "packed_with_batch" in muts:
        psp = types.SimpleNamespace(cu_seqlens_q=torch.tensor([0, w.s], dtype=torch.int32))
    config: Any = "ppo" if "bad_config" in muts else cfg

    def extra(kw: dict[str, Any], r: int) -> None:
        kw["loss_mask"] = loss_mask
        kw["packed_seq_params"] = psp
        if cp_size > 1:
            kw["parallel"] = ParallelLayout(
                tp_size=w.tp, tp_rank=r, cp_size=cp_size, sequence_parallel=w.sp
            )

    def truth(H: torch.Tensor, W: torch.Tensor) -> Any:
        inv = _inv(w, temperature if temperature is not None else 1.0)
        z = _logits(w, H, W, inv)
        values, _ = _policy_values(w, z, cfg, batch, m, seg, count)
        return values, z, inv

    def compare(values: dict[str, torch.Tensor], tol: Bounds) -> Compare:
        tols: dict[str, Any] = {k: tol(k) for k in values}
        if ambiguous:
            for k in ("clip_fraction", "dual_clip_fraction"):
                if k in tols:
                    tols[k] = torch.tensor(1.0)
        return Compare(tols, {k: w.wide for k in values})

    return processor_case(
        "policy_loss",
        w,
        lambda: policy_loss(config, **tiles),
        context=lambda r: ctx_obj,
        muts=muts,
        table=table,
        truth=truth,
        compare=compare,
        grad_keys=() if ambiguous else ("loss",),
        extra_kwargs=extra,
    )


# ---------------------------------------------------------------- topk_logprobs


def topk_case(d: Draw) -> Case:
    w = draw_world(d)
    with_labels = not d.chance("no_labels", 0.3)
    k = d.int("k", 1, w.V)
    source, t = _temperature(d, w)
    entropy = d.chance("entropy", 0.4)
    table = ctx_mutations(
        w,
        name="topk_logprobs",
        needs_labels=False,
        reads_mask=False,
        reads_temperature=True,
        collective_methods=(
            "all_reduce_sum",
            "all_reduce_max",
            "gather_hidden_states",
            "all_gather",
        ),
    )
    if not with_labels:
        for key in [key for key in table if key.startswith("labels")]:
            del table[key]
    factory = {
        "bad_k": ("k",),
        "k_beyond_vocab": ("k",),
        "bad_temperature": ("temperature",),
        "bad_entropy": ("entropy",),
        "bad_tile_rows": ("tile_rows",),
    }
    muts = d.mutate({**{key: m.fields for key, m in table.items()}, **factory})
    if "context_temperature" in muts and source == "processor":  # two sources: either is named
        muts["context_temperature"] = ("context.temperature", "temperature")
    tiles = _tiles(d, w, muts)
    kk: Any = k
    if "bad_k" in muts:
        kk = d.pick("bad_k", [0, -1, True, 2.0, "3", None, 2**70])
    if "k_beyond_vocab" in muts:
        kk = w.V + d.int("k_excess", 1, 3)
    kwargs: dict[str, Any] = dict(entropy=entropy, **tiles)
    if source == "processor":
        kwargs["temperature"] = t
    if "bad_temperature" in muts:
        kwargs["temperature"] = d.pick(
            "bad_temperature", [v for v in BAD_POSITIVE if v is not None]
        )
    if "bad_entropy" in muts:
        kwargs["entropy"] = d.pick("bad_entropy", ["no", 0, None])
    ctx_t = _context(source, t) if source in ("context", "attr") else None
    seen: dict[str, torch.Tensor] = {}

    def extra(kw: dict[str, Any], r: int) -> None:
        if not with_labels:
            kw["labels"] = None

    def truth(H: torch.Tensor, W: torch.Tensor) -> Any:
        inv = _inv(w, t)
        z = _logits(w, H, W, inv)
        logp, lp, ent = token_stats64(z, w.labels if with_labels else None, w.ignore_index)
        seen["logp"] = logp.detach()
        ids = seen.get("ids")
        values: dict[str, torch.Tensor] = {
            # the truth at the ids the implementation chose (checked below to be a top-k)
            "topk_logprobs": logp.gather(-1, ids) if ids is not None else logp[..., :k],
            "topk_ids": ids if ids is not None else torch.zeros(w.b, w.s, k, dtype=torch.long),
        }
        if with_labels:
            assert lp is not None
            values["logprobs"] = lp
        if entropy:
            values["entropy"] = ent
        return values, z, inv

    def topk_rules(result: dict[str, Any]) -> list[str]:
        return check_topk(seen["logp"], result["topk_logprobs"], result["topk_ids"], k, w)

    def compare(values: dict[str, torch.Tensor], tol: Bounds) -> Compare:
        tols: dict[str, Any] = {
            key: tol(key) for key in values if key not in ("topk_ids", "topk_logprobs")
        }
        tols["topk_logprobs"] = 8 * tol.prec.zmax + 64 * tol.prec.acc * (
            1 + values["topk_logprobs"].abs()
        )
        tols["topk_ids"] = None
        dtypes = {key: w.wide for key in values}
        dtypes["topk_ids"] = torch.long
        return Compare(tols, dtypes, extra=topk_rules)

    case = processor_case(
        "topk_logprobs",
        w,
        lambda: topk_logprobs(kk, **kwargs),
        context=lambda r: ctx_t,
        muts=muts,
        table=table,
        truth=truth,
        compare=compare,
        grad_keys=("topk_logprobs", "logprobs", "entropy")
        if with_labels
        else ("topk_logprobs", "entropy"),
        extra_kwargs=extra,
        cot_shapes={"topk_logprobs": (w.b, w.s, k)},
    )
    if not muts:
        check = case.check

        def observed(outs: list[Any]) -> list[str]:
            first = outs[0][0]
            if isinstance(first, dict) and isinstance(first.get("topk_ids"), torch.Tensor):
                ids = first["topk_ids"]
                if (
                    tuple(ids.shape) == (w.b, w.s, k)
                    and ids.dtype == torch.long
                    and bool(((ids >= 0) & (ids < w.V)).all())
                ):
                    seen["ids"] = ids.cpu().clone()  # a normal tensor even from inference mode
                else:
                    return [
                        f"topk_ids: shape {list(ids.shape)} dtype {ids.dtype}, "
                        f"ids in [{int(ids.min())}, {int(ids.max())}]"
                    ]
            return check(outs)

        case.check = observed
    return case


def check_topk(logp: torch.Tensor, values: Any, ids: Any, k: int, w: World) -> list[str]:
    """The contract's top-k: ``k`` distinct ids whose true logprobs are the ``k``
    largest (up to rounding), values descending, and among exactly equal true values
    the smaller id first."""
    if not isinstance(ids, torch.Tensor) or not isinstance(values, torch.Tensor):
        return ["topk: not tensors"]
    problems = []
    srt = torch.sort(ids, -1).values
    if k > 1 and bool((srt[..., 1:] == srt[..., :-1]).any()):
        problems.append("topk_ids: an id twice in a row")
    if k > 1 and bool((values[..., 1:] > values[..., :-1]).any()):
        problems.append("topk_logprobs: not descending")
    best = torch.sort(logp, -1, descending=True).values[..., :k]
    chosen = torch.sort(logp.gather(-1, ids), -1, descending=True).values
    slack = 8 * float(w.precision(1.0).zmax) * 4 + 1e-5 * (1 + float(best.abs().max()))
    if bool(((best - chosen).abs() > slack).any()):
        i = int(((best - chosen).abs()).flatten().argmax())
        problems.append(
            f"topk_ids: not the top {k}: true logprob {chosen.flatten()[i]:.6g} where the {k} best "
            f"has {best.flatten()[i]:.6g}"
        )
    if not w.exact:
        return problems
    # exact logits (small integers): equal true logprobs are equal computed ones, and the
    # contract's order holds: among equal values the smaller id first, the smaller ids
    # chosen at the k-th value
    picked = logp.gather(-1, ids)
    for idx in np.ndindex(*ids.shape[:-1]):
        row_ids, row_lp, full = ids[idx].tolist(), picked[idx].tolist(), logp[idx]
        for j in range(k - 1):
            if row_lp[j] == row_lp[j + 1] and row_ids[j] > row_ids[j + 1]:
                problems.append(
                    f"topk_ids: tied ids {row_ids[j]}, {row_ids[j + 1]} out of order at token {idx}"
                )
        tied = [v for v in range(full.shape[0]) if float(full[v]) == row_lp[-1]]
        take = [v for v in row_ids if v in tied]
        if take != sorted(tied)[: len(take)]:
            problems.append(
                f"topk_ids: among ids {tied} tied at the k-th value took {take}, not the smallest"
            )
    return problems


# ---------------------------------------------------------------- distillation_loss


def _teacher_distribution(d: Draw, w: World) -> torch.Tensor:
    """A teacher's logprobs ``[b, s, V]`` (float64)."""
    zt = d.randn(w.b, w.s, w.V, dtype=F64, scale=d.pick("teacher_sigma", [0.5, 2.0, 6.0]))
    return torch.log_softmax(zt, -1)


def distill_case(d: Draw) -> Case:
    w = draw_world(d)
    sparse = d.pick("teacher", ["sparse", "dense"]) == "sparse"
    with_labels = not d.chance("no_labels", 0.3)
    divergence = d.pick("divergence", ["forward-kl", "reverse-kl", "jsd"])
    tail = d.pick("tail", ["renormalize", "bucket"])
    beta = d.pick("beta", [0.5, 0.1, 0.9, np.float32(0.25)])
    # a power of two keeps an exact world's ties exact (the hidden rows are scaled by 1 / T)
    temperature = d.pick(
        "temperature", [1.0, 0.5, 2.0] if w.exact else [1.0, 0.5, 2.0, Fraction(3, 2)]
    )
    aggregation = d.pick("aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
    compute = d.pick("compute_dtype", [None, F32, F64], [6, 1, 1])
    tile_rows = d.int("tile_rows", 1, 3) if d.chance("tile", 0.3) else None
    loss_mask = _loss_mask(d, w)
    own_mask = _loss_mask(d, w) if d.chance("teacher_mask", 0.3) else None
    m = _counted(w, own_mask if own_mask is not None else loss_mask, labels=with_labels)
    gt = gs = None
    if aggregation == "token-mean" and d.chance("global_tokens", 0.3):
        gt = d.pick("global_tokens", [*GOOD_POSITIVE, 50])
    if aggregation != "token-mean" and d.chance("global_sequences", 0.3):
        gs = d.pick("global_sequences", GOOD_POSITIVE)
    cp = 1
    if aggregation != "seq-mean-token-mean" and d.chance("cp_share", 0.1):
        cp = 2
        if aggregation == "token-mean":
            gt = gt or 20
        else:
            gs = gs or 3
        d.note("cp_size", cp)
    counted = [(i, j) for i in range(w.b) for j in range(w.s) if m[i, j] > 0]
    # the teacher
    ids = lp_t = t_hidden = t_weight = None
    t_scale = 1.0
    if sparse:
        k = d.int("k", 1, w.V)
        full = _teacher_distribution(d, w)
        order = torch.sort(full, dim=-1, descending=True, stable=True).indices[..., :k]
        ids = order
        lp_dtype = d.pick("teacher_dtype", [F32, F64, torch.bfloat16], [4, 1, 1])
        lp_t = full.gather(-1, order).to(lp_dtype)
        residue = 1 - lp_t.double().exp().sum(-1)
        if lp_dtype == F64 and bool(((residue.abs() < 1e-9) & (residue != 0)).any()):
            # a float64 teacher's tail below float64's resolution of a sum of k terms: the
            # bucket's log of it is rounding noise in any evaluation; take fp32 logprobs,
            # whose tail (their rounding residue) float64 resolves
            lp_t = lp_t.float()
            d.note("teacher_dtype", F32)
        if k >= 2 and divergence != "reverse-kl" and d.chance("teacher_zero_ids", 0.3):
            # ids of probability 0 (-inf: a teacher that masks them), never the first;
            # reverse KL is +inf there (hookspec.conventions), tested by value elsewhere
            zero = d.rand(w.b, w.s, k) < 0.4
            zero[..., 0] = False
            lp_t = lp_t.masked_fill(zero, -math.inf)
    else:
        ht = d.int("h_teacher", 1, 5)
        t_hidden = d.randn(
            w.s, w.b, ht, dtype=d.pick("teacher_dtype", [F32, F64, torch.bfloat16], [4, 1, 1])
        )
        t_weight = d.randn(w.V, ht, dtype=t_hidden.dtype, scale=d.pick("teacher_sigma", [0.5, 1.5]))
        t_scale = d.pick("teacher_logit_scale", [1.0, 0.5, np.float64(2.0)])
    table = ctx_mutations(
        w,
        name="distillation_loss",
        needs_labels=False,
        reads_mask=own_mask is None,
        reads_temperature=False,
    )
    if not with_labels:
        for key in [key for key in table if key.startswith("labels")]:
            del table[key]
    own: dict[str, tuple[str, ...]] = {
        "context_mapping": ("context",),
        "bad_config": ("config",),
        "bad_beta": ("beta",),
        "bad_temperature": ("temperature",),
        "bad_tail": ("tail",),
        "bad_divergence": ("divergence",),
        "bad_aggregation": ("aggregation",),
        "bad_tile_rows": ("tile_rows",),
        "bad_compute_dtype": ("compute_dtype",),
        "bad_global_count": ("context.global_tokens", "context.global_sequences"),
        "unused_global_count": ("context.global_tokens", "context.global_sequences"),
        "teacher_mask_shape": ("context.mask",),
    }
    if w.check_values:
        own["teacher_mask_negative"] = ("context.mask",)
    if cp == 1:
        # a global_tokens drawn for token-mean is then an unused count: either refusal is right
        own["cp_seq_mean_token_mean"] = ("parallel.cp_size",) + (
            ("context.global_tokens",) if gt else ()
        )
    if sparse:
        assert ids is not None and lp_t is not None
        own.update(
            ids_float=("context.ids",),
            ids_2d=("context.ids",),
            ids_empty=("context.ids",),
            logprobs_shape=("context.logprobs",),
            logprobs_int=("context.logprobs",),
            teacher_meta=("context.ids", "context.logprobs"),
        )
        if w.check_values and counted:
            own.update(
                ids_out_of_range=("context.ids",),
                logprobs_positive=("context.logprobs",),
                logprobs_nan=("context.logprobs",),
                logprobs_mass=("context.logprobs",),
            )
            if ids.shape[-1] >= 2:
                own.update(
                    ids_duplicate=("context.ids",),
                    logprobs_not_first=("context.logprobs", "context.ids"),
                )
    else:
        own.update(
            teacher_hidden_shape=("context.hidden_states",),
            teacher_hidden_int=("context.hidden_states",),
            teacher_weight_rows=("context.weight",),
            teacher_logit_scale=("context.logit_scale",),
            teacher_vocab_other=("context.vocab",),
            teacher_meta=("context.hidden_states", "context.weight"),
        )
        if w.tp > 1:
            own["teacher_vocab_missing"] = ("context.vocab",)
    muts = d.mutate({**{key: mm.fields for key, mm in table.items()}, **own})
    cfg_kwargs: dict[str, Any] = dict(
        divergence=divergence,
        beta=beta,
        tail=tail,
        temperature=temperature,
        aggregation=aggregation,
    )
    for key, bad in (
        ("bad_beta", [0.0, 1.0, -0.5, float("nan"), "0.5"]),
        ("bad_temperature", [0.0, -1.0, float("inf"), None, "1"]),
        ("bad_tail", ["drop", None, 1]),
        ("bad_divergence", ["kl", None]),
        ("bad_aggregation", ["mean", None]),
    ):
        if key in muts:
            cfg_kwargs[key.removeprefix("bad_")] = d.pick(key, bad)
    ci = cj = 0
    if counted:
        ci, cj = counted[d.rng.randrange(len(counted))]
    fields: dict[str, Any] = dict(mask=own_mask, global_tokens=gt, global_sequences=gs)
    if "bad_global_count" in muts:
        fields["global_tokens" if aggregation == "token-mean" else "global_sequences"] = d.pick(
            "bad_count", BAD_COUNT
        )
    if "unused_global_count" in muts:
        fields["global_sequences" if aggregation == "token-mean" else "global_tokens"] = 5
    if "teacher_mask_shape" in muts:
        fields["mask"] = torch.ones(w.b, w.s + 2)
    if "teacher_mask_negative" in muts:
        bad_mask = torch.ones(w.b, w.s)
        bad_mask[0, 0] = d.pick("bad_mask", [-0.5, float("nan")])
        fields["mask"] = bad_mask
    if sparse:
        assert ids is not None and lp_t is not None
        s_ids, s_lp = ids.clone(), lp_t.clone()
        if "ids_float" in muts:
            s_ids = s_ids.double()
        if "ids_2d" in muts:
            s_ids = s_ids[..., 0]
        if "ids_empty" in muts:
            s_ids, s_lp = s_ids[..., :0], s_lp[..., :0]
        if "logprobs_shape" in muts:
            s_lp = torch.cat([s_lp, s_lp[..., :1]], -1)
        if "logprobs_int" in muts:
            s_lp = s_lp.long()
        kk = s_lp.shape[-1] if s_ids.dim() == 3 and s_ids.shape[-1] == s_lp.shape[-1] else 0
        if "ids_out_of_range" in muts and kk:
            s_ids[ci, cj, d.rng.randrange(kk)] = d.pick("bad_id", [w.V, -1, w.V + 7])
        if "ids_duplicate" in muts and kk:
            s_ids[ci, cj, 1] = s_ids[ci, cj, 0]
        if "logprobs_positive" in muts and kk:
            s_lp[ci, cj, 0] = 0.5
        if "logprobs_nan" in muts and kk:  # -inf is probability 0: refused as the first only
            bad_lp = d.pick("bad_lp", [float("nan"), float("inf"), float("-inf")])
            s_lp[ci, cj, 0 if bad_lp == -math.inf else d.rng.randrange(kk)] = bad_lp
        if "teacher_meta" in muts:
            s_lp = s_lp.to("meta") if d.chance("meta_logprobs", 0.5) else s_lp
            s_ids = s_ids.to("meta") if s_lp.device.type != "meta" else s_ids
        if "logprobs_mass" in muts and kk:
            s_lp[ci, cj] = math.log(1.5 / kk) if kk > 1 else 0.3
        if "logprobs_not_first" in muts and kk:
            first, second = float(s_lp[ci, cj, 0]), float(s_lp[ci, cj, 1])
            s_lp[ci, cj, 0], s_lp[ci, cj, 1] = second - 0.5, first
        teacher_of = lambda r: SparseTeacher(ids=s_ids, logprobs=s_lp, **fields)  # noqa: E731
    else:
        assert t_hidden is not None and t_weight is not None

        def teacher_of(r: int) -> Any:
            th = t_hidden
            if w.sp:
                rows = w.s // w.tp
                th = t_hidden[r * rows : (r + 1) * rows]
            tw = t_weight[r * w.vl : (r + 1) * w.vl]
            vocab: Any = w.shard(r) if (w.tp > 1 or d.rng.random() < 0.5) else None
            scale: Any = t_scale
            if "teacher_hidden_shape" in muts:
                th = th[:, :, None]
            if "teacher_hidden_int" in muts:
                th = th.long()
            if "teacher_meta" in muts:
                th, tw = th.to("meta"), tw.to("meta")
            if "teacher_weight_rows" in muts:
                tw = torch.cat([tw, tw[:1]])
            if "teacher_logit_scale" in muts:
                scale = bad_scale
            if "teacher_vocab_missing" in muts:
                vocab = None
            if "teacher_vocab_other" in muts:
                vocab = (
                    VocabShard(start=0, end=w.vl, size=w.V + 1)
                    if w.tp == 1
                    else w.shard((r + 1) % w.tp)
                )
            return DenseTeacher(
                hidden_states=th, weight=tw, vocab=vocab, logit_scale=scale, **fields
            )

    bad_scale = (
        d.pick("bad_teacher_scale", [0.0, -2.0, float("nan"), "1", True])
        if "teacher_logit_scale" in muts
        else None
    )
    kwargs: dict[str, Any] = dict(tile_rows=tile_rows, compute_dtype=compute)
    if "bad_tile_rows" in muts:
        kwargs["tile_rows"] = d.pick("bad_tile_rows", BAD_CHUNK)
    if "bad_compute_dtype" in muts:
        kwargs["compute_dtype"] = d.pick(
            "bad_compute_dtype", [torch.int64, "float32", torch.complex64]
        )
    cp_size = 2 if "cp_seq_mean_token_mean" in muts else cp
    if "cp_seq_mean_token_mean" in muts:
        cfg_kwargs["aggregation"] = "seq-mean-token-mean"

    # a valid draw may go through the tensor function instead, called as an adopter
    # would from the hook (one sequence per batch row: no context parallel, no MuP scale)
    by_rows = not muts and cp == 1 and w.scale_kind == "none" and d.chance("tensor_door", 0.3)

    def make() -> Any:
        if "bad_config" in muts:
            return distillation_loss({"divergence": divergence}, **kwargs)  # type: ignore[arg-type]
        if by_rows:
            return distillation_by_rows(DistillConfig(**cfg_kwargs), **kwargs)
        return distillation_loss(DistillConfig(**cfg_kwargs), **kwargs)

    def extra(kw: dict[str, Any], r: int) -> None:
        kw["loss_mask"] = loss_mask
        if not with_labels:
            kw["labels"] = None
        if cp_size > 1:
            kw["parallel"] = ParallelLayout(
                tp_size=w.tp, tp_rank=r, cp_size=cp_size, sequence_parallel=w.sp
            )

    def context(r: int) -> Any:
        teacher = teacher_of(r)
        if "context_mapping" in muts:
            return {"ids": ids, "logprobs": lp_t} if sparse else {"hidden_states": t_hidden}
        return teacher

    seg = torch.arange(w.b)[:, None].expand(w.b, w.s)
    ambiguous: dict[str, float] = {}

    def truth(H: torch.Tensor, W: torch.Tensor) -> Any:
        inv = w.scale / float(temperature)
        z = _logits(w, H, W, inv)
        lse = torch.logsumexp(z, -1)
        acc = w.precision(inv, compute).acc
        if sparse:
            assert ids is not None and lp_t is not None
            lp64 = lp_t.detach().double().clone().requires_grad_()
            # the given logprobs are exact: the tails can be formed from them in float64
            # (1 - sum(exp(lp)) cancels in fp32), so they carry float64's rounding only
            # a -inf (probability 0) is exact: no error bound, its NaN gradient unread
            finite = torch.isfinite(lp64.detach())
            extras = [
                (
                    lp64,
                    torch.where(finite, 4 * unit(F64) * (ids.shape[-1] + lp64.detach().abs()), 0.0),
                )
            ]
            log_p, log_q, _, _ = sparse_sets64(lp64, z, ids, tail)
            top_t = ids[..., 0]
        else:
            assert t_hidden is not None and t_weight is not None
            th64, tw64 = t_hidden.double(), t_weight.double()
            t_inv = float(t_scale) / float(temperature)
            zt = (torch.einsum("sbh,vh->bsv", th64, tw64) * t_inv).requires_grad_()
            t_prec = Precision.of(
                th64.abs().transpose(0, 1),
                tw64.abs(),
                t_inv,
                compute=compute or (F64 if w.wide == F64 else F32),
                acc=F64 if acc < 1e-10 else F32,
            )
            extras = [(zt, t_prec.zerr[..., None] + 64 * acc * (1 + zt.detach().abs()))]
            log_p, log_q = torch.log_softmax(zt, -1), z - lse[..., None]
            top_t = zt.detach().argmax(-1)
        dv = divergence64(log_p, log_q, divergence, float(beta))
        kl = divergence64(log_p, log_q, "forward-kl", 0.5)
        weights = aggregation_weights64(
            m, seg, w.b, aggregation, global_tokens=gt, global_sequences=gs
        )
        loss = (torch.where(weights != 0, dv, 0.0) * weights).sum()
        top_s = z.detach().argmax(-1)
        # a student argmax decided by rounding is ambiguous
        two = torch.topk(z.detach(), min(2, w.V), -1).values
        gap = (two[..., 0] - two[..., -1]) if w.V > 1 else torch.full_like(lse, math.inf)
        zerr = w.precision(inv, compute).zerr
        # an exact float64 tie (tied weight rows) is one only where the world is exact: elsewhere
        # the GEMM may round the two columns apart (seed 33, case 11064)
        near = (gap <= 8 * zerr + 1e-6) & ((gap > 0) | (not w.exact)) & (m > 0)
        ambiguous["agree"] = float((m * near).sum() / m.sum()) if float(m.sum()) > 0 else 0.0
        values = {
            "loss": loss,
            "kl": masked_mean64(kl, m),
            "top1_agreement": masked_mean64((top_s == top_t).double(), m),
        }
        return values, z, inv, extras

    def compare(values: dict[str, torch.Tensor], tol: Bounds) -> Compare:
        tols = {key: tol(key) for key in values}
        tols["top1_agreement"] = tols["top1_agreement"] + ambiguous["agree"]
        acc_dtype = F64 if (compute if compute is not None else w.wide) == F64 else F32
        return Compare(tols, {key: acc_dtype for key in values})

    return processor_case(
        "linear_distillation_loss" if by_rows else "distillation_loss",
        w,
        make,
        context=context,
        muts=muts,
        table=table,
        truth=truth,
        compare=compare,
        grad_keys=("loss",),
        compute=compute,
        extra_kwargs=extra,
    )


PROCESSOR_ENTRIES = {
    "selected_logprobs": (selected_case, 8),
    "cross_entropy_loss": (cross_entropy_case, 8),
    "policy_loss": (policy_case, 10),
    "topk_logprobs": (topk_case, 7),
    "distillation_loss": (distill_case, 9),
}
