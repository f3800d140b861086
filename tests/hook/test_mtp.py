"""MTP under the output hook: the MTP processor, bitwise stock defaults, the RL cases.

Training mode on a CPU: Megatron's MTP loss logging allocates its tracker on
CUDA the first time it logs. The ``cpu_tracker`` fixture puts CPU buffers of
the same shape into ``MTPLossLoggingHelper.tracker`` (Megatron's own store,
emptied and restored after the test), so that training mode runs the same code
on a CPU and the logged values can be compared. ``test_training_mode_on_gpu``
runs training mode without that help.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

import hookspec
from hookspec import ContractError, OutputContext
from tests.support.hook_cases import grads, stock_loss, stock_loss_upstream
from tests.support.mtp_support import DEPTHS, LogitWatch, build_mtp_gpt
from torch_impl import enable_output_processor
from torch_impl.mtp import default_mtp_loss, detached_head, mtp_semantics
from torch_impl.processors import cross_entropy_loss
from torch_impl.testing.tiny import build_tiny_gpt, tiny_batch, tiny_config

pytestmark = pytest.mark.usefixtures("megatron_single")

SEMANTICS = mtp_semantics()


def run(model: Any, batch: dict[str, Any], **kw: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Forward, backward of ``sum`` of every floating output, and the grads."""
    model.zero_grad(set_to_none=True)
    out = model(batch["input_ids"], batch["position_ids"], None, **kw)
    values = out.values() if isinstance(out, dict) else [out]
    sum(v.float().sum() for v in values).backward()
    return out, grads(model)


def assert_same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def tracker_snapshot() -> dict[str, torch.Tensor]:
    tracker = MTPLossLoggingHelper.tracker
    return {k: v.clone() for k, v in tracker.items() if isinstance(v, torch.Tensor)}


def clear_tracker() -> None:
    for value in MTPLossLoggingHelper.tracker.values():
        if isinstance(value, torch.Tensor):
            value.zero_()


@pytest.fixture
def cpu_tracker() -> Iterator[None]:
    tracker = MTPLossLoggingHelper.tracker
    saved = dict(tracker)
    tracker.clear()
    keys = (
        ("loss_values", "correct_values", "total_values")
        if SEMANTICS.logs_acceptance
        else ("values",)
    )
    for key in keys:
        tracker[key] = torch.zeros(DEPTHS)
    yield
    tracker.clear()
    tracker.update(saved)


CONFIGS = {
    "plain": {},
    "tied": {"tied": True},
    "per_token": {"calculate_per_token_loss": True},
    "detach_heads": {"mtp_detach_heads": True},
}


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_default_mtp_processor_is_bitwise_stock(
    config: str, training: bool, cpu_tracker: None
) -> None:
    overrides = dict(CONFIGS[config])
    if config == "detach_heads" and not hasattr(tiny_config(), "mtp_detach_heads"):
        pytest.skip("this Megatron Core has no mtp_detach_heads")
    batch = tiny_batch()
    batch["loss_mask"][0, 5:] = 0.0  # uneven token counts per depth
    kw = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]}
    stock = build_mtp_gpt(**overrides).train(training)
    want, want_grads = run(stock, batch, **kw)
    want_log = tracker_snapshot()
    model = enable_output_processor(build_mtp_gpt(**overrides)).train(training)
    cases = {
        "mtp only": {"mtp_processor": default_mtp_loss},
        "both": {"output_processor": stock_loss, "mtp_processor": default_mtp_loss},
        "main only": {"output_processor": stock_loss_upstream},
    }
    for name, processors in cases.items():
        clear_tracker()
        got, got_grads = run(model, batch, **kw, **processors)
        assert torch.equal(got, want), name
        assert_same_grads(got_grads, want_grads)
        if training:
            log = tracker_snapshot()
            assert log.keys() == want_log.keys()
            for key in want_log:
                assert torch.equal(log[key], want_log[key]), (name, key)
            assert log[next(iter(log))].abs().sum() > 0  # something was logged


