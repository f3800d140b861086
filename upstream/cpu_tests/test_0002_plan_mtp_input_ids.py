"""0002 on a CPU: the schedule plan's MTP nodes leave the chunk's ``input_ids`` and
``position_ids`` as they were, so the postprocess node hands the output processor and
``process_mtp_loss`` what ``GPTModel.forward`` hands them. One and two MTP depths (the
overlap config allows one; the plan itself takes any number)."""

import pytest
import torch
from cpu_harness import (
    cuda_stand_ins,
    moe_overrides,
    run_plan_forward,
    tiny_config,
    token_batch,
    with_cpu_attention,
)

VOCAB, SEQ = 40, 8
pytestmark = [
    pytest.mark.usefixtures("model_parallel", "router_on_cpu"),
    pytest.mark.parametrize("depths", [1, 2]),
]


def moe_gpt_with_mtp(depths):
    """Two MoE layers (the plan takes MTP layers after a MoE layer only)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )

    config = tiny_config(mtp_num_layers=depths, mtp_loss_scaling_factor=0.3, **moe_overrides())
    spec = with_cpu_attention(get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False))
    torch.manual_seed(1234)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="learned_absolute",
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    ).eval()


def plan_forward(model, *args, **kwargs):
    with cuda_stand_ins():
        return run_plan_forward(model.build_schedule_plan(*args, **kwargs))


def test_mtp_nodes_leave_the_chunks_ids(depths):
    model = moe_gpt_with_mtp(depths)
    batch = token_batch(VOCAB, SEQ)
    with torch.no_grad(), cuda_stand_ins():
        plan = model.build_schedule_plan(
            batch["input_ids"], batch["position_ids"], None, labels=batch["labels"]
        )
        run_plan_forward(plan)
    assert plan.state.input_ids is batch["input_ids"]
    assert plan.state.position_ids is batch["position_ids"]


def test_output_processor_sees_the_chunks_ids(depths):
    model = moe_gpt_with_mtp(depths)
    batch = token_batch(VOCAB, SEQ)
    seen = []

    def output_processor(**kwargs):
        seen.append(kwargs["input_ids"])
        logits, _ = kwargs["output_layer"](kwargs["hidden_states"])
        logits = logits.float().transpose(0, 1)
        taken = logits.gather(-1, kwargs["input_ids"].unsqueeze(-1)).squeeze(-1)
        return logits.logsumexp(-1) - taken

    args = (batch["input_ids"], batch["position_ids"], None)
    with torch.no_grad():
        want = model(*args, output_processor=output_processor)
        got = plan_forward(model, *args, output_processor=output_processor)
    assert [ids is batch["input_ids"] for ids in seen] == [True, True]
    assert torch.equal(got, want)


@pytest.mark.parametrize("labels_given", [True, False], ids=["labels", "rl-labels-none"])
def test_mtp_losses_equal_forwards(depths, labels_given, cpu_mtp_tracker):
    """With ``labels=None`` (RL), ``process_mtp_loss`` derives the MTP labels from the
    ``input_ids`` it is handed. With labels given this passes without the fix too."""
    model = moe_gpt_with_mtp(depths).train()
    batch = token_batch(VOCAB, SEQ)
    args = (batch["input_ids"], batch["position_ids"], None)
    kwargs = {"loss_mask": batch["loss_mask"]}
    if labels_given:
        kwargs["labels"] = batch["labels"]
    logged = []
    for run in (lambda: model(*args, **kwargs), lambda: plan_forward(model, *args, **kwargs)):
        cpu_mtp_tracker.clear()  # the logging allocates on the (CPU) current device
        with torch.no_grad():
            run()
        # main and the releases log the loss as "loss_values", dev as "loss_sums"
        logged.append(cpu_mtp_tracker.get("loss_sums", cpu_mtp_tracker.get("loss_values")))
    want, got = logged
    assert torch.all(want > 0)
    assert torch.equal(got, want)
