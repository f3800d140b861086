"""enable_output_processor on one process: bitwise stock behaviour, both kinds of
processor, wrappers, undo, and bad input. Runs on megatron-core 0.16.1 (no native
hook) and 0.19.2 (native hook)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hookspec
import torch_impl
from hookspec import ContractError, OutputContext
from tests.support import hook_cases as cases
from torch_impl.testing.tiny import build_tiny_gpt, tiny_batch

pytestmark = pytest.mark.usefixtures("megatron_single")


def _loss_and_grads(
    model: torch.nn.Module, batch: dict[str, Any], **kw: Any
) -> tuple[Any, dict[str, Any]]:
    model.zero_grad(set_to_none=True)
    out = model(
        *cases.model_inputs(batch), labels=batch["labels"], loss_mask=batch["loss_mask"], **kw
    )
    (out * batch["loss_mask"]).sum().backward()
    return out.detach(), cases.grads(model)


def _assert_bitwise(a: tuple[Any, dict[str, Any]], b: tuple[Any, dict[str, Any]]) -> None:
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys() and len(a[1]) > 0
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.mark.release_matrix
@pytest.mark.parametrize("tied", [False, True])
def test_without_processor_outputs_and_grads_are_bitwise_stock(tied: bool) -> None:
    batch = tiny_batch()
    stock = build_tiny_gpt(share_embeddings_and_output_weights=tied)
    enabled = torch_impl.enable_output_processor(
        build_tiny_gpt(share_embeddings_and_output_weights=tied)
    )
    assert type(enabled).__name__ == "OutputHookGPTModel"
    _assert_bitwise(_loss_and_grads(stock, batch), _loss_and_grads(enabled, batch))
    # The logits path (labels None) too.
    logits_stock = stock(*cases.model_inputs(batch))
    logits_enabled = enabled(*cases.model_inputs(batch))
    assert logits_stock.shape == (2, 8, 64) and torch.equal(logits_stock, logits_enabled)


@pytest.mark.release_matrix
@pytest.mark.parametrize(
    "processor", [cases.stock_loss_upstream, cases.stock_loss], ids=["upstream", "hookspec"]
)
@pytest.mark.parametrize("tied", [False, True])
def test_processor_through_output_layer_gives_bitwise_stock_loss_and_grads(
    processor: Any, tied: bool
) -> None:
    batch = tiny_batch()
    model = build_tiny_gpt(share_embeddings_and_output_weights=tied)
    stock = _loss_and_grads(model, batch)
    torch_impl.enable_output_processor(model)
    _assert_bitwise(stock, _loss_and_grads(model, batch, output_processor=processor))


@pytest.mark.release_matrix
def test_verl_style_processor_runs_unchanged() -> None:
    batch = tiny_batch()
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    logits = model(*cases.model_inputs(batch))  # [b, s, V], stock path
    out = model(
        *cases.model_inputs(batch),
        labels=batch["labels"],
        output_processor=cases.fused_output_processor,
        output_processor_context={"temperature": 2.0},
    )
    expected = cases.reference_logprobs(logits.detach() / 2.0, batch["labels"])
    assert out.shape == (2, 8)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)


def test_hookspec_context_is_filled_from_the_model() -> None:
    seen: list[OutputContext] = []

    @hookspec.processor
    def capture(ctx: OutputContext) -> torch.Tensor:
        seen.append(ctx)
        return torch.zeros(ctx.batch_size, ctx.seq_len)

    batch = tiny_batch(batch=3, seq=5)
    model = torch_impl.enable_output_processor(
        build_tiny_gpt(share_embeddings_and_output_weights=True)
    )
    padding = torch.zeros(3, 5, dtype=torch.bool)
    marker = object()
    out = model(
        *cases.model_inputs(batch),
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
        padding_mask=padding,
        output_processor=capture,
        output_processor_context=marker,
    )
    assert torch.equal(out, torch.zeros(3, 5))
    (ctx,) = seen
    assert ctx.context is marker
    assert ctx.hidden_states.shape == (5, 3, 32)
    assert ctx.labels is batch["labels"] and ctx.loss_mask is batch["loss_mask"]
    assert ctx.input_ids is batch["input_ids"] and ctx.padding_mask is padding
    assert ctx.output_weight is not None and ctx.vocab_weight is ctx.output_weight
    assert ctx.vocab_weight is model.embedding.word_embeddings.weight
    assert ctx.vocab == hookspec.VocabShard(0, 64, 64)
    assert ctx.parallel == hookspec.ParallelLayout()
    assert ctx.mtp_depth == 0 and ctx.ignore_index == hookspec.IGNORE_INDEX
    assert ctx.config is model.config
    assert isinstance(ctx.collectives, hookspec.Collectives)
    x = torch.randn(3)
    assert torch.equal(ctx.scale_logits(x), x)  # no MuP: the logits unchanged


def test_context_reads_the_groups_once_per_model() -> None:
    """The layout, vocab shard and collectives are cached per model and read
    again when the groups object or the weight's rows change."""
    import copy

    model = build_tiny_gpt()
    kw = {"output_layer": model.output_layer}
    first = torch_impl.build_output_context(model, kw)
    again = torch_impl.build_output_context(model, kw)
    assert again.parallel is first.parallel and again.collectives is first.collectives
    assert first.vocab == hookspec.VocabShard(0, 64, 64)
    half = torch.zeros(32, model.config.hidden_size)
    narrower = torch_impl.build_output_context(
        model, {"output_layer": model.output_layer, "output_weight": half}
    )
    assert narrower.vocab == hookspec.VocabShard(0, 32, 32) and narrower.vocab_weight is half
    model.pg_collection = copy.copy(model.pg_collection)
    regrouped = torch_impl.build_output_context(model, kw)
    assert regrouped.parallel == first.parallel and regrouped.collectives is not first.collectives
    other = build_tiny_gpt()
    assert torch_impl.build_output_context(
        other, {"output_layer": other.output_layer}
    ).collectives is not (regrouped.collectives)


