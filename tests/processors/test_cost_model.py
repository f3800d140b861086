"""The processors' cost model, checked on a CPU: GEMM flops and the largest logits buffer.

A ``TorchDispatchMode`` sees every aten op that runs: it adds up the flops of the
matrix products (``mm``, ``addmm``, ``addmm_``, ``bmm``, ``baddbmm``, ``matmul``, each
overload, ``out_dtype`` included) of one forward plus backward, in units of one
GEMM-equivalent ``2 n h V``, and records the largest buffer any op allocates (views
and hidden-sized tensors left out: the weight, ``dW``, the hidden rows). The GEMMs
of both backends are ``torch.mm`` calls, so they all show here; the Triton kernels,
run under the interpreter, do not. The floor:

- logprobs (+ entropy): 4.0: the logits in the forward pass; in the backward the
  logits again, ``dh`` and ``dW``;
- a scalar loss whose gradients are formed in the forward pass
  (``fused_token_loss``, the fused policy loss, the reduced cross entropy): 3.0,
  no logits recomputed;
- an output-layer bias adds ``1 / h``: the column sum of each gradient tile for
  ``db``, a GEMV ``[1, r] @ [r, c]`` (``2 n V`` flops in all).

A GEMM moved into a kernel makes a count fall below the floor, a recompute makes it
rise above it; both fail (see the self-tests at the end). No timing is asserted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hookspec import DistillDivergence, OutputContext, TeacherTail, VocabShard
from tests.support.backend_support import force_backend
from torch_impl import processors
from torch_impl.processors import (
    DenseTeacher,
    DistillConfig,
    LinearOptions,
    PolicyBatch,
    PolicyLossConfig,
    RatioLevel,
    SparseTeacher,
    cross_entropy_loss,
    distillation_loss,
    fused_token_loss,
    linear_logprobs,
    linear_topk_logprobs,
    policy_loss,
    selected_logprobs,
    topk_logprobs,
)

# numpy under the interpreter evaluates both sides of tl.where (masked lanes warn)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

B, S, H, V = 4, 12, 24, 300  # n = 48 tokens; no other dimension equals H
K = 5  # top-k and the sparse teacher
N = B * S
IGNORE = -100
aten = torch.ops.aten
PRODUCTS = {aten.mm, aten.addmm, aten.addmm_, aten.bmm, aten.baddbmm, aten.matmul}
THREE_ARGS = {aten.addmm, aten.addmm_, aten.baddbmm}  # (acc, a, b)


class GemmCounter(TorchDispatchMode):
    """Flops of the matrix products, and the largest non-view buffer without a
    dimension equal to ``hidden``, of every op run inside the mode."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.flops = 0
        self.largest = 0
        self.products: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket in PRODUCTS:
            a, b = (args[1], args[2]) if func.overloadpacket in THREE_ARGS else (args[0], args[1])
            # [.., m, k] @ [.., k, n]: 2 m k n per batch. A batch of dot products
            # (m = n = 1, the entropy's row sums) is a reduction, not a GEMM.
            m, n = a.shape[-2], b.shape[-1]
            if not (m == 1 and n == 1):
                self.flops += 2 * a.numel() * n
                self.products.append((str(func), tuple(a.shape), tuple(b.shape)))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t._is_view() and self.hidden not in t.shape:
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def measure(run: Callable[[], None], hidden: int = H) -> GemmCounter:
    with GemmCounter(hidden) as counter:
        run()
    return counter


def gemms(counter: GemmCounter, n: int = N, hidden: int = H, vocab: int = V) -> float:
    """The count in GEMM-equivalents ``2 n h V``."""
    return counter.flops / (2 * n * hidden * vocab)


def data(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, (B, S), generator=g)
    y[0, ::5] = IGNORE
    teacher_h = torch.randn(S, B, H, generator=g).to(dtype)
    teacher_w = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    top = torch.sort(
        torch.einsum("sbh,vh->bsv", teacher_h.double(), teacher_w.double()).log_softmax(-1),
        -1,
        descending=True,
    )
    return {
        "dense": DenseTeacher(hidden_states=teacher_h, weight=teacher_w),
        "sparse": SparseTeacher(
            ids=top.indices[..., :K].contiguous(), logprobs=top.values[..., :K].contiguous()
        ),
        "h": torch.randn(S, B, H, generator=g).to(dtype),  # [s, b, h], Megatron's layout
        "w": (torch.randn(V, H, generator=g) * 0.3).to(dtype),
        "y": y,
        "batch": PolicyBatch(
            old_logprobs=-torch.rand(B, S, generator=g) * 5,
            advantages=torch.randn(B, S, generator=g),
            mask=(torch.rand(B, S, generator=g) > 0.2).float(),
            ref_logprobs=-torch.rand(B, S, generator=g) * 5,
        ),
    }


