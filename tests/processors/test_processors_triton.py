"""The Triton backend of ``linear_logprobs`` and ``fused_token_loss``, three ways.

Its GEMMs are ``torch.mm`` calls; its Triton kernels do the passes over each fp32
logits chunk (statistics; the logit gradient in place). On a CPU the kernels run under
Triton's interpreter (``TRITON_INTERPRET=1``, set by ``conftest.py`` before any import),
at small awkward sizes: no dimension a multiple of a block, and chunks that divide
nothing. Each case is checked against a float64 ground truth (the full logits,
upcast) and against the torch path on the same inputs. ``gpu``-marked tests run the
compiled kernels and cuBLAS at real sizes. The kernels use no ``tl.dot``, so the
interpreter's wrong bf16 ``tl.dot`` does not matter here.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed here (the CPU torch wheel of the py311 environment has none); "
        "the interpreter tests run in the py312 environment",
        allow_module_level=True,
    )

from hookspec import ContractError, VocabShard
from tests.support.distributed import run_distributed
from torch_impl.processors import LinearOptions, fused_token_loss, linear_logprobs

# numpy under the interpreter evaluates both sides of tl.where: the unused side's
# inf * 0 (masked edge lanes, the first block of the online logsumexp) warns there
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

IGNORE = -100
N, H, V = 37, 40, 300  # no multiple of a block (32 x 64 x 32 under the interpreter)
ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"


def inputs(
    n: int = N,
    h: int = H,
    v: int = V,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    shift: float = 0.0,
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.4
    if shift:  # every logit near `shift`: add a constant direction to h and w
        hid[:, 0] = 1.0
        w[:, 0] = shift
    y = torch.randint(0, v, (n,), generator=g)
    y[::7] = IGNORE
    return {
        "h": hid.to(dtype).to(DEV),
        "w": w.to(dtype).to(DEV),
        "y": y.to(DEV),
        "t": (torch.rand(n, generator=g, dtype=torch.float64) + 0.5).to(DEV),
        "c_lp": torch.randn(n, generator=g, dtype=torch.float64).to(DEV),
        "c_ent": torch.randn(n, generator=g, dtype=torch.float64).to(DEV),
    }


def truth(
    p: dict[str, torch.Tensor], temperature: object, scale: float = 1.0
) -> dict[str, torch.Tensor]:
    """float64: logprobs, entropy and the gradients of ``sum(c_lp * lp + c_ent * ent)``."""
    h = p["h"].double().requires_grad_()
    w = p["w"].double().requires_grad_()
    t = (
        p["t"].double()[:, None]
        if temperature == "per-token"
        else float(temperature)  # type: ignore[arg-type]
    )  # fmt: skip
    z = (h @ w.T) * scale / t
    logp = z.log_softmax(-1)
    y = p["y"]
    lp = torch.where(y == IGNORE, 0.0, logp.gather(1, y.clamp(min=0)[:, None]).squeeze(1))
    ent = -(logp.exp() * logp).sum(-1)
    (p["c_lp"] * lp + p["c_ent"] * ent).sum().backward()
    return {
        "lp": lp.detach(),
        "ent": ent.detach(),
        "dh": h.grad,  # type: ignore[dict-item]
        "dw": w.grad,  # type: ignore[dict-item]
    }


def ours(
    p: dict[str, torch.Tensor],
    backend: str,
    temperature: object,
    *,
    grad_out_strided: bool = False,
    **kw: object,
) -> dict[str, torch.Tensor]:
    h = p["h"].clone().requires_grad_()
    w = p["w"].clone().requires_grad_()
    t = p["t"] if temperature == "per-token" else temperature
    options = LinearOptions(temperature=t, backend=backend, **kw)  # type: ignore[arg-type]
    r = linear_logprobs(h, w, p["y"], with_entropy=True, options=options)
    assert r.entropy is not None
    c_lp, c_ent = p["c_lp"].float(), p["c_ent"].float()
    if grad_out_strided:  # cotangents that are views with stride 2
        c_lp = torch.stack([c_lp, c_lp]).T.reshape(-1)[::2]
        c_ent = torch.stack([c_ent, c_ent]).T.reshape(-1)[::2]
        assert not c_lp.is_contiguous() or c_lp.stride() != (1,)
    torch.autograd.backward([r.logprobs, r.entropy], [c_lp, c_ent])
    return {
        "lp": r.logprobs.detach(),
        "ent": r.entropy.detach(),
        "dh": h.grad,  # type: ignore[dict-item]
        "dw": w.grad,  # type: ignore[dict-item]
    }


def max_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float((a[k].double() - b[k].double()).abs().max()) for k in b}


def scale_of(x: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float(v.double().abs().max()) for k, v in x.items()}


@pytest.mark.parametrize("temperature", [1.0, 0.7, "per-token"])
def test_fp32_three_way(temperature: object) -> None:
    """Values, dh and dW within fp32 rounding of float64, and of the torch path."""
    p = inputs()
    exact = truth(p, temperature)
    tri = ours(p, "triton", temperature)
    ref = ours(p, "torch", temperature)
    big = scale_of(exact)
    for k, err in max_err(tri, exact).items():
        assert err <= 2e-6 * max(1.0, big[k]), (k, err)
    for k, err in max_err(tri, ref).items():
        assert err <= 2e-6 * max(1.0, big[k]), (k, err)
    assert torch.equal(
        tri["lp"][p["y"] == IGNORE].cpu(), torch.zeros(int((p["y"] == IGNORE).sum()))
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("token_chunk", "vocab_chunk"),
    [(8, 64), (37, 100), (5, 300), (16, 33)],
    ids=["rows-and-columns-split", "all-rows", "all-columns", "odd-columns"],
)
def test_chunks_against_the_torch_path(
    dtype: torch.dtype, token_chunk: int, vocab_chunk: int
) -> None:
    """Chunks of the cuBLAS logits: rows split (``dW`` through its fp32 accumulator) or
    not (each ``dW`` chunk one GEMM), columns split (``dh`` accumulated) or not; the
    gradient written in place over several kernel steps (64 columns a step here),
    2-byte outputs included. Against float64."""
    p = inputs(dtype=dtype, seed=11)
    kw = dict(tile_rows=token_chunk, tile_cols=vocab_chunk)
    tri = ours(p, "triton", "per-token", **kw)
    exact = truth(p, "per-token")
    big = scale_of(exact)
    # the values are fp32 statistics of exact products: as close as fp32 allows,
    # whatever the input dtype; the gradients carry the dtype's rounding (of the
    # logit gradient, then of dh and dW)
    rel = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    for k, err in max_err(tri, exact).items():
        tol = 2e-6 if k in ("lp", "ent") else rel
        assert err <= tol * max(1.0, big[k]), (k, err)
    assert tri["dh"].dtype == dtype and tri["dw"].dtype == dtype


def test_chunks_from_the_memory_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without sizes, the chunk comes from ``TILE_BYTES``: a budget below
    ``n x 1024`` entries splits the rows too; the results do not change beyond fp32
    rounding."""
    from torch_impl import processors

    p = inputs(seed=12)
    whole = ours(p, "triton", 0.8)
    monkeypatch.setitem(processors.TILE_BYTES, "cpu", 10 * 128 * 4)  # 10 rows x 128 entries
    split = ours(p, "triton", 0.8)
    big = scale_of(whole)
    for k, err in max_err(split, whole).items():
        assert err <= 2e-6 * max(1.0, big[k]), (k, err)


