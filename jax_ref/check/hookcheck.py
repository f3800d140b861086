"""``hookcheck``: cross-check output processors against the float64 JAX reference.

With no arguments it builds the tiny Megatron GPT on the CPU (fp32, bf16, fp16,
and fp32 with tied embeddings), runs every built-in processor through the
output hook, compares values and the VJPs for the hidden states and the output
weight with ``jax_ref``, adds synthetic and adversarial cases, prints the table
and exits 1 on a mismatch::

    hookcheck
    hookcheck --processor mypkg.procs:my_logprobs --reference mypkg.refs:my_reference
    hookcheck --tp 2            # vocab-parallel over 2 gloo ranks, sharded reference
    hookcheck --cp 2            # context parallel: each case split over 2 gloo ranks
    hookcheck --case random --case masked   # the synthetic kinds not run by default
    python -m jax_ref.check.hookcheck ...   # the same, without the console script

The heavy imports (jax, torch, Megatron, the cases) wait inside the functions
that use them: ``--tp`` sets ``XLA_FLAGS`` for virtual JAX devices before JAX
starts, and ``--help`` answers without loading a framework.

Exit status: 0 all passed, 1 a mismatch (or a non-finite value), 2 bad input,
named by the input at fault: ``--processor`` (it raises), ``--reference`` (it
raises, or its output structure differs from the processor's), ``--context``
(its maker raises, or it holds a dtype DLPack cannot carry), ``--seed``,
``--tp``, ``--cp``, ``--case``, or a ``module:attr`` that does not import.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

from hookspec import ContractError

__all__ = ["BUILTIN_CHECKS", "BuiltinCheck", "main"]

DTYPES = ("float32", "bfloat16", "float16")
_MAX_FAILURE_LINES = 20
SYNTHETIC_KINDS = ("strongly-negative", "peaked", "awkward")
"""The synthetic kinds run by default (``--case`` asks for others)."""
ALL_SYNTHETIC_KINDS = ("random", "strongly-negative", "peaked", "masked", "awkward", "ties")
"""Every kind of :func:`jax_ref.check.cases.synthetic_context` (``CASE_KINDS``; a test keeps them
equal)."""
SEED_MAX = 2**32 - 1
"""``--seed`` is in ``[0, SEED_MAX]``: it seeds torch generators after mixing (cotangents per
output)."""


@dataclasses.dataclass(frozen=True)
class BuiltinCheck:
    """A processor (``module:attr``), its reference (a factory, called once the
    processor imported), and the maker of its user context (``module:attr``)."""

    name: str
    processor: str
    reference: Callable[[], Any]
    make_context: str | None = None
    tp1_only: bool = False  # one process only: skipped under --tp and --cp
    cp_refused: str = ""  # why the processor refuses context parallel: skipped under --cp


def _policy_reference(config_spec: str) -> Callable[[], Any]:
    def make() -> Any:
        from .. import processors
        from ._spec import resolve

        return processors.policy_loss(resolve(config_spec))

    return make


def _preference_reference(config_spec: str) -> Callable[[], Any]:
    def make() -> Any:
        from .. import preference
        from ._spec import resolve

        return preference.preference_loss(resolve(config_spec))

    return make


def _ref(name: str, **kwargs: Any) -> Callable[[], Any]:
    def make() -> Any:
        from .. import processors

        return getattr(processors, name)(**kwargs)

    return make


def _sampling_ref(**kwargs: Any) -> Callable[[], Any]:
    def make() -> Any:
        from .. import sampling

        return sampling.selected_logprobs(**kwargs)

    return make


def _distill_ref(config_spec: str | None = None, **topk: Any) -> Callable[[], Any]:
    """``jax_ref.distill``'s reference: ``distillation_loss`` of the config at
    ``config_spec``, else ``topk_logprobs(**topk)``."""

    def make() -> Any:
        from .. import distill
        from ._spec import resolve

        if config_spec is not None:
            return distill.distillation_loss(resolve(config_spec))
        return distill.topk_logprobs(**topk)

    return make


def _capped_ref(name: str, **kwargs: Any) -> Callable[[], Any]:
    """``jax_ref.processors.<name>(**kwargs)`` under the builtin checks' softcap
    (``builtin_processors.SOFTCAP``): the reference of a processor run by
    ``builtin_processors.softcapped``, whose config the harness does not see."""

    def make() -> Any:
        from .. import processors
        from .builtin_processors import SOFTCAP

        ref = getattr(processors, name)(**kwargs)

        def capped_reference(hidden: Any, weight: Any, inputs: Any) -> Any:
            return ref(hidden, weight, inputs.replace(softcap=SOFTCAP))

        capped_reference.__name__ = f"{name}_softcapped"
        return capped_reference

    return make


def _example_ref(name: str) -> Callable[[], Any]:
    def make() -> Any:
        from . import examples

        return getattr(examples, name)

    return make


_B = "jax_ref.check.builtin_processors"
_NO_TEACHER_COUNT = (
    "under context parallel distillation needs the teacher's global_tokens, which the "
    "check's teacher does not carry"
)
BUILTIN_CHECKS: tuple[BuiltinCheck, ...] = (
    BuiltinCheck(
        "selected_logprobs(entropy)", f"{_B}:LOGPROBS", _ref("selected_logprobs", entropy=True)
    ),
    BuiltinCheck(
        "selected_logprobs(T=0.7)",
        f"{_B}:LOGPROBS_T07",
        _ref("selected_logprobs", temperature=0.7, entropy=True),
    ),
    BuiltinCheck(
        "selected_logprobs(T per token)",
        f"{_B}:LOGPROBS_CONTEXT_TEMPERATURE",
        _ref("selected_logprobs", entropy=True),
        f"{_B}:temperature_context",
    ),
    BuiltinCheck(
        "selected_logprobs(entropy, kept ids)",
        f"{_B}:LOGPROBS_SUPPORT",
        _sampling_ref(entropy=True),
        f"{_B}:sampling_context",
    ),
    BuiltinCheck("cross_entropy_loss", f"{_B}:CROSS_ENTROPY", _ref("cross_entropy_loss")),
    BuiltinCheck(
        "cross_entropy_loss(z_loss)",
        f"{_B}:CROSS_ENTROPY_Z_LOSS",
        _ref("cross_entropy_loss", z_loss=0.01),
    ),
    BuiltinCheck(
        "cross_entropy_loss(label_smoothing)",
        f"{_B}:CROSS_ENTROPY_LABEL_SMOOTHING",
        _ref("cross_entropy_loss", label_smoothing=0.1, z_loss=0.01),
    ),
    BuiltinCheck(
        "selected_logprobs(entropy, softcap config)",
        f"{_B}:LOGPROBS_SOFTCAP",
        _capped_ref("selected_logprobs", entropy=True),
    ),
    BuiltinCheck(
        "cross_entropy_loss(z_loss, softcap config)",
        f"{_B}:CROSS_ENTROPY_SOFTCAP",
        _capped_ref("cross_entropy_loss", z_loss=0.01),
    ),
    BuiltinCheck(
        "policy_loss(ppo, fused)",
        f"{_B}:PPO",
        _policy_reference(f"{_B}:PPO_CONFIG"),
        f"{_B}:policy_context",
    ),
    BuiltinCheck(
        "policy_loss(grpo)",
        f"{_B}:GRPO",
        _policy_reference(f"{_B}:GRPO_CONFIG"),
        f"{_B}:policy_context",
    ),
    BuiltinCheck(
        "policy_loss(gspo)",
        f"{_B}:GSPO",
        _policy_reference(f"{_B}:GSPO_CONFIG"),
        f"{_B}:gspo_context",
    ),
    BuiltinCheck(
        "policy_loss(seq-mean-token-sum)",
        f"{_B}:SEQ_SUM",
        _policy_reference(f"{_B}:SEQ_SUM_CONFIG"),
        f"{_B}:policy_context",
    ),
    BuiltinCheck(
        "policy_loss(cispo, k3+, fused)",
        f"{_B}:CISPO",
        _policy_reference(f"{_B}:CISPO_CONFIG"),
        f"{_B}:policy_context",
    ),
    BuiltinCheck(
        "policy_loss(geo_mean)",
        f"{_B}:GEO_MEAN",
        _policy_reference(f"{_B}:GEO_MEAN_CONFIG"),
        f"{_B}:policy_context",
    ),
    BuiltinCheck(
        "policy_loss(grpo, rollout correction)",
        f"{_B}:CORRECTED",
        _policy_reference(f"{_B}:CORRECTED_CONFIG"),
        f"{_B}:rollout_context",
        cp_refused="a sequence-level rejection (seq_mean_k3) is refused under context parallel",
    ),
    BuiltinCheck(
        "policy_loss(bypass reinforce)",
        f"{_B}:BYPASS",
        _policy_reference(f"{_B}:BYPASS_CONFIG"),
        f"{_B}:rollout_context",
    ),
    BuiltinCheck(
        "preference_loss(dpo, label smoothing)",
        f"{_B}:PREFERENCE_DPO",
        _preference_reference(f"{_B}:PREFERENCE_DPO_CONFIG"),
        f"{_B}:preference_context",
    ),
    BuiltinCheck(
        "preference_loss(simpo)",
        f"{_B}:PREFERENCE_SIMPO",
        _preference_reference(f"{_B}:PREFERENCE_SIMPO_CONFIG"),
        f"{_B}:reference_free_context",
    ),
    BuiltinCheck("topk_logprobs(k=5, entropy)", f"{_B}:TOPK", _distill_ref(k=5, entropy=True)),
    BuiltinCheck(
        "distillation_loss(sparse jsd, bucket)",
        f"{_B}:DISTILL_SPARSE",
        _distill_ref(f"{_B}:DISTILL_SPARSE_CONFIG"),
        f"{_B}:sparse_teacher_context",
        cp_refused=_NO_TEACHER_COUNT,
    ),
    BuiltinCheck(
        "linear_distillation_loss(sparse jsd, bucket)",
        f"{_B}:DISTILL_ROWS",
        _distill_ref(f"{_B}:DISTILL_SPARSE_CONFIG"),
        f"{_B}:sparse_teacher_context",
        cp_refused=_NO_TEACHER_COUNT,
    ),
    BuiltinCheck(
        "distillation_loss(sparse kl, renormalize)",
        f"{_B}:DISTILL_RENORMALIZE",
        _distill_ref(f"{_B}:DISTILL_RENORMALIZE_CONFIG"),
        f"{_B}:sparse_teacher_context",
        cp_refused=_NO_TEACHER_COUNT,
    ),
    BuiltinCheck(
        "distillation_loss(dense reverse kl)",
        f"{_B}:DISTILL_DENSE",
        _distill_ref(f"{_B}:DISTILL_DENSE_CONFIG"),
        f"{_B}:dense_teacher_context",
        cp_refused=_NO_TEACHER_COUNT + "; its teacher's hidden states are [s, b, h], not split",
    ),
    BuiltinCheck(
        "example: vocab-parallel recipe",
        "jax_ref.check.examples:vocab_parallel_logprobs",
        _example_ref("logprobs_entropy_reference"),
    ),
    BuiltinCheck(
        "example: upstream-style processor",
        "jax_ref.check.examples:full_vocab_logprobs",
        _example_ref("logprobs_entropy_reference"),
        tp1_only=True,
    ),
    BuiltinCheck(
        "example: token-mean loss",
        "jax_ref.check.examples:token_mean_loss",
        _example_ref("token_mean_loss_reference"),
    ),
)
"""What ``hookcheck`` checks with no arguments."""


class _Progress:
    def __init__(self, total: int, stream: TextIO, quiet: bool) -> None:
        self.total, self.done, self.stream, self.quiet = total, 0, stream, quiet
        self.start = time.monotonic()

    def step(self, what: str, status: str) -> None:
        self.done += 1
        if not self.quiet:
            elapsed = time.monotonic() - self.start
            width = len(str(self.total))
            print(
                f"[{self.done:>{width}}/{self.total}] {elapsed:5.1f}s  {what}: {status}",
                file=self.stream,
                flush=True,
            )

    def say(self, line: str) -> None:
        if not self.quiet:
            print(line, file=self.stream, flush=True)


@dataclasses.dataclass
class _Job:
    name: str
    processor: Any
    reference: Any
    make_context: Any
    spec: str
    context_spec: str | None


_EPILOG = """\
running it:
  without the console script (a checkout on PYTHONPATH, or before `pip install`):
    python -m jax_ref.check.hookcheck [options]

