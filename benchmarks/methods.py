"""The methods the benchmarks compare, each ``fn(h, w, y) -> (logprobs, entropy | None)``
or, for the policy loss, ``fn(h, w, y, batch) -> loss``.

Every method computes the same quantities (``hookspec.conventions``):
selected-token logprobs and entropy of ``softmax(h @ w.T)``, or the PPO loss
of those. Baselines:

- ``naive``: what a training loop writes: the output layer, fp32 logits,
  logsumexp, gather, softmax for the entropy (``[n, V]`` tensors throughout).
- ``naive-upcast`` (bf16/fp16 only): the same with the inputs cast to fp32
  first; CPUs without bf16 instructions run fp32 GEMMs several times faster,
  and ours computes in fp32 on a CPU.
- ``verl``: veRL 0.9.1's pure-torch ``FusedLinearForPPO`` (chunks of 512
  tokens, logits recomputed in backward), loaded by file path from the
  unpacked wheel (``scripts/bench.sh`` fetches it); never vendored.
- ``floor3`` / ``floor4``: bare GEMMs (logits, dh, dW; plus the recomputed
  logits), the time no method can beat.
- ``liger`` / ``cce`` (GPU only): Liger-Kernel's fused linear cross entropy and
  Cut Cross-Entropy, which return the cross entropy (``-logprobs``) only.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LOGPROB_METHODS", "POLICY_METHODS", "VERL_ENV", "available"]

VERL_ENV = "HOOKSPEC_VERL_TORCH_FUNCTIONAL"
"""Path of ``verl/utils/experimental/torch_functional.py`` from the unpacked wheel."""

Result = tuple[torch.Tensor, torch.Tensor | None]


def naive(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
    z = (h @ w.T).float()  # the output layer, fp32 logits [n, V]
    lse = z.logsumexp(-1)
    logprobs = z.gather(1, y[:, None]).squeeze(1) - lse
    entropy = lse - (z.softmax(-1) * z).sum(-1)
    return logprobs, entropy


def naive_upcast(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
    """``naive`` with bf16/fp16 inputs cast to fp32 before the output layer: the
    baseline that runs its GEMMs in the dtype ours uses on a CPU."""
    return naive(h.float(), w.float(), y)


def ours(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
    from torch_impl.processors import linear_logprobs  # on use: the baselines run without it

    r = linear_logprobs(h, w, y, with_entropy=True)
    return r.logprobs, r.entropy


@functools.cache
def _load_verl() -> Any:
    """The module, loaded once per process (a call does not time the import)."""
    path = os.environ.get(VERL_ENV)
    if not path or not os.path.exists(path):
        raise RuntimeError(
            f"veRL's torch_functional.py not found: set {VERL_ENV} (scripts/bench.sh does)"
        )
    spec = importlib.util.spec_from_file_location("verl_torch_functional", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def verl(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
    fused = _load_verl().FusedLinearForPPO(chunk_size=512)
    logprobs, entropy = fused(h, w, y, temperature=1.0)
    return logprobs, entropy


def floor3(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
    """Three bare GEMMs in the input dtype: logits, ``dh``, ``dW``."""
    with torch.no_grad():
        z = h @ w.T
        h.grad = z @ w
        w.grad = z.T @ h
    return torch.zeros(h.shape[0]), None


def floor4(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
    """Four bare GEMMs: the logits twice (forward, recomputed), ``dh``, ``dW``."""
    with torch.no_grad():
        torch.mm(h, w.T)
    return floor3(h, w, y)


def liger(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    loss = liger_fused_linear_cross_entropy(h, w, y, reduction="none")
    loss = loss[0] if isinstance(loss, tuple) else loss  # (loss, z_loss) in some releases
    return -loss, None


def cce(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
    from cut_cross_entropy import linear_cross_entropy

    return -linear_cross_entropy(h, w, y, reduction="none"), None


def ours_ce(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
    """Ours without the entropy, the quantity Liger and CCE compute."""
    from torch_impl.processors import linear_logprobs

    return linear_logprobs(h, w, y).logprobs, None


LOGPROB_METHODS: dict[str, Callable[..., Result]] = {
    "naive": naive,
    "naive-upcast": naive_upcast,
    "verl": verl,
    "ours": ours,
    "floor3": floor3,
    "floor4": floor4,
    "liger": liger,
    "cce": cce,
    "ours-ce": ours_ce,
}


# ---------------------------------------------------------------- policy loss

CLIP, ENTROPY_COEF, CLAMP = 0.2, 0.01, 20.0


def ppo_terms(
    lp: torch.Tensor, ent: torch.Tensor, old: torch.Tensor, adv: torch.Tensor
) -> torch.Tensor:
    """Per-token PPO clip with an entropy bonus: ``max(-A r, -A clip(r)) - c * H``."""
    ratio = torch.exp((lp - old).clamp(-CLAMP, CLAMP))
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
    return pg - ENTROPY_COEF * ent


def _policy_of(
    stats: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]
    ],
) -> Callable[..., torch.Tensor]:
    """The token-mean PPO loss of ``stats(h, w, y) -> (logprobs, entropy)``."""

    def loss(
        h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        lp, ent = stats(h, w, y)
        assert ent is not None
        return (ppo_terms(lp, ent, batch["old"], batch["adv"]) * batch["mask"]).sum() / batch[
            "mask"
        ].sum()

    return loss


policy_naive = _policy_of(naive)
policy_naive_upcast = _policy_of(naive_upcast)
policy_autograd = _policy_of(ours)


def policy_fused(
    h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, batch: dict[str, torch.Tensor]
) -> torch.Tensor:
    weights = batch["mask"] / batch["mask"].sum()

    def token_loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
        return (ppo_terms(lp, ent, batch["old"][rows], batch["adv"][rows]) * weights[rows]).sum()

    from torch_impl.processors import fused_token_loss

    return fused_token_loss(h, w, y, token_loss).loss


POLICY_METHODS: dict[str, Callable[..., torch.Tensor]] = {
    "policy-naive": policy_naive,
    "policy-naive-upcast": policy_naive_upcast,
    "policy-ours-autograd": policy_autograd,
    "policy-ours-fused": policy_fused,
}


def available(method: str, device: str) -> tuple[bool, str]:
    """Whether ``method`` can run here, and why not."""
    if method in ("liger", "cce"):
        if device != "cuda":
            return False, "GPU only (Triton kernels)"
        module = "liger_kernel" if method == "liger" else "cut_cross_entropy"
        if importlib.util.find_spec(module) is None:
            return False, f"{module} not installed"
    if method == "verl" and not os.path.exists(os.environ.get(VERL_ENV, "")):
        return False, f"{VERL_ENV} not set (run scripts/bench.sh)"
    return True, ""