def test_bf16_three_way_no_worse_than_naive() -> None:
    """bf16 inputs: the error against float64 is no worse than the naive bf16 path's."""
    p = inputs(dtype=torch.bfloat16, seed=1)
    exact = truth(p, 1.0)
    tri = ours(p, "triton", 1.0)
    h = p["h"].clone().requires_grad_()
    w = p["w"].clone().requires_grad_()
    z = (h @ w.T).float()
    logp = z.log_softmax(-1)
    lp = torch.where(p["y"] == IGNORE, 0.0, logp.gather(1, p["y"].clamp(min=0)[:, None]).squeeze(1))
    ent = -(logp.exp() * logp).sum(-1)
    (p["c_lp"].float() * lp + p["c_ent"].float() * ent).sum().backward()
    naive = {"lp": lp.detach(), "ent": ent.detach(), "dh": h.grad, "dw": w.grad}
    e_tri, e_naive = max_err(tri, exact), max_err(naive, exact)  # type: ignore[arg-type]
    for k in exact:
        assert e_tri[k] <= e_naive[k] + 1e-6, (k, e_tri[k], e_naive[k])
    assert tri["dh"].dtype == torch.bfloat16 and tri["dw"].dtype == torch.bfloat16


def test_logit_scale_and_strided_cotangents() -> None:
    p = inputs(seed=2)
    exact = truth(p, 0.9, scale=0.5)
    tri = ours(p, "triton", 0.9, logit_scale=0.5, grad_out_strided=True)
    big = scale_of(exact)
    for k, err in max_err(tri, exact).items():
        assert err <= 2e-6 * max(1.0, big[k]), (k, err)