synthetic cases (float32, besides the tiny GPT):
  strongly-negative, peaked and awkward run by default; random and masked run when
  asked: --case random --case masked (or --case all for every kind). --case replaces
  the default set; --no-synthetic runs none.

context parallel (--cp N, N in 1, 2, 4; with --tp 1):
  every case (the GPT in each --dtype, float32 by default, and the synthetic kinds whose
  sequence length is a multiple of 2N: awkward, s=7, is skipped) is split over N gloo
  ranks as Megatron's get_batch_on_this_cp_rank splits a batch (rank r: chunks r and
  2N-1-r of every row; the hidden states, labels, masks and every user-context tensor
  [b, s, ...]), with Megatron's context-parallel group in ctx.collectives
  (all_reduce_sum_context_parallel) and ctx.parallel.cp_size/cp_rank. The ranks' results
  are put together (per-token outputs at their positions, scalars summed: each rank
  returns its share; hidden-state gradients at their positions, weight gradients summed)
  and compared with the reference on the whole batch. The GPT's forward itself runs on
  one process (Megatron's local attention takes no context parallel on a CPU): its hook
  context is split afterwards. Not covered: packed (THD) rows, tp x cp, upstream-style
  processors (which see no context-parallel group).

how a row passes (printed again under the table):
  max abs err <= atol + rtol * max|reference| + 8 * floor, per compared array, with
  rtol and atol by the dtype of the hidden states (float32: rtol 1e-4, atol 1e-7;
  float16: 5e-3, 1e-6; bfloat16: 2e-2, 1e-5). "max rel err" is max abs err /
  max|reference|: a row whose rel err exceeds rtol can pass on atol where the
  reference is tiny. floor: the error of the reference's own formula evaluated in
  float32 against float64, computed only for an array that fails the first two
  terms; "ok (f32 floor)" passed on it, "(floor X)" in a FAIL line is that error.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hookcheck",
        description="Cross-check output processors (values and VJPs) against the float64 JAX "
        "reference, on a tiny Megatron GPT run on the CPU and on synthetic cases.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--processor",
        action="append",
        metavar="MODULE:ATTR",
        help="a processor of either kind (hookspec or upstream); repeat to check several",
    )
    p.add_argument(
        "--reference",
        action="append",
        metavar="MODULE:ATTR",
        help="its JAX reference, f(hidden, weight, inputs) -> the processor's structure; "
        "one per --processor",
    )
    p.add_argument(
        "--context",
        action="append",
        metavar="MODULE:ATTR",
        help="make_context(ctx) -> the user context (output_processor_context) the processor reads "
        "('-' for none); one per --processor, in order",
    )
    p.add_argument(
        "--dtype",
        action="append",
        choices=DTYPES,
        help="a dtype of the GPT case, repeat for several (default: all three at one rank; "
        "float32 under --tp and --cp; the synthetic cases are float32)",
    )
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks for the GPT case (gloo processes)"
    )
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel ranks (gloo processes): each case split as Megatron splits a "
        "batch, the ranks' shares put together and compared whole (see below)",
    )
    p.add_argument(
        "--case",
        action="append",
        choices=(*ALL_SYNTHETIC_KINDS, "all"),
        help="a synthetic case to run; repeat for several (default: "
        + ", ".join(SYNTHETIC_KINDS)
        + "; random and masked only when asked; 'all': every kind)",
    )
    p.add_argument(
        "--no-synthetic", action="store_true", help="skip the synthetic and adversarial cases"
    )
    p.add_argument(
        "--full", action="store_true", help="print every compared array, not the summary"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the cotangents and synthetic cases, in [0, 2**32 - 1]",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument(
        "--traceback", action="store_true", help="show the traceback of an unexpected error"
    )
    return p


