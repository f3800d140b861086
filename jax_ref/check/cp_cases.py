"""Context-parallel cases: a whole context split over ``cp`` gloo ranks as Megatron
splits a batch, the processor run on each rank's part, the parts put back together.

Megatron balances causal attention by cutting every sequence into ``2 cp`` equal chunks
and giving rank ``r`` chunks ``r`` and ``2 cp - 1 - r`` (``docs/processors.md``, "Context
parallel"). On each rank :func:`megatron_cp_index` takes that split from Megatron itself
(``megatron.core.utils.get_batch_on_this_cp_rank`` of the positions ``0 .. s-1``), and
:func:`split_context` keeps the rank's positions of the hidden states (dim 0), of the
labels, masks, ids and of every user-context tensor whose leading dims are ``[b, s]``
(dim 1; a dataclass is rebuilt with its fields split, as the data loader would have
split the batch); ``parallel.cp_size``/``cp_rank`` say where it sits, and
``ctx.collectives`` is ``torch_impl.TorchCollectives`` over Megatron's context-parallel
group (``all_reduce_sum_context_parallel``; the vocabulary is whole: tp=1).

Each rank runs the processor with a fresh leaf for its hidden states and its own copy
of the weight, and pulls back the rank's part of one whole-batch cotangent per output
(the same scalar cotangent on every rank). :func:`assemble` then forms the run of the
whole batch, the contract's reading of context parallel: per-token outputs at their
positions; a scalar the sum of the ranks' **shares** (each rank returns its share, the
shares sum to the micro-batch's value: a token mean divides by the count over the CP
group); the hidden-state gradient at each rank's positions (the whole loss's gradient
there: the CP sum's backward brings the other ranks' parts); the weight gradient summed
over the ranks (as the data- and context-parallel gradient all-reduce does). That run is
compared with the reference on the whole batch, so a reference needs no
context-parallel code.

The model itself does not run context parallel here: Megatron's local attention (no
Transformer Engine, on a CPU) takes ``context_parallel_size == 1``, so the GPT case is
the hook's context of a one-process forward, split afterwards. Packed (THD) rows are not
among the cases.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hookspec import ContractError, OutputContext, ParallelLayout, validate_context, validate_result

from ._spec import resolve
from .comparison import logit_scale
from .gpt_cases import context_from_wire, spawn_ranks, value_from_wire, value_to_wire
from .torch_run import TorchRun, cotangent_of, outputs_of, processor_name, vjps_of

__all__ = [
    "CPCase",
    "assemble",
    "megatron_cp_index",
    "run_context_parallel",
    "split_context",
    "split_tree",
]


@dataclasses.dataclass(frozen=True)
class CPCase:
    """One context-parallel case: ``processor`` (``module:attr``, imported on each rank)
    on the whole context ``context`` (``gpt_cases.context_to_wire``, its user context
    made), with the cotangents of ``seed``."""

    processor: str
    context: dict[str, Any]
    seed: int = 0


def megatron_cp_index(seq: int, group: Any) -> torch.Tensor:
    """The positions ``[seq / cp]`` this rank of the context-parallel ``group`` holds of a
    sequence of ``seq`` tokens, as ``megatron.core.utils.get_batch_on_this_cp_rank`` splits
    a batch without ``cu_seqlens`` (0.16: ``(batch, cp_group)``; 0.19: also
    ``is_hybrid_cp``)."""
    from megatron.core import utils as mcore_utils

    split = mcore_utils.get_batch_on_this_cp_rank
    kw: dict[str, Any] = {"cp_group": group}
    if "is_hybrid_cp" in inspect.signature(split).parameters:
        kw["is_hybrid_cp"] = False
    return split({"positions": torch.arange(seq)[None]}, **kw)["positions"][0]


def split_tree(obj: Any, index: torch.Tensor, b: int, s: int) -> Any:
    """``obj`` with every tensor whose leading dims are ``[b, s]`` cut to ``[:, index]``;
    a dataclass rebuilt (``dataclasses.replace``), a mapping a dict, tuples and lists
    their type; anything else as it is."""
    if isinstance(obj, torch.Tensor):
        return obj[:, index] if obj.dim() >= 2 and tuple(obj.shape[:2]) == (b, s) else obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f.name for f in dataclasses.fields(obj) if f.init]
        return dataclasses.replace(
            obj, **{k: split_tree(getattr(obj, k), index, b, s) for k in fields}
        )
    if isinstance(obj, Mapping):
        return {k: split_tree(v, index, b, s) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(split_tree(v, index, b, s) for v in obj)
    return obj


def _times(c: float, z: torch.Tensor) -> torch.Tensor:
    return z * c


def split_context(
    whole: OutputContext, index: torch.Tensor, *, cp: int, rank: int, collectives: Any
) -> OutputContext:
    """Rank ``rank``'s part of ``whole`` (positions ``index``; module docstring), with
    ``parallel.cp_size=cp``, ``cp_rank=rank``, ``collectives`` and the whole context's
    MuP scale as ``scale_logits``."""
    b, s = whole.batch_size, whole.seq_len
    hs = whole.hidden_states
    assert isinstance(hs, torch.Tensor)
    c = logit_scale(whole.config)
    return whole.replace(
        hidden_states=hs[index],
        labels=split_tree(whole.labels, index, b, s),
        loss_mask=split_tree(whole.loss_mask, index, b, s),
        input_ids=split_tree(whole.input_ids, index, b, s),
        position_ids=split_tree(whole.position_ids, index, b, s),
        padding_mask=split_tree(whole.padding_mask, index, b, s),
        context=split_tree(whole.context, index, b, s),
        parallel=ParallelLayout(cp_size=cp, cp_rank=rank),
        collectives=collectives,
        scale_logits=functools.partial(_times, c),
    )


def _run_rank(case: CPCase, rank: int, cp: int, group: Any) -> dict[str, Any]:
    """``case`` on this rank: its part of the context, the processor, the pullbacks of
    its part of the whole cotangents; the results on the wire, with ``index``."""
    from torch_impl import TorchCollectives

    whole = context_from_wire(case.context)
    b, s = whole.batch_size, whole.seq_len
    index = megatron_cp_index(s, group)
    coll = TorchCollectives(None, sequence_parallel=False, cp_group=group)
    ctx = split_context(whole, index, cp=cp, rank=rank, collectives=coll)
    hs, weight = ctx.hidden_states, ctx.vocab_weight
    assert isinstance(hs, torch.Tensor) and isinstance(weight, torch.Tensor)
    h = hs.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    ctx = ctx.replace(hidden_states=h, vocab_weight=w)
    validate_context(ctx)
    proc = resolve(case.processor, field="--processor")
    name = processor_name(proc)

    def cotangent(key: str, out: torch.Tensor, seed: int) -> torch.Tensor:
        if out.dim() == 0:  # a share: the whole value's cotangent on every rank
            return cotangent_of(key, out, seed)
        whole_like = out.new_empty((b, s, *out.shape[2:]))
        return cotangent_of(key, whole_like, seed)[:, index]

    with torch.enable_grad():
        try:
            result = proc(ctx)
        except ContractError as exc:  # named by field; say which processor, which rank
            where = f"raised by {case.processor} on context-parallel rank {rank} of {cp}"
            hint = f"{exc.hint} ({where})" if exc.hint else where
            raise ContractError(
                exc.field, expected=exc.expected, actual=exc.actual, hint=hint
            ) from None
        validate_result(result, batch=b, seq=int(index.numel()), field=f"processor {name!r} result")
        outputs, single = outputs_of(result, name)
        cots, dh, dw = vjps_of(outputs, h, w, case.seed, cotangent=cotangent)
    parts = {
        "outputs": {k: v.detach() for k, v in outputs.items()},
        "cotangents": cots,
        "grad_hidden": dh,
        "grad_weight": dw,
    }
    wire = {k: value_to_wire(v) for k, v in parts.items()}
    return {"index": value_to_wire(index), "single": single, **wire}


def _cp_worker(rank: int, cp: int, port: int, cases: tuple[CPCase, ...], results: Any) -> None:
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    try:
        from megatron.core import parallel_state

        from torch_impl.process_state import megatron_parallel, rank_store

        with megatron_parallel(cp=cp, rank=rank, world_size=cp, store=rank_store(port, cp)):
            group = parallel_state.get_context_parallel_group()
            wires = [_run_rank(case, rank, cp, group) for case in cases]
        results.put((rank, "ok", wires))
    except ContractError as exc:
        results.put((rank, "contract", (exc.field, exc.expected, exc.actual, exc.hint)))
    except BaseException as exc:
        first = f"{type(exc).__name__}: {exc}".splitlines()[0]
        results.put((rank, "error", (first, traceback.format_exc())))


def _join(parts: list[torch.Tensor], indices: list[torch.Tensor], b: int, s: int) -> torch.Tensor:
    """A scalar: the ranks' sum (float64 for floating shares); ``[b, s/cp, ...]``: each
    rank's part at its positions of ``[b, s, ...]``."""
    first = parts[0]
    if first.dim() == 0:
        acc = torch.float64 if first.is_floating_point() else first.dtype
        return torch.stack([p.to(acc) for p in parts]).sum(0)
    whole = first.new_zeros((b, s, *first.shape[2:]))
    for part, index in zip(parts, indices, strict=True):
        whole[:, index] = part
    return whole


