"""The methods the GPU benchmark compares, each ``fn(h, w, y) -> (values, entropy | None)``.

Every method belongs to one *family*, the quantity whose gradient it forms:

- ``lp+ent``: selected-token logprobs and entropy of ``softmax(h @ w.T)``; the
  benchmark's cotangents are ones on both, so the objective is
  ``sum(logprobs) + sum(entropy)``.
- ``lp``: selected-token logprobs only (Liger's and CCE's cross entropy is
  ``-logprobs``); objective ``sum(logprobs)``.
- ``loss``: the fused GRPO scalar loss (:func:`grpo_token_loss` of the logprobs;
  no entropy term), returned as the first element; objective the loss.
- ``ce-mean``: the mean cross entropy over the rows, a scalar (what Liger's fused
  linear cross entropy and CCE serve with ``reduction="mean"``); objective
  ``-mean(logprobs)``. Ours: ``fused_token_loss`` with that token loss (3 GEMMs).
- ``floor``: bare GEMMs, no objective.
- ``replay-ids``, ``replay-topk-topp``, ``replay-topp``: sampling replay, the label's
  logprob under ``softmax(h @ w.T)`` renormalised over the tokens a sampler kept
  (``linear_logprobs(..., support=)``, :data:`REPLAY`): by kept ids (:func:`kept_ids`),
  or by vLLM's parameters with and without a top-k bound; objective the sum of the
  finite logprobs (a label outside the support has logprob ``-inf`` and no gradient).

Methods (a method that cannot run reports why, and the run goes on):

- ``floor3`` / ``floor4``: three bare GEMMs in the input dtype (logits, ``dh``,
  ``dW``), and four (plus the logits again): the times no method can beat.
- ``naive`` / ``naive-loss``: the output layer, fp32 logits ``[n, V]``,
  logsumexp, gather, softmax.
- ``ours-{torch,triton}``, ``ours-ce-{torch,triton}``: ``linear_logprobs`` with
  and without the entropy; ``ours-loss-{torch,triton}``: ``fused_token_loss`` (the
  path ``policy_loss`` takes) with :func:`grpo_token_loss` and ``entropy_grad=False``
  (one pass over each tile on the Triton backend); each on the backend named.
- ``verl-triton``: veRL 0.9.1's Triton ``linear_cross_entropy``
  (``verl/utils/kernel/{kernels,linear_cross_entropy}.py``), loaded by path from the
  carried wheel as a package of its own, with a stand-in ``verl.utils.device`` for
  the four helpers the two files import; never vendored.
- ``verl``: veRL 0.9.1's pure-torch ``FusedLinearForPPO`` (``benchmarks.methods``).
- ``liger``: Liger-Kernel's fused linear cross entropy (Triton, or its CuTe-DSL inner
  cross entropy when ``nvidia-cutlass-dsl`` is importable; the row's note says which).
- ``liger-sm90``: Liger-Kernel's SM90 fused scaled cross entropy (CUTLASS Python DSL,
  logprobs + entropy): needs ``nvidia-cutlass-dsl``. ``scripts/gpu_tests.sh`` installs
  only the wheels ``scripts/gpu_wheels.sh`` puts in ``.whl/`` (at most 64 MiB with the
  working tree), and that package's libraries wheel (about 92 MB) is not among them: the
  row says "not measured" and why, unless the package is already installed.
- ``cce``: Cut Cross-Entropy's ``linear_cross_entropy`` with its defaults (it skips
  gradient tiles below a threshold: inexact by design, and its speed depends on the
  logits); ``cce-exact``: with ``filter_eps=None`` (no filter).
- ``ours-support-ids-{torch,triton}``, ``ours-support-topk-topp-{torch,triton}``,
  ``ours-support-topp-{torch,triton}``: ``linear_logprobs(..., support=)`` (logprobs only)
  by kept ids and by parameters, each against ``ours-ce-<backend>`` (``linear_logprobs``
  on the same shape and backend; ``benchmarks.gpu_results``' "Sampling replay" table).
- Like with like: per-token logprobs (``reduction="none"``: ``liger``, ``cce``,
  ``cce-exact``) against ``ours-ce-triton`` (``linear_logprobs``), family ``lp``; the
  scalar mean (``liger-mean``, ``cce-mean``, ``cce-mean-exact``) against
  ``ours-ce-mean-triton`` (``fused_token_loss``, 3 GEMMs), family ``ce-mean``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
import types
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .methods import floor3, floor4, naive, ppo_terms, verl

__all__ = [
    "FAMILIES",
    "KEPT",
    "METHODS",
    "REPLAY",
    "REPLAY_METHODS",
    "VERL_WHEEL_ENV",
    "Method",
    "NotAvailable",
    "grpo_token_loss",
    "kept_ids",
    "loss_batch",
    "objective",
    "replay_support",
]

VERL_WHEEL_ENV = "HOOKSPEC_VERL_WHEEL"
"""Path of the veRL 0.9.1 wheel (``scripts/gpu_wheels.sh`` downloads it to ``.whl/``)."""

CUTLASS_NOT_CARRIED = (
    "not measured: Liger's SM90 path needs nvidia-cutlass-dsl, which is not installed here; "
    "scripts/gpu_wheels.sh does not put its libraries wheel (about 92 MB) in .whl/, "
    "which holds at most 64 MiB with the working tree"
)

Result = tuple[torch.Tensor, torch.Tensor | None]

KEPT = 64
"""The width of the kept ids, ``[n, KEPT]`` (``benchmarks.sampling``'s on the CPU)."""
REPLAY: dict[str, dict[str, Any]] = {
    "replay-ids": {"kept_ids": KEPT},
    "replay-topk-topp": {"top_k": 50, "top_p": 0.9, "min_p": 0.01},
    "replay-topp": {"top_p": 0.9},
}
"""Each sampling-replay family's support: ``KEPT`` ids a row (:func:`kept_ids`), or vLLM's
parameters (``benchmarks.sampling``'s ``top-k+top-p`` and ``top-p`` on the CPU)."""
FAMILIES = ("floor", "lp+ent", "lp", "loss", "ce-mean", *REPLAY)


class NotAvailable(RuntimeError):
    """A method that cannot run here (a package not installed, a device it does not support)."""


@dataclasses.dataclass(frozen=True)
class Method:
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Result]
    family: str
    backend: str = ""  # ours only: "torch" or "triton"
    cuda_only: bool = False


