"""The processors on a GPU, through their public API only, on both backends: bitwise
the same run to run; no host read under ``torch.cuda.set_sync_debug_mode("error")``
with the label check on (deferred, not skipped); a CUDA graph replay equal to the
eager call; and the fused scalar loss against float64 at an awkward real size.

Every test is ``gpu``-marked (skipped on a CPU by ``tests/conftest.py``). The other
GPU checks the design is held to live beside the code they test: the 1F1B plan equal
to ``forward`` (``test_schedule_plan.py``); the label check alone under sync debug
mode, a bad label found without a host read, and a processor with its checks in a
CUDA graph (``test_value_checks.py``); ``linear_logprobs``'s Triton kernels against
float64 at real sizes (``test_processors_triton.py``). ``tests/processors/test_gpu_bench.py``
checks on the CPU that each of them is there and marked.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.support.peer_options import gpu_inputs, peer_options
from torch_impl.processors import LinearOptions, fused_token_loss, linear_logprobs
from torch_impl.value_checks import pending_checks, raise_pending_errors

pytestmark = pytest.mark.gpu

IGNORE = -100
BACKENDS = ("torch", "triton")
N, H, V = 2053, 1024, 32771  # no dimension a multiple of a block


def _inputs(
    n: int = N, h: int = H, v: int = V, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return gpu_inputs(n, h, v, dtype=dtype, seed=seed)


def _token_loss(n: int) -> Callable[[torch.Tensor, torch.Tensor, slice], torch.Tensor]:
    """A GRPO-like per-token loss: clipped ratio against fixed old logprobs, an entropy bonus."""
    g = torch.Generator(device="cuda").manual_seed(7)
    old = -torch.rand(n, device="cuda", generator=g) * 12.0
    adv = torch.randn(n, device="cuda", generator=g)

    def loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
        ratio = torch.exp((lp - old[rows].to(lp.dtype)).clamp(-20.0, 20.0))
        a = adv[rows].to(lp.dtype)
        pg = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
        return (pg - 0.01 * ent).sum() / n

    return loss


def _logprobs_pass(
    hid: torch.Tensor, w: torch.Tensor, y: torch.Tensor, backend: str
) -> dict[str, torch.Tensor]:
    hh, ww = hid.clone().requires_grad_(), w.clone().requires_grad_()
    r = linear_logprobs(
        hh,
        ww,
        y,
        with_entropy=True,
        options=LinearOptions(backend=backend),  # type: ignore[arg-type]
    )
    assert r.entropy is not None
    (r.logprobs.sum() + r.entropy.sum()).backward()
    assert hh.grad is not None and ww.grad is not None
    return {"logprobs": r.logprobs, "entropy": r.entropy, "dh": hh.grad, "dw": ww.grad}


def _loss_pass(
    hid: torch.Tensor, w: torch.Tensor, y: torch.Tensor, backend: str
) -> dict[str, torch.Tensor]:
    hh, ww = hid.clone().requires_grad_(), w.clone().requires_grad_()
    r = fused_token_loss(
        hh, ww, y, _token_loss(hid.shape[0]), options=LinearOptions(backend=backend)
    )  # type: ignore[arg-type]
    r.loss.backward()
    assert hh.grad is not None and ww.grad is not None
    return {"loss": r.loss.detach(), "dh": hh.grad, "dw": ww.grad}


PASSES = {"logprobs": _logprobs_pass, "fused_loss": _loss_pass}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", list(PASSES))
def test_bitwise_run_to_run(path: str, backend: str) -> None:
    """No atomics, no order that depends on timing: two runs give the same bits."""
    hid, w, y = _inputs()
    a = PASSES[path](hid, w, y, backend)
    b = PASSES[path](hid, w, y, backend)
    for k in a:
        assert torch.equal(a[k], b[k]), (path, backend, k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", list(PASSES))
def test_no_host_read_forward_and_backward(path: str, backend: str) -> None:
    """Forward and backward, labels checked (the default), under sync debug mode
    "error": any host synchronisation raises. The label check is deferred, not
    skipped: it is pending afterwards, and reading it finds nothing wrong."""
    hid, w, y = _inputs()
    PASSES[path](hid, w, y, backend)  # warm-up: Triton compiles and autotunes outside the mode
    raise_pending_errors(wait=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = PASSES[path](hid, w, y, backend)
        pending = pending_checks()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pending >= 1
    raise_pending_errors(wait=True)
    assert pending_checks() == 0
    assert all(bool(torch.isfinite(v).all()) for v in out.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_replay_equals_eager(backend: str) -> None:
    """``linear_logprobs`` (forward, no grad) captured in a CUDA graph: the replay on new
    inputs copied into the captured buffers equals an eager call on them, bitwise."""
    hid, w, y = _inputs(n=1031, h=512, v=20011)
    hid2, _, y2 = _inputs(n=1031, h=512, v=20011, seed=3)

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        r = linear_logprobs(
            hid,
            w,
            y,
            with_entropy=True,
            options=LinearOptions(backend=backend),  # type: ignore[arg-type]
        )
        assert r.entropy is not None
        return r.logprobs, r.entropy

    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside capture, as torch.cuda.graphs requires
            call()
        torch.cuda.current_stream().wait_stream(s)
        raise_pending_errors(wait=True)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            lp, ent = call()
        hid.copy_(hid2)
        y.copy_(y2)
        g.replay()
        torch.cuda.synchronize()
        eager = linear_logprobs(
            hid2, w, y2, with_entropy=True, options=LinearOptions(backend=backend)
        )  # type: ignore[arg-type]
    assert torch.equal(lp, eager.logprobs)
    assert eager.entropy is not None and torch.equal(ent, eager.entropy)
    raise_pending_errors(wait=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_loss_against_float64(backend: str, dtype: torch.dtype) -> None:
    """``fused_token_loss`` (the path ``policy_loss`` takes), compiled, at an awkward real
    size: the loss, ``dh`` on a row subset and ``dW`` on a vocabulary subset against
    float64 of the same (rounded) inputs."""
    n, h, v = 4099, 1000, 32771
    hid, w, y = _inputs(n, h, v, dtype=dtype, seed=11)
    got = _loss_pass(hid, w, y, backend)
    rows = torch.arange(0, n, 16, device="cuda")
    cols = torch.cat([y[y != IGNORE][:64], torch.arange(0, v, 257, device="cuda")]).unique()
    # float64 truth by autograd on the materialised logits (row chunks of the loss are sums)
    h64 = hid.double().requires_grad_()
    w64 = w.double().requires_grad_()
    logp = (h64 @ w64.T).log_softmax(-1)
    valid = y != IGNORE
    lp = torch.where(valid, logp.gather(1, y.clamp(min=0)[:, None]).squeeze(1), 0.0)
    ent = -(logp.exp() * logp).sum(-1)  # every row's, an ignored label's too (as the processors)
    loss = _token_loss(n)(lp, ent, slice(None))
    loss.backward()
    assert h64.grad is not None and w64.grad is not None
    tol = {torch.bfloat16: 2e-2, torch.float32: 1e-4}[dtype]
    assert abs(float(got["loss"]) - float(loss)) <= tol * max(1.0, abs(float(loss)))
    rel_dh = float((got["dh"][rows].double() - h64.grad[rows]).norm() / h64.grad[rows].norm())
    rel_dw = float((got["dw"][cols].double() - w64.grad[cols]).norm() / w64.grad[cols].norm())
    assert rel_dh <= tol, (backend, rel_dh)
    assert rel_dw <= tol, (backend, rel_dw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_peer_options_against_float64(backend: str, dtype: torch.dtype) -> None:
    """:func:`tests.support.peer_options.peer_options` compiled, at 1031 x 512 x 20011."""
    peer_options(1031, 512, 20011, dtype, "cuda", backend)
