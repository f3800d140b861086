"""The public readings of a hook's context for a processor of one's own:
``context_options``, ``context_rows``, ``to_rows`` and ``from_rows`` give
what the built-in processors use (the same options, the same rows in the same order),
and name a bad input."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
import torch

from hookspec import ContractError, OutputContext, ParallelLayout, VocabShard
from jax_ref.check.cases import synthetic_context
from tests.support.distributed import run_distributed
from tests.support.identity_collectives import identity_collectives
from torch_impl.processors import (
    ContextRows,
    _logprob_processors,
    context_options,
    context_rows,
    cross_entropy_loss,
    from_rows,
    linear_logprobs,
    selected_logprobs,
    to_rows,
)


def _ctx(kind: str = "masked", *, temperature: bool = True, seed: int = 1) -> OutputContext:
    ctx = synthetic_context(kind, seed=seed, dtype=torch.float64)
    if temperature:
        g = torch.Generator().manual_seed(seed)
        t = torch.rand(ctx.batch_size, ctx.seq_len, generator=g, dtype=torch.float64) + 0.5
        ctx = ctx.replace(context={"temperature": t})
    return ctx


def _leaf(ctx: OutputContext) -> OutputContext:
    w = ctx.vocab_weight.detach().clone().requires_grad_()  # type: ignore[union-attr]
    h = ctx.hidden_states.detach().clone().requires_grad_()  # type: ignore[union-attr]
    return ctx.replace(hidden_states=h, vocab_weight=w, output_weight=None)


@pytest.mark.parametrize("kind", ["masked", "awkward"])
def test_rows_and_options_give_the_builtin_logprobs_and_gradients(kind: str) -> None:
    """``from_rows(linear_logprobs(*context_rows(ctx), options=context_options(ctx)))`` is
    ``selected_logprobs()(ctx)`` (a per-token temperature from the user context), values
    and both gradients, bit for bit."""
    ctx = _ctx(kind)
    got: list[dict[str, torch.Tensor]] = []
    for mine in (False, True):
        c = _leaf(ctx)
        if mine:
            res = linear_logprobs(*context_rows(c), options=context_options(c), with_entropy=True)
            out = {"logprobs": from_rows(res.logprobs, c), "entropy": from_rows(res.entropy, c)}
        else:
            out = selected_logprobs(entropy=True)(c)
        cot = torch.linspace(-1, 1, out["logprobs"].numel(), dtype=torch.float64)
        (out["logprobs"] * cot.view_as(out["logprobs"]) + out["entropy"]).sum().backward()
        grads = {"dh": c.hidden_states.grad, "dw": c.vocab_weight.grad}  # type: ignore[union-attr]
        got.append({**out, **grads})
    for key in got[0]:
        assert torch.equal(got[0][key], got[1][key]), key


def test_context_options_is_the_builtin_processors_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """The options ``selected_logprobs`` hands its tensor function, and its rows, equal
    ``context_options`` and ``context_rows`` of the same context."""
    seen: dict[str, Any] = {}
    real = _logprob_processors.linear_logprobs

    def spy(hidden: Any, weight: Any, labels: Any, **kw: Any) -> Any:
        seen.update(rows=(hidden, weight, labels), options=kw["options"])
        return real(hidden, weight, labels, **kw)

    monkeypatch.setattr(_logprob_processors, "linear_logprobs", spy)
    ctx = _ctx(temperature=False)
    selected_logprobs(temperature=0.7, tile_rows=5, tile_cols=16)(ctx)
    mine = context_options(ctx, temperature=0.7, tile_rows=5, tile_cols=16)
    assert seen["options"] == mine
    assert (mine.temperature, mine.tile_rows, mine.check_values) == (0.7, 5, False)
    assert mine.vocab == ctx.vocab and mine.collectives is ctx.collectives
    rows = context_rows(ctx)
    assert isinstance(rows, ContextRows)
    for a, b in zip(rows, seen["rows"], strict=True):
        assert torch.equal(a, b)
    # cross_entropy_loss(reduction="none") reads no temperature: T = 1, as context_options's
    seen.clear()
    cross_entropy_loss(tile_cols=16)(ctx)
    assert seen["options"] == context_options(ctx, tile_cols=16)


def test_the_rows_are_s_major_and_from_rows_inverts_to_rows() -> None:
    """Row ``i * b + j`` is token ``(j, i)``: hidden ``[s, b, h]`` reshaped, labels ``[b, s]``
    transposed; ``from_rows`` inverts ``to_rows``, for ``[b, s]`` and ``[b, s, k]``."""
    ctx = _ctx("awkward")
    b, s = ctx.batch_size, ctx.seq_len
    rows = context_rows(ctx)
    hs, labels = ctx.hidden_states, ctx.labels
    assert isinstance(hs, torch.Tensor) and isinstance(labels, torch.Tensor)
    assert rows.hidden.shape == (s * b, hs.shape[-1]) and rows.labels is not None
    for i, j in [(0, 0), (0, 2), (4, 1), (s - 1, b - 1)]:
        assert torch.equal(rows.hidden[i * b + j], hs[i, j])
        assert rows.labels[i * b + j] == labels[j, i]
    assert rows.weight is ctx.vocab_weight
    x = torch.arange(b * s * 2.0).view(b, s, 2)
    assert to_rows(x)[1 * b + 2].tolist() == x[2, 1].tolist()
    assert torch.equal(from_rows(to_rows(x), ctx), x)
    assert torch.equal(from_rows(to_rows(x[..., 0]), ctx), x[..., 0])
    # a context without labels: rows without them
    assert context_rows(ctx.replace(labels=None, loss_mask=None)).labels is None


def test_context_options_reads_the_logit_scale_and_softcap_as_numbers() -> None:
    """MuP's output multiplier as ``logit_scale`` (from ``scale_logits``), the model's
    final-logit softcap as ``softcap``; a ``scale_logits`` that is not ``z -> c z`` raises."""
    ctx = _ctx()
    mup = types.SimpleNamespace(use_mup=True, mup_output_mult=2.5, final_logit_softcapping=30.0)
    opts = context_options(ctx.replace(config=mup, scale_logits=lambda z: 2.5 * z))
    assert (opts.logit_scale, opts.softcap) == (2.5, 30.0)
    assert context_options(ctx).logit_scale == 1.0
    with pytest.raises(ContractError) as err:
        context_options(ctx.replace(scale_logits=lambda z: z.clamp(max=3.0)))
    assert err.value.field == "scale_logits"


def _raises(call: Any) -> ContractError:
    with pytest.raises(ContractError) as err:
        call()
    return err.value


def test_bad_input_is_named() -> None:
    ctx = _ctx()
    e = _raises(lambda: context_options("ctx"))  # type: ignore[arg-type]
    assert (e.field, e.expected, e.actual) == ("ctx", "a hookspec.OutputContext", "str")
    e = _raises(lambda: context_rows(None))  # type: ignore[arg-type]
    assert (e.field, e.actual) == ("ctx", "NoneType")
    e = _raises(lambda: context_options(ctx.replace(vocab_weight=None)))
    assert (e.field, e.actual) == ("vocab_weight", "None")
    e = _raises(lambda: context_rows(ctx.replace(vocab=None)))
    assert (e.field, e.actual) == ("vocab", "None")
    e = _raises(lambda: context_options(ctx, temperature=0.7))
    assert e.field == "temperature" and "both" in e.actual
    e = _raises(lambda: context_options(ctx.replace(context=None), temperature=-1.0))
    assert e.field == "temperature"
    e = _raises(lambda: context_options(ctx.replace(context={"temperature": 1.0}),
                                                   tile_rows=0))  # fmt: skip
    assert e.field == "tile_rows"
    bad_t = {"temperature": torch.ones(ctx.seq_len, ctx.batch_size)}
    e = _raises(lambda: context_options(ctx.replace(context=bad_t)))
    assert (e.field, e.actual) == ("context.temperature", "[8, 3]")
    e = _raises(lambda: from_rows(torch.zeros(23), ctx))
    assert e.field == "values" and "n=24" in e.expected and e.actual == "[23]"
    e = _raises(lambda: from_rows([0.0] * 24, ctx))  # type: ignore[arg-type]
    assert (e.field, e.actual) == ("values", "list")
    e = _raises(lambda: to_rows(torch.zeros(24)))
    assert (e.field, e.actual) == ("x", "[24]")


def test_sequence_parallel_rows_are_this_ranks_and_from_rows_takes_the_gathered_count() -> None:
    """Under sequence parallel the hidden rows are this rank's ``s/tp`` positions, and
    ``from_rows`` takes the ``b * s`` rows a tensor function returns (gathered)."""
    ctx = _ctx(temperature=False)
    hs = ctx.hidden_states
    local = ctx.replace(
        hidden_states=hs[:4],  # type: ignore[index]
        parallel=ParallelLayout(tp_size=2, tp_rank=0, sequence_parallel=True),
        vocab=VocabShard(0, 32, 64),
        vocab_weight=ctx.vocab_weight[:32],  # type: ignore[index]
        output_weight=None,
        output_layer=None,
        collectives=identity_collectives("StandInRanks")(),
    )
    rows = context_rows(local)
    assert rows.hidden.shape == (4 * 3, hs.shape[-1])  # type: ignore[union-attr]
    assert rows.labels is not None and rows.labels.shape == (24,)
    assert from_rows(torch.zeros(24), local).shape == (3, 8)


# ---------------------------------------------------------------- tensor parallel 2


def _tp2(rank: int, whole: dict[str, torch.Tensor]) -> None:
    from megatron.core import parallel_state

    from torch_impl import TorchCollectives

    group = parallel_state.get_tensor_model_parallel_group()
    v = whole["w"].shape[0]
    half = v // 2
    ctx = OutputContext(
        hidden_states=whole["h"].clone(),
        labels=whole["y"],
        vocab_weight=whole["w"][rank * half : (rank + 1) * half].clone(),
        vocab=VocabShard(rank * half, (rank + 1) * half, v),
        parallel=ParallelLayout(tp_size=2, tp_rank=rank),
        collectives=TorchCollectives(group, sequence_parallel=False),
        context={"temperature": whole["t"]},
    )
    opts = context_options(ctx)
    assert opts.vocab == ctx.vocab and opts.collectives is ctx.collectives
    got = from_rows(linear_logprobs(*context_rows(ctx), options=opts).logprobs, ctx)
    want = selected_logprobs()(ctx)["logprobs"]
    assert torch.equal(got, want)
    z = torch.einsum("sbh,vh->bsv", whole["h"], whole["w"]) / whole["t"][..., None]
    truth = z.log_softmax(-1).gather(-1, whole["y"].clamp(min=0)[..., None])[..., 0]
    truth = torch.where(whole["y"] == -100, 0.0, truth)
    torch.testing.assert_close(got, truth, rtol=1e-12, atol=1e-12)


@pytest.mark.release_independent
@pytest.mark.slow
def test_tp2_rows_and_options_are_the_builtins() -> None:
    """Two gloo ranks, each holding half of the vocabulary: ``context_options`` takes the
    rank's shard and collectives, and the rows through ``linear_logprobs`` give
    ``selected_logprobs``' values on each rank, equal to the float64 whole-vocabulary truth."""
    g = torch.Generator().manual_seed(0)
    s, b, h, v = 6, 3, 8, 20
    y = torch.randint(0, v, (b, s), generator=g)
    y[1, 2] = -100
    whole = {
        "h": torch.randn(s, b, h, generator=g, dtype=torch.float64),
        "w": torch.randn(v, h, generator=g, dtype=torch.float64),
        "y": y,
        "t": torch.rand(b, s, generator=g, dtype=torch.float64) + 0.5,
    }
    run_distributed(_tp2, whole, tp=2)


def test_contextrows_is_a_frozen_triple() -> None:
    rows = context_rows(_ctx())
    with pytest.raises(AttributeError):
        rows.hidden = rows.weight  # type: ignore[misc]
    hidden, weight, labels = rows
    assert dataclasses.is_dataclass(context_options(_ctx()))
    assert labels is rows.labels and hidden is rows.hidden and weight is rows.weight
