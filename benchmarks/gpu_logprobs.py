"""Selected-token logprobs (+ entropy) and the fused GRPO loss, forward + backward, on a
GPU: every method of :mod:`benchmarks.gpu_methods` at each size, one process per size,
inside a time budget, each result appended to a JSON-lines file as soon as it is measured.

    python -m benchmarks.gpu_logprobs --out DIR               # on CUDA: every size, every method
    python -m benchmarks.gpu_logprobs --quick --device cpu    # a tiny smoke run on a CPU

Per method: ``--warmup`` warm-ups (1: Triton's compilation and autotuning are
excluded), then ``--runs`` (3) timed forward + backward passes with CUDA events, the
median kept; then one profiled call (:mod:`benchmarks.gpu_profile`: the GPU's busy
fraction, kernels and launches per call). The peak extra memory is the growth of
``max_memory_allocated`` over what the inputs hold; ``dh`` and ``dW`` are compared, on
a subset of rows and of vocabulary entries, with a float64 reference of the same
objective (see :func:`reference`; a sampling-replay family's over its kept set,
:func:`replay_mask`), and so are the per-token logprobs (and the entropy) a method
returns (``lp_rel_err``, ``ent_rel_err``). Cotangents are ones (``(x * ones).sum()``,
contiguous, which veRL's backward asks for).

Each size names its logits distribution (:func:`make_inputs`): ``flat`` (random
weights, entropy near ``log V``) or ``peaked`` (a language model's: a mean entropy of
``PEAKED_ENTROPY`` nats, labels drawn from the softmax), recorded in each row; the
peaked one runs the methods whose speed may depend on it and the sampling-replay methods
(``PEERS_ON_PEAKED``; ``REPLAY_ON_PEAKED``: there the labels are drawn from the model's
distribution, as a rollout's are, so most of them lie in the sampler's kept set; on flat
logits a top-k bound of 50 would leave nearly every uniform label outside it). A size
may drop methods (``skip``): naive's ``[n, V]`` fp32 logits at 32768 rows, the replay
methods at every size but the peaked one.

The sizes run in the order the targets need them (the targets' size first); a size whose
process runs out of the budget gets a row "not reached" for each method it did not
finish, so ``DIR/gpu_logprobs.jsonl`` always names every (size, method).
``python -m benchmarks.gpu_results DIR`` turns it into the tables of
``docs/gpu-results.md``. ``scripts/gpu_bench.sh`` (and ``scripts/gpu_tests.sh``)
run this on a GPU machine without a package index.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ._harness import ROOT
from .gpu_methods import METHODS, REPLAY, REPLAY_METHODS, NotAvailable, kept_ids, objective
from .gpu_profile import profile_call

__all__ = [
    "PEAKED_ENTROPY",
    "PEERS_ON_PEAKED",
    "QUICK_SIZES",
    "REPLAY_ON_PEAKED",
    "RESULTS",
    "SIZES",
    "TARGET_SIZE",
    "device_class_here",
    "main",
    "make_inputs",
    "methods_at",
    "parameter_mask",
    "reference",
    "reference_stats",
    "replay_mask",
    "run_size",
    "size_of",
]

REPLAY_ON_PEAKED = ["ours-ce-torch", *REPLAY_METHODS]
"""Sampling replay and its torch baseline (``ours-ce-triton`` runs there already), last at
the peaked size and on the peaked logits only (see the module docstring)."""
PEERS_ON_PEAKED = [
    "floor3",
    "floor4",
    "ours-triton",
    "ours-ce-triton",
    "ours-ce-mean-triton",
    "verl-triton",
    "liger",
    "liger-mean",
    "cce",
    "cce-exact",
    "cce-mean",
    "cce-mean-exact",
    *REPLAY_ON_PEAKED,
]
"""The methods run on the peaked logits: the ones whose speed may depend on them, and
``REPLAY_ON_PEAKED``."""

SIZES: list[dict[str, Any]] = [
    # the targets' size first; each size's "logits" is its distribution (see make_inputs)
    {"tokens": 8192, "hidden": 4096, "vocab": 151936, "dtype": "bf16", "logits": "flat",
     "skip": REPLAY_METHODS},
    {"tokens": 8192, "hidden": 4096, "vocab": 151936, "dtype": "bf16", "logits": "peaked",
     "only": PEERS_ON_PEAKED},
    # naive needs [n, V] fp32 logits (80 GB at 32768 rows), and veRL's torch path the same
    {"tokens": 32768, "hidden": 4096, "vocab": 151936, "dtype": "bf16", "logits": "flat",
     "skip": ["naive", "naive-loss", "verl", "ours-torch", "ours-loss-torch", "ours-ce-torch",
              *REPLAY_METHODS]},
    {"tokens": 8192, "hidden": 1024, "vocab": 65536, "dtype": "bf16", "logits": "flat",
     "skip": REPLAY_METHODS},
    # last: if time is left
    {"tokens": 8192, "hidden": 1024, "vocab": 65536, "dtype": "fp32", "logits": "flat",
     "skip": REPLAY_METHODS},
]  # fmt: skip
TARGET_SIZE = SIZES[0]
QUICK_SIZES: list[dict[str, Any]] = [
    {"tokens": 96, "hidden": 48, "vocab": 1000, "dtype": "fp32", "logits": "flat",
     "skip": REPLAY_METHODS},
    {"tokens": 64, "hidden": 32, "vocab": 500, "dtype": "fp32", "logits": "peaked"},
]  # fmt: skip
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
RESULTS = "gpu_logprobs.jsonl"
SIZE_KEYS = ("tokens", "hidden", "vocab", "dtype", "logits")
PEAKED_ENTROPY = 3.0
"""The mean entropy (nats) of the peaked logits, as a language model's: a few nats."""