def test_logits_near_minus_1e4() -> None:
    """Every logit about -1e4: the online logsumexp must not lose the spread."""
    p = inputs(seed=3, shift=-1e4)
    exact = truth(p, 1.0)
    assert float(exact["lp"].abs().max()) < 50  # the constant cancels in the truth
    tri = ours(p, "triton", 1.0)
    ref = ours(p, "torch", 1.0)
    e_tri, e_ref = max_err(tri, exact), max_err(ref, exact)
    for k in ("lp", "ent"):
        assert e_tri[k] <= max(2 * e_ref[k], 5e-3), (k, e_tri[k], e_ref[k])


def test_logprobs_only_and_ignored_everywhere() -> None:
    p = inputs(n=19, v=77, seed=4)
    h = p["h"].clone().requires_grad_()
    r = linear_logprobs(h, p["w"], p["y"], options=LinearOptions(backend="triton"))
    assert r.entropy is None
    exact = truth(p, 1.0)
    torch.testing.assert_close(r.logprobs.double(), exact["lp"], rtol=0, atol=2e-6)
    y_none = torch.full_like(p["y"], IGNORE)
    h2 = p["h"].clone().requires_grad_()
    r2 = linear_logprobs(h2, p["w"], y_none, options=LinearOptions(backend="triton"))
    r2.logprobs.sum().backward()
    assert torch.equal(r2.logprobs, torch.zeros_like(r2.logprobs))
    assert torch.equal(h2.grad, torch.zeros_like(h2))


def test_bitwise_run_to_run() -> None:
    """No atomics: the same inputs give the same bits twice."""
    p = inputs(seed=5)
    a = ours(p, "triton", "per-token")
    b = ours(p, "triton", "per-token")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_nan_in_hidden_is_visible() -> None:
    p = inputs(seed=6)
    p["h"][3, 5] = float("nan")
    r = linear_logprobs(
        p["h"], p["w"], p["y"], with_entropy=True, options=LinearOptions(backend="triton")
    )
    assert r.entropy is not None
    assert bool(torch.isnan(r.entropy[3]))
    assert int(p["y"][3]) != IGNORE  # a counted row: its logprob carries the NaN
    assert bool(torch.isnan(r.logprobs[3]))
    others = torch.arange(N, device=r.logprobs.device) != 3
    assert bool(torch.isfinite(r.logprobs[others]).all())


def _fused_loss(c_lp: torch.Tensor, c_ent: torch.Tensor):  # type: ignore[no-untyped-def]
    def token_loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
        return (c_lp[rows].to(lp.dtype) * lp + c_ent[rows].to(lp.dtype) * ent**2).sum()

    return token_loss