def assemble(whole: OutputContext, wires: Sequence[dict[str, Any]]) -> TorchRun:
    """The run of the whole batch from the ranks' (module docstring): ``context`` is
    ``whole``; outputs and cotangents joined (:func:`_join`); ``d/d hidden`` at each
    rank's positions; ``d/d weight`` summed."""
    b, s = whole.batch_size, whole.seq_len
    indices = [value_from_wire(w["index"]) for w in wires]
    ranks = [{k: value_from_wire(w[k]) for k in _PARTS} for w in wires]
    keys = list(ranks[0]["outputs"])
    for r, part in enumerate(ranks):
        if list(part["outputs"]) != keys:
            raise ContractError(
                f"processor result on cp rank {r}",
                expected=f"the outputs of rank 0: {keys}",
                actual=str(list(part["outputs"])),
            )
    outputs = {k: _join([p["outputs"][k] for p in ranks], indices, b, s) for k in keys}
    cots: dict[str, torch.Tensor] = {}
    dh: dict[str, torch.Tensor] = {}
    dw: dict[str, torch.Tensor] = {}
    for k in ranks[0]["cotangents"]:
        first = ranks[0]["cotangents"][k]
        parts = [p["cotangents"][k] for p in ranks]
        cots[k] = first if first.dim() == 0 else _join(parts, indices, b, s)
        hidden = ranks[0]["grad_hidden"][k]
        dh[k] = hidden.new_zeros((s, *hidden.shape[1:]))
        for p, index in zip(ranks, indices, strict=True):
            dh[k][index] = p["grad_hidden"][k]
        dw[k] = torch.stack([p["grad_weight"][k].double() for p in ranks]).sum(0)
    return TorchRun(whole, outputs, cots, dh, dw, bool(wires[0]["single"]), via_hook=False)


_PARTS = ("outputs", "cotangents", "grad_hidden", "grad_weight")


def run_context_parallel(
    cases: Sequence[CPCase],
    wholes: Sequence[OutputContext],
    /,
    *,
    cp: int = 2,
    timeout_s: float = 300.0,
) -> list[TorchRun]:
    """Each case on ``cp`` gloo ranks (one spawn for all), Megatron's context-parallel
    groups; for each, the whole batch's run (:func:`assemble`, ``wholes[i]`` its
    context). A ``ContractError`` raised on a rank is raised here; another exception
    becomes a ``RuntimeError`` naming the rank."""
    got = spawn_ranks(_cp_worker, cp, tuple(cases), timeout_s=timeout_s, what="context-parallel")
    return [assemble(wholes[i], [got[r][i] for r in range(cp)]) for i in range(len(cases))]