def size_of(row: dict[str, Any]) -> tuple[Any, ...]:
    """A row's (or a size's) key: ``SIZE_KEYS``' values; rows of runs before the
    ``logits`` option had flat logits."""
    return tuple(row.get(k, "flat" if k == "logits" else None) for k in SIZE_KEYS)


def methods_at(size: dict[str, Any], methods: list[str]) -> list[str]:
    """The methods ``size`` runs, of ``methods``: its ``only`` list, less its ``skip`` list."""
    only = size.get("only")
    return [m for m in methods if (only is None or m in only) and m not in size.get("skip", ())]


def make_inputs(
    size: dict[str, Any], device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """``h [n, hidden]``, ``W [V, hidden]`` (both leaves), labels ``[n]`` and the fields
    that describe them. ``logits="flat"``: ``h ~ N(0, 1)``, ``W ~ N(0, 1/hidden)``
    (logits ~ N(0, 1): entropy near ``log V``), uniform labels. ``"peaked"``: ``h``
    scaled so that the mean entropy of 64 rows is ``PEAKED_ENTROPY`` nats (bisection on
    the scale), and each label drawn from its row's softmax, as a language model's
    targets are mostly its likely tokens."""
    dtype = DTYPES[size["dtype"]]
    n, hid, v = size["tokens"], size["hidden"], size["vocab"]
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(n, hid, device=device, generator=g)
    w = (torch.randn(v, hid, device=device, generator=g) * hid**-0.5).to(dtype)
    info: dict[str, Any] = {"logits": size.get("logits", "flat")}
    if info["logits"] == "flat":
        y = torch.randint(0, v, (n,), device=device, generator=g)
    elif info["logits"] == "peaked":
        z = (h[:64].to(dtype) @ w.T).float()

        def entropy(scale: float) -> float:
            logp = (z * scale).log_softmax(-1)
            return float(-(logp.exp() * logp).sum(-1).mean())

        lo, hi = 1.0, 64.0
        for _ in range(30):
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if entropy(mid) > PEAKED_ENTROPY else (lo, mid)
        scale = (lo * hi) ** 0.5
        h = h * scale
        y = torch.empty(n, dtype=torch.long, device=device)
        step = max(1, (1 << 26) // v)
        for i in range(0, n, step):
            probs = (h[i : i + step].to(dtype) @ w.T).float().softmax(-1)
            y[i : i + step] = torch.multinomial(probs, 1, generator=g).squeeze(1)
        info.update(hidden_scale=round(scale, 4), mean_entropy=round(entropy(scale), 3))
    else:
        raise ValueError(f"logits {info['logits']!r}: expected 'flat' or 'peaked'")
    return h.to(dtype).requires_grad_(), w.requires_grad_(), y, info


Result = tuple[torch.Tensor, torch.Tensor | None]


# ---------------------------------------------------------------- float64 reference on row subsets


def _chunks(n: int, v: int) -> range:
    return range(0, n, max(1, (1 << 27) // max(1, v)))  # 1 GiB of float64 logits a chunk


Keep = Callable[[torch.Tensor, slice], torch.Tensor]
"""A sampling-replay family's kept set: ``keep(z, rows)`` of the float64 logits ``z`` of
the rows ``rows``, ``[r, V]`` bool."""


def parameter_mask(
    z: torch.Tensor,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """The tokens vLLM's sampler keeps, ``[r, V]`` bool, from the logits of whole rows,
    its three rules in its order (``hookspec.conventions``, "Sampling support")::

        keep = z >= max(z) + log(min_p)
        keep &= z >= kth_largest(z[keep], top_k)                  # ties at the k-th kept
        q = softmax(z[keep]);  above_j = sum of q_i over z_i > z_j
        keep &= above_j < top_p                                   # a tie group whole
    """
    keep = torch.ones_like(z, dtype=torch.bool)
    if min_p is not None and min_p > 0:
        keep &= z >= z.amax(1, keepdim=True) + math.log(min_p)
    if top_k is not None and top_k < z.shape[1]:
        kth = z.masked_fill(~keep, -math.inf).topk(top_k, dim=1).values[:, -1:]
        keep &= z >= kth
    if top_p is not None and top_p < 1:
        kept = z.masked_fill(~keep, -math.inf)
        desc, order = kept.sort(1, descending=True)
        q = desc.softmax(1)
        before = q.cumsum(1) - q  # the mass of the entries sorted before each
        tie_start = torch.searchsorted(-desc, -desc)  # the first entry equal to each
        above = before.gather(1, tie_start)  # the mass strictly above each entry
        keep &= torch.zeros_like(keep).scatter_(1, order, above < top_p)
    return keep


def replay_mask(family: str, y: torch.Tensor, vocab: int) -> Keep | None:
    """The kept set of a sampling-replay ``family`` (:data:`benchmarks.gpu_methods.REPLAY`),
    built here from the ids or parameters themselves (never from the method's
    ``SamplingSupport``); ``None`` for another family (the whole vocabulary)."""
    if family not in REPLAY:
        return None
    if family == "replay-ids":
        ids = kept_ids(y, vocab)

        def by_ids(z: torch.Tensor, rows: slice) -> torch.Tensor:
            at = ids[rows]
            at = torch.where(at >= 0, at, at[:, :1])  # padding: the label's column again
            return torch.zeros_like(z, dtype=torch.bool).scatter_(1, at, True)

        return by_ids
    parameters = REPLAY[family]
    return lambda z, rows: parameter_mask(z, **parameters)


def _chunk_logprobs(
    hc: torch.Tensor, w64: torch.Tensor, rows: slice, keep: Keep | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log q, kept)`` of one chunk of rows: ``log_softmax`` of the float64 logits over
    the kept set (-inf outside it), and the kept set (``None``: every token)."""
    z = hc @ w64.T
    if keep is None:
        return z.log_softmax(-1), None
    kept = keep(z, rows)
    return z.masked_fill_(~kept, -math.inf).log_softmax(-1), kept


def reference_stats(
    h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, *, keep: Keep | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 logprobs and entropy of every row over the kept set ``keep`` (``None``: the
    whole vocabulary): ``log q = log_softmax(z[kept])``, ``lp = log q[y]`` (-inf where
    the label is not kept), ``ent = -sum(q * log q)`` over the kept tokens."""
    w64 = w.double()
    n, v = h.shape[0], w.shape[0]
    lp = torch.empty(n, dtype=torch.float64, device=h.device)
    ent = torch.empty_like(lp)
    step = _chunks(n, v).step
    for i0 in _chunks(n, v):
        sl = slice(i0, i0 + step)
        logq, kept = _chunk_logprobs(h[sl].double(), w64, sl, keep)
        lp[sl] = logq.gather(1, y[sl, None]).squeeze(1)
        plogp = logq.exp() * logq
        ent[sl] = -(plogp if kept is None else plogp.masked_fill_(~kept, 0.0)).sum(-1)
        del logq, kept, plogp
    return lp, ent


def reference(
    h: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    objective_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    stats: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    keep: Keep | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``dh[rows]`` and ``dW[cols]`` of ``objective_fn(lp, ent)``, ``lp`` and
    ``ent`` over the kept set ``keep`` (:func:`reference_stats`; ``None``: the whole
    vocabulary, ``q = p``)::

    c_lp, c_ent = d objective / d lp, d objective / d ent      (autograd, float64, [n])
    c_lp = 0 where lp = -inf                                    (a label not kept)
    q = softmax(z[kept]), 0 elsewhere;  d lp / dz = onehot(y) - q;  d ent / dz = -q (log q + ent)
    dz = c_lp * (onehot(y) - q) - c_ent * q * (log q + ent);  dh = dz @ W;  dW = dz.T @ h
    """
    lp, ent = reference_stats(h, w, y, keep=keep) if stats is None else stats
    lp, ent = lp.detach().requires_grad_(), ent.detach().requires_grad_()
    c_lp, c_ent = torch.autograd.grad(objective_fn(lp, ent), (lp, ent), allow_unused=True)
    c_lp = torch.zeros_like(lp) if c_lp is None else c_lp
    c_lp = torch.where(lp.isfinite(), c_lp, 0.0)
    c_ent = torch.zeros_like(ent) if c_ent is None else c_ent
    w64 = w.double()
    n, v = h.shape[0], w.shape[0]
    dw = torch.zeros(len(cols), h.shape[1], dtype=torch.float64, device=h.device)
    parts = []
    step = _chunks(n, v).step
    for i0 in _chunks(n, v):
        sl = slice(i0, i0 + step)
        hc = h[sl].double()
        logq, kept = _chunk_logprobs(hc, w64, sl, keep)
        q = logq.exp()
        if kept is not None:
            logq.masked_fill_(~kept, 0.0)  # q is 0 there: no -inf * 0
        dz = -c_ent[sl, None] * q * (logq + ent.detach()[sl, None])
        dz -= c_lp[sl, None] * q
        dz.scatter_add_(1, y[sl, None], c_lp[sl, None])
        dw += dz[:, cols].T @ hc
        sel = (rows >= i0) & (rows < i0 + hc.shape[0])
        if bool(sel.any()):
            parts.append(dz[rows[sel] - i0] @ w64)
        del logq, kept, q, dz
    return torch.cat(parts), dw


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-300))


VALUE_FAMILIES = ("lp+ent", "lp", *REPLAY)
"""The families whose methods return per-token logprobs (and the entropy, or None)."""


def value_errors(
    family: str, got: Result, stats: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, Any]:
    """A method's per-token values against the float64 reference's: ``lp_rel_err`` over
    the rows whose logprob both give finite, ``ent_rel_err`` where it returns the
    entropy; for sampling replay ``outside_support`` (the share of labels the reference's
    kept set leaves out: logprob -inf) and ``support_mismatch`` (rows where one of the two
    gives -inf and the other not: a kept set that differs at the label)."""
    out, ent = got
    lp_ref, ent_ref = stats
    both = out.isfinite() & lp_ref.isfinite()
    fields: dict[str, Any] = {"lp_rel_err": _rel(out[both], lp_ref[both])}
    if ent is not None:
        fields["ent_rel_err"] = _rel(ent, ent_ref)
    if family in REPLAY:
        fields["outside_support"] = float((~lp_ref.isfinite()).double().mean())
        fields["support_mismatch"] = int((out.isfinite() != lp_ref.isfinite()).sum())
    return fields


# -------------------------------------------------------------- one size, every method, one process


def _time_once(
    fn: Callable[..., Result],
    h: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    cuda: bool,
    *,
    seen: list[Result] | None = None,
) -> float:
    """One forward + backward of ``fn``, timed; its outputs (detached) left in ``seen``."""
    h.grad = w.grad = None
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    else:
        t0 = time.perf_counter()
    out, ent = fn(h, w, y)
    if seen is not None:
        seen[:] = [(out.detach(), None if ent is None else ent.detach())]
    if out.requires_grad:
        loss = (out * torch.ones_like(out)).sum()
        if ent is not None:
            loss = loss + (ent * torch.ones_like(ent)).sum()
        loss.backward()
    if cuda:
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end)) / 1e3
    return time.perf_counter() - t0


def _replay_note(row: dict[str, Any]) -> str:
    """A sampling-replay row's note: the labels outside the kept set, and any row where
    the method and the reference disagree on whether the label is kept."""
    note = f"{row.get('outside_support', 0.0):.1%} of labels outside the kept set (-inf)"
    if row.get("support_mismatch"):
        note += f"; {row['support_mismatch']} rows kept or not against the float64 reference"
    return note


def _device_fields(device: str) -> dict[str, Any]:
    if device != "cuda":
        return {"device": "CPU", "device_class": "cpu"}
    return {"device": torch.cuda.get_device_name(), "device_class": device_class_here()}


def device_class_here() -> str:
    """The ``backend="auto"`` table's key for this CUDA device (the processors' own
    ``device_class``; ``sm_<major><minor>`` if the processors do not import)."""
    name, (major, minor) = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
    try:
        from torch_impl.processors import device_class
    except ImportError:
        return f"sm_{major}{minor}"
    return str(device_class(name, (major, minor)))


def _append(path: Path | None, row: dict[str, Any]) -> None:
    shape = (
        "x".join(str(row[k]) for k in SIZE_KEYS[:3])
        + f" {row['dtype']} {row.get('logits', 'flat')}"
    )
    if row.get("error"):
        print(f"  {shape:<22} {row['method']:<17} {row['error']}", flush=True)
    else:
        peak = row.get("peak_extra_gb")
        print(f"  {shape:<22} {row['method']:<17} {row['time_ms']:9.2f} ms"
              + (f"  {peak:6.2f} GB" if peak is not None else "")
              + (f"  dh {row['dh_rel_err']:.1e}  dW {row['dw_rel_err']:.1e}"
                 if "dh_rel_err" in row else "")
              + (f"  lp {row['lp_rel_err']:.1e}" if "lp_rel_err" in row else "")
              + (f"  busy {row['busy_fraction']:.2f}"
                 if row.get("busy_fraction") is not None else "")
              + (f"  {row['kernels']} kernels {row['launches']} launches"
                 if "kernels" in row else ""),
              flush=True)  # fmt: skip
    if path is not None:
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()


def run_size(
    size: dict[str, Any],
    methods: list[str],
    *,
    device: str,
    runs: int,
    warmup: int,
    out: Path | None = None,
    deadline: float = float("inf"),
) -> list[dict[str, Any]]:
    """Every method at one size, each row appended to ``out`` as it is measured. A method
    is not started once ``deadline`` (a ``time.time()``) has passed: its row says so."""
    cuda = device == "cuda"
    n, v = size["tokens"], size["vocab"]
    h, w, y, info = make_inputs(size, device)
    rows = torch.linspace(0, n - 1, min(n, 128), device=device).long().unique()
    cols = torch.cat([y[:64], torch.linspace(0, v - 1, 64, device=device).long()]).unique()
    stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # per kept set ("": every token)
    refs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    fields = _device_fields(device)
    got = []
    for name in methods:
        method = METHODS[name]
        row: dict[str, Any] = {k: size[k] for k in SIZE_KEYS}
        row.update(info, method=name, family=method.family, backend=method.backend, **fields)
        row.update(error="", note="")
        if name.startswith("liger"):
            from .gpu_methods import liger_note

            row["note"] = liger_note() if name == "liger" else ""
        if name in ("cce", "cce-mean"):
            row["note"] = "defaults (gradient filtering on)"
        if name in ("cce-exact", "cce-mean-exact"):
            row["note"] = "filter_eps=None (exact)"
        if time.time() > deadline:
            row["error"] = "not reached: the time budget was spent"
        elif method.cuda_only and not cuda:
            row["error"] = "needs CUDA"
        else:
            try:
                for _ in range(warmup):
                    _time_once(method.fn, h, w, y, cuda)
                if cuda:
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                times, peaks = [], []
                seen: list[Result] = []  # the last run's outputs
                for _ in range(runs):
                    h.grad = w.grad = None
                    if cuda:
                        torch.cuda.reset_peak_memory_stats()
                    times.append(_time_once(method.fn, h, w, y, cuda, seen=seen))
                    if cuda:
                        peaks.append(torch.cuda.max_memory_allocated() - base)
                row.update(
                    time_ms=1e3 * statistics.median(times),
                    min_ms=1e3 * min(times),
                    runs=len(times),
                    peak_extra_gb=max(peaks) / 1e9 if peaks else None,
                )
                row.update(
                    profile_call(lambda fn=method.fn: _time_once(fn, h, w, y, cuda), device=device)
                )
                if method.family != "floor":
                    family, hd, wd = method.family, h.detach(), w.detach()
                    keep = replay_mask(family, y, v)
                    kept_set = family if keep is not None else ""
                    if kept_set not in stats:
                        stats[kept_set] = reference_stats(hd, wd, y, keep=keep)
                    if family not in refs:
                        goal = objective(family, n, device)
                        refs[family] = reference(
                            hd, wd, y, rows, cols, goal, stats[kept_set], keep=keep
                        )
                    dh_ref, dw_ref = refs[family]
                    if h.grad is None or w.grad is None:
                        raise RuntimeError("no gradient reached h or W")
                    row.update(
                        dh_rel_err=_rel(h.grad[rows], dh_ref), dw_rel_err=_rel(w.grad[cols], dw_ref)
                    )
                    if family in VALUE_FAMILIES and seen:
                        row.update(value_errors(family, seen[0], stats[kept_set]))
                    if family in REPLAY:
                        row["note"] = _replay_note(row)
            except NotAvailable as exc:
                row["error"] = str(exc)
            except torch.cuda.OutOfMemoryError:
                row["error"] = "out of memory"
            except Exception as exc:  # reported in the table: a method that cannot run here
                text = str(exc).strip().splitlines()
                row["error"] = f"{type(exc).__name__}: {text[0][:160] if text else ''}"
            finally:
                h.grad = w.grad = None
                if cuda:
                    torch.cuda.empty_cache()
        _append(out, row)
        got.append(row)
    return got


# -------------------------------------------------------------- every size, each in its own process


def _rows_of(path: Path, size: dict[str, Any]) -> set[str]:
    if not path.exists():
        return set()
    done = set()
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            if size_of(r) == size_of(size):
                done.add(r["method"])
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--budget", type=float, default=160.0, help="seconds for every size together")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or (args.runs < 3 and not args.quick):
        ap.error(f"unknown methods {unknown}" if unknown else "--runs must be >= 3")
    results = args.out / RESULTS
    if args.worker:
        size = json.loads(args.worker)
        run_size(size, methods_at(size, methods), device=args.device, runs=args.runs,
                 warmup=args.warmup, out=results, deadline=args.deadline)  # fmt: skip
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_logprobs: no CUDA device here: nothing measured (--device cpu for a smoke run)")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    end = time.time() + args.budget
    for size in QUICK_SIZES if args.quick else SIZES:
        left = end - time.time()
        print(f"== {size} ({left:.0f} s of the budget left)", flush=True)
        tail = ""
        if left > 5:
            # the worker starts no method after its deadline; the timeout is the backstop
            cmd = [sys.executable, "-m", "benchmarks.gpu_logprobs", "--worker", json.dumps(size),
                   "--device", args.device, "--methods", ",".join(methods),
                   "--runs", str(args.runs), "--warmup", str(args.warmup),
                   "--out", str(args.out), "--deadline", str(end - 3),
                   *(["--quick"] if args.quick else [])]  # fmt: skip
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            try:
                proc = subprocess.run(
                    cmd, stderr=subprocess.PIPE, text=True, timeout=left, cwd=ROOT, env=env
                )
                if proc.returncode != 0:
                    lines = proc.stderr.strip().splitlines() or ["no output"]
                    print("\n".join(lines[-20:]), file=sys.stderr, flush=True)
                    tail = f"exit {proc.returncode}: {lines[-1][:160]}"
            except subprocess.TimeoutExpired:
                tail = f"killed at the budget's end ({args.budget:.0f} s)"
        missing = [m for m in methods_at(size, methods) if m not in _rows_of(results, size)]
        for i, m in enumerate(missing):
            why = "not reached: the time budget was spent" if not tail else (
                f"killed while running: {tail}" if i == 0 else f"not reached: {tail}")  # fmt: skip
            row = {k: size[k] for k in SIZE_KEYS}
            row.update(
                method=m, family=METHODS[m].family, backend=METHODS[m].backend, error=why, note=""
            )
            _append(results, row)
    print(f"gpu_logprobs: rows in {results}; tables: python -m benchmarks.gpu_results {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
