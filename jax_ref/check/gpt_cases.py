"""Cases from a real tiny Megatron GPT on a CPU, on one process or tensor parallel.

:func:`build_case_model` is ``torch_impl.tiny.build_tiny_gpt`` (wider init, so
logits spread over a few units rather than sitting near uniform), wrapped in
Megatron's ``Float16Module`` for bf16 and fp16 (the hidden states then reach
the hook in that dtype) and enabled for output processors.

:func:`run_tensor_parallel` runs one processor through the hook on ``tp`` gloo
processes (one per rank, Megatron's tensor-parallel groups, vocab split over
ranks) and brings each rank's :class:`~jax_ref.check.torch_run.TorchRun` back to
the caller, its tensors pickled across the process boundary.
"""

from __future__ import annotations

import dataclasses
import os
import queue as queue_module
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hookspec import ContractError, OutputContext, VocabShard

from ._spec import resolve
from .torch_run import TorchRun, run_through_hook

__all__ = [
    "CASE_BATCH",
    "CASE_SEQ",
    "GPTCase",
    "build_case_model",
    "case_batch",
    "context_from_wire",
    "context_to_wire",
    "resolve",
    "run_gpt_case",
    "run_tensor_parallel",
    "spawn_ranks",
    "value_from_wire",
    "value_to_wire",
]

CASE_BATCH = 3
"""The GPT case's rows: an odd number (a transpose of ``[b, s]`` and ``[s, b]`` cannot
pass for the identity), each of ``CASE_SEQ`` tokens."""
CASE_SEQ = 8
"""The GPT case's sequence length (``hookcheck --cp N`` needs ``2 N`` to divide it)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class GPTCase:
    """One tiny-GPT case. ``processor`` and ``make_context`` are ``module:attr``
    specs (picklable, importable in a spawned rank)."""

    processor: str
    make_context: str | None = None
    dtype: str = "float32"
    tied: bool = False
    seed: int = 0
    batch: int = CASE_BATCH
    seq: int = CASE_SEQ

    @property
    def name(self) -> str:
        return "gpt-tied" if self.tied else "gpt"


def build_case_model(
    *, dtype: str = "float32", tied: bool = False, seed: int = 1234
) -> torch.nn.Module:
    """An enabled tiny GPT in ``dtype`` (call inside ``megatron_parallel``)."""
    from megatron.core.transformer.module import Float16Module

    from torch_impl import enable_output_processor
    from torch_impl.tiny import build_tiny_gpt

    flags: dict[str, Any] = {"bfloat16": {"bf16": True}, "float16": {"fp16": True}}.get(dtype, {})
    model: torch.nn.Module = build_tiny_gpt(
        seed=seed, share_embeddings_and_output_weights=tied, init_method_std=0.2, **flags
    )
    if flags:
        model = Float16Module(model.config, model)
    return enable_output_processor(model)


def case_batch(batch: int = CASE_BATCH, seq: int = CASE_SEQ, *, seed: int = 0) -> dict[str, Any]:
    """``torch_impl.tiny.tiny_batch`` with two ignored labels and a partly masked sequence."""
    from torch_impl.tiny import tiny_batch

    data: dict[str, Any] = tiny_batch(batch, seq, seed=seed)
    data["labels"][0, 1] = data["labels"][-1, -1] = -100
    data["loss_mask"][-1, seq // 2 :] = 0
    return data


def run_gpt_case(case: GPTCase, proc: Any = None, make_context: Any = None) -> TorchRun:
    """Run ``case`` through the hook on this process (inside ``megatron_parallel``)."""
    proc = proc if proc is not None else resolve(case.processor)
    if make_context is None and case.make_context:
        make_context = resolve(case.make_context, field="make_context")
    model = build_case_model(dtype=case.dtype, tied=case.tied)
    return run_through_hook(
        proc,
        model,
        case_batch(case.batch, case.seq),
        make_user_context=make_context,
        seed=case.seed,
    )


# ---------------------------------------------------------------- tensor parallel over gloo


def value_to_wire(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return (
            "tensor",
            str(t.dtype).removeprefix("torch."),
            t.to(torch.float64 if t.is_floating_point() else t.dtype).numpy().copy(),
        )
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (
            "dataclass",
            type(obj),
            {
                f.name: value_to_wire(getattr(obj, f.name))
                for f in dataclasses.fields(obj)
                if f.init
            },
        )
    if isinstance(obj, Mapping):
        return ("dict", {k: value_to_wire(v) for k, v in obj.items()})
    if isinstance(obj, (tuple, list)):
        return ("seq", type(obj), [value_to_wire(v) for v in obj])
    return ("plain", obj)


def value_from_wire(wire: Any) -> Any:
    kind = wire[0]
    if kind == "tensor":
        return torch.from_numpy(wire[2]).to(_DTYPES.get(wire[1], getattr(torch, wire[1])))
    if kind == "dataclass":
        return wire[1](**{k: value_from_wire(v) for k, v in wire[2].items()})
    if kind == "dict":
        return {k: value_from_wire(v) for k, v in wire[1].items()}
    if kind == "seq":
        return wire[1](value_from_wire(v) for v in wire[2])
    return wire[1]


_CONTEXT_FIELDS = (
    "hidden_states",
    "labels",
    "loss_mask",
    "input_ids",
    "position_ids",
    "context",
    "vocab_weight",
)


def context_to_wire(ctx: OutputContext) -> dict[str, Any]:
    """What a reference and a processor read of ``ctx`` (its tensors, the user context,
    the vocabulary shard, the layout, MuP and the softcap), picklable: for
    :func:`context_from_wire` in another process."""
    vocab = ctx.vocab
    assert vocab is not None
    return {
        "context": {k: value_to_wire(getattr(ctx, k)) for k in _CONTEXT_FIELDS},
        "vocab": (vocab.start, vocab.end, vocab.size),
        "ignore_index": ctx.ignore_index,
        "parallel": ctx.parallel,
        "use_mup": (
            bool(getattr(ctx.config, "use_mup", False)),
            float(getattr(ctx.config, "mup_output_mult", 1.0)),
        ),
        "final_logit_softcapping": getattr(ctx.config, "final_logit_softcapping", None),
    }


def _run_to_wire(run: TorchRun) -> dict[str, Any]:
    return {
        **context_to_wire(run.context),
        "run": {
            k: value_to_wire(getattr(run, k))
            for k in ("outputs", "cotangents", "grad_hidden", "grad_weight")
        },
        "single": run.single,
    }


@dataclasses.dataclass
class _MupConfig:
    """The model config's fields a processor reads, sent to another process; mutable, as a
    model's config is (a processor may run on a copy with a field set)."""

    use_mup: bool
    mup_output_mult: float
    final_logit_softcapping: Any = None


