"""``python -m torch_impl.doctor``: the installed Megatron Core, the adapter's path
on it, and whether the output hook holds there.

It prints the project's version and the contract's ``SPEC_VERSION``; the torch,
megatron-core, triton and Transformer Engine versions (or "absent"); the CUDA
device; which backend ``backend="auto"`` picks there and whether that choice was
measured on this device class (:func:`environment`). Then the installed release
(from the distribution metadata, checked
against the ``megatron.core`` package actually imported), the adapter path it
takes, the release's facts as read from its code (:func:`facts_row`, the
row of the release table in docs/releases.md), whether the release is in the CI matrix
(:data:`MATRIX_RELEASES`), and then runs the checks on a tiny CPU model
(:func:`run_checks`, a few seconds): bitwise stock without a processor, tied and
untied; a hookspec and an upstream-style processor through the output layer,
bitwise the stock loss and gradients; on a model with MTP layers, the stock
MTP losses under a main processor and under the per-depth MTP processor; a
``HybridModel`` where the release has one; on a CUDA machine, the processors on
both backends against the torch path and float64, and the label check without a
host read (skipped on a CPU, with the reason). A release outside the matrix gets
every check that applies to it, each reported as passed, failed or skipped
(with the reason read from the installed code), rather than a refusal.

Exit status: 0 when no check failed, 1 otherwise.

``--facts-row`` prints only the release-table row (docs/releases.md); ``--no-checks`` skips
the checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal

import torch

from .process_state import known_noise_silenced, megatron_parallel, tool_state

if TYPE_CHECKING:
    from ._compat import InstalledMegatron

__all__ = [
    "MATRIX_RELEASES",
    "TABLE_HEADER",
    "CheckResult",
    "Environment",
    "SkipCheck",
    "adapter_path",
    "default_checks",
    "environment",
    "facts_row",
    "gpu_checks",
    "main",
    "run_checks",
]

MATRIX_RELEASES: dict[str, str] = {
    "0.13.1": "3.11",
    "0.14.0": "3.11",
    "0.15.3": "3.11",
    "0.16.1": "3.11",
    "0.17.1": "3.12",
    "0.18.2": "3.12",
    "0.19.2": "3.12",
}
"""The releases ``scripts/matrix.sh`` checks in CI, and their Python (the full
suite runs on 0.16.1 and 0.19.2)."""

TABLE_HEADER = (
    "| release | native hook | MTP loss computed in | MTP labels from `input_ids` | `HybridModel` "
    "| `build_schedule_plan`: `ScheduleNode` stream | Megatron defects the adapter works around |"
)


def _installed() -> InstalledMegatron:
    """``torch_impl._compat.installed_megatron()``, the one object where every fact
    read from the installed Megatron Core lives (imported here, not at the
    doctor's import, so that Megatron's import-time notices fall inside
    :func:`~torch_impl.process_state.known_noise_silenced`)."""
    from ._compat import installed_megatron

    return installed_megatron()


def facts_row(facts: InstalledMegatron | None = None) -> str:
    """The release-table row of docs/releases.md for ``facts`` (default: the
    installed release's ``torch_impl.installed_megatron()``): release, native
    hook, where the MTP losses are computed, MTP labels from ``input_ids``,
    ``HybridModel``, the schedule plan's stream, the Megatron defects the adapter
    works around."""
    m = _installed() if facts is None else facts

    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    cells = [
        m.release,
        yes(m.native_hook),
        m.mtp_loss_site,
        yes(m.mtp_labels_from_input_ids),
        yes(m.hybrid_model),
        m.schedule_plan,
        "; ".join(m.workarounds()) or "none",
    ]
    return "| " + " | ".join(cells) + " |"


@dataclasses.dataclass(frozen=True)
class Environment:
    """What an adopter needs to know of this machine: versions (``"absent"`` where a
    package is not installed), the CUDA device, and ``backend="auto"``'s choice."""

    project: str
    spec_version: str
    python: str
    torch: str
    megatron_core: str
    triton: str
    transformer_engine: str
    cuda_device: str
    device_class: str | None
    auto_backend: str
    auto_measured: bool
    auto_source: str

    def lines(self) -> list[str]:
        if self.device_class is None:  # the CPU: the rule, no measurement to speak of
            why = self.auto_source
        elif self.auto_measured:
            why = f"measured on this device class: {self.auto_source}"
        else:
            why = f"not measured on this device class: {self.auto_source}"
        return [
            f"mcore-hookspec {self.project}, contract SPEC_VERSION {self.spec_version}",
            f"Python {self.python}; torch {self.torch}; megatron-core {self.megatron_core}; "
            f"triton {self.triton}; transformer-engine {self.transformer_engine}",
            f"CUDA device: {self.cuda_device}"
            + (f" (device class {self.device_class})" if self.device_class else ""),
            f'backend "auto": {self.auto_backend} ({why})',
        ]


def _version(*names: str, module: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "installed (no distribution metadata)" if importlib.util.find_spec(module) else "absent"


def environment() -> Environment:
    """The :class:`Environment` of this process (on a CPU, CUDA is not initialised)."""
    import hookspec

    from .processors import auto_choice, device_class

    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(device)
        capability = torch.cuda.get_device_capability(device)
        cuda = f"{name}, sm_{capability[0]}{capability[1]}, {torch.cuda.device_count()} visible"
        klass: str | None = device_class(name, capability)
    else:
        device, cuda, klass = torch.device("cpu"), "none (torch.cuda.is_available() is False)", None
    choice = auto_choice(device)
    where = "this CUDA device" if device.type == "cuda" else "the CPU"
    return Environment(
        project=_version("mcore-hookspec", module="hookspec").replace(
            "installed (no distribution metadata)", "a checkout (not installed)"
        ),
        spec_version=".".join(str(v) for v in hookspec.SPEC_VERSION),
        python=sys.version.split()[0],
        torch=torch.__version__,
        megatron_core=_version("megatron-core", module="megatron.core"),
        triton=_version("triton", module="triton"),
        transformer_engine=_version(
            "transformer-engine",
            "transformer_engine",
            "transformer-engine-torch",
            module="transformer_engine",
        ),
        cuda_device=cuda,
        device_class=klass,
        auto_backend=f"{choice.backend} on {where}",
        auto_measured=choice.measured,
        auto_source=choice.source,
    )


def adapter_path(facts: InstalledMegatron) -> str:
    """Which way the adapter runs a processor on this release, in words."""
    if facts.native_hook:
        main = (
            "native hook: the adapter hands Megatron's `output_processor=` a bridge to the "
            "typed context"
        )
    else:
        main = (
            "no native hook: the adapter's own `_postprocess` runs the processor in place of "
            "the output layer"
        )
    return (
        main + " (decided from `GPTModel.forward`'s signature); a model with MTP layers takes the "
        "adapter's own `_postprocess` on every release"
    )


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One check: ``status`` is ``"pass"``, ``"fail"`` or ``"skip"``; ``detail``
    the failure or the reason for the skip."""

    name: str
    status: str
    detail: str = ""
    seconds: float = 0.0


class SkipCheck(Exception):
    """Raised by a check that does not apply to the installed release (the message says why)."""


def _stock_loss(ctx: Any) -> torch.Tensor:
    """The stock head as a hookspec processor, through the output layer (the
    upstream-style one is ``torch_impl._call.default_output``)."""
    logits, _ = ctx.output_layer(
        ctx.hidden_states, weight=ctx.output_weight, runtime_gather_output=ctx.runtime_gather_output
    )
    return ctx.compute_language_model_loss(ctx.labels, ctx.scale_logits(logits))


def _run(
    model: Any, batch: dict[str, Any], **kw: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(batch["input_ids"], batch["position_ids"], None, **kw)
    out.float().sum().backward()
    return out.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _same(
    got: tuple[torch.Tensor, dict[str, torch.Tensor]],
    want: tuple[torch.Tensor, dict[str, torch.Tensor]],
    what: str,
) -> None:
    if not torch.equal(got[0], want[0]):
        raise AssertionError(
            f"{what}: output differs from stock (max |diff| {(got[0] - want[0]).abs().max():.3g})"
        )
    if got[1].keys() != want[1].keys():
        raise AssertionError(
            f"{what}: gradients of {sorted(set(got[1]) ^ set(want[1]))} present on one side only"
        )
    for name in want[1]:
        if not torch.equal(got[1][name], want[1][name]):
            raise AssertionError(f"{what}: gradient of {name} differs from stock")


def _gpt_checks() -> Iterator[tuple[str, Callable[[], None]]]:
    import hookspec

    from ._call import default_output
    from .enable import enable_output_processor
    from .tiny import build_tiny_gpt, tiny_batch

    batch = tiny_batch()
    kw = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]}
    stock_hookspec = hookspec.processor(_stock_loss, name="stock_loss")

    def without_processor() -> None:
        for tied in (False, True):
            want = _run(build_tiny_gpt(share_embeddings_and_output_weights=tied), batch, **kw)
            model = enable_output_processor(
                build_tiny_gpt(share_embeddings_and_output_weights=tied)
            )
            _same(_run(model, batch, **kw), want, f"tied={tied}")
            logits_want = _run(build_tiny_gpt(share_embeddings_and_output_weights=tied), batch)
            _same(_run(model, batch), logits_want, f"tied={tied}, logits")

    def through(processor: Any) -> Callable[[], None]:
        def check() -> None:
            for tied in (False, True):
                want = _run(build_tiny_gpt(share_embeddings_and_output_weights=tied), batch, **kw)
                model = enable_output_processor(
                    build_tiny_gpt(share_embeddings_and_output_weights=tied)
                )
                _same(_run(model, batch, **kw, output_processor=processor), want, f"tied={tied}")

        return check

    yield (
        "GPT without a processor: loss, logits and gradients bitwise stock (untied, tied)",
        without_processor,
    )
    yield (
        "GPT, hookspec processor through the output layer: bitwise the stock loss and gradients",
        through(stock_hookspec),
    )
    yield (
        "GPT, upstream-style processor (16 keywords): bitwise the stock loss and gradients",
        through(default_output),
    )


def _mtp_checks() -> Iterator[tuple[str, Callable[[], None]]]:
    from ._call import default_output
    from .enable import enable_output_processor
    from .mtp import default_mtp_loss
    from .tiny import TinyGPTShape, build_tiny_gpt, cpu_layer_spec, tiny_batch, tiny_config

    def build() -> Any:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        # mtp_loss_scaling_factor is None by default where the block computes the loss.
        options: dict[str, Any] = {"mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.1}
        config = tiny_config(TinyGPTShape(), **options)
        spec = get_gpt_mtp_block_spec(config, cpu_layer_spec(), use_transformer_engine=False)
        return build_tiny_gpt(mtp_block_spec=spec, **options).eval()

    batch = tiny_batch()
    loss_mask = torch.ones(2, 8)
    loss_mask[0, 5:] = 0.0  # uneven token counts per depth
    kw = {"labels": batch["labels"], "loss_mask": loss_mask}

    def main_processor() -> None:
        want = _run(build(), batch, **kw)
        model = enable_output_processor(build())
        _same(_run(model, batch, **kw, output_processor=default_output), want, "main processor")

    def mtp_processor() -> None:
        if _installed().mtp_loss_in_block:
            raise SkipCheck(
                "MultiTokenPredictionBlock.forward computes the MTP losses on this release "
                "(it takes compute_language_model_loss): no per-depth processor"
            )
        want = _run(build(), batch, **kw)
        model = enable_output_processor(build())
        _same(_run(model, batch, **kw, mtp_processor=default_mtp_loss), want, "default_mtp_loss")

    yield "GPT with 2 MTP layers, main processor: stock MTP losses, bitwise stock", main_processor
    yield "GPT with 2 MTP layers, default_mtp_loss as mtp_processor: bitwise stock", mtp_processor


def _hybrid_checks() -> Iterator[tuple[str, Callable[[], None]]]:
    def check() -> None:
        if not _installed().hybrid_model:
            raise SkipCheck("no megatron.core.models.hybrid in this release")
        from ._call import default_output
        from .enable import enable_output_processor
        from .tiny import tiny_batch
        from .tiny_hybrid import build_tiny_hybrid

        batch = tiny_batch()
        kw = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]}
        want = _run(build_tiny_hybrid("*-*-"), batch, **kw)
        model = enable_output_processor(build_tiny_hybrid("*-*-"))
        _same(_run(model, batch, **kw), want, "no processor")
        _same(_run(model, batch, **kw, output_processor=default_output), want, "processor")

    yield "HybridModel (*-*-), without and with a processor: bitwise stock", check


def _need_cuda(device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SkipCheck(
            "no CUDA device: the GPU checks run on a CUDA machine (torch.cuda.is_available() "
            "is False)"
        )


def _gpu_case(
    dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Awkward sizes on ``device`` in ``dtype``, and the float64 truth on the same
    rounded inputs: ``logprobs``, ``d(sum logprobs)/d hidden``."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 67, 96, 1003
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100
    h64 = hidden.double().requires_grad_()
    logp = torch.log_softmax(h64 @ weight.double().T, dim=-1)
    truth = torch.where(labels == -100, 0.0, logp.gather(1, labels.clamp(min=0)[:, None])[:, 0])
    (grad,) = torch.autograd.grad(truth.sum(), h64)
    return hidden.to(device), weight.to(device), labels.to(device), truth.detach(), grad


def _gpu_backends() -> list[Literal["torch", "triton"]]:
    """Both backends where Triton imports (it ships with torch's CUDA builds), else torch."""
    return ["torch", "triton"] if importlib.util.find_spec("triton") is not None else ["torch"]


def gpu_checks(device: torch.device | str = "cuda") -> Iterator[tuple[str, Callable[[], None]]]:
    """The GPU checks, by name, on ``device``: skipped on ``"cuda"`` without a CUDA
    device. On a CPU (with Triton's interpreter, ``TRITON_INTERPRET=1``, for the
    Triton backend) they run the same calls, so that the CPU suite runs this code;
    there the label check is read at once, inside the call."""
    dev = torch.device(device)

    yield (
        "GPU: linear_logprobs on both backends (fp32, bf16) against the torch path and float64",
        functools.partial(_backends_agree, dev),
    )
    yield (
        "GPU: the label check makes no host read and reports a bad label later",
        functools.partial(_label_check_without_host_read, dev),
    )


def _backends_agree(dev: torch.device) -> None:
    """:func:`gpu_checks`' first: ``linear_logprobs`` and its gradient on each backend, at
    fp32 and bf16, against float64 and against the torch path."""
    _need_cuda(dev)
    from .processors import LinearOptions, linear_logprobs

    for dtype, rtol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        hidden, weight, labels, truth, grad = _gpu_case(dtype, dev)
        got = {}
        for backend in _gpu_backends():
            h = hidden.clone().requires_grad_()
            r = linear_logprobs(h, weight, labels, options=LinearOptions(backend=backend))
            (dh,) = torch.autograd.grad(r.logprobs.sum(), h)
            got[backend] = (r.logprobs.detach().double().cpu(), dh.double().cpu())
        for backend, (lp, dh) in got.items():
            for what, a, want in (("logprobs", lp, truth), ("d/d hidden", dh, grad)):
                scale = float(want.abs().max())
                err = float((a - want).abs().max())
                if not err <= rtol * scale:
                    raise AssertionError(
                        f"{backend} {str(dtype).removeprefix('torch.')} {what}: max abs err "
                        f"{err:.3g} against float64, allowed {rtol:g} * {scale:.3g}"
                    )
                base = got["torch"][0 if what == "logprobs" else 1]
                diff = float((a - base).abs().max())
                if not diff <= rtol * scale:
                    raise AssertionError(f"{backend} {what}: {diff:.3g} from the torch path")


def _label_check_without_host_read(dev: torch.device) -> None:
    """:func:`gpu_checks`' second: an out-of-range label is reported, on a GPU by the
    deferred check after the call (which reads nothing back to the host), on a CPU at once."""
    _need_cuda(dev)
    from hookspec import ContractError

    from .processors import LinearOptions, linear_logprobs
    from .value_checks import pending_checks, raise_pending_errors

    hidden, weight, labels, _, _ = _gpu_case(torch.float32, dev)
    raise_pending_errors(wait=True)
    for backend in _gpu_backends():
        bad = labels.clone()
        bad[3] = weight.shape[0] + 5  # a label no row holds
        h = hidden.clone().requires_grad_()
        options = LinearOptions(backend=backend)
        if dev.type != "cuda":  # read at once, inside the call
            try:
                linear_logprobs(h, weight, bad, options=options)
            except ContractError as error:
                if error.field != "labels":
                    raise
                continue
            raise AssertionError(f"{backend}: the out-of-range label was not reported")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # a host read raises here
        try:
            r = linear_logprobs(h, weight, bad, options=options)
            r.logprobs.sum().backward()
            pending = pending_checks()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if pending < 1:
            raise AssertionError(f"{backend}: no deferred label check was queued")
        try:
            raise_pending_errors(wait=True)
        except ContractError as error:
            if error.field != "labels":
                raise
        else:
            raise AssertionError(f"{backend}: the out-of-range label was not reported")


def default_checks() -> Iterator[tuple[str, Callable[[], None]]]:
    """The doctor's checks, by name: GPT, GPT with MTP layers, HybridModel, and the
    GPU checks (skipped without a CUDA device)."""
    for group in (_gpt_checks, _mtp_checks, _hybrid_checks, gpu_checks):
        yield from group()


def run_checks(checks: Iterable[tuple[str, Callable[[], None]]] | None = None) -> list[CheckResult]:
    """Run ``checks`` (default: :func:`default_checks`), each in Megatron's groups
    over gloo (world size 1). A check that raises is a failure carrying the
    exception and where it was raised, never a crash; ``SkipCheck`` a skip.

    The checks run under their own state, whatever the caller's
    (:func:`torch_impl.process_state.tool_state`: float32 default dtype, grad
    mode on, inference mode and autocast off), and leave the caller's as found:
    a process group and Megatron groups it initialised (world size 1) are used
    and kept, every group the checks made is destroyed, and the RNG states,
    default dtype, grad mode and environment variables are restored. Megatron's
    known notices on a CPU are silenced (``known_noise_silenced``)."""
    with known_noise_silenced(), tool_state():
        return _run_checks(default_checks() if checks is None else checks)


def _run_checks(checks: Iterable[tuple[str, Callable[[], None]]]) -> list[CheckResult]:
    results: list[CheckResult] = []
    for name, check in checks:
        start = time.perf_counter()
        try:
            with megatron_parallel():  # one process: an in-memory store, no port
                check()
        except SkipCheck as skip:
            results.append(CheckResult(name, "skip", str(skip), time.perf_counter() - start))
        except Exception as error:
            last = traceback.extract_tb(error.__traceback__)[-1]
            where = f" ({os.path.basename(last.filename)}:{last.lineno})"
            detail = f"{type(error).__name__}: {error}{where}"
            results.append(CheckResult(name, "fail", detail, time.perf_counter() - start))
        else:
            results.append(CheckResult(name, "pass", "", time.perf_counter() - start))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torch_impl.doctor", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--facts-row",
        action="store_true",
        help="print only the release-table row of docs/releases.md",
    )
    parser.add_argument("--no-checks", action="store_true", help="print the facts, run no checks")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0), or a bad option (2; argparse printed why)
        return exit_.code if isinstance(exit_.code, int) else 2
    with known_noise_silenced():
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    installed = _installed()
    if args.facts_row:
        print(facts_row(installed))
        return 0
    for line in environment().lines():
        print(line)
    print(f"megatron-core {installed.release} at {installed.package}")
    if installed.shadowed:
        print("warning: the megatron-core metadata found first is not that of the imported package")
    print(f"adapter path: {adapter_path(installed)}")
    python = MATRIX_RELEASES.get(installed.release)
    if python is not None:
        print(f"covered: yes, {installed.release} is in the CI release matrix (on Python {python})")
    else:
        print(
            f"covered: no, {installed.release} is not in the CI release matrix "
            f"({', '.join(MATRIX_RELEASES)}); the checks below say what holds here"
        )
    print("facts (read from the installed code):")
    print(f"  {TABLE_HEADER}")
    print(f"  {facts_row(installed)}")
    if args.no_checks:
        return 0
    print("checks (tiny CPU model; the GPU checks on a CUDA device):")
    results = run_checks()
    for r in results:
        line = f"  {r.status.upper():4}  {r.name}  [{r.seconds:.1f} s]"
        print(line + (f"\n        {r.detail}" if r.detail else ""))
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "skip")}
    print(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped")
    if counts["fail"] and python is None:
        print(
            "this release is outside the matrix: the failed checks above are what does not "
            "hold here"
        )
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