def test_fused_token_loss_triton_equals_torch() -> None:
    p = inputs(seed=7)
    out = {}
    for backend in ("triton", "torch"):
        h = p["h"].clone().requires_grad_()
        w = p["w"].clone().requires_grad_()
        f = fused_token_loss(
            h,
            w,
            p["y"],
            _fused_loss(p["c_lp"], p["c_ent"]),
            options=LinearOptions(
                temperature=p["t"], backend=backend, tile_rows=max(1, 11 * V // w.shape[0])
            ),
        )
        f.loss.backward()
        out[backend] = {"loss": f.loss.detach(), "lp": f.logprobs, "dh": h.grad, "dw": w.grad}
    for k, v in out["torch"].items():
        torch.testing.assert_close(
            out["triton"][k], v, rtol=0, atol=2e-6 * max(1.0, float(v.abs().max()))
        )


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fused_token_loss_contract(backend: str) -> None:
    p = inputs(n=9, v=50, seed=8)
    h = p["h"].clone().requires_grad_()
    for bad, what in [
        (lambda lp, ent, rows: lp * 2, "shape [9]"),
        (lambda lp, ent, rows: 1.5, "float"),
        (lambda lp, ent, rows: torch.ones((), dtype=torch.long), "int64"),
    ]:
        with pytest.raises(ContractError, match="token_loss") as err:
            fused_token_loss(h, p["w"], p["y"], bad, options=LinearOptions(backend=backend))
        assert what in str(err.value)
    # a constant loss is valid: zero gradients
    f = fused_token_loss(
        h,
        p["w"],
        p["y"],
        lambda lp, ent, rows: torch.tensor(3.0),
        options=LinearOptions(backend=backend),
    )
    f.loss.backward()
    assert torch.equal(h.grad, torch.zeros_like(h))


def test_backend_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    p = inputs(n=4, v=20)
    with pytest.raises(ContractError, match=r"backend.*one of"):
        linear_logprobs(
            p["h"],
            p["w"],
            p["y"],
            options=LinearOptions(backend="cuda"),  # type: ignore[arg-type]
        )
    with pytest.raises(ContractError, match="float64"):
        linear_logprobs(
            p["h"].double(), p["w"].double(), p["y"], options=LinearOptions(backend="triton")
        )
    if not ON_GPU:
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ContractError, match="TRITON_INTERPRET"):
            linear_logprobs(p["h"], p["w"], p["y"], options=LinearOptions(backend="triton"))
        # "auto" on a CPU is the torch path: bitwise the same as asking for it
        a = linear_logprobs(p["h"], p["w"], p["y"], options=LinearOptions(backend="auto")).logprobs
        b = linear_logprobs(p["h"], p["w"], p["y"], options=LinearOptions(backend="torch")).logprobs
        assert torch.equal(a, b)


def test_auto_backend_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """``"auto"``: torch on a CPU; on CUDA the device class's measured entry (H200: the
    2026-11-26 run), else the cuBLAS + Triton design, unmeasured."""
    from torch_impl.processors import MEASURED_CHOICES, BackendChoice, auto_choice, device_class

    assert device_class("NVIDIA H100 80GB HBM3", (9, 0)) == "H100"
    assert device_class("NVIDIA H200", (9, 0)) == "H200"
    assert device_class("NVIDIA GH200 480GB", (9, 0)) == "GH200"
    assert device_class("NVIDIA A100-SXM4-80GB", (8, 0)) == "A100"
    assert device_class("Some Future GPU", (12, 1)) == "sm_121"
    assert auto_choice(torch.device("cpu")).backend == "torch"
    assert set(MEASURED_CHOICES) == {"H200"}
    h200 = MEASURED_CHOICES["H200"]
    assert (h200.backend, h200.measured) == ("triton", True) and "bench.log" in h200.source
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert auto_choice(torch.device("cuda")) is h200
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    unmeasured = auto_choice(torch.device("cuda"))
    assert (unmeasured.backend, unmeasured.measured) == ("triton", False)
    assert "not measured" in unmeasured.source
    measured = BackendChoice("torch", measured=True, source="docs/gpu-results.md")
    monkeypatch.setitem(MEASURED_CHOICES, "H100", measured)
    assert auto_choice(torch.device("cuda")) is measured