def context_from_wire(wire: dict[str, Any]) -> OutputContext:
    """The context :func:`context_to_wire` sent (its config: MuP and the softcap only)."""
    fields = {k: value_from_wire(v) for k, v in wire["context"].items()}
    use_mup, mult = wire["use_mup"]
    return OutputContext(
        **fields,
        vocab=VocabShard(*wire["vocab"]),
        ignore_index=wire["ignore_index"],
        parallel=wire["parallel"],
        config=_MupConfig(use_mup, mult, wire["final_logit_softcapping"]),
    )


def _run_from_wire(wire: dict[str, Any]) -> TorchRun:
    parts = {k: value_from_wire(v) for k, v in wire["run"].items()}
    return TorchRun(context=context_from_wire(wire), single=wire["single"], via_hook=True, **parts)


def _tp_worker(rank: int, tp: int, port: int, cases: tuple[GPTCase, ...], results: Any) -> None:
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    try:
        from torch_impl.process_state import megatron_parallel, rank_store

        with megatron_parallel(tp=tp, rank=rank, world_size=tp, store=rank_store(port, tp)):
            wires = [_run_to_wire(run_gpt_case(case)) for case in cases]
        results.put((rank, "ok", wires))
    except ContractError as exc:
        results.put((rank, "contract", (exc.field, exc.expected, exc.actual, exc.hint)))
    except BaseException as exc:
        first = f"{type(exc).__name__}: {exc}".splitlines()[0]
        results.put((rank, "error", (first, traceback.format_exc())))


