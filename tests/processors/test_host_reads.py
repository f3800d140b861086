"""No processor reads a device value on the host: proven on a CPU, for every processor
and tensor function of ``torch_impl.processors``, forward and backward.

On a GPU, a host read (``bool(t)``, ``t.item()``, ``int(t)``, ``float(t)``,
``t.tolist()``, ``if t:``, a boolean-mask index, ``nonzero``) waits for the device:
a synchronisation in the training step, and an error under
``torch.cuda.set_sync_debug_mode("error")`` (``tests/processors/test_gpu_checks.py``) and in
CUDA graph capture. :class:`HostReads` fails on each, wherever it happens:

- a ``TorchDispatchMode`` sees every aten op: ``_local_scalar_dense`` (what ``bool``,
  ``int``, ``float``, ``.item()`` and ``if t`` run) and the ops whose output shape
  depends on the values (``nonzero``, ``masked_select``, ``unique``, an index by a
  boolean mask, ...);
- a ``TorchFunctionMode`` sees what never reaches aten on a CPU tensor:
  ``.tolist()``, ``.numpy()``, ``.cpu()``, ``.to("cpu")``.

Inside a Triton launch the mode steps aside: under ``TRITON_INTERPRET=1`` the
interpreter copies the arguments to numpy, which on a GPU is a kernel launch.

Two ways to run each call, both through the public API only, value checks off
(the deferred label check is ``tests/contract/test_value_checks.py``'s):

- ``cpu``: real tensors on the CPU: the processors on the CPU's backend (torch),
  the tensor functions on both backends (Triton interpreted, py312);
- ``cuda``: fake CUDA tensors (``tests/support/fake_cuda.py``): every call takes its CUDA
  branches: ``backend="auto"`` is Triton there, so each processor's Triton path runs
  its host code (the kernels are recorded, not run), backward included.

The two reads this found when it was written (the fused backward's ``bool(g_loss ==
1)``, top-k's per-tile ``bool(tied.any())`` for its tie rule) are gone: the fused
backward scales on the device whatever the factor, and the tie rule takes the entries
equal to the ``k``-th value by a second ``topk`` on their columns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hookspec import OutputContext, VocabShard
from tests.support.fake_cuda import backward, fake_cuda, record_launches
from tests.support.host_reads_support import HostRead, HostReads
from torch_impl import processors as P
from torch_impl.mtp import detached_head, scaled_mtp_gradient
from torch_impl.processors import (
    DenseTeacher,
    DistillConfig,
    PolicyBatch,
    PolicyLossConfig,
    RatioLevel,
    SparseTeacher,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None  # interpreted on a CPU: conftest.py

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
    # a fake tensor's data_ptr (the torch path compares two buffers' addresses): not a read
    pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor:UserWarning"),
]

B, S, H, V, K = 3, 7, 16, 100, 4  # 21 tokens
IGNORE = -100


def _data(device: str) -> dict[str, Any]:
    if device == "cuda":  # fake tensors: shapes and dtypes only

        def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device="cuda")

        ids = torch.zeros(B, S, K, dtype=torch.long, device="cuda")
        labels = torch.zeros(B, S, dtype=torch.long, device="cuda")
    else:
        g = torch.Generator().manual_seed(0)

        def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.randn(*shape, generator=g).to(dtype)

        labels = torch.randint(0, V, (B, S), generator=g)
        labels[0, ::3] = IGNORE
        ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * S)]).view(B, S, K)
    mask = rand(B, S).abs()
    return {
        "h": rand(S, B, H),  # Megatron's layout [s, b, h]
        "w": rand(V, H) * 0.3,
        "y": labels,
        "batch": PolicyBatch(
            old_logprobs=-rand(B, S).abs(),
            advantages=rand(B, S),
            mask=mask,
            ref_logprobs=-rand(B, S).abs(),
        ),
        "sparse": SparseTeacher(ids=ids, logprobs=-rand(B, S, K).abs(), mask=mask),
        "dense": DenseTeacher(hidden_states=rand(S, B, 12), weight=rand(V, 12), mask=mask),
    }


def _ctx(d: dict[str, Any], context: Any = None, **kw: Any) -> OutputContext:
    return OutputContext(
        hidden_states=d["h_leaf"],
        labels=d["y"],
        vocab_weight=d["w_leaf"],
        vocab=VocabShard(0, V, V),
        context=context,
        check_values=False,
        **kw,
    )


def _rows(d: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return d["h_leaf"].reshape(-1, H), d["w_leaf"], d["y"].T.reshape(-1)


def _token_loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
    return (0.3 * lp - ent**2).sum()


Call = Callable[[dict[str, Any], str], Any]


def _with_rollout(batch: Any) -> Any:
    """The batch with rollout-engine logprobs a little off the old ones."""
    return dataclasses.replace(batch, rollout_logprobs=batch.old_logprobs * 0.9)


def _pairs(d: dict[str, Any]) -> Any:
    """One pair of the batch's three sequences (0 chosen, 2 rejected) and its reference sums."""
    device = d["h_leaf"].device
    index = torch.tensor([0], device=device), torch.tensor([2], device=device)
    zero = torch.zeros(1, device=device)
    return P.PreferenceBatch(
        ref_chosen=zero, ref_rejected=zero - 1.0, chosen=index[0], rejected=index[1]
    )