def test_enable_is_idempotent_and_undone() -> None:
    model = build_tiny_gpt()
    stock_cls = type(model)
    assert torch_impl.enable_output_processor(model) is model
    enabled_cls = type(model)
    assert torch_impl.enable_output_processor(model, ignore_index=-1) is model
    assert type(model) is enabled_cls and issubclass(enabled_cls, stock_cls)
    assert torch_impl.is_output_processor_enabled(model)
    # A second model of the same class shares the generated subclass.
    assert type(torch_impl.enable_output_processor(build_tiny_gpt())) is enabled_cls
    assert torch_impl.disable_output_processor(model) is model
    assert type(model) is stock_cls and not torch_impl.is_output_processor_enabled(model)
    assert "_hookspec_state" not in model.__dict__
    # Megatron's class itself was never touched.
    assert "OutputHook" not in type(build_tiny_gpt()).__name__


def test_options_reach_the_context() -> None:
    batch = tiny_batch()
    batch["labels"][0, 0] = -1
    model = torch_impl.enable_output_processor(build_tiny_gpt(), ignore_index=-1)
    seen = []
    model(
        *cases.model_inputs(batch),
        labels=batch["labels"],
        output_processor=hookspec.processor(
            lambda ctx: seen.append(ctx.ignore_index) or ctx.hidden_states.sum()
        ),
    )
    assert seen == [-1]


def test_works_through_torch_ddp() -> None:
    batch = tiny_batch()
    model = build_tiny_gpt()
    stock = _loss_and_grads(model, batch)
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    assert torch_impl.enable_output_processor(wrapped) is wrapped
    assert torch_impl.unwrap_model(wrapped) is model
    out = wrapped(
        *cases.model_inputs(batch), labels=batch["labels"], output_processor=cases.stock_loss
    )
    model.zero_grad(set_to_none=True)
    (out * batch["loss_mask"]).sum().backward()
    assert torch.equal(out.detach(), stock[0])
    for name, grad in cases.grads(model).items():
        assert torch.equal(grad, stock[1][name]), name


def test_works_through_float16module() -> None:
    from megatron.core.transformer.module import Float16Module

    batch = tiny_batch()
    model = build_tiny_gpt(bf16=True)
    wrapped = Float16Module(model.config, model)
    stock = wrapped(*cases.model_inputs(batch), labels=batch["labels"])
    torch_impl.enable_output_processor(wrapped)
    assert torch_impl.is_output_processor_enabled(wrapped)
    out = wrapped(
        *cases.model_inputs(batch),
        labels=batch["labels"],
        output_processor=cases.stock_loss_upstream,
    )
    assert out.dtype == torch.float32 and torch.equal(out, stock)
    assert torch.equal(wrapped(*cases.model_inputs(batch), labels=batch["labels"]), stock)


