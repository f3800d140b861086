"""Every processor and tensor function at the GPU's compute dtype, against float64 of
the same inputs, beside the naive bf16 path.

The inputs are bf16 (hidden states, output weight, a dense teacher's). Three ways:

- ours: the processor on them with ``compute_dtype=torch.bfloat16`` forced (the
  CPU's stand-in for CUDA, where the compute dtype is the input's: bf16 GEMM
  operands, fp32 GEMM outputs);
- naive: the logits from a bf16 GEMM (rounded to bf16, as a bf16 ``torch.mm``
  returns them), then the processor's own maths in fp32 on those logits;
- truth: the logits in float64 from the same bf16 inputs, then the maths in float64.

The naive and true paths run the same processor on materialised logits: hidden
states = the logits, weight = the identity (a GEMM that copies each logit exactly),
so only the formation of the logits and of their gradient differs between the three;
the processors' maths is checked against independent float64 references in their
own test modules. Each value and each gradient (``dh``, ``dW``, by autograd through
the materialised GEMM for naive and truth) must be within a third of the naive
path's error, or within twice the bf16 rounding of the float64 result itself (the
gradients are returned in the inputs' dtype, bf16). Errors are relative Frobenius
norms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hookspec import DistillDivergence, OutputContext, TeacherTail, VocabShard
from tests.support.backend_support import force_backend
from torch_impl.processors import (
    DenseTeacher,
    DistillConfig,
    LinearOptions,
    PolicyBatch,
    PolicyLossConfig,
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

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

B, S, H, K = 2, 48, 64, 8
N = B * S
BF16 = torch.bfloat16


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def _data(vocab: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, vocab, (B, S), generator=g)
    y[0, ::7] = -100
    th = torch.randn(S, B, H, generator=g).to(BF16)
    tw = (torch.randn(vocab, H, generator=g) * 0.3).to(BF16)
    top = torch.sort(
        torch.einsum("sbh,vh->bsv", th.double(), tw.double()).log_softmax(-1), -1, descending=True
    )
    mask = (torch.rand(B, S, generator=g) > 0.2).float()
    return {
        "h": (torch.randn(S, B, H, generator=g) * 1.5).to(BF16),  # [s, b, h]
        "w": (torch.randn(vocab, H, generator=g) * 0.3).to(BF16),
        "y": y,
        "dense": (th, tw),
        "sparse": SparseTeacher(
            ids=top.indices[..., :K].contiguous(), logprobs=top.values[..., :K].float()
        ),
        "batch": PolicyBatch(
            old_logprobs=-torch.rand(B, S, generator=g) * 4 - 4,
            advantages=torch.randn(B, S, generator=g),
            mask=mask,
            ref_logprobs=-torch.rand(B, S, generator=g) * 4 - 4,
        ),
        "mask": mask,
        "cot": torch.Generator().manual_seed(1),
    }


# A case: (h [s, b, h], w [V, h], d, how) -> a dict of differentiable outputs. ``how``
# says how the logits are formed: "ours" (from h and w, bf16 compute), or
# "materialised" (h holds the logits [s, b, V], w the identity).
Case = Callable[[torch.Tensor, torch.Tensor, dict[str, Any], str], dict[str, torch.Tensor]]


def _opts(how: str, **kw: Any) -> LinearOptions:
    return LinearOptions(compute_dtype=BF16 if how == "ours" else None, **kw)


def _ctx(
    h: torch.Tensor, w: torch.Tensor, d: dict[str, Any], context: Any = None, **kw: Any
) -> OutputContext:
    return OutputContext(
        hidden_states=h,
        labels=d["y"],
        vocab_weight=w,
        vocab=VocabShard(0, w.shape[0], w.shape[0]),
        context=context,
        **kw,
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _labels(d: dict[str, Any]) -> torch.Tensor:
    return d["y"].T.reshape(-1)


def _dense(d: dict[str, Any], how: str, w: torch.Tensor) -> DenseTeacher:
    th, tw = d["dense"]
    if how == "ours":
        return DenseTeacher(hidden_states=th, weight=tw)
    z = (
        torch.einsum("sbh,vh->sbv", th.to(w.dtype), tw.to(w.dtype))
        if w.dtype == torch.float64
        else th @ tw.T
    )
    return DenseTeacher(hidden_states=z.to(w.dtype), weight=torch.eye(w.shape[0], dtype=w.dtype))


def _distill(cfg: DistillConfig, teacher: str) -> Case:
    def case(
        h: torch.Tensor, w: torch.Tensor, d: dict[str, Any], how: str
    ) -> dict[str, torch.Tensor]:
        t = _dense(d, how, w) if teacher == "dense" else d["sparse"]
        proc = distillation_loss(cfg, compute_dtype=BF16 if how == "ours" else None)
        return proc(_ctx(h, w, d, t, loss_mask=d["mask"]))

    return case


CASES: dict[str, Case] = {
    "linear_logprobs + entropy + mean_logit": lambda h, w, d, how: vars(
        linear_logprobs(
            _rows(h),
            w,
            _labels(d),
            with_entropy=True,
            with_mean_logit=True,
            options=_opts(how, temperature=0.9),
        )
    ),
    "fused_token_loss": lambda h, w, d, how: {
        "loss": fused_token_loss(
            _rows(h),
            w,
            _labels(d),
            lambda lp, ent, rows: (lp * 0.7 + 0.2 * ent).sum(),
            options=_opts(how),
        ).loss
    },
    "fused_token_loss(entropy_grad=False)": lambda h, w, d, how: {
        "loss": fused_token_loss(
            _rows(h),
            w,
            _labels(d),
            lambda lp, ent, rows: -lp.sum(),
            options=_opts(how),
            entropy_grad=False,
        ).loss
    },
    "linear_topk_logprobs": lambda h, w, d, how: {
        k: v
        for k, v in vars(
            linear_topk_logprobs(
                _rows(h), w, k=K, labels=_labels(d), with_entropy=True, options=_opts(how)
            )
        ).items()
        if k != "ids"
    },
    "selected_logprobs": lambda h, w, d, how: selected_logprobs(entropy=True)(_ctx(h, w, d)),
    "cross_entropy_loss": lambda h, w, d, how: {"loss": cross_entropy_loss()(_ctx(h, w, d))},
    "cross_entropy_loss(mean)": lambda h, w, d, how: cross_entropy_loss(reduction="mean")(
        _ctx(h, w, d, loss_mask=d["mask"])
    ),
    "cross_entropy_loss(z_loss)": lambda h, w, d, how: {
        "loss": cross_entropy_loss(z_loss=0.01)(_ctx(h, w, d))
    },
    "cross_entropy_loss(mean, z_loss)": lambda h, w, d, how: cross_entropy_loss(
        reduction="mean", z_loss=0.01
    )(_ctx(h, w, d, loss_mask=d["mask"])),
    "cross_entropy_loss(label_smoothing)": lambda h, w, d, how: {
        "loss": cross_entropy_loss(label_smoothing=0.1)(_ctx(h, w, d))
    },
    "cross_entropy_loss(mean, label_smoothing)": lambda h, w, d, how: cross_entropy_loss(
        reduction="mean", label_smoothing=0.1
    )(_ctx(h, w, d, loss_mask=d["mask"])),
    "cross_entropy_loss(mean, label_smoothing, class_weights)": lambda h, w, d, how: (
        cross_entropy_loss(
            reduction="mean",
            label_smoothing=0.1,
            class_weights=torch.linspace(0.0, 2.0, w.shape[0]),
        )(_ctx(h, w, d, loss_mask=d["mask"]))
    ),
    "fused_token_loss(mean_logit_loss)": lambda h, w, d, how: {
        k: v
        for k, v in vars(
            fused_token_loss(
                _rows(h),
                w,
                _labels(d),
                lambda lp, ent, rows: -0.9 * lp.sum(),
                options=_opts(how),
                entropy_grad=False,
                mean_logit_loss=lambda mean, rows: -0.1 * mean.sum(),
            )
        ).items()
        if k in ("loss", "mean_logit")
    },
    "fused_token_loss(lse_loss)": lambda h, w, d, how: {
        k: v
        for k, v in vars(
            fused_token_loss(
                _rows(h),
                w,
                _labels(d),
                lambda lp, ent, rows: -lp.sum(),
                options=_opts(how),
                entropy_grad=False,
                lse_loss=lambda lse, rows: 1e-3 * lse.square().sum(),
            )
        ).items()
        if k in ("loss", "lse")
    },
    "policy_loss(GRPO, fused)": lambda h, w, d, how: policy_loss(PolicyLossConfig.grpo())(
        _ctx(h, w, d, d["batch"])
    ),
    "policy_loss(PPO, entropy bonus, fused)": lambda h, w, d, how: policy_loss(
        PolicyLossConfig(entropy_coef=0.01)
    )(_ctx(h, w, d, d["batch"])),
    "policy_loss(GSPO)": lambda h, w, d, how: policy_loss(
        PolicyLossConfig.gspo(clip_low=0.2, clip_high=0.2), tile_rows=37
    )(_ctx(h, w, d, d["batch"])),
    "topk_logprobs": lambda h, w, d, how: {
        k: v for k, v in topk_logprobs(K, entropy=True)(_ctx(h, w, d)).items() if k != "topk_ids"
    },
    "distillation_loss(dense, forward-kl)": _distill(DistillConfig(temperature=0.8), "dense"),
    "distillation_loss(dense, reverse-kl)": _distill(
        DistillConfig(divergence=DistillDivergence.REVERSE_KL), "dense"
    ),
    "distillation_loss(dense, jsd)": _distill(
        DistillConfig(divergence=DistillDivergence.JSD, beta=0.3), "dense"
    ),
    "distillation_loss(sparse, renormalize)": _distill(DistillConfig(), "sparse"),
    "distillation_loss(sparse, bucket, reverse-kl)": _distill(
        DistillConfig(divergence=DistillDivergence.REVERSE_KL, tail=TeacherTail.BUCKET), "sparse"
    ),
}
# processors take the compute dtype from the inputs: the case forces it on ours below
_PROCESSOR_CASES = {
    name for name in CASES if not name.startswith(("linear_", "fused_token_loss", "distillation"))
}


def _run(case: Case, d: dict[str, Any], how: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Values and gradients: ``how`` "ours" on the bf16 inputs; "materialised" through
    the logits ``h @ w.T`` formed in ``dtype`` (bf16: the naive path; float64: the truth)."""
    h = d["h"].to(dtype).requires_grad_()
    w = d["w"].to(dtype).requires_grad_()
    if how == "ours":
        out = case(h, w, d, how)
    else:
        z = torch.einsum("sbh,vh->sbv", h, w)  # [s, b, V]: a bf16 GEMM rounds to bf16
        zf = z.float() if dtype == BF16 else z
        out = case(zf, torch.eye(w.shape[0], dtype=zf.dtype), d, how)
    gen = torch.Generator().manual_seed(2)
    total = sum(
        (v.double() * torch.randn(v.shape, generator=gen, dtype=torch.float64)).sum()
        for v in out.values()
        if v is not None and v.dtype.is_floating_point  # a result's field not asked for: None
    )
    dh, dw = torch.autograd.grad(total, (h, w))
    return {
        **{k: v.detach() for k, v in out.items() if v is not None and v.dtype.is_floating_point},
        "dh": dh,
        "dw": dw,
    }