# name -> call(d, backend); backend is None for a processor (its device's "auto")
PROCESSORS: dict[str, Call] = {
    "selected_logprobs": lambda d, b: P.selected_logprobs(entropy=True)(_ctx(d, d["batch"])),
    "cross_entropy_loss(none)": lambda d, b: P.cross_entropy_loss()(_ctx(d)),
    "cross_entropy_loss(sum)": lambda d, b: P.cross_entropy_loss(reduction="sum")(_ctx(d)),
    "cross_entropy_loss(mean)": lambda d, b: P.cross_entropy_loss(reduction="mean")(
        _ctx(d, loss_mask=d["batch"].mask)
    ),
    "cross_entropy_loss(mean, z_loss, class_weights)": lambda d, b: P.cross_entropy_loss(
        reduction="mean", z_loss=1e-3, class_weights=d["w_leaf"].detach()[:, 0].abs()
    )(_ctx(d, loss_mask=d["batch"].mask)),
    "cross_entropy_loss(none, z_loss, class_weights)": lambda d, b: P.cross_entropy_loss(
        z_loss=1e-3, class_weights=d["w_leaf"].detach()[:, 0].abs()
    )(_ctx(d)),
    "cross_entropy_loss(mean, z_loss, label_smoothing)": lambda d, b: P.cross_entropy_loss(
        reduction="mean", z_loss=1e-3, label_smoothing=0.1
    )(_ctx(d, loss_mask=d["batch"].mask)),
    "cross_entropy_loss(none, label_smoothing)": lambda d, b: P.cross_entropy_loss(
        label_smoothing=0.1
    )(_ctx(d)),
    "policy_loss(GRPO, fused)": lambda d, b: P.policy_loss(PolicyLossConfig.grpo())(
        _ctx(d, d["batch"])
    ),
    "policy_loss(PPO, autograd)": lambda d, b: P.policy_loss(
        PolicyLossConfig(fused=False, entropy_coef=0.01)
    )(_ctx(d, d["batch"])),
    "policy_loss(GSPO, sequence ratio)": lambda d, b: P.policy_loss(PolicyLossConfig.gspo())(
        _ctx(d, d["batch"])
    ),
    "policy_loss(token ratio, sequence mean, dual clip)": lambda d, b: P.policy_loss(
        PolicyLossConfig(ratio=RatioLevel.TOKEN, dual_clip=3.0, aggregation="seq-mean-token-mean")
    )(_ctx(d, d["batch"])),
    "policy_loss(GRPO, fused, rollout correction)": lambda d, b: P.policy_loss(
        PolicyLossConfig.grpo(
            rollout_correction=P.RolloutCorrection(
                rollout_is="token", rollout_rs={"token_k1": 1.5, "seq_mean_k3": 0.1}
            )
        )
    )(_ctx(d, _with_rollout(d["batch"]))),
    "policy_loss(bypass, reinforce)": lambda d, b: P.policy_loss(
        PolicyLossConfig(
            rollout_correction=P.RolloutCorrection(
                rollout_is="sequence", bypass_mode=True, loss_type="reinforce"
            )
        )
    )(_ctx(d, _with_rollout(d["batch"]))),
    "preference_loss(dpo, explicit pairs)": lambda d, b: P.preference_loss()(_ctx(d, _pairs(d))),
    "topk_logprobs": lambda d, b: P.topk_logprobs(K, entropy=True)(_ctx(d)),
    "distillation_loss(sparse, renormalize)": lambda d, b: P.distillation_loss(DistillConfig())(
        _ctx(d, d["sparse"])
    ),
    "distillation_loss(sparse, bucket)": lambda d, b: P.distillation_loss(
        DistillConfig(tail="bucket")
    )(_ctx(d, d["sparse"])),
    "distillation_loss(dense, jsd)": lambda d, b: P.distillation_loss(
        DistillConfig(divergence="jsd")
    )(_ctx(d, d["dense"])),
    "cross_entropy_loss as an MTP processor": lambda d, b: scaled_mtp_gradient(
        detached_head(P.cross_entropy_loss()), 0.5
    )(_ctx(d)),
}


