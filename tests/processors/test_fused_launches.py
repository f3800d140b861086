"""The fused loss issues a bounded number of launches per row tile, whatever the
user's loss does: counted on a CPU, on both backends.

A ``TorchDispatchMode`` counts every aten op that would launch a kernel on a GPU (view
and allocation ops excluded), and every Triton launch (kernels made under
``TRITON_INTERPRET=1``) counts one, the interpreter's own work inside it stepping aside.
The same call is counted at two tilings with the same gradient buffers; the
difference over the difference in tiles is the cost of one tile. With the single
pass (``entropy_grad=False``) and where no gradient is formed, ``token_loss`` is
called once per gradient buffer, so a loss of many ops adds nothing per tile; with a
gradient through the entropy it is called once a tile (``torch_impl/processors/_fused.py``
says why), and the engine's own part of a tile is bounded.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_impl import processors
from torch_impl.processors import LinearOptions, fused_token_loss

N, H, V = 48, 8, 64
FREE = {
    "empty",
    "empty_strided",
    "empty_like",
    "detach",
    "lift_fresh",
    "alias",
    "scalar_tensor",
    "device",
}
"""Ops that launch nothing: allocations, autograd bookkeeping, metadata (``prim.device``,
seen on fake tensors) and ``scalar_tensor`` (a Python number wrapped on the host, as in
``torch.where(c, x, 0.0)``)."""
PER_TILE = {"torch": 10, "triton": 2}
"""The single pass: at most this many launches per row tile, the logits GEMM and the
pass (one Triton launch; the torch form's handful of ops)."""
STATS_PER_TILE = 24
"""No gradient formed: the logits GEMM and the tile's exact statistics (``row_stats``)."""
ENGINE_PER_TILE = 36
"""With the entropy's gradient: the engine's part of a tile (statistics, coefficients,
the gradient pass), beside the loss it calls once a tile."""
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") is not None else [])


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in FREE:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _counting() -> Iterator[_Count]:
    mode = _Count()
    patched = None
    if importlib.util.find_spec("triton") is not None:
        from triton.runtime.interpreter import InterpretedFunction

        real = InterpretedFunction.run

        def run(fn: Any, *args: Any, **kwargs: Any) -> Any:
            was, mode.paused = mode.paused, True  # the interpreter's copies to numpy
            if not was:
                mode.ops.append(f"triton:{fn.fn.__name__}")
            try:
                return real(fn, *args, **kwargs)
            finally:
                mode.paused = was

        patched = real
        InterpretedFunction.run = run  # type: ignore[method-assign]
    try:
        with mode:
            yield mode
    finally:
        if patched is not None:
            InterpretedFunction.run = patched  # type: ignore[method-assign]


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, (N,), generator=g)
    y[5] = -100
    return torch.randn(N, H, generator=g), torch.randn(V, H, generator=g), y


def _light(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
    return -lp.sum()


def _heavy(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
    x = lp
    for k in range(40):  # 80 more ops
        x = torch.tanh(x * (1.0 + 0.01 * k))
    return -(lp + 1e-3 * x).sum()


def _with_entropy(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
    return -lp.sum() - 0.1 * ent.sum()


def _ops(
    backend: str, tile_rows: int, loss: Any, *, entropy_grad: bool, grad: bool = True
) -> list[str]:
    """The launches of one call, forward and backward, with ``tile_rows`` rows a tile."""
    h, w, y = _inputs()
    h.requires_grad_(grad)
    opts = LinearOptions(
        backend=backend,  # type: ignore[arg-type]
        tile_rows=tile_rows,
        check_values=False,
    )
    with _counting() as mode:
        out = fused_token_loss(h, w, y, loss, options=opts, entropy_grad=entropy_grad)
        if grad:
            out.loss.backward()
    return mode.ops


def _per_tile(backend: str, loss: Any, *, entropy_grad: bool, grad: bool = True) -> float:
    few, many = (
        _ops(backend, 16, loss, entropy_grad=entropy_grad, grad=grad),
        _ops(backend, 4, loss, entropy_grad=entropy_grad, grad=grad),
    )
    return (len(many) - len(few)) / (N // 4 - N // 16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_single_pass_launches_a_bounded_count_per_tile_whatever_the_loss(backend: str) -> None:
    light = _per_tile(backend, _light, entropy_grad=False)
    heavy = _per_tile(backend, _heavy, entropy_grad=False)
    assert light == heavy, (light, heavy)
    assert light <= PER_TILE[backend], _ops(backend, 4, _light, entropy_grad=False)
    if backend == "triton":  # the logits GEMM and the one pass
        assert light == 2, _ops(backend, 4, _light, entropy_grad=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_gradient_the_loss_is_called_per_buffer_too(backend: str) -> None:
    light = _per_tile(backend, _light, entropy_grad=False, grad=False)
    assert light == _per_tile(backend, _heavy, entropy_grad=False, grad=False)
    assert light <= STATS_PER_TILE


@pytest.mark.parametrize("backend", BACKENDS)
def test_with_the_entropy_gradient_the_engine_part_of_a_tile_is_bounded(backend: str) -> None:
    # the loss is called once a tile here (its gradient is needed before the tile's gradient pass)
    loss_ops = len(_ops_of_loss(_with_entropy))
    assert _per_tile(backend, _with_entropy, entropy_grad=True) - loss_ops <= ENGINE_PER_TILE


def _ops_of_loss(loss: Any) -> list[str]:
    lp, ent = torch.zeros(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    with _counting() as mode:
        torch.autograd.grad(loss(lp, ent, slice(0, 4)), (lp, ent))
    return mode.ops


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_loss_spans_a_gradient_buffer(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # a buffer of 2 tiles of 6 rows: each call spans 12 rows, every row once
    monkeypatch.setitem(processors.GRAD_BUFFER_BYTES, "cpu", 12 * V * 4)
    spans: list[slice] = []

    def loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
        spans.append(rows)
        return -lp.sum()

    h, w, y = _inputs()
    opts = LinearOptions(backend=backend, tile_rows=6)  # type: ignore[arg-type]
    fused_token_loss(
        h.requires_grad_(), w, y, loss, options=opts, entropy_grad=False
    ).loss.backward()
    assert spans == [slice(i, i + 12) for i in range(0, N, 12)]


def test_on_a_fake_gpu_at_the_benchmark_size_the_single_pass_is_two_launches_a_tile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA branches (Triton backend, the GPU's tile sizes) at 151936 x 4096 bf16,
    fake tensors (``tests/support/fake_cuda.py``): 11 more row tiles of 384 rows cost 22 more
    launches (one gradient buffer for both)."""
    pytest.importorskip("triton")
    from tests.support.fake_cuda import fake_cuda, record_launches

    monkeypatch.setitem(processors.GRAD_BUFFER_BYTES, "cuda", 8 << 30)

    def count(n: int) -> int:
        with fake_cuda(), record_launches(run=False), _counting() as mode:
            h = torch.zeros(n, 4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            w = torch.zeros(151936, 4096, dtype=torch.bfloat16, device="cuda")
            y = torch.zeros(n, dtype=torch.long, device="cuda")
            fused_token_loss(h, w, y, _heavy, entropy_grad=False)
        return len(mode.ops)

    assert count(22 * 384) - count(11 * 384) == 2 * 11
