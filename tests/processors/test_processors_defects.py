"""Silent wrong answers of the logprob tensor functions, each with its class swept.

1. Double backward: a gradient formed outside autograd has no graph, so a
   Hessian-vector product through it read as zero. Every custom autograd function
   under ``torch_impl/`` either differentiates twice correctly or refuses by name.
2. A vocabulary shard with nothing to reduce over: logprobs normalised over one
   shard. Every pairing of shard and collectives of the tensor functions.
3. float64 inputs with a lower-precision operand (a float32 temperature, weight or
   cotangent): every promotion on the float64 path is exact, checked against float64
   at 1e-12; every processor with a float32 and a float64 operand works in float64;
   a caller's ``torch.autocast`` changes no processor.
4. One meaning per name: "plan" is the 1F1B schedule plan's word only.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from hookspec import ContractError, OutputContext, SingleProcessCollectives, TeacherTail, VocabShard
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

HAS_TRITON = importlib.util.find_spec("triton") is not None
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton here")),
]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

ROOT = Path(__file__).resolve().parents[2]
IGNORE = -100
N, H, V = 9, 6, 23


def _inputs(
    dtype: torch.dtype = torch.float64, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    y = torch.randint(0, V, (N,), generator=g)
    y[2] = IGNORE
    return h.to(dtype), w.to(dtype), y


def _truth(
    h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, t: Any = 1.0, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 logprobs and entropy from the full logits (differentiable)."""
    t = t.double()[:, None] if isinstance(t, torch.Tensor) else t
    z = (h.double() @ w.double().T) * scale / t
    logp = z.log_softmax(-1)
    lp = torch.where(y == IGNORE, 0.0, logp.gather(1, y.clamp(min=0)[:, None]).squeeze(1))
    return lp, -(logp.exp() * logp).sum(-1)