def run_tensor_parallel(
    cases: Sequence[GPTCase], /, *, tp: int = 2, timeout_s: float = 300.0
) -> list[list[TorchRun]]:
    """Each case through the hook on ``tp`` ranks (one spawn of ``tp`` gloo
    processes for all of them); for each case, one :class:`TorchRun` per rank
    in rank order. A ``ContractError`` raised on a rank is raised here; another
    exception becomes a ``RuntimeError`` naming the rank."""
    got = spawn_ranks(_tp_worker, tp, tuple(cases), timeout_s=timeout_s, what="tensor-parallel")
    return [[_run_from_wire(got[r][i]) for r in range(tp)] for i in range(len(cases))]


def spawn_ranks(
    worker: Any, world: int, payload: Any, *, timeout_s: float, what: str
) -> dict[int, Any]:
    """``worker(rank, world, port, payload, results)`` on ``world`` processes, each putting
    ``(rank, status, payload)`` on ``results`` (``"ok"``, ``"contract"``: a
    ``ContractError``'s fields, ``"error"``: its first line and traceback); rank -> the
    ``"ok"`` payloads. A rank's ``ContractError`` is raised here; another failure, a rank
    that dies or a run past ``timeout_s`` is a ``RuntimeError`` naming it.

    One process is spawned (a fresh interpreter: nothing of the caller's state, threads or
    devices comes along); it imports what every rank imports and forks the ranks from
    there (:func:`_fork_ranks`), so that torch and Megatron are imported once a run, not
    once a rank: about 10 s of CPU each on a CPU, most of a small check's time.

    The ranks meet at ``port``, a :func:`~torch_impl.process_state.launcher_store` this
    process holds for the length of the run."""
    import torch.multiprocessing as mp

    from torch_impl.process_state import launcher_store

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = launcher_store(world)
    args = (worker, world, store.port, payload, results)
    launcher = ctx.Process(target=_fork_ranks, args=args)
    launcher.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            try:
                rank, status, payload = results.get(timeout=1.0)
            except queue_module.Empty:
                if launcher.exitcode not in (None, 0):
                    raise RuntimeError(
                        f"the process starting the {world} ranks exited with code "
                        f"{launcher.exitcode} before they reported"
                    ) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what} run timed out after {timeout_s:.0f} s") from None
                continue
            if status == "died":
                if rank in got:  # after its report: the others still count
                    continue
                raise RuntimeError(
                    f"rank {rank} of {world} exited with code {payload} before reporting"
                )
            if status == "contract":
                field, expected, actual, hint = payload
                raise ContractError(field, expected=expected, actual=actual, hint=hint)
            if status == "error":
                first, trace = payload
                error = RuntimeError(f"rank {rank} of {world} failed: {first}")
                error.add_note(f"traceback on rank {rank}:\n{trace}")
                raise error
            got[rank] = payload
    finally:
        if len(got) < world:  # a failure or the timeout: the other ranks' work is not wanted
            launcher.terminate()  # its SIGTERM handler ends the ranks it forked
        launcher.join(timeout=30)
        if launcher.is_alive():
            launcher.kill()
            launcher.join()
    return got


_RANK_IMPORTS = ("megatron.core", "torch_impl.process_state", "torch_impl.tiny")
"""What every rank imports before it runs a case: imported once, in :func:`_fork_ranks`."""


def _fork_ranks(worker: Any, world: int, port: int, payload: Any, results: Any) -> None:
    """The spawned process of :func:`spawn_ranks`: import :data:`_RANK_IMPORTS`, fork the
    ``world`` ranks (nothing has run here but imports: no threads to inherit, no CUDA),
    and put ``(rank, "died", exitcode)`` on ``results`` for a rank that exits non-zero. A
    SIGTERM (the caller's timeout) ends the ranks too: they are daemonic, and the handler
    exits through ``multiprocessing``'s clean-up, which terminates them."""
    import importlib
    import signal
    import sys
    from multiprocessing.connection import wait

    import torch.multiprocessing as mp

    for name in _RANK_IMPORTS:
        importlib.import_module(name)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    ctx = mp.get_context("fork")
    ranks = [
        ctx.Process(target=worker, args=(r, world, port, payload, results), daemon=True)
        for r in range(world)
    ]
    for rank in ranks:
        rank.start()
    running = dict(enumerate(ranks))
    while running:
        wait([rank.sentinel for rank in running.values()])
        for r, rank in list(running.items()):
            if rank.exitcode is None:
                continue
            del running[r]
            if rank.exitcode != 0:
                results.put((r, "died", rank.exitcode))