def test_unsupported_model_is_refused() -> None:
    with pytest.raises(ContractError, match="model: expected a Megatron GPTModel"):
        torch_impl.enable_output_processor(torch.nn.Linear(2, 2))


# ---- bad input ----


def _run(model: torch.nn.Module, batch: dict[str, Any], processor: Any, **kw: Any) -> Any:
    return model(
        *cases.model_inputs(batch), labels=batch["labels"], output_processor=processor, **kw
    )


@pytest.mark.parametrize(
    ("result", "actual"),
    [
        (lambda ctx: torch.zeros(ctx.batch_size, ctx.seq_len + 1), "[2, 9]"),
        (lambda ctx: torch.zeros(ctx.seq_len, ctx.batch_size), "[8, 2]"),
        (lambda ctx: [0.0], "list"),
        (lambda ctx: {"logprobs": torch.zeros(3)}, "[3]"),
    ],
)
def test_processor_returning_the_wrong_shape_or_a_non_array(result: Any, actual: str) -> None:
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    with pytest.raises(ContractError) as info:
        _run(model, tiny_batch(), hookspec.processor(result, name="bad"))
    assert info.value.field.startswith("processor 'bad' result")
    assert "[b=2, s=8]" in str(info.value.expected) and actual in str(info.value.actual)


@pytest.mark.parametrize(
    "processor", [cases.stock_loss_upstream, cases.stock_loss], ids=["upstream", "hookspec"]
)
@pytest.mark.parametrize("bad_label", [64, 1000, -1])
def test_labels_outside_the_vocabulary(processor: Any, bad_label: int) -> None:
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    batch = tiny_batch()
    batch["labels"][1, 2] = bad_label
    with pytest.raises(ContractError) as info:
        _run(model, batch, processor)
    assert info.value.field == "labels"
    assert "[0, 64) or ignore_index=-100" in str(info.value.expected)
    assert str(info.value.actual).endswith(f"in [{bad_label}, {bad_label}]")  # the one bad label
    batch["labels"][1, 2] = hookspec.IGNORE_INDEX  # the ignore index itself is allowed
    _run(model, batch, cases.vocab_parallel_logprobs)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("labels", torch.zeros(2, 7, dtype=torch.long), "[b=2, s=8]"),
        ("labels", torch.zeros(3, 8, dtype=torch.long), "[b=2, s=8]"),
        ("loss_mask", torch.ones(2, 5), "[b=2, s=8]"),
    ],
)
def test_mismatched_batch_or_sequence_sizes(field: str, value: torch.Tensor, expected: str) -> None:
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    batch = tiny_batch()
    batch[field] = value
    with pytest.raises(ContractError) as info:
        _run(model, batch, cases.vocab_parallel_logprobs, loss_mask=batch["loss_mask"])
    assert info.value.field == field and expected in str(info.value.expected)


def test_non_callable_processor() -> None:
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    with pytest.raises(ContractError, match="output_processor: expected a callable"):
        _run(model, tiny_batch(), 42)


def test_processor_on_a_model_that_was_not_enabled() -> None:
    model = build_tiny_gpt()
    with pytest.raises(ContractError) as info:
        torch_impl.require_output_processor(model)
    assert "torch_impl.enable_output_processor(model)" in str(info.value)
    if torch_impl.has_native_hook(model):
        # 0.18+: Megatron's own hook calls the hookspec processor with its keywords.
        with pytest.raises(ContractError, match=r"enable_output_processor\(model\)"):
            _run(model, tiny_batch(), cases.stock_loss)
        assert "native hook" in str(info.value)
    else:
        # Before 0.18 the stock forward has no such keyword at all.
        assert "no native output hook" in str(info.value)
        with pytest.raises(TypeError, match="output_processor"):
            _run(model, tiny_batch(), cases.stock_loss)


def test_state_dict_is_unchanged_by_the_adapter() -> None:
    stock = build_tiny_gpt().state_dict()
    enabled = torch_impl.enable_output_processor(build_tiny_gpt()).state_dict()
    assert list(stock) == list(enabled)
    for key, value in stock.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, enabled[key]), key
