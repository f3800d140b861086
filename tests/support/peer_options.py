"""The peers' options at an awkward size against float64, one body for the GPU check
(``tests/processors/test_gpu_checks.py``, compiled, at 1031 x 512 x 20011) and a CPU test
(``tests/processors/test_softcap.py``, small, the Triton interpreter), so that the GPU check's
API drift fails CI and not the GPU command."""

from __future__ import annotations

import torch

from torch_impl.processors import LinearOptions, fused_token_loss, linear_logprobs

__all__ = ["gpu_inputs", "peer_options"]

IGNORE = -100


def gpu_inputs(
    n: int,
    h: int,
    v: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device: str = "cuda",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``[n, h]``, a weight ``[v, h]`` scaled by ``h ** -0.5``, labels with every
    17th ignored: the GPU checks' inputs."""
    g = torch.Generator(device=device).manual_seed(seed)
    hid = torch.randn(n, h, device=device, generator=g).to(dtype)
    w = (torch.randn(v, h, device=device, generator=g) * h**-0.5).to(dtype)
    y = torch.randint(0, v, (n,), device=device, generator=g)
    y[::17] = IGNORE
    return hid, w, y


def peer_options(n: int, h: int, v: int, dtype: torch.dtype, device: str, backend: str) -> None:
    """The peers' options at an awkward size: a softcap (the tanh inside the
    Triton kernels), a bias, a per-token temperature and a z-loss through
    ``linear_logprobs`` and the fused loss's single pass: values, ``dh`` on a row subset,
    ``dW`` and ``db`` on a vocabulary subset against float64 of the same rounded inputs."""
    cap = 30.0
    hid, w, y = gpu_inputs(n, h, v, dtype=dtype, seed=5, device=device)
    g = torch.Generator(device=device).manual_seed(6)
    b = (torch.randn(v, device=device, generator=g) * 2.0).to(dtype)
    t = torch.rand(n, device=device, generator=g) + 0.5
    hid = hid * 4.0  # logits up to ~40: the cap bites
    rows = torch.arange(0, n, 8, device=device)
    cols = torch.cat([y[y != IGNORE][:64], torch.arange(0, v, 211, device=device)]).unique()
    tol = {torch.bfloat16: 2e-2, torch.float32: 1e-4}[dtype]
    opts = LinearOptions(backend=backend, softcap=cap, temperature=t)  # type: ignore[arg-type]
    for fused in (False, True):
        leaves = [x.clone().requires_grad_() for x in (hid, w, b)]
        h64, w64, b64 = (x.double().requires_grad_() for x in (hid, w, b))
        z = cap * torch.tanh((h64 @ w64.T + b64) / cap) / t.double()[:, None]
        logp = z.log_softmax(-1)
        lp = torch.where(y != IGNORE, logp.gather(1, y.clamp(min=0)[:, None]).squeeze(1), 0.0)
        lse = torch.logsumexp(z, -1)
        (-lp.sum() / n + 1e-3 * (lse**2).sum() / n).backward()
        if fused:
            r = fused_token_loss(
                *leaves[:2],
                y,
                lambda lp, _, rows: -lp.sum() / n,
                options=opts,
                bias=leaves[2],
                lse_loss=lambda lse, rows: 1e-3 * (lse**2).sum() / n,
            )
            got_lp = r.logprobs
            r.loss.backward()
        else:
            r2 = linear_logprobs(*leaves[:2], y, options=opts, bias=leaves[2])
            got_lp = r2.logprobs
            lse_err = float((r2.lse.detach().double() - lse.detach()).abs().max())
            assert lse_err <= tol * float(lse.detach().abs().max())
            (-r2.logprobs.sum() / n + 1e-3 * (r2.lse**2).sum() / n).backward()
        lp_err = float((got_lp.detach().double() - lp.detach()).abs().max())
        assert lp_err <= tol * float(lp.detach().abs().max())
        for got, want, sub in zip(
            (x.grad for x in leaves), (h64.grad, w64.grad, b64.grad), (rows, cols, cols)
        ):
            assert got is not None and want is not None
            rel = float((got[sub].double() - want[sub]).norm() / want[sub].norm())
            assert rel <= tol, (backend, fused, rel)