def _options(b: str | None, **kw: Any) -> P.LinearOptions:
    return P.LinearOptions(backend=b or "auto", check_values=False, **kw)


TENSOR_FUNCTIONS: dict[str, Call] = {
    "linear_logprobs": lambda d, b: P.linear_logprobs(*_rows(d), options=_options(b)),
    "linear_logprobs(entropy, per-token temperature)": lambda d, b: P.linear_logprobs(
        *_rows(d),
        with_entropy=True,
        options=_options(b, temperature=d["batch"].mask.T.reshape(-1) + 0.5),
    ),
    "fused_token_loss": lambda d, b: P.fused_token_loss(
        *_rows(d), _token_loss, options=_options(b)
    ),
    "fused_token_loss(entropy_grad=False)": lambda d, b: P.fused_token_loss(
        *_rows(d), lambda lp, ent, rows: -lp.sum(), options=_options(b), entropy_grad=False
    ),
    "fused_token_loss(lse_loss)": lambda d, b: P.fused_token_loss(
        *_rows(d),
        lambda lp, ent, rows: -lp.sum(),
        options=_options(b),
        entropy_grad=False,
        lse_loss=lambda lse, rows: 1e-3 * lse.square().sum(),
    ),
    "linear_distillation_loss(sparse)": lambda d, b: P.linear_distillation_loss(
        *_rows(d),
        SparseTeacher(
            ids=d["sparse"].ids.transpose(0, 1).reshape(-1, K),
            logprobs=d["sparse"].logprobs.transpose(0, 1).reshape(-1, K),
            mask=d["batch"].mask.T.reshape(-1),
        ),
        options=_options(b),
    ),
    "linear_topk_logprobs": lambda d, b: P.linear_topk_logprobs(
        _rows(d)[0], d["w_leaf"], k=K, labels=_rows(d)[2], with_entropy=True, options=_options(b)
    ),
    "linear_distillation_loss(sparse, bucket)": lambda d, b: P.linear_distillation_loss(
        *_rows(d),
        SparseTeacher(
            ids=d["sparse"].ids.transpose(0, 1).reshape(-1, K),
            logprobs=d["sparse"].logprobs.transpose(0, 1).reshape(-1, K),
            mask=d["sparse"].mask.T.reshape(-1),
        ),
        options=_options(b),
        config=DistillConfig(tail="bucket"),
    ),
    "linear_distillation_loss(dense)": lambda d, b: P.linear_distillation_loss(
        *_rows(d),
        DenseTeacher(
            hidden_states=d["dense"].hidden_states.reshape(-1, 12), weight=d["dense"].weight
        ),
        options=_options(b),
    ),
}
WITH_BACKEND = set(TENSOR_FUNCTIONS)