@pytest.mark.parametrize(
    ("keyword", "field"),
    [("temperature", "LinearOptions(temperature)"), ("chunk_size", "LinearOptions(tile_cols)"),
     ("vocab_start", "LinearOptions(vocab=VocabShard"),
     ("tile_elements", "LinearOptions(tile_rows")],
)  # fmt: skip
def test_a_keyword_of_the_earlier_signature_names_its_option(keyword: str, field: str) -> None:
    """The options moved into ``LinearOptions``: an old keyword raises ``TypeError``
    naming where it went, not a bare "unexpected keyword"."""
    p = inputs(n=6, v=40)
    with pytest.raises(TypeError, match=re.escape(field)):
        linear_logprobs(p["h"], p["w"], p["y"], **{keyword: 1})
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['temprature'\]$"):
        linear_logprobs(p["h"], p["w"], p["y"], temprature=2.0)


# ---------------------------------------------------------------- tensor parallel over gloo


def _tp2_triton(rank: int, p: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> None:
    from megatron.core import parallel_state

    from torch_impl import TorchCollectives

    coll = TorchCollectives(
        parallel_state.get_tensor_model_parallel_group(), sequence_parallel=False
    )
    half = V // 2
    shard = slice(rank * half, (rank + 1) * half)
    h = p["h"].clone().requires_grad_()
    w = p["w"][shard].clone().requires_grad_()
    r = linear_logprobs(
        h,
        w,
        p["y"],
        with_entropy=True,
        options=LinearOptions(
            temperature=p["t"],
            collectives=coll,
            backend="triton",
            vocab=VocabShard(rank * half, (rank + 1) * half, V),
        ),
    )
    assert r.entropy is not None
    torch.autograd.backward([r.logprobs, r.entropy], [p["c_lp"].float(), p["c_ent"].float()])
    tol = {"rtol": 0.0, "atol": 2e-6 * 10}
    torch.testing.assert_close(r.logprobs.double(), exact["lp"], **tol)
    torch.testing.assert_close(r.entropy.double(), exact["ent"], **tol)
    torch.testing.assert_close(h.grad.double(), exact["dh"], **tol)  # both shards' contributions
    torch.testing.assert_close(w.grad.double(), exact["dw"][shard], **tol)


@pytest.mark.skipif(ON_GPU, reason="the gloo ranks run the interpreter on the CPU")
def test_tp2_shards_combine_over_gloo() -> None:
    p = {k: v.cpu() for k, v in inputs(seed=9).items()}
    run_distributed(_tp2_triton, p, truth(p, "per-token"), tp=2)


# ---------------------------------------------------------------- compiled kernels on a GPU


def reference_rows(
    hid: torch.Tensor, w: torch.Tensor, y: torch.Tensor, rows: torch.Tensor
) -> dict[str, torch.Tensor]:
    """float64 autograd on the rows ``rows``: logprobs, entropy and ``d(sum(lp + ent))/dh``
    (a row's ``dh`` depends on that row alone). An ignored row's logprob is 0, so only
    its entropy has a gradient."""
    h = hid[rows].double().requires_grad_()
    logp = (h @ w.double().T).log_softmax(-1)
    yr = y[rows]
    lp = torch.where(yr == IGNORE, 0.0, logp.gather(1, yr.clamp(min=0)[:, None]).squeeze(1))
    ent = -(logp.exp() * logp).sum(-1)
    (dh,) = torch.autograd.grad((lp + ent).sum(), h)
    return {"lp": lp.detach(), "ent": ent.detach(), "dh": dh}


def naive_rows(
    hid: torch.Tensor, w: torch.Tensor, y: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """The naive path's ``dh`` on the rows: logits in the inputs' dtype, softmax in fp32."""
    h = hid[rows].clone().requires_grad_()
    logp = (h @ w.T).float().log_softmax(-1)
    yr = y[rows]
    lp = torch.where(yr == IGNORE, 0.0, logp.gather(1, yr.clamp(min=0)[:, None]).squeeze(1))
    ent = -(logp.exp() * logp).sum(-1)
    (dh,) = torch.autograd.grad((lp + ent).sum(), h)
    return dh


# the relative dh error allowed: 2x naive's on the same rows, and never above this
DH_CAP = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}
VALUE_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}


