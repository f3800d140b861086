"""The policy loss's float64 truth, shared by the single-process and the
context-parallel tests: the full logits, every formula written out."""

from __future__ import annotations

import torch

from torch_impl.processors import PolicyBatch, PolicyLossConfig

IGNORE = -100


def policy_truth(
    h: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    batch: PolicyBatch,
    cfg: PolicyLossConfig,
    sequences: list[list[tuple[int, int]]] | None = None,
    loss_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Loss, metrics and gradients in float64 with the full logits."""
    h = h.detach().double().requires_grad_()
    w = w.detach().double().requires_grad_()
    b, s = labels.shape
    t = batch.temperature
    t = 1.0 if t is None else (t.double()[..., None] if isinstance(t, torch.Tensor) else t)
    z = torch.einsum("sbh,vh->bsv", h, w) / t
    logp_all = z.log_softmax(-1)
    lp = logp_all.gather(2, labels.clamp(min=0)[..., None]).squeeze(-1)
    lp = torch.where(labels == IGNORE, 0.0, lp)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    mask = batch.mask if batch.mask is not None else loss_mask
    m = (torch.ones(b, s) if mask is None else mask).double() * (labels != IGNORE)
    if sequences is None:
        sequences = [[(i, j) for j in range(s)] for i in range(b)]
    old, adv = batch.old_logprobs.double(), batch.advantages.double()
    clamp = cfg.log_ratio_clamp or float("inf")
    if cfg.ratio == "token":
        log_ratio = torch.where(m > 0, lp - old, 0.0).clamp(-clamp, clamp)
    else:
        per_token: dict[tuple[int, int], torch.Tensor] = {}
        for seq in sequences:
            n_k = sum(m[i, j] for i, j in seq)
            mean = (
                sum(m[i, j] * (lp[i, j] - old[i, j]) for i, j in seq) / n_k
                if n_k > 0
                else lp.sum() * 0
            )
            for i, j in seq:
                per_token[i, j] = torch.as_tensor(mean).clamp(-clamp, clamp)
        zero = lp.sum() * 0
        log_ratio = torch.stack(
            [torch.stack([per_token.get((i, j), zero) for j in range(s)]) for i in range(b)]
        )
    ratio = torch.exp(log_ratio)
    hi = cfg.clip_low if cfg.clip_high is None else cfg.clip_high
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - cfg.clip_low, 1 + hi)
    pg = torch.maximum(pg1, pg2)
    dual = None
    if cfg.dual_clip is not None:
        dual = (adv < 0) & (pg > -adv * cfg.dual_clip)
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.dual_clip), pg)
    ref = (
        torch.where(m > 0, batch.ref_logprobs.double(), lp.detach())
        if batch.ref_logprobs is not None
        else None
    )
    kl = None
    if ref is not None:
        r = (ref - lp).clamp(-clamp, clamp)
        kl = {"k1": -r, "k2": r**2 / 2, "k3": torch.exp(r) - r - 1}[cfg.kl_estimator.value]
    per_token = pg + (cfg.kl_coef * kl if kl is not None else 0.0) - cfg.entropy_coef * ent

    def aggregate(x: torch.Tensor) -> torch.Tensor:
        how = cfg.aggregation.value
        if how == "token-mean":
            total = m.sum() if batch.global_tokens is None else batch.global_tokens
            return (x * m).sum() / total if total > 0 else (x * 0).sum()
        sums, counts = [], []
        for seq in sequences:
            sums.append(sum(x[i, j] * m[i, j] for i, j in seq))
            counts.append(sum(m[i, j] for i, j in seq))
        live = [k for k, c in enumerate(counts) if c > 0]
        k_seq = len(live) if batch.global_sequences is None else batch.global_sequences
        if not live:
            return (x * 0).sum()
        if how == "seq-mean-token-sum":
            return sum(sums[k] for k in live) / k_seq
        return sum(sums[k] / counts[k] for k in live) / k_seq

    loss = aggregate(per_token)
    loss.backward()
    mm = m.sum()
    r_old = (old - lp.detach()).clamp(-clamp, clamp)
    out = {
        "loss": loss.detach(),
        "pg_loss": aggregate(pg.detach()),
        "entropy": (ent.detach() * m).sum() / mm,
        "clip_fraction": ((pg2 > pg1).double() * m).sum() / mm,
        "approx_kl": (torch.where(m > 0, torch.exp(r_old) - r_old - 1, 0.0) * m).sum() / mm,
        "dh": h.grad,
        "dw": w.grad,
    }
    if kl is not None:
        out["kl"] = aggregate(kl.detach())
    if dual is not None:
        out["dual_clip_fraction"] = (dual.double() * m).sum() / mm
    return out