def _loss(out: Any) -> torch.Tensor:
    """Every floating output of a call, summed into one scalar (so backward reaches all)."""
    if isinstance(out, torch.Tensor):
        return out.sum()
    if isinstance(out, dict):
        parts = [v.sum() for v in out.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    else:
        parts = [
            getattr(out, f).sum()
            for f in ("loss", "logprobs", "entropy", "label_logprobs", "lse")
            if isinstance(getattr(out, f, None), torch.Tensor) and getattr(out, f).requires_grad
        ]
    assert parts, f"no output carries a gradient: {type(out).__name__}"
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def run_watched(call: Call, device: str, backend: str | None) -> None:
    """Forward and backward of ``call`` under :class:`HostReads` on ``device``."""
    outer = fake_cuda() if device == "cuda" else contextlib.nullcontext()
    with outer, record_launches(run=device != "cuda") if HAS_TRITON else contextlib.nullcontext():
        d = _data(device)
        d["h_leaf"] = d["h"].clone().requires_grad_()
        d["w_leaf"] = d["w"].clone().requires_grad_()
        with HostReads(device).watching():
            loss = _loss(call(d, backend))  # type: ignore[arg-type]
            if device == "cuda":
                grads = backward([(loss, torch.ones((), device="cuda"))])
                got = [grads.get(id(d["h_leaf"])), grads.get(id(d["w_leaf"]))]
            else:
                loss.backward()
                got = [d["h_leaf"].grad, d["w_leaf"].grad]
        assert any(g is not None for g in got), (
            "no gradient reached the hidden states or the weight"
        )


def _cases() -> list[Any]:
    out = []
    for device in ("cpu", "cuda"):
        for name in PROCESSORS:
            out.append((name, device, None))
        for name in TENSOR_FUNCTIONS:
            for backend in ("torch", "triton") if name in WITH_BACKEND else (None,):
                out.append((name, device, backend))
    params = []
    for name, device, backend in out:
        marks = []
        needs_triton = device == "cuda" or backend == "triton"
        if needs_triton and not HAS_TRITON:
            marks.append(
                pytest.mark.skip(reason="triton is not installed here (py311's CPU torch wheel)")
            )
        params.append(
            pytest.param(
                name, device, backend, marks=marks, id=f"{device}-{backend or 'auto'}-{name}"
            )
        )
    return params


@pytest.mark.parametrize(("name", "device", "backend"), _cases())
def test_no_host_read_forward_and_backward(name: str, device: str, backend: str | None) -> None:
    run_watched(PROCESSORS.get(name) or TENSOR_FUNCTIONS[name], device, backend)


def test_every_public_function_is_covered() -> None:
    """Each processor and tensor function of ``torch_impl.processors.__all__`` has a case."""
    covered = {n.split("(")[0] for n in (*PROCESSORS, *TENSOR_FUNCTIONS)}
    helpers = {
        "auto_choice",
        "device_class",
        "aggregation_weights",
        "kl_penalty",
        "rollout_correction",
        "context_rows",  # the hook's tensors as rows, read by the processors' cases
        "context_options",  # the options the processors build from the same context
        "from_rows",
        "to_rows",
    }  # no logits, no tiles
    functions = {n for n in P.__all__ if callable(getattr(P, n)) and n[0].islower()} - helpers
    assert functions <= covered, sorted(functions - covered)


# ---------------------------------------------------------------- the detector can fail


@pytest.mark.parametrize(
    ("what", "read"),
    [
        ("bool", lambda t: bool(t.sum() > 0)),
        ("if", lambda t: 1 if t.any() else 0),
        ("item", lambda t: t.sum().item()),
        ("int", lambda t: int(t.argmax())),
        ("float", lambda t: float(t.max())),
        ("tolist", lambda t: t.tolist()),
        ("numpy", lambda t: t.numpy()),
        ("cpu", lambda t: t.cpu()),
        ("to cpu", lambda t: t.to("cpu")),
        ("nonzero", lambda t: (t > 0).nonzero()),
        ("mask index", lambda t: t[t > 0]),
        ("mask assign", lambda t: t.clone().__setitem__(t > 0, torch.zeros(1))),
        ("unique", lambda t: t.unique()),
    ],
)
def test_detector_finds_each_kind_of_read(what: str, read: Callable[[torch.Tensor], Any]) -> None:
    t = torch.randn(5)
    with pytest.raises(HostRead), HostReads().watching():
        read(t)


def test_detector_passes_device_side_work_and_names_the_site() -> None:
    t = torch.randn(6, 4)
    with HostReads().watching():
        torch.where(t > 0, t, 0.0).logsumexp(1)
        t.masked_fill(t > 0, 0.0)
        t.to(torch.float64)
        t.shape[0] * 2
    err = HostRead("x")
    assert err.site == "outside the project"