def _synthetic_kinds(args: argparse.Namespace) -> tuple[str, ...]:
    if args.no_synthetic:
        return ()
    if not args.case:
        return SYNTHETIC_KINDS
    if "all" in args.case:
        return ALL_SYNTHETIC_KINDS
    return tuple(dict.fromkeys(args.case))


def _error(message: str, stream: TextIO) -> int:
    print(f"hookcheck: error: {message}", file=stream, flush=True)
    return 2


def _versions() -> str:
    import jax
    import megatron.core
    import torch

    from torch_impl import installed_megatron

    hook = (
        "native hook"
        if installed_megatron().native_hook
        else "no native hook: the adapter's own path"
    )
    return (
        f"python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"megatron-core {megatron.core.__version__} ({hook}), "
        f"jax {jax.__version__}, {len(jax.devices())} JAX device(s)"
    )


def _jobs(args: argparse.Namespace) -> tuple[list[_Job], list[str]]:
    from ._spec import resolve

    if args.processor or args.reference or args.context:  # --context alone is an error, not ignored
        procs, refs, contexts = args.processor or [], args.reference or [], args.context or []
        if len(procs) != len(refs) or len(contexts) > len(procs):
            raise ContractError(
                "arguments",
                expected="one --reference per --processor (in order), at most one --context each",
                actual=(
                    f"{len(procs)} --processor, {len(refs)} --reference, {len(contexts)} --context"
                ),
            )
        jobs = []
        for i, (proc_spec, ref_spec) in enumerate(zip(procs, refs)):
            context_spec = contexts[i] if i < len(contexts) and contexts[i] != "-" else None
            proc = resolve(proc_spec, field="--processor")
            ref = resolve(ref_spec, field="--reference")
            make = resolve(context_spec, field="--context") if context_spec else None
            if not callable(proc):
                raise ContractError(
                    "--processor",
                    expected=f"{proc_spec} to be a callable processor",
                    actual=type(proc).__name__,
                )
            if not callable(ref):
                raise ContractError(
                    "--reference",
                    expected=f"{ref_spec} to be a callable reference",
                    actual=type(ref).__name__,
                )
            if make is not None and not callable(make):
                raise ContractError(
                    "--context",
                    expected=f"{context_spec} to be a callable make_context(ctx) -> user context",
                    actual=type(make).__name__,
                )
            jobs.append(
                _job(
                    proc_spec.rpartition(":")[2], proc, ref, make, proc_spec, context_spec, ref_spec
                )
            )
        return jobs, []
    jobs, unavailable = [], []
    for check in BUILTIN_CHECKS:
        if check.tp1_only and (args.tp > 1 or args.cp > 1):
            unavailable.append(f"{check.name} ({check.processor}): written for one process only")
            continue
        if check.cp_refused and args.cp > 1:
            unavailable.append(f"{check.name} ({check.processor}): {check.cp_refused}")
            continue
        try:
            proc = resolve(check.processor)
            make = resolve(check.make_context, field="make_context") if check.make_context else None
        except ContractError as exc:
            unavailable.append(f"{check.name} ({check.processor}): {exc.actual}")
            continue
        jobs.append(
            _job(
                check.name, proc, check.reference(), make, check.processor, check.make_context, None
            )
        )
    return jobs, unavailable


