"""The cross-check harness: right processors pass, wrong ones fail, on synthetic,
adversarial and real tiny-GPT contexts, for both kinds of processor."""

from __future__ import annotations

import dataclasses
import math
import types

import jax.numpy as jnp
import pytest
import torch

import hookspec
from hookspec import ContractError
from jax_ref.check import examples as E
from jax_ref.check.cases import CASE_KINDS, synthetic_context
from jax_ref.check.comparison import TOLERANCES, Tolerance, cross_check, to_reference_tree
from jax_ref.check.report import CrossCheckReport
from jax_ref.check.torch_run import run_through_hook

REF = E.logprobs_entropy_reference


def _failing(report: CrossCheckReport) -> set[tuple[str, str]]:
    return {(r.output, r.quantity) for r in report.failures()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", CASE_KINDS)
def test_a_right_processor_passes_every_case(kind, dtype):
    report = cross_check(
        E.vocab_parallel_logprobs, REF, synthetic_context(kind, dtype=dtype), case_name=kind
    )
    assert report.passed, str(report)
    assert len(report.rows) == 6  # 2 outputs x (value, d/d hidden, d/d weight)
    assert {r.dtype for r in report.rows} == {str(dtype).removeprefix("torch.")}


def test_an_upstream_style_processor_is_checked_too():
    ctx = synthetic_context("random")
    assert cross_check(E.full_vocab_logprobs, REF, ctx).passed


def test_sign_error_is_caught_in_value_and_both_gradients():
    report = cross_check(E.wrong_sign_entropy, REF, synthetic_context("random"))
    assert _failing(report) == {
        ("entropy", "value"),
        ("entropy", "d/d hidden"),
        ("entropy", "d/d weight"),
    }
    worst = max(r.max_rel for r in report.failures())
    assert worst == pytest.approx(2.0, rel=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wrong_reduction_is_caught(dtype):
    ctx = synthetic_context("masked", dtype=dtype)
    assert cross_check(E.token_mean_loss, E.token_mean_loss_reference, ctx).passed
    report = cross_check(E.wrong_reduction_loss, E.token_mean_loss_reference, ctx)
    assert _failing(report) == {
        ("output", "value"),
        ("output", "d/d hidden"),
        ("output", "d/d weight"),
    }
    counted = float((ctx.loss_mask * (ctx.labels != -100)).sum())
    assert min(r.max_rel for r in report.failures()) == pytest.approx(counted - 1, rel=1e-2)


def test_the_float32_floor_rescues_only_what_float32_cannot_resolve():
    # peaked softmax: entropies ~1e-4 from logits ~25; a correct fp32 processor is off by
    # ~1e-7 there, as is the plain fp32 formula, and passes; a sign error does not.
    ctx = synthetic_context("peaked")
    report = cross_check(E.vocab_parallel_logprobs, REF, ctx)
    assert report.passed
    assert any(r.floor > 0 for r in report.rows), (
        "expected the floor to be needed in the peaked case"
    )
    assert not cross_check(E.wrong_sign_entropy, REF, ctx).passed
    strict = dataclasses.replace(TOLERANCES["float32"], slack=0.0)
    assert not cross_check(E.vocab_parallel_logprobs, REF, ctx, tolerance=strict).passed


def test_non_finite_values_fail_with_a_note():
    @hookspec.processor
    def leaky(ctx):
        out = E.vocab_parallel_logprobs(ctx)
        bad = out["logprobs"].clone()
        bad[0, :3] = float("nan")
        bad[1, 0] = -float("inf")
        return {"logprobs": bad, "entropy": out["entropy"]}

    report = cross_check(leaky, REF, synthetic_context("random"))
    row = next(r for r in report.failures() if r.quantity == "value")
    assert (
        row.output == "logprobs"
        and row.note == "non-finite: 4 of 24 values"
        and math.isnan(row.max_abs)
    )
    assert "non-finite: 4 of 24 values" in report.table()


def test_a_non_finite_reference_is_named_in_the_note():
    """A NaN from the reference used to read "finite where the reference is not",
    naming neither the reference nor what was wrong with it."""

    def nan_reference(hidden, weight, inputs):
        out = dict(REF(hidden, weight, inputs))
        out["logprobs"] = out["logprobs"].at[0, :2].set(jnp.nan)
        return out

    report = cross_check(E.vocab_parallel_logprobs, nan_reference, synthetic_context("random"))
    row = next(r for r in report.failures() if r.quantity == "value")
    assert row.output == "logprobs"
    assert row.note == (
        "the reference 'nan_reference' is NaN at 2 of 24 values where the processor is finite "
        "(a defect of the reference, or of the inputs it reads)"
    )
    assert "the reference 'nan_reference' is NaN at 2 of 24 values" in report.table()


def test_a_reference_of_another_structure_is_a_contract_error():
    def only_logprobs(hidden, weight, inputs):
        return {"logprobs": REF(hidden, weight, inputs)["logprobs"]}

    with pytest.raises(
        ContractError, match=r"reference 'only_logprobs' result: expected the processor's"
    ):
        cross_check(E.vocab_parallel_logprobs, only_logprobs, synthetic_context("random"))

    def one_array(hidden, weight, inputs):
        return REF(hidden, weight, inputs)["logprobs"]

    with pytest.raises(ContractError, match="a mapping of arrays"):
        cross_check(E.vocab_parallel_logprobs, one_array, synthetic_context("random"))


def test_the_exchanged_tensors_are_not_written_to():
    ctx = synthetic_context("random")
    before = (ctx.hidden_states.clone(), ctx.vocab_weight.detach().clone(), ctx.labels.clone())
    assert cross_check(E.vocab_parallel_logprobs, REF, ctx).passed
    assert torch.equal(ctx.hidden_states, before[0]) and torch.equal(ctx.vocab_weight, before[1])
    assert torch.equal(ctx.labels, before[2])


def test_report_prints_as_a_table():
    report = cross_check(
        E.vocab_parallel_logprobs, REF, synthetic_context("random"), case_name="rand"
    )
    text = str(report)
    assert text.splitlines()[0] == "vocab_parallel_logprobs vs selected_logprobs_reference: passed"
    assert "max abs err" in text and "d/d weight" in text and text.count("\nrand ") == 6
    assert "d/d hidden" in report.summary()


def test_user_context_crosses_to_jax():
    @dataclasses.dataclass(frozen=True)
    class Batch:
        old: torch.Tensor
        steps: int
        extra: dict

        def __post_init__(self):
            if not isinstance(self.old, torch.Tensor):
                raise TypeError("torch only")

    tree = to_reference_tree(
        Batch(torch.ones(2, 3, dtype=torch.bfloat16), 4, {"a": torch.arange(3)})
    )
    assert tree.old.dtype == jnp.float64 and tree.steps == 4 and tree.extra["a"].dtype == jnp.int64


@pytest.mark.parametrize("tied", [False, True])
def test_through_the_hook_of_a_real_tiny_gpt(megatron_single, tied):
    from jax_ref.check.gpt_cases import build_case_model, case_batch

    model = build_case_model(tied=tied)
    batch = case_batch()
    for proc in (E.vocab_parallel_logprobs, E.full_vocab_logprobs):
        run = run_through_hook(proc, model, batch)
        assert run.via_hook and run.context.hidden_states.shape == (8, 3, 32)
        assert run.context.vocab_weight is (
            model.shared_embedding_or_output_weight() if tied else model.output_layer.weight
        )
        report = cross_check(proc, REF, run, case_name="gpt")
        assert report.passed, str(report)
    bad = cross_check(
        E.wrong_sign_entropy, REF, run_through_hook(E.wrong_sign_entropy, model, batch)
    )
    assert not bad.passed


def test_bf16_through_float16module(megatron_single):
    from jax_ref.check.gpt_cases import build_case_model, case_batch

    model = build_case_model(dtype="bfloat16")
    run = run_through_hook(E.vocab_parallel_logprobs, model, case_batch())
    assert run.context.hidden_states.dtype == torch.bfloat16
    assert run.context.vocab_weight.dtype == torch.bfloat16
    assert cross_check(E.vocab_parallel_logprobs, REF, run).passed


def test_a_context_that_breaks_the_contract_is_refused():
    ctx = synthetic_context("random")
    bad = ctx.replace(labels=ctx.labels.clone().fill_(64))  # V = 64: one past the last id
    with pytest.raises(ContractError, match=r"labels: expected token ids in \[0, 64\)"):
        cross_check(E.vocab_parallel_logprobs, REF, bad)


def test_jax_collectives_satisfy_the_contract_protocol():
    from jax_ref import JaxCollectives

    assert isinstance(JaxCollectives("tp"), hookspec.Collectives)


def test_tolerance_policy():
    tol = Tolerance(rtol=1e-3, atol=1e-9, slack=4.0)
    assert tol.allows(1e-3, 1.0) and not tol.allows(2e-3, 1.0) and tol.allows(2e-3, 1.0, floor=5e-4)
    assert TOLERANCES["bfloat16"].rtol > TOLERANCES["float16"].rtol > TOLERANCES["float32"].rtol


def test_a_softcap_in_the_config_reaches_processor_and_reference():
    """``config.final_logit_softcapping`` (an instance attribute of a copy of the
    config, as a release with the field has it): the built-in processor follows it,
    ``reference_inputs`` reads it (None, 0, False: off), and a reference that
    ignores it fails, so the cap binds on this case."""
    from jax_ref import processors as P
    from jax_ref.check.builtin_processors import LOGPROBS, SOFTCAP, softcapped_config
    from jax_ref.check.comparison import logit_softcap, reference_inputs

    ctx = synthetic_context("random")
    capped = ctx.replace(config=softcapped_config(ctx.config))
    assert reference_inputs(capped).softcap == SOFTCAP and reference_inputs(ctx).softcap is None
    for off in (None, 0, 0.0, False):
        assert logit_softcap(types.SimpleNamespace(final_logit_softcapping=off)) is None
    ref = P.selected_logprobs(entropy=True)
    assert cross_check(LOGPROBS, ref, capped).passed
    uncapped = cross_check(LOGPROBS, ref, ctx)
    assert uncapped.passed
    wrong = cross_check(LOGPROBS, lambda h, w, i: ref(h, w, i.replace(softcap=None)), capped)
    assert {q for _, q in _failing(wrong)} == {"value", "d/d hidden", "d/d weight"}, str(wrong)