def ctx_of(
    d: dict[str, Any], h: torch.Tensor, w: torch.Tensor, context: Any = None, **kw: Any
) -> OutputContext:
    return OutputContext(
        hidden_states=h,
        labels=d["y"],
        vocab_weight=w,
        vocab=VocabShard(0, V, V),
        context=d["batch"] if context is None else context,
        **kw,
    )


def _rows(d: dict[str, Any], w: torch.Tensor) -> int:
    """The row sweep's tile: ``tile_elements`` logits of whole rows."""
    return max(1, d["tile_elements"] // w.shape[0])


def _distill(how: str) -> Callable[[dict[str, Any], torch.Tensor, torch.Tensor], Any]:
    tail = TeacherTail.BUCKET if how == "bucket" else TeacherTail.RENORMALIZE
    cfg = DistillConfig(divergence=DistillDivergence.REVERSE_KL, tail=tail)
    teacher = "dense" if how == "dense" else "sparse"
    return lambda d, h, w: distillation_loss(cfg, tile_rows=_rows(d, w))(
        ctx_of(d, h, w, d[teacher])
    )


def _bias(w: torch.Tensor) -> torch.Tensor:
    return torch.linspace(-1, 1, w.shape[0], dtype=w.dtype).requires_grad_()


def backward_of(out: Any) -> None:
    """Forward's result to a scalar with every output used, then backward."""
    if isinstance(out, dict):
        loss = out["loss"] if "loss" in out else sum(v.sum() for v in out.values())
    elif isinstance(out, torch.Tensor):
        loss = out.sum()
    else:  # LogprobResult / FusedLossResult
        loss = getattr(out, "loss", None)
        if loss is None:
            loss = out.logprobs.sum() + (out.entropy.sum() if out.entropy is not None else 0.0)
    loss.backward()


def _masked(d: dict[str, Any], h: torch.Tensor, w: torch.Tensor) -> OutputContext:
    """The one-shard context of the draw ``d`` with its batch's loss mask."""
    return OutputContext(
        hidden_states=h,
        labels=d["y"],
        vocab_weight=w,
        vocab=VocabShard(0, V, V),
        loss_mask=d["batch"].mask,
    )


# name -> (forward(d, h, w), GEMM-equivalents)
CASES: dict[str, tuple[Callable[[dict[str, Any], torch.Tensor, torch.Tensor], Any], float]] = {
    "linear_logprobs+entropy": (
        lambda d, h, w: linear_logprobs(
            h.reshape(-1, H),
            w,
            d["y"].T.reshape(-1),
            with_entropy=True,
            options=LinearOptions(**d["kw"]),
        ),
        4.0,
    ),
    "linear_logprobs": (
        lambda d, h, w: linear_logprobs(
            h.reshape(-1, H), w, d["y"].T.reshape(-1), options=LinearOptions(**d["kw"])
        ),
        4.0,
    ),
    "fused_token_loss": (
        lambda d, h, w: fused_token_loss(
            h.reshape(-1, H),
            w,
            d["y"].T.reshape(-1),
            lambda lp, ent, rows: (lp * 0.3 - ent**2).sum(),
            options=LinearOptions(backend=d["backend"], tile_rows=_rows(d, w)),
        ),
        3.0,
    ),
    # a bias: one more column sum per gradient tile, a GEMV [1, r] @ [r, c] (2 n V in all)
    "linear_logprobs(bias)": (
        lambda d, h, w: linear_logprobs(
            h.reshape(-1, H),
            w,
            d["y"].T.reshape(-1),
            options=LinearOptions(**d["kw"]),
            bias=_bias(w),
        ),
        4.0 + 1 / H,
    ),
    "fused_token_loss(bias, single pass)": (
        lambda d, h, w: fused_token_loss(
            h.reshape(-1, H),
            w,
            d["y"].T.reshape(-1),
            lambda lp, ent, rows: (lp * 0.3).sum(),
            options=LinearOptions(backend=d["backend"], tile_rows=_rows(d, w)),
            entropy_grad=False,
            bias=_bias(w),
        ),
        3.0 + 1 / H,
    ),
    "selected_logprobs(entropy=True)": (
        lambda d, h, w: selected_logprobs(entropy=True, **d["tile"])(ctx_of(d, h, w)),
        4.0,
    ),
    "selected_logprobs": (lambda d, h, w: selected_logprobs(**d["tile"])(ctx_of(d, h, w)), 4.0),
    "cross_entropy_loss": (
        lambda d, h, w: cross_entropy_loss(**d["tile"])(
            OutputContext(hidden_states=h, labels=d["y"], vocab_weight=w, vocab=VocabShard(0, V, V))
        ),
        4.0,
    ),
    "cross_entropy_loss(reduction='mean')": (
        lambda d, h, w: cross_entropy_loss(reduction="mean", tile_rows=_rows(d, w))(
            _masked(d, h, w)
        ),
        3.0,
    ),
    # the z-loss: its gradient a term of the same coefficient, no GEMM more
    "cross_entropy_loss(reduction='mean', z_loss)": (
        lambda d, h, w: cross_entropy_loss(reduction="mean", z_loss=1e-3, tile_rows=_rows(d, w))(
            _masked(d, h, w)
        ),
        3.0,
    ),
    "cross_entropy_loss(z_loss)": (
        lambda d, h, w: cross_entropy_loss(z_loss=1e-3, **d["tile"])(
            OutputContext(hidden_states=h, labels=d["y"], vocab_weight=w, vocab=VocabShard(0, V, V))
        ),
        4.0,
    ),
    # label smoothing: the mean logit a running sum, its gradient a per-row term, no GEMM more
    "cross_entropy_loss(reduction='mean', label_smoothing)": (
        lambda d, h, w: cross_entropy_loss(
            reduction="mean", label_smoothing=0.1, tile_rows=_rows(d, w)
        )(_masked(d, h, w)),
        3.0,
    ),
    "cross_entropy_loss(label_smoothing)": (
        lambda d, h, w: cross_entropy_loss(label_smoothing=0.1, **d["tile"])(
            OutputContext(hidden_states=h, labels=d["y"], vocab_weight=w, vocab=VocabShard(0, V, V))
        ),
        4.0,
    ),
    "policy_loss(GRPO, fused)": (
        lambda d, h, w: policy_loss(PolicyLossConfig.grpo(), tile_rows=_rows(d, w))(
            ctx_of(d, h, w)
        ),
        3.0,
    ),
    "linear_topk_logprobs": (
        lambda d, h, w: linear_topk_logprobs(
            h.reshape(-1, H),
            w,
            k=K,
            labels=d["y"].T.reshape(-1),
            with_entropy=True,
            options=LinearOptions(**d["kw"]),
        ),
        4.0,
    ),
    "topk_logprobs": (lambda d, h, w: topk_logprobs(K, **d["tile"])(ctx_of(d, h, w)), 4.0),
    "distillation_loss(dense)": (_distill("dense"), 4.0),  # and the teacher's logits (h_t = h)
    "distillation_loss(sparse, bucket)": (_distill("bucket"), 3.0),
    # the logits only; the gradient at the k ids of each row: elementwise, no GEMM
    "distillation_loss(sparse, renormalize)": (_distill("renormalize"), 1.0),
    "cross_entropy_loss as the MTP processor": (
        lambda d, h, w: cross_entropy_loss(**d["tile"])(ctx_of(d, h, w, mtp_depth=1)),
        4.0,
    ),
    "policy_loss(PPO, autograd)": (
        lambda d, h, w: policy_loss(PolicyLossConfig(fused=False), **d["tile"])(ctx_of(d, h, w)),
        4.0,
    ),
    "policy_loss(GSPO, sequence ratio)": (
        lambda d, h, w: policy_loss(PolicyLossConfig(ratio=RatioLevel.SEQUENCE), **d["tile"])(
            ctx_of(d, h, w)
        ),
        4.0,
    ),
}

ROW_SWEEP = {
    "fused_token_loss",
    "fused_token_loss(bias, single pass)",
    "cross_entropy_loss(reduction='mean')",
    "cross_entropy_loss(reduction='mean', z_loss)",
    "cross_entropy_loss(reduction='mean', label_smoothing)",
    "policy_loss(GRPO, fused)",
    "distillation_loss(dense)",
    "distillation_loss(sparse, bucket)",
    "distillation_loss(sparse, renormalize)",
}
TORCH_TILE = (11, 128)  # tile_rows x tile_cols: chunks that divide nothing
TILE_ELEMENTS = 9 * V  # the row sweep: 9 rows a tile
GRAD_BUFFER = (
    18 * V * 4
)  # the row sweep's gradient buffer: 18 rows (two tiles; three buffers in all)
TRITON_BUDGET = 16384  # bytes of one fp32 logits tile: 13 rows x 256 entries here


@pytest.fixture(params=["torch", "triton"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every processor on the given backend: ``"auto"`` answers it (the table's entry for
    this device), and the Triton chunks get a small budget."""
    name = force_backend(monkeypatch, request.param)
    monkeypatch.setitem(processors.TILE_BYTES, "cpu", TRITON_BUDGET)
    monkeypatch.setitem(processors.GRAD_BUFFER_BYTES, "cpu", GRAD_BUFFER)
    yield name


def _run_case(
    name: str, backend: str, dtype: torch.dtype = torch.float32
) -> tuple[GemmCounter, int]:
    forward, _ = CASES[name]
    d = data(dtype)
    tile = {} if backend == "triton" else {"tile_rows": TORCH_TILE[0], "tile_cols": TORCH_TILE[1]}
    kw = {} if backend == "triton" else {"tile_rows": TORCH_TILE[0], "tile_cols": TORCH_TILE[1]}
    d.update(tile=tile, kw=dict(kw, backend=backend), tile_elements=TILE_ELEMENTS, backend=backend)
    h = d["h"].clone().requires_grad_()
    w = d["w"].clone().requires_grad_()
    counter = measure(lambda: backward_of(forward(d, h, w)))
    if name in ROW_SWEEP:  # the gradient buffer (the compute dtype; fp32 here) is the larger
        budget = max((TILE_ELEMENTS // V) * V * 4, GRAD_BUFFER)
    elif backend == "triton":
        budget = TRITON_BUDGET
    else:
        budget = TORCH_TILE[0] * TORCH_TILE[1] * 4
    return counter, budget


@pytest.mark.parametrize("name", list(CASES))
def test_gemm_floor_and_largest_buffer(name: str, backend: str) -> None:
    counter, budget = _run_case(name, backend)
    want = CASES[name][1]
    assert gemms(counter) == pytest.approx(want, abs=1e-12), (name, backend, counter.products)
    # the largest logits buffer is the chunk the budget allows, no larger (and the
    # counter sees it: at least half of it)
    assert budget // 2 <= counter.largest <= budget, (name, backend, counter.largest, budget)


@pytest.mark.parametrize("name", ["linear_logprobs+entropy", "fused_token_loss"])
def test_bf16_floor(name: str, backend: str) -> None:
    """bf16 operands: the same count (upcast on a CPU, ``out_dtype`` on CUDA)."""
    counter, _ = _run_case(name, backend, torch.bfloat16)
    assert gemms(counter) == pytest.approx(CASES[name][1], abs=1e-12), counter.products


# ---------------------------------------------------------------- the counter can fail


def test_counter_counts_an_extra_gemm() -> None:
    """A recompute (here one extra logits product) is counted: 5.0, not 4.0."""
    d = data()
    h = d["h"].reshape(-1, H).clone().requires_grad_()
    w = d["w"].clone().requires_grad_()
    y = d["y"].T.reshape(-1)

    def with_recompute() -> None:
        r = linear_logprobs(h, w, y, with_entropy=True, options=LinearOptions(backend="torch"))
        (r.logprobs.sum() + r.entropy.sum()).backward()  # type: ignore[union-attr]
        torch.mm(h.detach(), w.detach().T)

    assert gemms(measure(with_recompute)) == pytest.approx(5.0)


def test_counter_misses_a_gemm_outside_torch() -> None:
    """A product computed where the mode cannot see it (as a GEMM inside a Triton kernel
    would be) lowers the count: 3.0, and the floor assertion fails."""
    d = data()
    h = d["h"].reshape(-1, H)
    w = d["w"]

    def hidden_product() -> None:
        torch.mm(h, w.T)
        torch.mm(h, w.T)
        torch.from_numpy(
            h.numpy() @ w.numpy().T
        )  # the mode sees the result wrapped, not the product
        torch.mm(h, w.T)

    assert gemms(measure(hidden_product)) == pytest.approx(3.0)


@pytest.mark.skipif(
    torch.__version__ < (2, 13),
    reason="torch < 2.13 cannot run addmm(out_dtype=) on meta tensors (its decomposition "
    "takes out_dtype for beta; CUDA runs the kernel); py311's torch 2.13 runs this test",
)
def test_counter_counts_out_dtype_products() -> None:
    """``torch.mm(a, b, out_dtype=torch.float32)`` (the bf16 path on CUDA) is counted:
    run on the meta device, where torch registers it."""
    a = torch.empty(8, 16, dtype=torch.bfloat16, device="meta")
    b = torch.empty(16, 32, dtype=torch.bfloat16, device="meta")

    def run() -> None:
        out = torch.mm(a, b, out_dtype=torch.float32)
        assert out.dtype == torch.float32
        torch.addmm(out, a, b, out_dtype=torch.float32)

    counter = measure(run, hidden=1000)
    assert counter.flops == 2 * (2 * 8 * 16 * 32)


def test_counter_records_the_largest_buffer() -> None:
    def run() -> None:
        torch.empty(40, 50)  # 8000 bytes
        torch.empty(30, H)  # has the hidden size: left out
        torch.empty(10, 10).view(100)

    assert measure(run).largest == 40 * 50 * 4
