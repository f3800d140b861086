"""0001 on a CPU: ``HybridModel.forward(..., output_processor=, output_processor_context=)``
with ``GPTModel``'s contract, on attention (``*``) and MLP (``-``) layers."""

import pytest
import torch
from cpu_harness import assert_same_grads, tiny_hybrid, token_batch

VOCAB, SEQ, HIDDEN = 48, 6, 16
pytestmark = pytest.mark.usefixtures("model_parallel")
# The keywords GPTModel.forward hands its output_processor.
HOOK_KEYWORDS = {
    "hidden_states",
    "output_layer",
    "output_weight",
    "labels",
    "loss_mask",
    "input_ids",
    "position_ids",
    "attention_mask",
    "decoder_input",
    "inference_context",
    "packed_seq_params",
    "runtime_gather_output",
    "context",
    "compute_language_model_loss",
    "scale_logits",
    "config",
}


def batch():
    return {**token_batch(VOCAB, SEQ), "attention_mask": None}


def hybrid(pattern="*-", **kwargs):
    return tiny_hybrid(pattern, vocab=VOCAB, seq=SEQ, **kwargs)


def default_loss(**kwargs):
    """The default head as an output processor: output layer, logit scaling, loss."""
    logits, _ = kwargs["output_layer"](
        kwargs["hidden_states"],
        weight=kwargs["output_weight"],
        runtime_gather_output=kwargs["runtime_gather_output"],
    )
    return kwargs["compute_language_model_loss"](kwargs["labels"], kwargs["scale_logits"](logits))


@pytest.mark.parametrize("tied", [False, True])
def test_output_processor_receives_the_gpt_keywords(tied):
    model = hybrid(share_embeddings_and_output_weights=tied)
    inputs = batch()
    context = {"temperature": 0.5}
    seen = {}
    result = {"payload": torch.zeros(1)}

    def output_processor(**kwargs):
        seen.update(kwargs)
        return result

    out = model(**inputs, output_processor=output_processor, output_processor_context=context)
    assert out is result
    assert set(seen) == HOOK_KEYWORDS
    assert tuple(seen["hidden_states"].shape) == (SEQ, 2, HIDDEN)
    assert seen["output_layer"] is model.output_layer
    want_weight = model.shared_embedding_or_output_weight() if tied else None
    assert seen["output_weight"] is want_weight
    for name in ("labels", "loss_mask", "input_ids", "position_ids"):
        assert seen[name] is inputs[name], name
    assert seen["decoder_input"].shape == (SEQ, 2, HIDDEN)  # the embedding's output
    assert seen["context"] is context and seen["config"] is model.config
    assert seen["compute_language_model_loss"].__self__ is model
    assert seen["scale_logits"].__self__ is model


@pytest.mark.parametrize("pattern", ["*-", "*-/-", "-*-/*-"])
@pytest.mark.parametrize("tied", [False, True])
def test_default_head_as_a_processor_equals_the_default_path(pattern, tied):
    """Loss and every gradient bitwise, with and without MTP layers."""
    inputs = batch()
    stock = hybrid(pattern, share_embeddings_and_output_weights=tied)
    want = stock(**inputs)
    want.sum().backward()
    model = hybrid(pattern, share_embeddings_and_output_weights=tied)
    got = model(**inputs, output_processor=default_loss)
    got.sum().backward()
    assert torch.equal(got, want)
    assert_same_grads(model, stock)


def test_mtp_loss_is_attached_before_the_hook():
    model = hybrid("*-/*-")
    seen = {}

    def output_processor(**kwargs):
        seen["shape"] = tuple(kwargs["hidden_states"].shape)
        return kwargs["hidden_states"].sum() * 0.0

    model(**batch(), output_processor=output_processor).backward()
    assert seen["shape"] == (SEQ, 2, HIDDEN)
    mtp_grads = [p.grad for n, p in model.named_parameters() if n.startswith("mtp.")]
    assert mtp_grads and all(g is not None for g in mtp_grads)
    assert any(g.abs().sum() > 0 for g in mtp_grads)


def test_no_hook_without_post_process():
    model = hybrid(post_process=False)
    called = []
    out = model(**batch(), output_processor=lambda **kwargs: called.append(kwargs))
    assert not called and tuple(out.shape) == (SEQ, 2, HIDDEN)
