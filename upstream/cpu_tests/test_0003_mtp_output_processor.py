"""0003 on a CPU: one callable per MTP depth computes that depth's per-token loss, while
``process_mtp_loss`` keeps rolling, masking, scaling, logging and attaching it."""

import inspect

import pytest
import torch
from cpu_harness import assert_same_grads, tiny_config, tiny_hybrid, token_batch

VOCAB, SEQ, HIDDEN, BATCH = 40, 8, 16, 2
pytestmark = pytest.mark.usefixtures("model_parallel")
# What process_mtp_loss hands an MTP output processor at each depth, and nothing else.
KEYWORDS = {
    "mtp_depth",
    "hidden_states",
    "labels",
    "loss_mask",
    "output_layer",
    "output_weight",
    "runtime_gather_output",
    "packed_seq_params",
    "input_ids",
    "compute_language_model_loss",
    "scale_logits",
    "config",
}


def lm_loss(labels, logits):
    """``LanguageModule.compute_language_model_loss`` without fusion: [b, s]."""
    from megatron.core import tensor_parallel

    loss = tensor_parallel.vocab_parallel_cross_entropy(
        logits.float(), labels.transpose(0, 1).contiguous()
    )
    return loss.transpose(0, 1).contiguous()


def default_head(**kwargs):
    """The default MTP head as an MTP output processor, with its top-1 acceptance."""
    logits, _ = kwargs["output_layer"](
        kwargs["hidden_states"],
        weight=kwargs["output_weight"],
        runtime_gather_output=kwargs["runtime_gather_output"],
    )
    loss = kwargs["compute_language_model_loss"](kwargs["labels"], logits)
    accepted = logits.argmax(dim=-1).transpose(0, 1) == kwargs["labels"]
    return {"loss": loss, "accepted": accepted}


def rolled(x, k):
    """``x`` [b, s] moved ``k`` places left, zeros after the end (not roll_tensor)."""
    out = torch.zeros_like(x)
    out[:, : x.shape[1] - k] = x[:, k:]
    return out