@pytest.fixture(params=["torch", "triton"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``"auto"`` answers the given backend; processors get the bf16 compute dtype."""
    return force_backend(monkeypatch, request.param)


@pytest.mark.parametrize("name", list(CASES))
def test_at_the_gpus_compute_dtype(
    name: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    vocab = 4096 if backend == "torch" else 1024  # the interpreter is slow
    d = _data(vocab)
    if name in _PROCESSOR_CASES:  # processors run at the input's dtype's compute dtype on a GPU
        monkeypatch.setattr("torch_impl.processors._options.resolve_compute_dtype", _forced_bf16)
    truth = _run(CASES[name], d, "materialised", torch.float64)
    ours = _run(CASES[name], d, "ours", BF16)
    monkeypatch.undo()
    naive = _run(CASES[name], d, "materialised", BF16)
    for key, want in truth.items():
        err, naive_err = _rel(ours[key], want), _rel(naive[key], want)
        rounding = _rel(want.to(BF16), want)
        assert err <= max(naive_err / 3, 2 * rounding), (
            name,
            backend,
            key,
            err,
            naive_err,
            rounding,
        )


def _forced_bf16(
    device: torch.device, dtype: torch.dtype, override: torch.dtype | None
) -> torch.dtype:
    """``compute_dtype`` as on CUDA for bf16 inputs: bf16 (float64 stays float64)."""
    return torch.float64 if dtype == torch.float64 else (override or BF16)


@pytest.mark.parametrize("upstream", [0.7, 1.0, 3.3])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_the_fused_dh_is_rounded_once_whatever_the_upstream_gradient(
    upstream: float, entropy_grad: bool, backend: str
) -> None:
    """``dh`` of the fused loss times an upstream gradient ``g != 1`` (a scaled sum)
    is no further from float64 than ``linear_logprobs``' under autograd: the gradient
    formed in the forward pass is kept in fp32 until the backward scales it."""
    d = _data(4096 if backend == "torch" else 1024)
    y = _labels(d)

    def token_loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
        return (-lp + 0.3 * ent).sum() if entropy_grad else -lp.sum()

    def dh(dtype: torch.dtype, fused: bool) -> torch.Tensor:
        h = _rows(d["h"]).to(dtype).requires_grad_()
        w = d["w"].to(dtype)
        opts = _opts("ours" if dtype == BF16 else "materialised")
        if fused:
            loss = fused_token_loss(
                h, w, y, token_loss, options=opts, entropy_grad=entropy_grad
            ).loss
        else:
            r = linear_logprobs(h, w, y, with_entropy=True, options=opts)
            loss = token_loss(r.logprobs, r.entropy, slice(None))  # type: ignore[arg-type]
        (loss * upstream).backward()
        assert h.grad is not None
        return h.grad.double()

    truth = dh(torch.float64, fused=False)
    fused, linear = (_rel(dh(BF16, f), truth) for f in (True, False))
    assert fused <= linear, (fused, linear)