def _job(
    name: str,
    proc: Any,
    ref: Any,
    make: Any,
    spec: str,
    context_spec: str | None,
    ref_spec: str | None,
) -> _Job:
    """A job whose reference and context maker name themselves when they raise."""
    ref_name = getattr(ref, "__name__", type(ref).__name__)
    ref_who = f"reference {ref_name!r}" + (f" (--reference {ref_spec})" if ref_spec else "")
    make_blamed = None
    if make is not None:
        make_name = getattr(make, "__name__", type(make).__name__)
        make_blamed = _blamed(f"context maker {make_name!r} (--context {context_spec})", make)
    return _Job(name, proc, _blamed(ref_who, ref), make_blamed, spec, context_spec)


def _run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    progress = _Progress(0, err, args.quiet)
    jobs, unavailable = _jobs(args)
    progress.say(f"hookcheck: {_versions()}")
    for line in unavailable:
        progress.say(f"hookcheck: unavailable, skipped: {line}")
    if not jobs:
        return _error("no processor to check", err)
    # several ranks: float32 unless --dtype asks (each dtype is one more spawn's worth of work)
    one = args.tp == 1 and args.cp == 1
    dtypes = tuple(dict.fromkeys(args.dtype or (DTYPES if one else ("float32",))))
    builtin = not args.processor
    kinds = _synthetic_kinds(args)
    model_cases = [(d, False) for d in dtypes] + (
        [("float32", True)] if "float32" in dtypes and one else []
    )
    progress.total = len(jobs) * (len(model_cases) + len(kinds))
    from .report import CrossCheckReport

    rows: list[Any] = []
    notes: list[str] = []
    if args.cp > 1:
        rows += _run_context_parallel(jobs, dtypes, kinds, args, progress, notes)
    elif args.tp > 1:
        rows += _run_tensor_parallel(jobs, dtypes, args, progress, notes)
    else:
        rows += _run_gpt(jobs, model_cases, args, progress)
    if args.cp == 1:
        rows += _run_synthetic(jobs, kinds, args, progress)
    report = CrossCheckReport("processors" if builtin else jobs[0].name, "jax_ref", tuple(rows))
    _print_report(report, args.full, out)
    for note in notes:
        print(note, file=out)
    failures = report.failures()
    if failures:
        for row in failures[:_MAX_FAILURE_LINES]:
            print(row.fail_line(), file=out)
        if len(failures) > _MAX_FAILURE_LINES:
            print(
                f"... and {len(failures) - _MAX_FAILURE_LINES} more (--full prints every row)",
                file=out,
            )
        print(f"hookcheck: {len(failures)} of {len(report.rows)} comparisons FAILED", file=out)
        return 1
    print(f"hookcheck: all {len(report.rows)} comparisons passed", file=out)
    return 0