def three_way_real_sizes(
    n: int, h: int, v: int, dtype: torch.dtype, device: str, backends: tuple[str, ...]
) -> None:
    """Values on a row subset against float64; ``dh`` on it no worse than twice the
    naive path's error (and under ``DH_CAP``); the backends' ``dW`` agree."""
    g = torch.Generator(device=device).manual_seed(0)
    hid = torch.randn(n, h, device=device, generator=g, dtype=torch.float32).to(dtype)
    w = (torch.randn(v, h, device=device, generator=g) * h**-0.5).to(dtype)
    y = torch.randint(0, v, (n,), device=device, generator=g)
    y[::13] = IGNORE
    res = {}
    for backend in backends:
        hh = hid.clone().requires_grad_()
        ww = w.clone().requires_grad_()
        r = linear_logprobs(hh, ww, y, with_entropy=True, options=LinearOptions(backend=backend))
        assert r.entropy is not None
        (r.logprobs.sum() + r.entropy.sum()).backward()
        res[backend] = (r.logprobs.detach(), r.entropy.detach(), hh.grad, ww.grad)
    rows = torch.arange(0, n, max(1, n // 256), device=device)
    assert bool((y[rows] == IGNORE).any()) and bool((y[rows] != IGNORE).any())
    exact = reference_rows(hid, w, y, rows)
    norm = exact["dh"].norm()
    naive = float((naive_rows(hid, w, y, rows).double() - exact["dh"]).norm() / norm)
    tol = VALUE_TOL[dtype]
    for backend, (r_lp, r_ent, r_dh, _) in res.items():
        assert float((r_lp[rows].double() - exact["lp"]).abs().max()) <= tol, backend
        assert float((r_ent[rows].double() - exact["ent"]).abs().max()) <= tol, backend
        rel = float((r_dh[rows].double() - exact["dh"]).norm() / norm)
        assert rel <= min(DH_CAP[dtype], 2 * naive + 1e-7), (backend, rel, naive)
    # the backends agree on the weight gradient to the dtype's rounding
    dw_a, dw_t = res[backends[0]][3].double(), res[backends[1]][3].double()
    assert float((dw_a - dw_t).norm() / dw_t.norm()) <= 2 * VALUE_TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n", "h", "v", "dtype"),
    [
        (4099, 1000, 32771, torch.bfloat16),  # awkward edges everywhere
        (8192, 4096, 151936, torch.bfloat16),  # Qwen vocabulary
        (2048, 1024, 65536, torch.float16),
        (1021, 512, 20011, torch.float32),
    ],
)
def test_gpu_three_way_real_sizes(n: int, h: int, v: int, dtype: torch.dtype) -> None:
    """Compiled kernels (bf16/fp16 tensor cores, IEEE fp32); auto picks Triton on CUDA."""
    three_way_real_sizes(n, h, v, dtype, "cuda", ("auto", "torch"))


@pytest.mark.skipif(ON_GPU, reason="the GPU runs the real sizes")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_three_way_real_sizes_body_on_a_cpu(dtype: torch.dtype) -> None:
    """The GPU test's body at a small size: the Triton kernels under the interpreter."""
    three_way_real_sizes(67, 24, 301, dtype, "cpu", ("triton", "torch"))


def test_the_reference_gradient_is_float64_autograd_with_ignored_rows() -> None:
    """The reference keeps no ``-p`` term on an ignored row (the hand-written one of
    the first GPU run did, off by 0.9% to 1.3% of ``dh``); the closed form that keeps
    it is refused by this check."""
    p = inputs(dtype=torch.float64)
    hid, w, y = p["h"].cpu(), p["w"].cpu(), p["y"].cpu()
    rows = torch.arange(hid.shape[0])
    got = reference_rows(hid, w, y, rows)["dh"]
    logp = (hid @ w.T).log_softmax(-1)
    prob = logp.exp()
    ent = -(prob * logp).sum(-1)
    valid = (y != IGNORE)[:, None]
    onehot = torch.zeros_like(logp).scatter_(1, y.clamp(min=0)[:, None], 1.0)
    right = (valid * (onehot - prob) - prob * (logp + ent[:, None])) @ w
    earlier = (onehot * valid - prob - prob * (logp + ent[:, None])) @ w  # the -p kept
    assert torch.allclose(got, right, rtol=1e-12, atol=1e-12)
    ignored = ~valid[:, 0]
    assert bool(ignored.any())
    assert float((earlier - got)[ignored].abs().max()) > 1e-2
    assert torch.equal(earlier[~ignored], right[~ignored]) or torch.allclose(
        earlier[~ignored], right[~ignored], rtol=1e-12, atol=1e-12
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_fused_loss_backends_agree_and_repeat_bitwise(dtype: torch.dtype) -> None:
    """The fused loss on a GPU: the Triton backend (cuBLAS GEMMs, in-place gradient in
    1 GiB tiles) equals the torch backend to the dtype's rounding, and gives the same
    bits twice (no atomics, no race in the in-place 2-byte write)."""
    n, h, v = 4099, 1000, 32771
    g = torch.Generator(device="cuda").manual_seed(1)
    hid = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).to(dtype)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[::11] = IGNORE
    t = torch.rand(n, device="cuda", generator=g) + 0.5

    def run(backend: str) -> tuple[torch.Tensor, ...]:
        hh = hid.clone().requires_grad_()
        ww = w.clone().requires_grad_()
        f = fused_token_loss(
            hh,
            ww,
            y,
            lambda lp, ent, rows: (lp - 0.1 * ent**2).sum(),
            options=LinearOptions(temperature=t, backend=backend),
        )
        f.loss.backward()
        return f.loss.detach(), f.logprobs, hh.grad, ww.grad

    a, b, ref = run("triton"), run("triton"), run("torch")
    for x, y_ in zip(a, b):
        assert torch.equal(x, y_)
    tol = {torch.bfloat16: 2e-2, torch.float32: 1e-4}[dtype]
    for x, r in zip(a, ref):
        assert float((x.double() - r.double()).norm() / r.double().norm()) <= tol


# --------------------------------------------------------------- the kernels alone, against float64


def _kernel_rows(seed: int, rows: int, cols: int) -> torch.Tensor:
    """fp32 logits rows of every kind the statistics meet: random, ascending (a new
    max in every block), descending, a -inf run, a row all -inf, a single +inf, NaN."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, cols, generator=g) * 3
    z[1] = torch.linspace(-20.0, 25.0, cols)
    z[2] = torch.linspace(25.0, -20.0, cols)
    z[3, 10:200] = float("-inf")
    z[4] = float("-inf")
    z[5, 77] = float("inf")
    z[6, 131] = float("nan")
    return z


def _f64_sums(
    zt: torch.Tensor, ref: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 ``sum(exp(zt - ref))``, ``sum(exp(zt - ref) * (zt - ref))`` and the scale
    of the second, ``sum(exp(zt - ref) * |zt - ref|)``, per row."""
    d = zt.double() - ref.double()[:, None]
    e = d.exp()
    ed = torch.where(e > 0, e * d, 0.0)
    return e.sum(1), ed.sum(1), ed.abs().sum(1)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's launch shape: blocks of 2 x 64")
@pytest.mark.parametrize(
    "split", [(300,), (64, 236), (100, 1, 199)], ids=["one-tile", "two-tiles", "three-tiles"]
)
def test_stats_kernel_against_float64(split: tuple[int, ...]) -> None:
    """``chunk_stats_`` over one or more column tiles (blocks of 64 columns, a ragged
    tail, a 1-column tile): the running max exact, the sums within fp32 rounding of
    float64; a -inf lane adds nothing, a row all -inf keeps ``(-inf, 0, 0)``, +inf
    and NaN make the row's sums NaN."""
    from torch_impl.processors._geometry import KernelConfig
    from torch_impl.processors._triton_kernels import chunk_stats_

    rows, cols = 9, sum(split)
    z = _kernel_rows(3, rows, cols)
    g = torch.Generator().manual_seed(4)
    inv_t = torch.rand(rows, generator=g) + 0.5
    labels = torch.randint(0, cols, (rows,), generator=g)
    cfg = KernelConfig(block_m=2, block_n=64)
    zt = z * inv_t[:, None]  # fp32, rounded as the kernel rounds it
    m_ref = zt.max(1).values
    s64, t64, t_scale = _f64_sums(zt, m_ref)
    nan_rows, ok = [5, 6], torch.tensor([i not in (4, 5, 6) for i in range(rows)])
    for with_t in (True, False):
        m, s, t, zy = torch.zeros(4, rows).unbind(0)
        m.fill_(float("-inf"))
        state = (m, s, t if with_t else None, zy)
        col0 = 0
        for width in split:
            tile = z[:, col0 : col0 + width].clone()
            chunk_stats_(tile, labels, inv_t, state, col0=col0, cfg=cfg)
            col0 += width
        assert torch.equal(m[:6], m_ref[:6]) and torch.equal(m[7:], m_ref[7:]), (m, m_ref)
        torch.testing.assert_close(
            zy, zt[torch.arange(rows), labels], rtol=0, atol=0, equal_nan=True
        )
        assert bool(torch.isnan(s[nan_rows]).all())
        assert (float(m[4]), float(s[4])) == (float("-inf"), 0.0)
        torch.testing.assert_close(s[ok].double(), s64[ok], rtol=2e-6, atol=0)
        if with_t:
            assert bool(torch.isnan(t[nan_rows]).all()) and float(t[4]) == 0.0
            assert bool(((t[ok].double() - t64[ok]).abs() <= 2e-6 * t_scale[ok]).all()), (t, t64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exp_rows_rounds_to_nearest_even(dtype: torch.dtype) -> None:
    """``exp_rows_`` writes ``E`` rounded to nearest even: its 2-byte output equals its
    own fp32 output rounded by torch, bit for bit (the interpreter's own bf16
    conversion truncates; compiled, the hardware rounds); the label's column is 0;
    the vectors do not depend on the output dtype; all against float64."""
    from torch_impl.processors._geometry import kernel_config
    from torch_impl.processors._triton_kernels import exp_rows_

    rows, cols = 7, (300 if not ON_GPU else 2 * 2048 + 300)  # full blocks and a tail
    z = _kernel_rows(5, rows, cols)
    z[3:] = (
        torch.randn(rows - 3, cols, generator=torch.Generator().manual_seed(6)) * 4
    )  # finite rows
    z = z.to(DEV)
    labels = torch.tensor([5, cols - 1, 0, 64, IGNORE, 150, 63], device=DEV)
    inv_t = 0.8
    got = {}
    for out_dtype in (torch.float32, dtype):
        out = torch.full((rows, cols), 7.0, dtype=out_dtype, device=DEV)
        c, m, s, t, zy = torch.empty(5, rows, device=DEV).unbind(0)
        flags = torch.empty(rows, dtype=torch.int8, device=DEV)
        exp_rows_(z, out, labels, inv_t, (c, m, s, t, zy, flags), cfg=kernel_config(z.device))
        got[out_dtype] = (out, c, m, s, t, zy)
    (e32, *v32), (e16, *v16) = got[torch.float32], got[dtype]
    assert torch.equal(e16, e32.to(dtype))
    for a, b in zip(v32, v16):
        assert torch.equal(a, b)
    c, m, s, t, _ = (x.cpu() for x in v32)
    zt = z.cpu() * inv_t
    assert torch.equal(m, zt.max(1).values)
    s64, t64, t_scale = _f64_sums(zt, c)
    # compiled, each term's exponent is rounded once (an FFMA, then exp2's argument):
    # half an ulp of |zt - c| <= 40 each, up to 2e-6 of a term
    torch.testing.assert_close(s.double(), s64, rtol=5e-6, atol=0)
    assert bool(((t.double() - t64).abs() <= 5e-6 * t_scale).all()), (t, t64)
    expect = (zt.double() - c.double()[:, None]).exp()
    here = (labels >= 0).nonzero().flatten().cpu()
    expect[here, labels.cpu()[here]] = 0.0
    # fp32 E: its exponent argument rounded once (|zt - c| <= 40 here)
    torch.testing.assert_close(e32.cpu().double(), expect, rtol=1e-5, atol=0)