def test_mtp_processor_sees_each_depth_rolled() -> None:
    seen: list[OutputContext] = []

    @hookspec.processor
    def record(ctx: OutputContext) -> Any:
        seen.append(ctx)
        return default_mtp_loss(ctx)

    model = enable_output_processor(build_mtp_gpt()).eval()
    batch = tiny_batch(seq=8)
    batch["loss_mask"][1, 2] = 0.0
    labels, mask = batch["labels"], batch["loss_mask"]
    model(
        batch["input_ids"],
        batch["position_ids"],
        None,
        labels=labels,
        loss_mask=mask,
        mtp_processor=record,
        output_processor_context={"temperature": 0.7},
    )
    assert [c.mtp_depth for c in seen] == list(range(1, DEPTHS + 1))
    for ctx in seen:
        k = ctx.mtp_depth
        want_labels = torch.zeros_like(labels)
        want_labels[:, :-k] = labels[:, k:]
        want_mask = torch.zeros_like(mask)
        want_mask[:, :-k] = mask[:, k:]
        assert torch.equal(ctx.labels, want_labels)
        assert torch.equal(ctx.loss_mask, want_mask)
        assert tuple(ctx.hidden_states.shape) == (8, 2, 32)
        assert ctx.vocab_weight is model.output_layer.weight
        assert ctx.output_weight is None
        assert ctx.context == {"temperature": 0.7}
        assert ctx.vocab is not None and (ctx.vocab.start, ctx.vocab.end) == (0, 64)
    assert not torch.equal(seen[0].hidden_states, seen[1].hidden_states)


def test_packed_sequences_roll_within_each_sequence() -> None:
    """THD input: Megatron's roll_tensor rolls each sequence on its own; the
    default MTP processor stays bitwise stock there too."""
    from megatron.core.packed_seq_params import PackedSeqParams

    batch = tiny_batch(batch=1, seq=12)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7
    )
    batch["position_ids"] = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    kw = {"labels": batch["labels"], "loss_mask": batch["loss_mask"], "packed_seq_params": packed}
    want, want_grads = run(build_mtp_gpt().eval(), batch, **kw)
    seen: list[OutputContext] = []

    def record(ctx: OutputContext) -> Any:
        seen.append(ctx)
        return default_mtp_loss(ctx)

    model = enable_output_processor(build_mtp_gpt()).eval()
    got, got_grads = run(model, batch, **kw, output_processor=stock_loss, mtp_processor=record)
    assert torch.equal(got, want)
    assert_same_grads(got_grads, want_grads)
    labels = batch["labels"][0]
    first = seen[0]
    assert torch.equal(first.labels[0, :4], labels[1:5]) and int(first.labels[0, 4]) == 0
    assert torch.equal(first.labels[0, 5:11], labels[6:12]) and int(first.labels[0, 11]) == 0
    assert first.loss_mask[0].tolist() == [1.0] * 4 + [0.0] + [1.0] * 6 + [0.0]
    assert first.packed_seq_params is packed


def test_rl_main_head_values_and_labels_from_input_ids(cpu_tracker: None) -> None:
    """labels=None: the main head returns logprobs, MTP trains on labels derived
    from input_ids (rolled once, last position masked), as 0.19's stock does;
    the reference is the stock model given those labels explicitly."""
    batch = tiny_batch()
    ids = batch["input_ids"]
    derived = torch.zeros_like(ids)
    derived[:, :-1] = ids[:, 1:]
    mask = torch.ones(ids.shape)
    mask[:, -1] = 0.0

    stock = build_mtp_gpt().train()
    loss = stock(ids, batch["position_ids"], None, labels=derived, loss_mask=mask)
    (loss * 0.0).sum().backward()
    want = grads(stock)

    @hookspec.processor
    def logprobs(ctx: OutputContext) -> Any:
        logits = torch.einsum("sbh,vh->bsv", ctx.hidden_states, ctx.vocab_weight)
        return {
            "logprobs": torch.log_softmax(logits, -1)[..., 0],
            "entropy": logits.detach()[..., 0],
        }

    model = enable_output_processor(build_mtp_gpt()).train()
    out = model(ids, batch["position_ids"], None, output_processor=logprobs)
    assert set(out) == {"logprobs", "entropy"} and tuple(out["logprobs"].shape) == (2, 8)
    (out["logprobs"] * 0.0).sum().backward()
    assert_same_grads(grads(model), want)
    assert any(g.abs().sum() > 0 for g in want.values())