# ---------------------------------------------------------------- the GRPO/PPO scalar loss

_BATCH: dict[tuple[int, str], dict[str, torch.Tensor]] = {}


def loss_batch(n: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Old logprobs, advantages and a mask for ``n`` tokens (fixed seed, one per size)."""
    key = (n, str(device))
    if key not in _BATCH:
        g = torch.Generator(device=device).manual_seed(1)
        _BATCH.clear()
        mask = (torch.rand(n, generator=g, device=device) > 0.1).float()
        _BATCH[key] = {
            "old": -torch.rand(n, generator=g, device=device) * 12.0,
            "adv": torch.randn(n, generator=g, device=device),
            "weight": mask / mask.sum(),
        }
    return _BATCH[key]


def grpo_token_loss(
    lp: torch.Tensor, ent: torch.Tensor, batch: dict[str, torch.Tensor], rows: slice = slice(None)
) -> torch.Tensor:
    """``sum(weight * max(-A r, -A clip(r, 0.8, 1.2)))`` over ``rows``, ``r = exp(lp -
    old)``: GRPO's clipped objective (no entropy term, as ``PolicyLossConfig.grpo``),
    token-mean weights (``benchmarks.methods.ppo_terms`` without its entropy bonus).
    Runs in the dtype of ``lp``; ``ent`` is not read."""
    old, adv, weight = (batch[k][rows].to(lp.dtype) for k in ("old", "adv", "weight"))
    return (ppo_terms(lp, torch.zeros_like(lp), old, adv) * weight).sum()


def objective(
    family: str, n: int, device: torch.device | str
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The scalar whose gradient a method of ``family`` forms, as a function of
    every row's logprobs and entropy (used in float64 by the reference)."""
    if family == "lp+ent":
        return lambda lp, ent: lp.sum() + ent.sum()
    if family == "lp":
        return lambda lp, ent: lp.sum() + 0.0 * ent.sum()
    if family == "ce-mean":
        return lambda lp, ent: -lp.sum() / n + 0.0 * ent.sum()
    if family == "loss":
        batch = loss_batch(n, device)
        return lambda lp, ent: grpo_token_loss(lp, ent, batch)
    if family in REPLAY:  # -inf: a label outside the support, no gradient
        return lambda lp, ent: torch.where(lp.isfinite(), lp, 0.0).sum() + 0.0 * ent.sum()
    raise ValueError(f"no objective for family {family!r}")


# ---------------------------------------------------------------- ours (the public API only)


def _ours(backend: str, entropy: bool) -> Callable[..., Result]:
    def run(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
        from torch_impl.processors import LinearOptions, linear_logprobs

        options = LinearOptions(backend=backend)  # type: ignore[arg-type]
        r = linear_logprobs(h, w, y, with_entropy=entropy, options=options)
        return r.logprobs, r.entropy

    return run


def _ours_loss(backend: str) -> Callable[..., Result]:
    def run(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
        from torch_impl.processors import LinearOptions, fused_token_loss

        batch = loss_batch(h.shape[0], h.device)

        def token_loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
            return grpo_token_loss(lp, ent, batch, rows)

        options = LinearOptions(backend=backend)  # type: ignore[arg-type]
        # no entropy term: one pass over each tile on the Triton backend
        return fused_token_loss(h, w, y, token_loss, options=options, entropy_grad=False).loss, None

    return run


def _ours_ce_mean(backend: str) -> Callable[..., Result]:
    def run(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
        from torch_impl.processors import LinearOptions, fused_token_loss

        n = h.shape[0]

        def token_loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
            return -lp.sum() / n

        options = LinearOptions(backend=backend)  # type: ignore[arg-type]
        return fused_token_loss(h, w, y, token_loss, options=options, entropy_grad=False).loss, None

    return run


# ---------------------------------------------------------------- sampling replay

_KEPT: dict[tuple[int, int, str], torch.Tensor] = {}


def kept_ids(y: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[n, KEPT]`` kept ids: the label first, then random ids (repeats allowed: they
    count once), -1 past a random count a row (at least the label); fixed seed, one
    draw per size, so that the benchmark's reference reads the ids a method replays."""
    n, device = int(y.shape[0]), y.device
    key = (n, vocab, str(device))
    if key not in _KEPT:
        g = torch.Generator(device=device).manual_seed(2)
        ids = torch.randint(0, vocab, (n, KEPT), generator=g, device=device)
        count = torch.randint(1, KEPT + 1, (n, 1), generator=g, device=device)
        _KEPT.clear()
        _KEPT[key] = torch.where(torch.arange(KEPT, device=device) < count, ids, -1)
    return torch.cat([y[:, None], _KEPT[key][:, 1:]], 1)


def replay_support(family: str, y: torch.Tensor, vocab: int) -> Any:
    """The ``SamplingSupport`` a method of a sampling-replay ``family`` passes."""
    from torch_impl.processors import SamplingSupport

    if family == "replay-ids":
        return SamplingSupport(kept_ids=kept_ids(y, vocab))
    return SamplingSupport(**REPLAY[family])


def _ours_support(backend: str, family: str) -> Callable[..., Result]:
    def run(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
        from torch_impl.processors import LinearOptions, linear_logprobs

        options = LinearOptions(backend=backend)  # type: ignore[arg-type]
        support = replay_support(family, y, w.shape[0])
        return linear_logprobs(h, w, y, options=options, support=support).logprobs, None

    return run


def naive_loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
    lp, ent = naive(h, w, y)
    assert ent is not None
    return grpo_token_loss(lp, ent, loss_batch(h.shape[0], h.device)), None


def floor3_dev(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
    floor3(h, w, y)
    return torch.zeros((), device=h.device), None


def floor4_dev(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
    floor4(h, w, y)
    return torch.zeros((), device=h.device), None


# ---------------------------------------------------------------- peers


_VERL_TRITON: Any = None


def _verl_triton_module() -> Any:
    """veRL's ``linear_cross_entropy`` loaded from the wheel by path (see the module docstring)."""
    global _VERL_TRITON
    if _VERL_TRITON is not None:
        return _VERL_TRITON
    wheel = os.environ.get(VERL_WHEEL_ENV, "")
    if not wheel or not Path(wheel).exists():
        raise NotAvailable(
            f"veRL wheel not found: set {VERL_WHEEL_ENV} (scripts/gpu_bench.sh does)"
        )
    target = Path(os.environ.get("TMPDIR", "/tmp")) / "hookspec-verl-kernel"
    target.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        for name in ("kernels.py", "linear_cross_entropy.py"):
            (target / name).write_bytes(zf.read(f"verl/utils/kernel/{name}"))
    device = types.ModuleType("verl.utils.device")  # the four helpers the two files import
    device.is_cuda_available = torch.cuda.is_available()  # type: ignore[attr-defined]
    device.get_device_capability = (  # type: ignore[attr-defined]
        lambda device_id=0: torch.cuda.get_device_capability(device_id)
    )
    device.get_device_name = lambda: "cuda"  # type: ignore[attr-defined]
    device.get_torch_device = lambda: torch.cuda  # type: ignore[attr-defined]
    for name in ("verl", "verl.utils"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["verl.utils.device"] = device
    package = types.ModuleType("hookspec_bench_verl_kernel")
    package.__path__ = [str(target)]  # type: ignore[attr-defined]
    sys.modules[package.__name__] = package
    spec = importlib.util.spec_from_file_location(
        f"{package.__name__}.linear_cross_entropy", target / "linear_cross_entropy.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    importlib.import_module(
        f"{package.__name__}.kernels"
    )  # what its forward imports: fail here, not timed
    _VERL_TRITON = module
    return module


def verl_triton(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
    logprobs, entropy = _verl_triton_module().linear_cross_entropy(h, w, y, 1.0, "none")
    return logprobs, entropy


def _require(module: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise NotAvailable(
            f"{module} not installed ({what}: run scripts/gpu_wheels.sh, carry .whl)"
        )


def liger_note() -> str:
    """Which inner cross entropy Liger's fused linear cross entropy dispatches to here."""
    if importlib.util.find_spec("cutlass") is not None:
        return "Liger picks its CuTe-DSL inner cross entropy (nvidia-cutlass-dsl importable)"
    return "Triton (nvidia-cutlass-dsl not installed)"


def liger(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
    _require("liger_kernel", "liger-kernel 0.8.5")
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    loss = liger_fused_linear_cross_entropy(h, w, y, reduction="none")
    loss = loss[0] if isinstance(loss, tuple) else loss  # (loss, z_loss) in some releases
    return -loss, None


def liger_sm90(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
    _require("liger_kernel", "liger-kernel 0.8.5")
    if importlib.util.find_spec("cutlass") is None:
        raise NotAvailable(CUTLASS_NOT_CARRIED)
    if h.device.type != "cuda" or torch.cuda.get_device_capability(h.device) != (9, 0):
        raise NotAvailable("Liger's SM90 path runs on compute capability 9.0 only")
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import (
        LigerFusedLinearScaledCrossEntropyFunction,
    )

    nll, entropy = LigerFusedLinearScaledCrossEntropyFunction.apply(h, w, y, 1.0, -100, 1, True)
    return -nll, entropy


def liger_mean(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
    _require("liger_kernel", "liger-kernel 0.8.5")
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    loss = liger_fused_linear_cross_entropy(h, w, y, reduction="mean")
    return (loss[0] if isinstance(loss, tuple) else loss), None


def _cce(reduction: str, exact: bool) -> Callable[..., Result]:
    """CCE's ``linear_cross_entropy``: per token (``-loss`` is the logprob) or the
    mean; with its default gradient filter, or exact (``filter_eps=None``)."""

    def run(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
        _require("cut_cross_entropy", "cut-cross-entropy 25.1.1")
        from cut_cross_entropy import linear_cross_entropy

        kw: dict[str, Any] = {"filter_eps": None} if exact else {}
        loss = linear_cross_entropy(h, w, y, reduction=reduction, **kw)
        return (-loss if reduction == "none" else loss), None

    return run


cce = _cce("none", exact=False)


# In the order they run at each size: what the targets need first.
METHODS: dict[str, Method] = {
    "floor3": Method(floor3_dev, "floor"),
    "floor4": Method(floor4_dev, "floor"),
    "ours-triton": Method(_ours("triton", True), "lp+ent", "triton"),
    "ours-torch": Method(_ours("torch", True), "lp+ent", "torch"),
    "ours-loss-triton": Method(_ours_loss("triton"), "loss", "triton"),
    "ours-loss-torch": Method(_ours_loss("torch"), "loss", "torch"),
    "ours-ce-triton": Method(_ours("triton", False), "lp", "triton"),
    "ours-ce-torch": Method(_ours("torch", False), "lp", "torch"),
    "ours-ce-mean-triton": Method(_ours_ce_mean("triton"), "ce-mean", "triton"),
    "naive": Method(naive, "lp+ent"),
    "naive-loss": Method(naive_loss, "loss"),
    "verl-triton": Method(verl_triton, "lp+ent", cuda_only=True),
    "liger": Method(liger, "lp", cuda_only=True),
    "liger-sm90": Method(liger_sm90, "lp+ent", cuda_only=True),
    "cce": Method(cce, "lp", cuda_only=True),
    "cce-exact": Method(_cce("none", exact=True), "lp", cuda_only=True),
    "liger-mean": Method(liger_mean, "ce-mean", cuda_only=True),
    "cce-mean": Method(_cce("mean", exact=False), "ce-mean", cuda_only=True),
    "cce-mean-exact": Method(_cce("mean", exact=True), "ce-mean", cuda_only=True),
    "verl": Method(verl, "lp+ent"),
    # sampling replay, against ours-ce-<backend> (linear_logprobs) on the same shape
    "ours-support-ids-triton": Method(
        _ours_support("triton", "replay-ids"), "replay-ids", "triton"
    ),
    "ours-support-ids-torch": Method(_ours_support("torch", "replay-ids"), "replay-ids", "torch"),
    "ours-support-topk-topp-triton": Method(
        _ours_support("triton", "replay-topk-topp"), "replay-topk-topp", "triton"
    ),
    "ours-support-topk-topp-torch": Method(
        _ours_support("torch", "replay-topk-topp"), "replay-topk-topp", "torch"
    ),
    "ours-support-topp-triton": Method(
        _ours_support("triton", "replay-topp"), "replay-topp", "triton"
    ),
    "ours-support-topp-torch": Method(
        _ours_support("torch", "replay-topp"), "replay-topp", "torch"
    ),
}
REPLAY_METHODS = [name for name, m in METHODS.items() if m.family in REPLAY]
"""The sampling-replay methods, in their order in :data:`METHODS`."""