def run(config, processor, *, training=False, **kwargs):
    """process_mtp_loss on a fresh output layer and hidden states; its output and the
    gradients of the hidden states and of the output layer's weight."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import process_mtp_loss

    torch.manual_seed(1234)
    output_layer = ColumnParallelLinear(
        HIDDEN, VOCAB, config=config, init_method=config.init_method, bias=False
    )
    hidden = torch.randn((1 + config.mtp_num_layers) * SEQ, BATCH, HIDDEN, requires_grad=True)
    out = process_mtp_loss(
        hidden_states=hidden,
        output_layer=output_layer,
        output_weight=None,
        runtime_gather_output=None,
        is_training=training,
        compute_language_model_loss=lm_loss,
        config=config,
        mtp_output_processor=processor,
        **kwargs,
    )
    out.sum().backward()
    return out, hidden, output_layer


@pytest.mark.parametrize(
    "training, per_token, detach_heads, rl_labels",
    [
        (False, False, False, False),
        (True, False, False, False),
        (True, True, False, False),
        (True, False, True, False),
        (True, False, False, True),
    ],
    ids=["eval", "train", "per-token-loss", "detached-heads", "rl-labels"],
)
def test_default_head_as_processor_is_bitwise_the_default(
    cpu_mtp_tracker, training, per_token, detach_heads, rl_labels
):
    """Output, gradients and logged values equal the default path bitwise."""
    config = tiny_config(
        mtp_num_layers=2,
        mtp_loss_scaling_factor=0.3,
        calculate_per_token_loss=per_token,
        mtp_detach_heads=detach_heads,
    )
    inputs = token_batch(VOCAB, SEQ, BATCH)
    kwargs = dict(input_ids=inputs["input_ids"], labels=inputs["labels"])
    kwargs["loss_mask"] = inputs["loss_mask"]
    if rl_labels:
        kwargs.update(labels=None, loss_mask=None)
    results, logged = [], []
    for processor in (None, default_head):
        buffers = {k: v for k, v in cpu_mtp_tracker.items() if isinstance(v, torch.Tensor)}
        for value in buffers.values():
            value.zero_()
        out, hidden, layer = run(config, processor, training=training, **kwargs)
        results.append((out, hidden.grad, layer.weight.grad))
        logged.append({k: v.clone() for k, v in buffers.items()})
    for want, got in zip(*results):
        assert (want is None and got is None) or torch.equal(got, want)
    assert logged[0].keys() == logged[1].keys()
    for key in logged[0]:
        assert torch.equal(logged[1][key], logged[0][key]), key
    if training:
        assert logged[0]["total_values"].sum() > 0 and logged[0]["loss_values"].sum() > 0


def test_processor_sees_each_depth_rolled():
    config = tiny_config(mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
    inputs = token_batch(VOCAB, SEQ, BATCH)
    calls = []

    def record(**kwargs):
        calls.append(kwargs)
        return torch.zeros(BATCH, SEQ)

    _, hidden, layer = run(
        config,
        record,
        input_ids=inputs["input_ids"],
        labels=inputs["labels"],
        loss_mask=inputs["loss_mask"],
    )
    assert [c["mtp_depth"] for c in calls] == [1, 2]
    chunks = torch.chunk(hidden, 3, dim=0)
    for k, call in enumerate(calls, start=1):
        assert set(call) == KEYWORDS
        assert torch.equal(call["hidden_states"], chunks[k])
        assert torch.equal(call["labels"], rolled(inputs["labels"], k))
        assert torch.equal(call["loss_mask"], rolled(inputs["loss_mask"], k))
        assert call["input_ids"] is inputs["input_ids"] and call["output_layer"] is layer
        logits = torch.randn(SEQ, BATCH, VOCAB)
        assert call["scale_logits"](logits) is logits  # no MuP scaling given


def test_labels_derived_from_input_ids():
    """labels=None (RL): each depth's labels come from input_ids rolled once more."""
    config = tiny_config(mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
    input_ids = token_batch(VOCAB, SEQ, BATCH)["input_ids"]
    calls = []

    def record(**kwargs):
        calls.append(kwargs)
        return torch.zeros(BATCH, SEQ)

    run(config, record, input_ids=input_ids, labels=None, loss_mask=None)
    for k, call in enumerate(calls, start=1):
        assert torch.equal(call["labels"], rolled(input_ids, k + 1))


def test_packed_sequences_roll_within_each_sequence():
    from megatron.core.packed_seq_params import PackedSeqParams

    config = tiny_config(mtp_num_layers=1)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5
    )
    calls = []

    def record(**kwargs):
        calls.append(kwargs)
        return torch.zeros(1, SEQ)

    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import process_mtp_loss

    layer = ColumnParallelLinear(
        HIDDEN, VOCAB, config=config, init_method=config.init_method, bias=False
    )
    process_mtp_loss(
        torch.randn(2 * SEQ, 1, HIDDEN),
        torch.arange(1, SEQ + 1).unsqueeze(0),
        torch.ones(1, SEQ),
        layer,
        None,
        None,
        False,
        lm_loss,
        config,
        packed_seq_params=packed,
        mtp_output_processor=record,
    )
    assert calls[0]["packed_seq_params"] is packed
    assert calls[0]["labels"].tolist() == [[2, 3, 0, 5, 6, 7, 8, 0]]
    assert calls[0]["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 1, 1, 0]]


@pytest.mark.parametrize("per_token", [False, True])
def test_loss_is_masked_scaled_and_attached(per_token):
    """d(sum of the returned hidden states) / d(loss_k[b, s]) is Megatron's weight of each
    token: scale * mask_k / n_k, or scale * mask_k * n_0 / n_k per token, in float64."""
    config = tiny_config(
        mtp_num_layers=2, mtp_loss_scaling_factor=0.3, calculate_per_token_loss=per_token
    )
    inputs = token_batch(VOCAB, SEQ, BATCH)
    losses = []

    def constant(**kwargs):
        losses.append(torch.ones(BATCH, SEQ, dtype=torch.float64, requires_grad=True))
        return losses[-1]

    run(
        config,
        constant,
        input_ids=inputs["input_ids"],
        labels=inputs["labels"],
        loss_mask=inputs["loss_mask"],
    )
    n0 = inputs["loss_mask"].double().sum()
    for k, loss in enumerate(losses, start=1):
        mask = rolled(inputs["loss_mask"], k).double()
        weight = 0.3 / 2 * mask * (n0 / mask.sum() if per_token else 1.0 / mask.sum())
        # the token counts are float32 (the mask's dtype): n_0 / n_k rounds there
        assert torch.allclose(loss.grad, weight, rtol=1e-6, atol=0), k


def test_accepted_feeds_the_acceptance_counts(cpu_mtp_tracker):
    config = tiny_config(mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
    inputs = token_batch(VOCAB, SEQ, BATCH)
    accepted = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    accepted[:, ::2] = True

    def depth_one_accepts(**kwargs):
        loss = torch.full((BATCH, SEQ), 2.0)
        return {"loss": loss, "accepted": accepted} if kwargs["mtp_depth"] == 1 else loss

    run(
        config,
        depth_one_accepts,
        training=True,
        input_ids=inputs["input_ids"],
        labels=inputs["labels"],
        loss_mask=inputs["loss_mask"],
    )
    mask = rolled(inputs["loss_mask"], 1).bool()
    assert cpu_mtp_tracker["correct_values"].tolist() == [float((accepted & mask).sum()), 0.0]
    assert cpu_mtp_tracker["total_values"].tolist() == [float(mask.sum()), 0.0]
    assert cpu_mtp_tracker["loss_values"].tolist() == [2.0, 2.0]


def test_a_loss_of_another_shape_is_refused():
    config = tiny_config(mtp_num_layers=1)
    inputs = token_batch(VOCAB, SEQ, BATCH)
    with pytest.raises(ValueError, match=r"shaped like the labels \(2, 8\), got \(8, 2\)"):
        run(
            config,
            lambda **kwargs: torch.zeros(SEQ, BATCH),
            labels=inputs["labels"],
            loss_mask=inputs["loss_mask"],
        )


def hybrid_batch():
    inputs = token_batch(VOCAB, SEQ, BATCH)
    return {**inputs, "attention_mask": None}


def test_hybrid_passes_it_to_process_mtp_loss():
    """Loss and gradients of the stock model, bitwise; exactly the twelve keywords."""
    inputs = hybrid_batch()
    stock = tiny_hybrid("--/-/-", vocab=VOCAB, seq=SEQ)
    want = stock(**inputs)
    want.sum().backward()
    model = tiny_hybrid("--/-/-", vocab=VOCAB, seq=SEQ)
    depths = []

    def processor(**kwargs):
        assert set(kwargs) == KEYWORDS
        depths.append(kwargs["mtp_depth"])
        return default_head(**kwargs)["loss"]

    got = model(**inputs, mtp_output_processor=processor)
    got.sum().backward()
    assert depths == [1, 2]
    assert torch.equal(got, want)
    assert_same_grads(model, stock)


def test_hybrid_refuses_it_without_mtp_layers():
    model = tiny_hybrid("---", vocab=VOCAB, seq=SEQ)
    with pytest.raises(ValueError, match="mtp_output_processor needs MTP layers"):
        model(**hybrid_batch(), mtp_output_processor=default_head)


def test_hybrid_refuses_it_where_mtp_is_switched_off():
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    if "compute_mtp_loss" not in inspect.signature(HybridModel.forward).parameters:
        pytest.skip("HybridModel.forward has no compute_mtp_loss here")
    model = tiny_hybrid("--/-/-", vocab=VOCAB, seq=SEQ)
    with pytest.raises(ValueError, match="compute_mtp_loss=True"):
        model(**hybrid_batch(), compute_mtp_loss=False, mtp_output_processor=default_head)