def test_detached_head_trains_mtp_layers_but_not_the_head() -> None:
    batch = tiny_batch()
    kw = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]}

    def main_zero(ctx: OutputContext) -> Any:
        return ctx.hidden_states.sum(-1).transpose(0, 1) * 0.0

    results = {}
    fused = cross_entropy_loss(tile_cols=16, tile_rows=4)
    mtps = {
        "attached": default_mtp_loss,
        "detached": detached_head(default_mtp_loss),
        "fused detached": detached_head(fused),
    }
    for name, mtp in mtps.items():
        model = enable_output_processor(build_mtp_gpt()).eval()
        _, results[name] = run(
            model, batch, **kw, output_processor=hookspec.processor(main_zero), mtp_processor=mtp
        )
    attached = results["attached"]
    assert attached["output_layer.weight"].abs().sum() > 0
    mtp_names = [n for n in attached if n.startswith("mtp.")]
    assert mtp_names
    for which in ("detached", "fused detached"):
        detached = results[which]
        assert "output_layer.weight" not in detached  # no gradient reaches the head at all
        for name in mtp_names:
            if which == "detached":
                assert torch.equal(detached[name], attached[name]), name
            else:
                torch.testing.assert_close(detached[name], attached[name], rtol=1e-5, atol=1e-6)


def test_fused_mtp_processor_matches_and_never_materialises_the_logits() -> None:
    """The project's fused per-token cross entropy as the MTP processor: the same
    gradients as the stock MTP loss, and no tensor of more than one token chunk
    of logits (4 tokens here) anywhere in forward or backward."""
    batch = tiny_batch(seq=8, vocab_size=72)  # V = 72: no other activation is [.., 72]
    kw = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]}

    @hookspec.processor
    def main_without_logits(ctx: OutputContext) -> Any:
        return ctx.hidden_states.float().pow(2).mean(-1).transpose(0, 1)

    peaks, results = {}, {}
    fused = cross_entropy_loss(tile_cols=16, tile_rows=4)
    for name, mtp in {"default": default_mtp_loss, "fused": fused}.items():
        model = enable_output_processor(build_mtp_gpt(vocab=72)).eval()
        with LogitWatch(vocab=72, hidden=32) as watch:
            results[name] = run(
                model, batch, **kw, output_processor=main_without_logits, mtp_processor=mtp
            )
        peaks[name] = watch.rows
    assert peaks["default"] >= 16  # [s=8, b=2, V]: the watch sees logits
    assert peaks["fused"] <= 4
    (_, want), (_, got) = results["default"], results["fused"]
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


# ---- bad input -------------------------------------------------------------


def _bad_shape(ctx: OutputContext) -> Any:
    return torch.zeros(ctx.batch_size, ctx.seq_len - 1)


@pytest.mark.parametrize(
    ("mtp", "field", "expected"),
    [
        (
            _bad_shape,
            "mtp_processor '_bad_shape' result at depth 1['loss']",
            "per-token shape [b=2, s=8]",
        ),
        (
            lambda ctx: {"logprobs": torch.zeros(2, 8)},
            "result at depth 1",
            "a mapping with a 'loss'",
        ),
        (lambda ctx: [0.0], "result at depth 1['loss']", "a torch.Tensor"),
        (
            lambda ctx: torch.zeros(2, 8, dtype=torch.long),
            "result at depth 1['loss']",
            "a floating dtype",
        ),
    ],
)
def test_mtp_processor_returning_the_wrong_thing(mtp: Any, field: str, expected: str) -> None:
    model = enable_output_processor(build_mtp_gpt()).eval()
    batch = tiny_batch()
    with pytest.raises(ContractError) as err:
        model(
            batch["input_ids"],
            batch["position_ids"],
            None,
            labels=batch["labels"],
            mtp_processor=mtp,
        )
    assert field in err.value.field and expected in str(err.value.expected)


