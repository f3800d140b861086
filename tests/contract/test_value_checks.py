"""Value checks that do not stall the GPU (``torch_impl.value_checks``), and where the
hook and the processors run them.

On a CPU the check is immediate and names the field, the range and the values found.
On CUDA (``gpu``-marked) it makes no host read: the result of one call is read at the
entry of a later checked call or on request (the rule of ``torch_impl.value_checks``,
tested here on the CPU with the GPU path emulated), and a captured CUDA graph carries a
device-side assert.
The hook checks the labels once per call; the built-in processors then check nothing
again, and ``check_values=False`` means no value check anywhere. A processor called
directly, on a context built by hand, checks what it reads.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookspec
import torch_impl
from hookspec import ContractError, OutputContext, VocabShard
from tests.support.fake_cuda import deferred_checks
from tests.support.hook_cases import model_inputs
from torch_impl import value_checks
from torch_impl.processors import LinearOptions, linear_logprobs, selected_logprobs
from torch_impl.testing.tiny import build_tiny_gpt, tiny_batch
from torch_impl.value_checks import (
    check_labels_deferred,
    check_positive_deferred,
    pending_checks,
    raise_pending_errors,
)


def test_cpu_is_immediate_and_names_the_values() -> None:
    check_labels_deferred(torch.tensor([0, 4, -100]), 5, ignore_index=-100)
    with pytest.raises(ContractError) as err:
        check_labels_deferred(
            torch.tensor([0, 7, -3, -100, 9]), 5, ignore_index=-100, field="labels"
        )
    text = str(err.value)
    assert "labels" in text and "[0, 5)" in text and "3 ids outside it, in [-3, 9]" in text
    assert pending_checks() == 0


def test_cpu_wrong_types_are_named() -> None:
    with pytest.raises(ContractError, match="integer dtype"):
        check_labels_deferred(torch.tensor([0.0, 1.0]), 5, ignore_index=-100)
    with pytest.raises(ContractError, match="array"):
        check_labels_deferred([0, 1], 5, ignore_index=-100)


@pytest.mark.gpu
def test_cuda_defers_without_a_host_read() -> None:
    raise_pending_errors(wait=True)
    good = torch.tensor([0, 4, -100], device="cuda")
    bad = torch.tensor([0, 7, -3, -100], device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
    try:
        check_labels_deferred(good, 5, ignore_index=-100)
        check_labels_deferred(bad, 5, ignore_index=-100, field="labels")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pending_checks() >= 1
    with pytest.raises(ContractError, match=r"2 ids outside it, in \[-3, 7\]"):
        raise_pending_errors(wait=True)
    assert pending_checks() == 0


@pytest.mark.gpu
def test_cuda_graph_capture_carries_the_check() -> None:
    labels = torch.tensor([0, 4, -100], device="cuda")
    out = torch.zeros(3, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture, as torch.cuda.graphs requires
        check_labels_deferred(labels, 5, ignore_index=-100)
        raise_pending_errors(wait=True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        check_labels_deferred(labels, 5, ignore_index=-100)
        out.copy_(labels.float())
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.tensor([0.0, 4.0, -100.0]))


def test_cpu_positive_check_counts_nan_and_names_the_field() -> None:
    check_positive_deferred(torch.tensor([0.5, 2.0]), field="temperature")
    with pytest.raises(ContractError) as err:
        check_positive_deferred(
            torch.tensor([0.5, -1.0, float("nan"), 0.0]), field="context.temperature"
        )
    text = str(err.value)
    assert (
        "context.temperature" in text
        and "finite values > 0" in text
        and "3 values outside it" in text
    )


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("ignore_index", "foo"),
        ("ignore_index", None),
        ("ignore_index", True),
        ("ignore_index", -100.0),
        ("check_values", "yes"),
        ("check_values", 1),
        ("check_values", None),
    ],
)
@pytest.mark.usefixtures("megatron_single")
def test_enable_refuses_bad_options_before_touching_the_model(option: str, value: Any) -> None:
    model = build_tiny_gpt()
    cls = type(model)
    with pytest.raises(ContractError) as err:
        torch_impl.enable_output_processor(model, **{option: value})
    assert option in str(err.value) and repr(value) in str(err.value)
    assert type(model) is cls and not torch_impl.is_output_processor_enabled(model)


class _Counter:
    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, _Counter]:
    """Count the label and temperature checks, wherever they run (this process only)."""
    counters = {
        "labels": _Counter(value_checks.check_labels_deferred),
        "positive": _Counter(value_checks.check_positive_deferred),
    }
    import torch_impl._call as call_module
    import torch_impl.processors._checks as checks_module
    import torch_impl.processors._inputs as inputs_module

    monkeypatch.setattr(call_module, "check_labels_deferred", counters["labels"])
    monkeypatch.setattr(checks_module, "check_labels_deferred", counters["labels"])
    monkeypatch.setattr(inputs_module, "check_labels_deferred", counters["labels"])
    monkeypatch.setattr(checks_module, "check_positive_deferred", counters["positive"])
    return counters


@pytest.mark.usefixtures("megatron_single")
@pytest.mark.parametrize("check_values", [True, False])
def test_hook_checks_once_and_the_processor_never_again(
    counted: dict[str, _Counter], check_values: bool
) -> None:
    batch = tiny_batch()
    model = torch_impl.enable_output_processor(build_tiny_gpt(), check_values=check_values)
    seen: list[bool] = []

    @hookspec.processor
    def spy(ctx: OutputContext) -> Any:
        seen.append((ctx.check_values, ctx.labels_checked))
        return selected_logprobs()(ctx)

    t = torch.full(batch["labels"].shape, 0.7)
    out = model(
        *model_inputs(batch),
        labels=batch["labels"],
        output_processor=spy,
        output_processor_context={"temperature": t},
    )
    assert out["logprobs"].shape == batch["labels"].shape
    # the hook checked the labels (or was told not to); the processor is told so
    assert seen == [(check_values, check_values)]
    assert counted["labels"].calls == (1 if check_values else 0)  # once, in the hook
    assert counted["positive"].calls == (1 if check_values else 0)  # the temperature, once


@pytest.mark.usefixtures("megatron_single")
def test_check_values_false_reads_no_label_value() -> None:
    batch = tiny_batch()
    labels = batch["labels"].clone()
    labels[0, 0] = 10_000  # outside the vocabulary
    checked = torch_impl.enable_output_processor(build_tiny_gpt())
    with pytest.raises(ContractError, match="labels"):
        checked(*model_inputs(batch), labels=labels, output_processor=selected_logprobs())
    unchecked = torch_impl.enable_output_processor(build_tiny_gpt(), check_values=False)
    out = unchecked(*model_inputs(batch), labels=labels, output_processor=selected_logprobs())
    assert out["logprobs"].shape == labels.shape  # the user opted out: no check, no error


def _hand_built(labels: torch.Tensor, **kw: Any) -> OutputContext:
    g = torch.Generator().manual_seed(0)
    s, b = labels.shape[1], labels.shape[0]
    return OutputContext(
        hidden_states=torch.randn(s, b, 8, generator=g),
        labels=labels,
        vocab_weight=torch.randn(20, 8, generator=g),
        vocab=VocabShard(start=0, end=20, size=20),
        **kw,
    )


def test_direct_call_checks_labels_and_temperature(counted: dict[str, _Counter]) -> None:
    labels = torch.tensor([[0, 3, 25], [1, -100, 2]])
    with pytest.raises(ContractError, match=r"1 ids outside it, in \[25, 25\]"):
        selected_logprobs()(_hand_built(labels))
    good = labels.clone()
    good[0, 2] = 4
    t = torch.tensor([[1.0, 0.5, 2.0], [1.0, 0.0, 1.0]])
    with pytest.raises(ContractError, match="temperature"):
        selected_logprobs()(_hand_built(good, context={"temperature": t}))
    # a good context: the labels and the temperature each checked once
    calls = counted["labels"].calls, counted["positive"].calls
    selected_logprobs()(_hand_built(good, context={"temperature": t.abs() + 0.5}))
    assert (counted["labels"].calls, counted["positive"].calls) == (calls[0] + 1, calls[1] + 1)
    # the same context with check_values=False: no value check at all
    calls = counted["labels"].calls, counted["positive"].calls
    selected_logprobs()(_hand_built(good, context={"temperature": t}, check_values=False))
    assert (counted["labels"].calls, counted["positive"].calls) == calls


@pytest.mark.parametrize("flag", ["check_values", "labels_checked"])
def test_context_flags_must_be_bools(flag: str) -> None:
    with pytest.raises(ContractError, match=flag):
        hookspec.validate_context(_hand_built(torch.tensor([[0, 1]]), **{flag: "no"}))


@pytest.mark.usefixtures("megatron_single")
def test_nan_temperature_through_the_hook_is_refused() -> None:
    batch = tiny_batch()
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    t = torch.full(batch["labels"].shape, 0.7)
    t[1, 3] = float("nan")
    with pytest.raises(ContractError, match=r"context.temperature.*1 values outside it"):
        model(
            *model_inputs(batch),
            labels=batch["labels"],
            output_processor=selected_logprobs(),
            output_processor_context={"temperature": t},
        )


_OURS = tuple(str(Path(m.__file__).resolve().parent) for m in (hookspec, torch_impl))


@pytest.mark.gpu
def test_cuda_forward_with_a_processor_makes_no_host_sync_in_our_code() -> None:
    """A forward through the hook on CUDA, under ``set_sync_debug_mode("warn")``: no
    synchronisation is asked for from a line of hookspec or torch_impl (Megatron's own
    forward may synchronise; that is not ours to remove)."""
    from torch_impl.testing.tiny import megatron_parallel

    with megatron_parallel():
        model = torch_impl.enable_output_processor(build_tiny_gpt().cuda())
        batch = {
            k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in tiny_batch().items()
        }
        kw = {"labels": batch["labels"], "output_processor": selected_logprobs(entropy=True)}
        model(*model_inputs(batch), **kw)  # warm-up: compilation, allocator
        raise_pending_errors(wait=True)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = model(*model_inputs(batch), **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ours = [
            w
            for w in caught
            if "synchron" in str(w.message) and str(Path(w.filename).resolve()).startswith(_OURS)
        ]
        assert not ours, [(w.filename, w.lineno, str(w.message)) for w in ours]
        raise_pending_errors(wait=True)
        assert torch.isfinite(out["logprobs"]).all() and (out["logprobs"] <= 0).all()


@pytest.mark.gpu
def test_cuda_graph_captures_a_processor_with_its_checks() -> None:
    """The processor on a hand-built CUDA context (``check_values=True``: the direct
    call checks labels and temperature) captured in a CUDA graph and replayed: the
    replay equals an eager call bitwise."""
    labels = torch.tensor([[0, 3, 7], [1, -100, 2]], device="cuda")
    ctx = _hand_built(labels.cpu(), context={"temperature": torch.full((2, 3), 0.8)})
    ctx = ctx.replace(
        hidden_states=ctx.hidden_states.cuda(),
        labels=labels,
        vocab_weight=ctx.vocab_weight.cuda(),
        context={"temperature": torch.full((2, 3), 0.8, device="cuda")},
    )
    proc = selected_logprobs(entropy=True)
    eager = proc(ctx)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        proc(ctx)  # warm-up outside capture, as torch.cuda.graphs requires
    torch.cuda.current_stream().wait_stream(s)
    raise_pending_errors(wait=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = proc(ctx)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured["logprobs"], eager["logprobs"])
    assert torch.equal(captured["entropy"], eager["entropy"])


# ---------------------------------------------------------------- when a deferred error surfaces
# The rule of ``torch_impl.value_checks`` (module docstring), on the CUDA path emulated on
# the CPU (``tests.support.fake_cuda.deferred_checks``): read at the entry of a checked call only.

BAD = torch.tensor([0, 7, -100])


def test_a_call_never_raises_for_its_own_values_even_when_its_copy_lands_at_once() -> None:
    """The race the GPU won (a small copy lands before the call's next check): the
    call still returns; the next checked call raises at its entry."""
    with deferred_checks(at_once=True):
        with value_checks.checked_call():
            check_labels_deferred(BAD, 5, ignore_index=-100, field="first")
            check_labels_deferred(torch.tensor([1]), 5, ignore_index=-100, field="second")
            with value_checks.checked_call():  # nested: only the outermost entry reads
                check_positive_deferred(torch.tensor([1.0]), field="t")
        assert pending_checks() == 3
        with pytest.raises(
            ContractError, match=r"1 ids outside it, in \[7, 7\] \(found by the deferred"
        ):
            with value_checks.checked_call():
                pytest.fail("the entry raises before the body runs")
        assert pending_checks() == 2  # read once, oldest first; the good ones stay until read
        raise_pending_errors()
        assert pending_checks() == 0


def test_an_unlanded_copy_is_read_at_the_first_entry_after_it_lands() -> None:
    with deferred_checks(at_once=False) as copies:
        check_labels_deferred(BAD, 5, ignore_index=-100, field="labels")  # a call of its own
        for _ in range(3):  # no synchronisation: nothing landed, nothing raised
            with value_checks.checked_call():
                check_labels_deferred(torch.tensor([1]), 5, ignore_index=-100)
        assert pending_checks() == 4
        copies.land()  # what float(loss), .item() or torch.cuda.synchronize() do
        with pytest.raises(ContractError) as err:
            check_labels_deferred(torch.tensor([1]), 5, ignore_index=-100)
        assert err.value.field == "labels"


def test_waiting_always_raises() -> None:
    with deferred_checks(at_once=False):
        with value_checks.checked_call():
            check_positive_deferred(torch.tensor([0.5, float("nan"), -1.0]), field="temperature")
        with pytest.raises(ContractError) as err:
            raise_pending_errors(wait=True)
        assert err.value.field == "temperature" and "2 values outside it" in str(err.value)
        assert pending_checks() == 0


def test_linear_logprobs_with_a_landed_bad_temperature_returns_then_the_next_call_raises() -> None:
    """``linear_logprobs`` is one checked call: its own bad values never raise inside it."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(4, 8, generator=g), torch.randn(20, 8, generator=g)
    labels = torch.tensor([1, 2, -100, 3])
    bad_t = torch.tensor([1.0, float("nan"), 1.0, 1.0])
    with deferred_checks(at_once=True):
        out = linear_logprobs(h, w, labels, options=LinearOptions(temperature=bad_t))
        assert out.logprobs.shape == (4,)
        with pytest.raises(
            ContractError, match="found by the deferred check of an earlier call"
        ) as err:
            linear_logprobs(h, w, labels)
        assert "temperature" in err.value.field
