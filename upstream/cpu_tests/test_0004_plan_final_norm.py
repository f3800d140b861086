"""0004 on a CPU: the schedule plan applies the decoder's final layer norm as
``GPTModel.forward`` does, whatever the decoder's last layer is.

The plan's nodes run in schedule order without streams, chained without detaching, so
one backward reaches the parameters. The MoE dispatch node gives the router (and through
it every earlier layer) its gradient in the node's own backward, which such a chain does
not drive; with MoE layers the gradients compared are those no router lies upstream of.
"""

import pytest
import torch
from cpu_harness import (
    cuda_stand_ins,
    grads,
    moe_overrides,
    run_plan_forward,
    tiny_config,
    token_batch,
    with_cpu_attention,
)

VOCAB, SEQ = 40, 8
pytestmark = pytest.mark.usefixtures("model_parallel", "router_on_cpu")


def gpt(moe_layers, mtp_num_layers=0):
    """Layer i is MoE where ``moe_layers[i]`` is 1, dense where it is 0."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )

    overrides = dict(num_layers=len(moe_layers), mtp_num_layers=mtp_num_layers or None)
    if any(moe_layers):
        overrides.update(moe_overrides(moe_layer_freq=list(moe_layers)))
    config = tiny_config(**overrides)
    block = with_cpu_attention(get_gpt_decoder_block_spec(config, use_transformer_engine=False))
    mtp = None
    if mtp_num_layers:  # the plan takes MTP layers after a MoE layer only
        moe_spec = next(s for s, m in zip(block.layer_specs, moe_layers) if m)
        mtp = get_gpt_mtp_block_spec(config, moe_spec, use_transformer_engine=False)
    torch.manual_seed(1234)
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="learned_absolute",
        mtp_block_spec=mtp,
    ).eval()


@pytest.mark.parametrize(
    "moe_layers, mtp_num_layers",
    [
        ((0, 0), 0),  # dense model
        ((1, 0), 0),  # moe_layer_freq=[1, 0]: the last layer is dense
        ((0, 1), 0),  # the last layer is MoE: the combine step normalizes (unchanged)
        ((1, 0), 1),  # a dense last layer, then an MTP layer reading its output
    ],
    ids=["dense", "moe-dense", "dense-moe", "moe-dense-mtp"],
)
def test_plan_equals_forward(moe_layers, mtp_num_layers):
    batch = token_batch(VOCAB, SEQ)
    args = (batch["input_ids"], batch["position_ids"], None)
    stock = gpt(moe_layers, mtp_num_layers)
    want = stock(*args, labels=batch["labels"])
    want.sum().backward()
    model = gpt(moe_layers, mtp_num_layers)
    with cuda_stand_ins():
        got = run_plan_forward(model.build_schedule_plan(*args, labels=batch["labels"]))
    got.sum().backward()
    assert torch.equal(got, want)
    want_grads, got_grads = grads(stock), grads(model)
    if not any(moe_layers):
        compared = set(want_grads)
        assert got_grads.keys() == want_grads.keys()
    elif mtp_num_layers:
        compared = {"output_layer.weight"}
    else:
        compared = {"output_layer.weight"} | {
            name for name in want_grads if name.startswith("decoder.final_layernorm.")
        }
        assert len(compared) > 1
    for name in compared:
        assert torch.equal(got_grads[name], want_grads[name]), name