def test_mtp_processor_on_a_model_without_mtp_layers() -> None:
    model = enable_output_processor(build_tiny_gpt()).eval()
    batch = tiny_batch()
    with pytest.raises(ContractError) as err:
        model(batch["input_ids"], batch["position_ids"], None, mtp_processor=default_mtp_loss)
    assert err.value.field == "mtp_processor" and "mtp_num_layers=None" in str(err.value.actual)


def test_mtp_processor_that_is_not_callable() -> None:
    model = enable_output_processor(build_mtp_gpt()).eval()
    batch = tiny_batch()
    with pytest.raises(ContractError, match="mtp_processor: expected a hookspec processor"):
        model(batch["input_ids"], batch["position_ids"], None, mtp_processor="mtp")


@pytest.mark.gpu
def test_training_mode_on_gpu() -> None:
    """Training mode without the CPU tracker: Megatron allocates its own on CUDA."""
    batch = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in tiny_batch().items()}
    kw = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]}
    stock = build_mtp_gpt().cuda().train()
    MTPLossLoggingHelper.tracker.clear()
    want, want_grads = run(stock, batch, **kw)
    want_log = tracker_snapshot()
    MTPLossLoggingHelper.tracker.clear()
    model = enable_output_processor(build_mtp_gpt().cuda()).train()
    got, got_grads = run(
        model, batch, **kw, output_processor=stock_loss, mtp_processor=default_mtp_loss
    )
    assert torch.equal(got, want)
    assert_same_grads(got_grads, want_grads)
    log = tracker_snapshot()
    for key in want_log:
        assert torch.equal(log[key], want_log[key]), key
    MTPLossLoggingHelper.tracker.clear()


@pytest.mark.parametrize("bad", [3, None, "default_mtp_loss"])
def test_detached_head_refuses_what_is_not_a_processor_when_made(bad: Any) -> None:
    with pytest.raises(
        ContractError, match=r"^mtp_processor: expected a hookspec processor or a callable"
    ):
        detached_head(bad)


def test_mtp_result_with_an_unknown_key_is_refused_not_dropped() -> None:
    model = enable_output_processor(build_mtp_gpt().eval())
    batch = tiny_batch()

    @hookspec.processor
    def misspelt(ctx: OutputContext) -> Any:
        out = default_mtp_loss(ctx)
        loss = out["loss"] if isinstance(out, dict) else out
        return {"loss": loss, "acceptance": torch.zeros_like(loss, dtype=torch.bool)}

    with pytest.raises(
        ContractError, match=r"result at depth 1: expected a mapping with a 'loss'"
    ) as err:
        model(
            batch["input_ids"],
            batch["position_ids"],
            None,
            labels=batch["labels"],
            mtp_processor=misspelt,
        )
    assert err.value.actual == "keys ['acceptance', 'loss']"


def test_mtp_processor_taking_upstream_keywords_is_refused_before_the_model_runs() -> None:
    model = enable_output_processor(build_mtp_gpt().eval())
    batch = tiny_batch()

    def upstream_style(*, hidden_states: Any, labels: Any, **_: Any) -> Any:
        raise AssertionError("never called")

    with pytest.raises(ContractError, match=r"^mtp_processor: expected a callable \(ctx\)") as err:
        model(
            batch["input_ids"],
            batch["position_ids"],
            None,
            labels=batch["labels"],
            mtp_processor=upstream_style,
        )
    assert "@hookspec.processor" in str(err.value)


# ---- MTPOptions: where veRL's patch departs from upstream --------------------