# ---------------------------------------------------------------- 1. double backward


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_logprobs_refuses_double_backward_by_name(backend: str) -> None:
    """It used to return a first gradient without a graph: the hvp read 0 where float64
    gives a nonzero value."""
    dtype = torch.float32 if backend == "triton" else torch.float64
    h, w, y = _inputs(dtype)
    h.requires_grad_()
    lp = linear_logprobs(h, w, y, options=LinearOptions(backend=backend)).logprobs
    with pytest.raises(RuntimeError, match="linear_logprobs: double backward"):
        torch.autograd.grad(lp.sum(), h, create_graph=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return linear_logprobs(x, w, y, options=LinearOptions(backend=backend)).logprobs.sum()

    with pytest.raises(RuntimeError, match="linear_logprobs: double backward"):
        torch.autograd.functional.hvp(f, h.detach(), torch.ones_like(h))
    # the float64 truth's hvp is not zero: a zero would have been a wrong answer
    _, hvp = torch.autograd.functional.hvp(
        lambda x: _truth(x, w, y)[0].sum(),
        h.detach().double(),
        torch.ones(N, H, dtype=torch.float64),
    )
    assert float(hvp.abs().max()) > 1e-3
    # one backward without create_graph is unaffected
    (g,) = torch.autograd.grad(
        linear_logprobs(h, w, y, options=LinearOptions(backend=backend)).logprobs.sum(), h
    )
    (g_truth,) = torch.autograd.grad(_truth(h, w, y)[0].sum(), h)
    torch.testing.assert_close(
        g.double(), g_truth.double(), rtol=0, atol=1e-5 if backend == "triton" else 1e-12
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_token_loss_refuses_double_backward_by_name(backend: str) -> None:
    h, w, y = _inputs(torch.float32 if backend == "triton" else torch.float64)
    h.requires_grad_()
    f = fused_token_loss(
        h, w, y, lambda lp, ent, rows: (lp - ent).sum(), options=LinearOptions(backend=backend)
    )
    with pytest.raises(RuntimeError, match="fused_token_loss: double backward"):
        torch.autograd.grad(f.loss, h, create_graph=True)


def _autograd_functions() -> dict[str, tuple[str, ast.ClassDef]]:
    """Every ``torch.autograd.Function`` subclass under ``torch_impl/``: name -> (module, class)."""
    found = {}
    for path in sorted((ROOT / "torch_impl").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                ast.unparse(base).endswith("autograd.Function") for base in node.bases
            ):
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                found[node.name] = (module, node)
    return found


def _first_statement(fn: ast.FunctionDef) -> str:
    """``fn``'s first statement after its docstring, as source ("" when it has none)."""
    body = [
        s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
    ]
    return ast.unparse(body[0]) if body else ""


def _refuses(node: ast.ClassDef) -> bool:
    """``backward`` calls ``refuse_double_backward(<name>)`` first, or first calls a method of
    its own class whose first statement does (``Recomputed.checked_cotangents``)."""
    methods = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
    refusing = {
        name for name, f in methods.items() if "refuse_double_backward(" in _first_statement(f)
    }
    first = _first_statement(methods["backward"]) if "backward" in methods else ""
    return "refuse_double_backward(" in first or any(
        f"{node.name}.{name}(" in first for name in refusing
    )


# Functions whose backward is differentiable: checked against the analytic hvp. With
# an identity forward whose backward scales by c, the hvp of sum(f(x)**3) is
# c**2 * 6 x v (the backward's factor applies to each of the two derivatives).
DIFFERENTIABLE: dict[str, Any] = {
    "_ContiguousGrad": lambda cls: (lambda a: cls.apply(a), 1.0),
    "_ScaleGradient": lambda cls: (lambda a: cls.apply(a, 0.25), 0.25**2),
}


def test_every_custom_autograd_function_differentiates_twice_or_refuses_by_name() -> None:
    """The class: each ``autograd.Function`` under ``torch_impl/`` either has a backward
    built of differentiable ops (its double backward checked here against the
    analytic value) or refuses ``create_graph=True`` by name, first thing in
    ``backward`` (the two of this package are also run above, on both backends)."""
    found = _autograd_functions()
    assert {"Recomputed", "FormedInForward"} <= set(found)
    wrong = []
    for name, (module, node) in found.items():
        if name in DIFFERENTIABLE:
            cls = getattr(importlib.import_module(module), name)
            apply, factor = DIFFERENTIABLE[name](cls)
            x = torch.randn(5, dtype=torch.float64)
            v = torch.randn(5, dtype=torch.float64)
            _, hvp = torch.autograd.functional.hvp(
                lambda a, apply=apply: (apply(a) ** 3).sum(), x, v
            )
            if not torch.allclose(hvp, factor * 6 * x * v, rtol=1e-12, atol=0):
                wrong.append(f"{module}.{name}: hvp {hvp.tolist()}")
        elif not _refuses(node):
            wrong.append(
                f"{module}.{name}: neither in DIFFERENTIABLE "
                "nor calling refuse_double_backward first"
            )
    assert not wrong, wrong


# ----------------------------------------------------------- 2. a shard with nothing to reduce over

SHARDS = {  # (vocab_start, vocab_size) for a weight of V rows
    "whole": (0, None),
    "whole, size given": (0, V),
    "first half": (0, 2 * V),
    "second half": (V, 2 * V),
    "middle third": (V, 3 * V),
}
NO_REDUCTION = {"None": None, "SingleProcessCollectives": SingleProcessCollectives()}


def _call(
    fn: str, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, options: LinearOptions
) -> Any:
    if fn == "linear_logprobs":
        return linear_logprobs(h, w, y, options=options).logprobs
    if fn == "linear_topk_logprobs":  # once normalised over one shard (error 0.86) without a word
        return linear_topk_logprobs(h, w, k=3, labels=y, options=options).logprobs
    return fused_token_loss(h, w, y, lambda lp, ent, rows: lp.sum(), options=options).loss


@pytest.mark.parametrize("fn", ["linear_logprobs", "fused_token_loss", "linear_topk_logprobs"])
@pytest.mark.parametrize("coll", list(NO_REDUCTION))
@pytest.mark.parametrize("shard", list(SHARDS))
def test_a_partial_shard_needs_collectives_that_reduce(fn: str, coll: str, shard: str) -> None:
    """With no collectives (or one rank's), only a weight holding the whole vocabulary is
    accepted; a shard raises ``ContractError`` naming ``collectives`` (it used to return
    finite logprobs normalised over the shard alone), for every tensor function."""
    h, w, y = _inputs()
    start, size = SHARDS[shard]
    y = torch.where(y == IGNORE, y, y + start)  # labels inside this shard
    vocab = None if size is None else VocabShard(start, start + V, size)
    options = LinearOptions(vocab=vocab, collectives=NO_REDUCTION[coll])
    if start == 0 and size in (None, V):
        out = _call(fn, h, w, y, options)
        assert bool(torch.isfinite(out).all())
        return
    with pytest.raises(ContractError) as err:
        _call(fn, h, w, y, options)
    e = err.value
    assert e.field == "collectives"
    assert f"rows [{start}, {start + V}) of a vocabulary of {size}" in str(e.expected)
    assert e.actual == ("None" if coll == "None" else "SingleProcessCollectives() (one rank)")


# ---------------------------------------------------------------- 3. the float64 path's promotions


def _grads(
    fn: Any, h: torch.Tensor, w: torch.Tensor, c_lp: torch.Tensor, c_ent: torch.Tensor
) -> dict[str, torch.Tensor]:
    hh = h.detach().clone().requires_grad_()
    ww = w.detach().clone().requires_grad_()
    lp, ent = fn(hh, ww)
    torch.autograd.backward(
        [lp, ent], [c_lp, c_ent]
    )  # cotangents as given: a float32 one is promoted
    return {
        "lp": lp.detach(),
        "ent": ent.detach(),
        "dh": hh.grad,  # type: ignore[dict-item]
        "dw": ww.grad,  # type: ignore[dict-item]
    }


PROMOTIONS = {
    # name: (hidden dtype, weight dtype, temperature, logit_scale, cotangent dtype)
    "float32 temperature": (torch.float64, torch.float64, torch.float32, 1.0, torch.float64),
    "float16 temperature": (torch.float64, torch.float64, torch.float16, 1.0, torch.float64),
    "bfloat16 temperature": (torch.float64, torch.float64, torch.bfloat16, 1.0, torch.float64),
    "float64 temperature": (torch.float64, torch.float64, torch.float64, 1.0, torch.float64),
    "number temperature and logit scale": (torch.float64, torch.float64, 0.7, 1.3, torch.float64),
    "float32 temperature and logit scale": (
        torch.float64,
        torch.float64,
        torch.float32,
        0.3,
        torch.float64,
    ),
    "float32 cotangents": (torch.float64, torch.float64, 1.0, 1.0, torch.float32),
    "float32 weight": (torch.float64, torch.float32, torch.float32, 1.0, torch.float64),
    "float32 hidden states": (torch.float32, torch.float64, torch.float32, 1.0, torch.float64),
}


@pytest.mark.parametrize("case", list(PROMOTIONS))
def test_float64_path_is_float64_accurate(case: str) -> None:
    """Each lower-precision operand is promoted exactly: values and gradients within
    1e-12 of the float64 computation on the same (promoted) numbers. A float32
    temperature used to give 3.7e-7 (1/T formed in float32)."""
    hd, wd, t_spec, scale, cot = PROMOTIONS[case]
    h, w, y = _inputs()
    h, w = h.to(hd), w.to(wd)
    g = torch.Generator().manual_seed(5)
    t: Any = t_spec
    if isinstance(t_spec, torch.dtype):
        t = (torch.rand(N, generator=g, dtype=torch.float64) + 0.5).to(t_spec)
    c_lp = torch.randn(N, generator=g, dtype=torch.float64).to(cot)
    c_ent = torch.randn(N, generator=g, dtype=torch.float64).to(cot)

    def ours(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = linear_logprobs(
            a,
            b,
            y,
            with_entropy=True,
            options=LinearOptions(temperature=t, logit_scale=scale, tile_cols=7, tile_rows=4),
        )
        assert r.logprobs.dtype == torch.float64 and r.entropy is not None
        return r.logprobs, r.entropy

    got = _grads(ours, h, w, c_lp, c_ent)
    want = _grads(
        lambda a, b: _truth(a, b, y, t, scale),
        h.double(),
        w.double(),
        c_lp.double(),
        c_ent.double(),
    )
    for k in ("lp", "ent"):
        torch.testing.assert_close(
            got[k], want[k], rtol=0, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}"
        )
    for k, like in (("dh", h), ("dw", w)):
        assert got[k].dtype == like.dtype, k
        # a float32 operand's gradient is the float64 gradient rounded once
        tol = 1e-12 if like.dtype == torch.float64 else 2**-23 * float(want[k].abs().max())
        torch.testing.assert_close(
            got[k].double(), want[k], rtol=0, atol=tol, msg=lambda m, k=k: f"{k}: {m}"
        )


def test_fused_loss_and_processor_with_float32_temperature_are_float64_accurate() -> None:
    h, w, y = _inputs()
    t = (
        torch.rand(N, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.5
    ).float()
    lp_truth, ent_truth = _truth(h, w, y, t)
    f = fused_token_loss(
        h, w, y, lambda lp, ent, rows: (lp + ent).sum(), options=LinearOptions(temperature=t)
    )
    torch.testing.assert_close(f.logprobs, lp_truth, rtol=0, atol=1e-12)
    torch.testing.assert_close(f.entropy, ent_truth, rtol=0, atol=1e-12)
    ctx = OutputContext(
        hidden_states=h.reshape(N, 1, H),
        labels=y.reshape(1, N),
        vocab_weight=w,
        vocab=VocabShard(0, V, V),
        context={"temperature": t.reshape(1, N)},
    )
    out = selected_logprobs()(ctx)
    torch.testing.assert_close(out["logprobs"].reshape(N), lp_truth, rtol=0, atol=1e-12)


# --------------------------------------------------------- 3b. every processor: promotion, autocast


def _processor_cases() -> dict[str, tuple[Any, Any]]:
    """name -> (processor, user context of (b, s, h_t, weight rows))."""
    g = torch.Generator().manual_seed(3)
    b, s = 1, N
    batch = PolicyBatch(
        old_logprobs=-torch.rand(b, s, generator=g, dtype=torch.float64) * 3,
        advantages=torch.randn(b, s, generator=g, dtype=torch.float64),
        ref_logprobs=-torch.rand(b, s, generator=g, dtype=torch.float64) * 3,
    )
    th, tw = (
        torch.randn(s, b, H, generator=g, dtype=torch.float64),
        torch.randn(V, H, generator=g, dtype=torch.float64),
    )
    top = torch.sort(torch.einsum("sbh,vh->bsv", th, tw).log_softmax(-1), -1, descending=True)
    sparse = SparseTeacher(
        ids=top.indices[..., :4].contiguous(), logprobs=top.values[..., :4].contiguous()
    )
    return {
        "selected_logprobs": (selected_logprobs(entropy=True), None),
        "cross_entropy_loss": (cross_entropy_loss(), None),
        "cross_entropy_loss(mean)": (cross_entropy_loss(reduction="mean"), None),
        "policy_loss(GRPO)": (policy_loss(PolicyLossConfig.grpo()), batch),
        "policy_loss(PPO, autograd)": (
            policy_loss(PolicyLossConfig(fused=False, entropy_coef=0.1)),
            batch,
        ),
        "topk_logprobs": (topk_logprobs(3, entropy=True), None),
        "distillation_loss(dense)": (
            distillation_loss(),
            DenseTeacher(hidden_states=th, weight=tw),
        ),
        "distillation_loss(sparse)": (
            distillation_loss(DistillConfig(tail=TeacherTail.BUCKET)),
            sparse,
        ),
    }


def _outputs(
    proc: Any, context: Any, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor
) -> dict[str, torch.Tensor]:
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ctx = OutputContext(
        hidden_states=hh.reshape(N, 1, H),
        labels=y.reshape(1, N),
        vocab_weight=ww,
        vocab=VocabShard(0, V, V),
        context=context,
    )
    out = proc(ctx)
    out = {"loss": out} if isinstance(out, torch.Tensor) else dict(out)
    total = sum(
        v.double().sum() for v in out.values() if v.dtype.is_floating_point and v.requires_grad
    )
    dh, dw = torch.autograd.grad(total, (hh, ww))
    return {**{k: v.detach() for k, v in out.items()}, "dh": dh, "dw": dw}


@pytest.mark.parametrize("name", list(_processor_cases()))
def test_every_processor_promotes_a_float64_operand(name: str) -> None:
    """float32 hidden states with a float64 weight (and the reverse): each processor works
    in float64, as on the promoted inputs, to 1e-12 (top-k returned float32, error
    4.6e-7; the reduced cross entropy's weights were float32, 2.1e-7)."""
    proc, context = _processor_cases()[name]
    h, w, y = _inputs()
    for hd, wd in ((torch.float32, torch.float64), (torch.float64, torch.float32)):
        got = _outputs(proc, context, h.to(hd).double().to(hd), w.to(wd).double().to(wd), y)
        want = _outputs(proc, context, h.to(hd).double(), w.to(wd).double(), y)
        for key, v in want.items():
            if key in ("dh", "dw"):  # in their operand's dtype: the float64 gradient rounded once
                continue
            assert got[key].dtype == v.dtype, (name, key, got[key].dtype)
            torch.testing.assert_close(
                got[key], v, rtol=1e-12, atol=1e-12, msg=lambda m, k=key: f"{name} {k}: {m}"
            )


@pytest.mark.parametrize("name", list(_processor_cases()))
def test_a_callers_autocast_changes_no_processor(name: str) -> None:
    """Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` each processor gives what it
    gives without (top-k was off by 6e-3: its GEMMs ran in bf16)."""
    proc, context = _processor_cases()[name]
    h, w, y = _inputs(torch.float32)
    want = _outputs(proc, context, h, w, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _outputs(proc, context, h, w, y)
    for key, v in want.items():
        torch.testing.assert_close(
            got[key], v, rtol=1e-6, atol=1e-7, msg=lambda m, k=key: f"{name} {k}: {m}"
        )


# ---------------------------------------------------------------- 4. one meaning per name


def test_no_plan_in_the_processors() -> None:
    """ "plan" means the 1F1B schedule plan: the logprob call's checked inputs are a
    ``TileSetup`` (``_setup.py``), and no processor module, test of it or its page uses
    the word."""
    tests = [
        p
        for p in sorted((ROOT / "tests" / "processors").glob("test_processors_*.py"))
        if p.name != Path(__file__).name
    ]
    files = [
        *sorted((ROOT / "torch_impl" / "processors").glob("*.py")),
        ROOT / "docs" / "processors.md",
        *tests,
        ROOT / "tests" / "processors" / "test_triton_compile.py",
        ROOT / "tests" / "processors" / "test_cost_model.py",
    ]
    word = re.compile(r"\bplan(s|_\w+)?\b|\b_?Plan\b|\bmake_plan\b|_plan\b", re.IGNORECASE)
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in files
        if p.exists()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if word.search(line) and "planted" not in line
    ]
    assert not hits, hits
    assert not (ROOT / "torch_impl" / "processors" / "_plan.py").exists()
