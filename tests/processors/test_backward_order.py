"""The vocabulary sweep's backward takes the row sweep where its byte model says the
accumulators move fewer bytes (many rows: ``dh`` fp32 read and written per column
tile otherwise). Forced here with small tile budgets on the Triton backend (the
interpreter), the gradients equal float64 autograd, and the columns-outer order's."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from torch_impl import processors
from torch_impl.processors import LinearOptions, linear_logprobs, linear_topk_logprobs

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed here (py311's CPU torch wheel has none)", allow_module_level=True
    )

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
N, H, V = 64, 8, 256


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, V, (N,), generator=g)
    y[3] = -100
    h = torch.randn(N, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return h, torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_(), y


def _grads(fn: str, dtype: torch.dtype, backend: str) -> list[torch.Tensor]:
    h, w, y = _inputs(dtype)
    opts = LinearOptions(backend=backend)  # type: ignore[arg-type]
    if fn == "logprobs":
        r: Any = linear_logprobs(h, w, y, with_entropy=True, options=opts)
        outs = [r.logprobs, r.entropy]
    else:
        r = linear_topk_logprobs(h, w, k=3, labels=y, with_entropy=True, options=opts)
        outs = [r.logprobs, r.entropy, r.label_logprobs]
    g = torch.Generator().manual_seed(1)
    total = sum(
        (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum() for o in outs
    )
    return [
        *(o.detach().double() for o in outs),
        *(x.double() for x in torch.autograd.grad(total, (h, w))),
    ]


@pytest.mark.parametrize("fn", ["logprobs", "topk"])
def test_the_rows_outer_backward_equals_float64_and_the_columns_outer_one(
    fn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    truth = _grads(fn, torch.float64, "torch")
    columns = _grads(fn, torch.float32, "triton")
    # a vocabulary tile of 16 rows x 256 (4 row tiles: dW read and written 3 times) against
    # gradient buffers of 32 rows (dW read and written once): the row sweep is chosen
    monkeypatch.setitem(processors.TILE_BYTES, "cpu", 16 * V * 4)
    monkeypatch.setitem(processors.GRAD_BUFFER_BYTES, "cpu", 32 * V * 4)
    chosen: list[bool] = []
    real = processors._engine._rows_outer  # type: ignore[attr-defined]
    monkeypatch.setattr(
        processors._engine,  # type: ignore[attr-defined]
        "_rows_outer",
        lambda *args: chosen.append(real(*args)) or chosen[-1],
    )
    rows = _grads(fn, torch.float32, "triton")
    assert chosen == [True]
    for got, ref, want in zip(rows, columns, truth, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)