def _print_report(report: Any, full: bool, out: TextIO) -> None:
    print(report.table() if full else report.summary(), file=out)
    print(report.legend(), file=out)
    print(file=out)


class _Culprit(Exception):
    """An exception raised inside one of hookcheck's inputs (a reference, a user
    context maker), carrying the input's name so that the error line names it."""

    def __init__(self, who: str, error: Exception) -> None:
        super().__init__(who)
        self.who, self.error = who, error


def _blamed(who: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` whose exceptions are :class:`_Culprit` naming ``who``."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _Culprit:
            raise
        except Exception as exc:
            raise _Culprit(who, exc) from exc

    call.__name__ = getattr(fn, "__name__", type(fn).__name__)
    return call


def _rank_failure(jobs: Any, where: str, expected: str, exc: Exception) -> ContractError:
    """The error of a run on gloo ranks where one rank failed: the processors named, where
    they ran, what they were to do, and the first line of the rank's error."""
    names = ", ".join(repr(j.name) for j in jobs)
    return ContractError(f"processor {names} {where}", expected=expected, actual=_first_line(exc))


def _first_line(exc: BaseException) -> str:
    return (f"{type(exc).__name__}: {exc}".splitlines() or [type(exc).__name__])[0]


@contextlib.contextmanager
def _attributed(job: _Job, case: str, stage: str) -> Iterator[None]:
    """Raise what fails inside as a :class:`ContractError` naming its culprit: the
    reference or the context maker where they raised (:class:`_Culprit`); else,
    in the ``"processor"`` stage (running it through the hook), the processor,
    whose own ``ContractError`` keeps its message; in the ``"reference"`` stage
    (the comparison under ``jax.vjp``), the reference, whose output JAX could not
    take (a ``ContractError`` there already names the reference or the context)."""
    try:
        yield
    except _Culprit as exc:
        raise ContractError(
            exc.who, expected=f"to run on the case [{case}]", actual=_first_line(exc.error)
        ) from None
    except ContractError:
        raise
    except Exception as exc:
        if stage == "reference":
            ref = getattr(job.reference, "__name__", "?")
            raise ContractError(
                f"reference {ref!r}",
                expected=f"an output jax.vjp can take on the case [{case}]",
                actual=_first_line(exc),
            ) from None
        raise ContractError(
            f"processor {job.name!r}", expected="to run on the case", actual=_first_line(exc)
        ) from None


def _case_failed(case: str, exc: Exception) -> ContractError:
    """hookcheck's own case could not be built (not an input's fault: say so)."""
    return ContractError(
        f"case {case!r}",
        expected="to build (hookcheck's tiny GPT or synthetic case; no input of yours is involved)",
        actual=_first_line(exc),
    )


def _run_gpt(
    jobs: list[_Job],
    model_cases: list[tuple[str, bool]],
    args: argparse.Namespace,
    progress: _Progress,
) -> list[Any]:
    from torch_impl.process_state import megatron_parallel

    from .comparison import compare_run
    from .gpt_cases import build_case_model, case_batch
    from .torch_run import run_through_hook

    rows: list[Any] = []
    with megatron_parallel():
        for dtype, tied in model_cases:
            case = "gpt-tied" if tied else "gpt"
            try:
                model = build_case_model(dtype=dtype, tied=tied)
                batch = case_batch()
            except Exception as exc:
                raise _case_failed(f"{case} {dtype}", exc) from None
            for job in jobs:
                with _attributed(job, f"{case}, {dtype}", "processor"):
                    run = run_through_hook(
                        job.processor,
                        model,
                        batch,
                        make_user_context=job.make_context,
                        seed=args.seed,
                    )
                with _attributed(job, f"{case}, {dtype}", "reference"):
                    got = compare_run(run, job.reference, case=case, processor=job.name)
                rows += got
                progress.step(f"{job.name} | {case} {dtype}", _status(got))
    return rows


def _run_synthetic(
    jobs: list[_Job], kinds: Sequence[str], args: argparse.Namespace, progress: _Progress
) -> list[Any]:
    from .cases import synthetic_context
    from .comparison import compare_run
    from .torch_run import run_on_context

    rows: list[Any] = []
    for kind in kinds:
        for job in jobs:
            try:
                ctx = synthetic_context(kind, seed=args.seed)
            except Exception as exc:
                raise _case_failed(f"{kind} float32", exc) from None
            with _attributed(job, f"{kind}, float32", "processor"):
                if job.make_context is not None:
                    ctx = ctx.replace(context=job.make_context(ctx))
                run = run_on_context(job.processor, ctx, seed=args.seed)
            with _attributed(job, f"{kind}, float32", "reference"):
                got = compare_run(run, job.reference, case=kind, processor=job.name)
            rows += got
            progress.step(f"{job.name} | {kind} float32", _status(got))
    return rows


def _run_tensor_parallel(
    jobs: list[_Job],
    dtypes: Sequence[str],
    args: argparse.Namespace,
    progress: _Progress,
    notes: list[str],
) -> list[Any]:
    """The GPT case of every job in every dtype on ``args.tp`` gloo ranks (one spawn), each
    rank compared with the sharded reference under the tolerance of its dtype."""
    from .comparison import cross_check_tensor_parallel
    from .gpt_cases import GPTCase, run_tensor_parallel

    for job in jobs:
        if ":" not in job.spec or (job.make_context is not None and not job.context_spec):
            raise ContractError("--tp", expected="processors named by module:attr", actual=job.spec)
    progress.say(f"hookcheck: starting {args.tp} gloo ranks for {len(jobs)} processor(s) ...")
    pairs = [(job, dtype) for dtype in dtypes for job in jobs]
    cases = [
        GPTCase(processor=j.spec, make_context=j.context_spec, dtype=dtype, seed=args.seed)
        for j, dtype in pairs
    ]
    try:
        all_runs = run_tensor_parallel(cases, tp=args.tp)
    except ContractError:
        raise
    except RuntimeError as exc:  # a rank failed: in a processor or its context maker, run there
        expected = "to run through the hook (with its --context maker, if any)"
        raise _rank_failure(jobs, f"on {args.tp} gloo ranks", expected, exc) from None
    rows: list[Any] = []
    how = ""
    for (job, dtype), runs in zip(pairs, all_runs, strict=True):
        with _attributed(job, f"gpt tp{args.tp}, {dtype}", "reference"):
            report, how = cross_check_tensor_parallel(
                runs, job.reference, processor=job.name, case="gpt"
            )
        rows += report.rows
        progress.step(f"{job.name} | gpt tp{args.tp} {dtype}", _status(report.rows))
    notes.append(f"hookcheck: tp={args.tp}: {how}")
    return rows


def _run_context_parallel(
    jobs: list[_Job],
    dtypes: Sequence[str],
    kinds: Sequence[str],
    args: argparse.Namespace,
    progress: _Progress,
    notes: list[str],
) -> list[Any]:
    """Every case of every job split over ``args.cp`` gloo ranks (one spawn;
    :mod:`.cp_cases`), each put back together and compared with the reference on the
    whole batch: the GPT's hook context in each dtype, and the synthetic kinds whose
    sequence length ``2 cp`` divides."""
    from hookspec import is_hookspec_processor
    from torch_impl.process_state import megatron_parallel

    from .cases import synthetic_context
    from .comparison import compare_run
    from .cp_cases import CPCase, run_context_parallel
    from .gpt_cases import build_case_model, case_batch, context_to_wire
    from .torch_run import capture_context

    cp = args.cp
    for job in jobs:
        if ":" not in job.spec or (job.make_context is not None and not job.context_spec):
            raise ContractError("--cp", expected="processors named by module:attr", actual=job.spec)
        if not is_hookspec_processor(job.processor):
            raise ContractError(
                "--cp",
                expected="hookspec processors (@hookspec.processor): an upstream-style "
                "processor sees no context-parallel group",
                actual=job.spec,
            )
    wholes: list[tuple[_Job, str, str, Any]] = []  # job, case, dtype, the whole context

    def add(job: _Job, case: str, dtype: str, ctx: Any) -> None:
        with _attributed(job, f"{case}, {dtype}", "processor"):
            if job.make_context is not None:
                ctx = ctx.replace(context=job.make_context(ctx))
        wholes.append((job, case, dtype, ctx))

    with megatron_parallel():
        for dtype in dtypes:
            try:
                base = capture_context(build_case_model(dtype=dtype), case_batch())
            except Exception as exc:
                raise _case_failed(f"gpt {dtype}", exc) from None
            for job in jobs:
                add(job, "gpt", dtype, base)
    for kind in kinds:
        try:
            base = synthetic_context(kind, seed=args.seed)
        except Exception as exc:
            raise _case_failed(f"{kind} float32", exc) from None
        if base.seq_len % (2 * cp):
            notes.append(
                f"hookcheck: cp={cp}: case {kind!r} skipped (s={base.seq_len} is no multiple "
                f"of 2 * cp = {2 * cp})"
            )
            progress.total -= len(jobs)
            continue
        for job in jobs:
            add(job, kind, "float32", base)
    progress.say(f"hookcheck: starting {cp} gloo ranks for {len(wholes)} case(s) ...")
    cases = [CPCase(job.spec, context_to_wire(ctx), seed=args.seed) for job, _, _, ctx in wholes]
    try:
        runs = run_context_parallel(cases, [ctx for *_, ctx in wholes], cp=cp)
    except ContractError:
        raise
    except RuntimeError as exc:  # a rank failed: in a processor, run there
        where = f"on {cp} context-parallel gloo ranks"
        raise _rank_failure(jobs, where, "to run on its part of the case", exc) from None
    rows: list[Any] = []
    for (job, case, dtype, _), run in zip(wholes, runs, strict=True):
        with _attributed(job, f"{case} cp{cp}, {dtype}", "reference"):
            got = compare_run(run, job.reference, case=f"{case} cp{cp}", processor=job.name)
        rows += got
        progress.step(f"{job.name} | {case} cp{cp} {dtype}", _status(got))
    notes.append(
        f"hookcheck: cp={cp}: each case split over {cp} ranks as Megatron's "
        "get_batch_on_this_cp_rank splits it; per-token outputs and hidden-state gradients "
        "put back at their positions, scalars (shares) and weight gradients summed, against "
        "the reference on the whole batch"
    )
    return rows


def _status(rows: Sequence[Any]) -> str:
    bad = [r for r in rows if not r.passed]
    return "ok" if not bad else f"FAIL ({len(bad)} of {len(rows)})"


def main(
    argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """Run ``hookcheck`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            args = _parser().parse_args(argv)
    except SystemExit as exit_:  # --help (0), or a bad option (2: argparse printed why)
        return exit_.code if isinstance(exit_.code, int) else 2
    if args.tp < 1:
        return _error(f"--tp: expected an int >= 1, got {args.tp}", err)
    if args.cp < 1:
        return _error(f"--cp: expected an int >= 1, got {args.cp}", err)
    if args.cp > 1 and args.tp > 1:
        return _error(
            f"--cp: expected --tp 1 beside it (tensor and context parallel together are not "
            f"checked), got --tp {args.tp}",
            err,
        )
    if not 0 <= args.seed <= SEED_MAX:
        return _error(f"--seed: expected an int in [0, 2**32 - 1], got {args.seed}", err)
    if args.case and args.no_synthetic:
        return _error(
            "--case: expected no --no-synthetic beside it, "
            f"got --case {' --case '.join(args.case)}",
            err,
        )
    from torch_impl.process_state import known_noise_silenced, tool_state  # torch: not for --help

    with known_noise_silenced():
        from torch_impl.tiny import TinyGPTShape  # Megatron: not for --help

    heads = TinyGPTShape().num_attention_heads
    if heads % args.tp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        expected = f"a divisor of the case model's {heads} attention heads {divisors}"
        return _error(f"--tp: expected {expected}, got {args.tp}", err)
    from .gpt_cases import CASE_SEQ

    if CASE_SEQ % (2 * args.cp):
        sizes = [c for c in range(1, CASE_SEQ + 1) if CASE_SEQ % (2 * c) == 0]
        expected = f"one of {sizes} (2 * cp must divide the cases' sequence length {CASE_SEQ})"
        return _error(f"--cp: expected {expected}, got {args.cp}", err)
    saved_flags = os.environ.get("XLA_FLAGS")
    if args.tp > 1 and _DEVICE_COUNT_FLAG not in (saved_flags or ""):
        # virtual CPU devices for the sharded reference; read when JAX starts its backend
        os.environ["XLA_FLAGS"] = f"{saved_flags or ''} {_DEVICE_COUNT_FLAG}={args.tp}".strip()
    try:
        # run in process (a notebook, a test), the checks run under their own state (float32,
        # grad mode on, no inference mode or autocast) and leave the caller's process group,
        # Megatron groups, RNG, default dtype, grad mode and environment as they were
        with tool_state():
            return _main(args, out, err)
    finally:
        if saved_flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = saved_flags


_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _main(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from torch_impl.process_state import NOISE_NOTE, known_noise_silenced

    with known_noise_silenced():
        if not args.quiet:
            print(f"hookcheck: {NOISE_NOTE}", file=err, flush=True)
        try:
            return _run(args, out, err)
        except ContractError as exc:
            return _error(str(exc), err)
        except Exception as exc:
            if args.traceback:
                raise
            return _error(
                f"{type(exc).__name__}: {exc} (run with --traceback for details)".replace(
                    "\n", " "
                ),
                err,
            )


if __name__ == "__main__":
    sys.exit(main())