def _grads_of(model: Any, batch: dict[str, Any], **kw: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Forward with labels and the batch's loss mask, backward of the summed loss."""
    return run(model, batch, labels=batch["labels"], loss_mask=batch["loss_mask"], **kw)


def _uneven_batch() -> dict[str, Any]:
    batch = tiny_batch()
    batch["loss_mask"][0, 5:] = 0.0  # 13 tokens; 11 after one roll
    return batch


@pytest.mark.parametrize(
    "processors",
    [{}, {"mtp_processor": default_mtp_loss}, {"output_processor": stock_loss}],
    ids=["no processor", "mtp processor", "main processor"],
)
def test_detach_encoder_trains_the_mtp_layers_only(processors: dict[str, Any]) -> None:
    """``MTPOptions(detach_encoder=True)``: Megatron's MTP loss trains each MTP
    layer and the output head, not the embedding or the main decoder.

    Independent computations: the stock model gives the loss, the output head's
    gradient and the last MTP layer's (only the last depth's loss reaches it);
    the stock model with ``mtp_loss_scaling_factor=0`` gives the embedding's and
    the decoder's (no MTP gradient). The first MTP layer no longer receives the
    second depth's gradient through its output, so it differs from stock."""
    from torch_impl.mtp import MTPOptions

    batch = _uneven_batch()
    want, stock = _grads_of(build_mtp_gpt().eval(), batch)
    _, no_mtp = _grads_of(build_mtp_gpt(mtp_loss_scaling_factor=0.0).eval(), batch)
    model = enable_output_processor(build_mtp_gpt(), mtp=MTPOptions(detach_encoder=True)).eval()
    got, grads_ = _grads_of(model, batch, **processors)
    assert torch.equal(got, want)
    assert grads_.keys() == stock.keys()
    for name, grad in grads_.items():
        if name.startswith("mtp.layers.1.") or name == "output_layer.weight":
            assert torch.equal(grad, stock[name]), name
        elif name.startswith("mtp.layers.0."):
            continue
        else:
            assert torch.equal(grad, no_mtp[name]), name
    assert not torch.equal(
        stock["embedding.word_embeddings.weight"], no_mtp["embedding.word_embeddings.weight"]
    )
    first = [n for n in stock if n.startswith("mtp.layers.0.") and stock[n].abs().sum() > 0]
    assert first and any(not torch.equal(grads_[n], stock[n]) for n in first)
    assert all(grads_[n].abs().sum() > 0 for n in first)  # still trained, by its own depth


def test_detach_encoder_at_one_depth_equals_the_stock_mtp_gradients() -> None:
    """One MTP layer: every MTP gradient is the stock one, bitwise."""
    from torch_impl.mtp import MTPOptions

    batch = _uneven_batch()
    _, stock = _grads_of(build_mtp_gpt(1).eval(), batch)
    _, no_mtp = _grads_of(build_mtp_gpt(1, mtp_loss_scaling_factor=0.0).eval(), batch)
    model = enable_output_processor(build_mtp_gpt(1), mtp=MTPOptions(detach_encoder=True)).eval()
    _, got = _grads_of(model, batch, mtp_processor=default_mtp_loss)
    for name, grad in got.items():
        want = (
            stock[name]
            if name.startswith("mtp.") or name == "output_layer.weight"
            else no_mtp[name]
        )
        assert torch.equal(grad, want), name


def test_mtp_options_are_undone_with_the_adapter() -> None:
    from torch_impl import disable_output_processor
    from torch_impl.mtp import MTPOptions

    model = build_mtp_gpt()
    classes = [type(layer) for layer in model.mtp.layers]
    enable_output_processor(model, mtp=MTPOptions(detach_encoder=True))
    assert all(type(layer).__name__.startswith("OutputHook") for layer in model.mtp.layers)
    enable_output_processor(model)  # the defaults: the layers' own classes again
    assert [type(layer) for layer in model.mtp.layers] == classes
    enable_output_processor(model, mtp=MTPOptions(cp_group_from_packed=True))
    disable_output_processor(model)
    assert [type(layer) for layer in model.mtp.layers] == classes
    batch = _uneven_batch()
    assert torch.equal(
        _grads_of(model.eval(), batch)[0], _grads_of(build_mtp_gpt().eval(), batch)[0]
    )


def test_rolled_per_token_normalization_on_every_release() -> None:
    """``per_token_normalization="rolled"`` under ``calculate_per_token_loss``:
    each depth's MTP gradient is scaled by ``n_0 / n_k`` (the loss mask's token
    count over the rolled mask's), the rule of ``process_mtp_loss`` (0.17+) and
    veRL's patch. Reference: the stock model, whose MTP gradient is linear in
    ``mtp_loss_scaling_factor``, with that factor times ``13 / 11`` where the
    release does not renormalise (0.16), or unchanged where it does (0.17+,
    bitwise). One MTP layer, so one ratio."""
    from torch_impl.mtp import MTPOptions

    batch = _uneven_batch()
    factor = 0.1 if SEMANTICS.clamped_counts else 0.1 * 13 / 11
    reference = build_mtp_gpt(
        1, calculate_per_token_loss=True, mtp_loss_scaling_factor=factor
    ).eval()
    want, want_grads = _grads_of(reference, batch)
    _, release = _grads_of(
        build_mtp_gpt(1, calculate_per_token_loss=True, mtp_loss_scaling_factor=0.1).eval(), batch
    )
    options = MTPOptions(per_token_normalization="rolled")
    model = enable_output_processor(
        build_mtp_gpt(1, calculate_per_token_loss=True, mtp_loss_scaling_factor=0.1), mtp=options
    ).eval()
    for processors in ({}, {"mtp_processor": default_mtp_loss}):
        got, got_grads = _grads_of(model, batch, **processors)
        assert torch.equal(got, want)
        for name, grad in want_grads.items():
            if SEMANTICS.clamped_counts:
                assert torch.equal(got_grads[name], grad), name
            else:
                torch.testing.assert_close(got_grads[name], grad, rtol=1e-6, atol=1e-9, msg=name)
    if not SEMANTICS.clamped_counts:  # the option changes something on this release
        assert not torch.allclose(
            release["mtp.layers.0.enorm.weight"], got_grads["mtp.layers.0.enorm.weight"]
        )


def test_scaled_mtp_gradient_scales_the_gradient_not_the_logged_loss(cpu_tracker: None) -> None:
    """veRL's per-micro-batch factor (``mtp_loss_scaling_factor * routed / batch``
    tokens): the same gradients as the stock model with the factor folded into
    ``mtp_loss_scaling_factor``, and Megatron's logged MTP loss unchanged."""
    from torch_impl.mtp import scaled_mtp_gradient

    batch = _uneven_batch()
    stock = build_mtp_gpt().train()
    _, stock_grads = _grads_of(stock, batch)
    logged = tracker_snapshot()
    clear_tracker()
    _, want = _grads_of(build_mtp_gpt(mtp_loss_scaling_factor=0.1 * 0.75).train(), batch)
    clear_tracker()
    model = enable_output_processor(build_mtp_gpt()).train()
    _, got = _grads_of(model, batch, mtp_processor=scaled_mtp_gradient(default_mtp_loss, 0.75))
    for key, value in tracker_snapshot().items():
        assert torch.equal(value, logged[key]), key
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-9, msg=name)
    assert not torch.allclose(
        got["mtp.layers.0.enorm.weight"], stock_grads["mtp.layers.0.enorm.weight"]
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"detach_encoder": 1}, "mtp.detach_encoder"),
        ({"cp_group_from_packed": "yes"}, "mtp.cp_group_from_packed"),
        ({"per_token_normalization": "veRL"}, "mtp.per_token_normalization"),
    ],
)
def test_bad_mtp_options(kwargs: dict[str, Any], field: str) -> None:
    from torch_impl.mtp import MTPOptions

    with pytest.raises(ContractError) as err:
        MTPOptions(**kwargs)
    assert err.value.field == field
    with pytest.raises(ContractError, match=r"^mtp: expected a torch_impl.mtp.MTPOptions"):
        enable_output_processor(
            build_mtp_gpt(),
            mtp={"detach_encoder": True},  # type: ignore[arg-type]
        )


@pytest.mark.parametrize("factor", [0, -1.0, float("nan"), float("inf"), True, "2"])
def test_scaled_mtp_gradient_refuses_a_bad_factor(factor: Any) -> None:
    from torch_impl.mtp import scaled_mtp_gradient

    with pytest.raises(ContractError, match=r"^factor: expected a finite number > 0"):
        scaled_mtp_gradient(default_mtp_loss, factor)
