"""The hook on the combined-1F1B schedule plan.

On a CPU the plan's post-process node is driven directly (``forward_impl``):
the plan's streams and events need CUDA. Where the release builds a plan on a
CPU (0.19 with a CUDA build of torch, dense layers), the node comes from
``torch_impl.build_schedule_plan``; elsewhere (0.16's plan takes a CUDA stream
when built; an MTP plan needs MoE MTP layers) it is Megatron's
``PostProcessNode`` over a ``ModelChunkState`` filled the way the plan fills
it, adapted by the same ``prepare_plan_hook`` and ``attach_plan_hook``. The
whole plan runs node by node on a CPU in ``test_plan_whole.py`` and through
Megatron's own ``run``, with streams, in the GPU tests here (marked ``gpu``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hookspec
from hookspec import ContractError, OutputContext
from tests.support.hook_cases import stock_loss, stock_loss_upstream
from tests.support.mtp_support import build_mtp_gpt
from tests.support.plan_support import post_node
from torch_impl import enable_output_processor
from torch_impl._plan_final_norm import missing_final_norm
from torch_impl._postprocess import as_inner_stage
from torch_impl.mtp import default_mtp_loss
from torch_impl.schedule_plan import build_schedule_plan, plan_loss_func, plan_outputs
from torch_impl.testing.tiny import build_tiny_gpt, tiny_batch
from torch_impl.testing.tiny_moe import build_tiny_moe_gpt

pytestmark = pytest.mark.usefixtures("megatron_single")


def decoder_output(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """What reaches the post-process node: the decoder's (and MTP layers') hidden states."""
    with torch.no_grad(), as_inner_stage(model):
        hidden = model(batch["input_ids"], batch["position_ids"], None)
    return hidden.detach().requires_grad_(True)


@pytest.mark.parametrize("mtp", [False, True], ids=["gpt", "gpt+mtp"])
@pytest.mark.parametrize(
    "processor", [stock_loss, stock_loss_upstream], ids=["hookspec", "upstream"]
)
def test_post_process_node_runs_the_hook_like_forward(processor: Any, mtp: bool) -> None:
    model = enable_output_processor(build_mtp_gpt() if mtp else build_tiny_gpt()).eval()
    batch = tiny_batch()
    kw = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]}
    extra = {"mtp_processor": default_mtp_loss} if mtp else {}
    want = model(
        batch["input_ids"], batch["position_ids"], None, **kw, output_processor=processor, **extra
    )
    want.sum().backward()
    want_grad = model.output_layer.weight.grad.clone()
    model.zero_grad(set_to_none=True)

    plan = post_node(model, batch, output_processor=processor, **extra)
    got = plan.post_process.forward_impl(decoder_output(model, batch))
    assert torch.equal(got, want)
    got.sum().backward()
    assert torch.equal(model.output_layer.weight.grad, want_grad)


def test_hook_sees_the_original_ids_where_mtp_rolled_them() -> None:
    """The MTP pre-dispatch writes ids rolled once per MTP layer into the chunk
    state; the hook sees the chunk's own ids, and MTP's labels derived from
    them (labels=None) match plain forward's."""
    seen: dict[str, list[OutputContext]] = {"forward": [], "plan": []}

    def recorder(where: str) -> Any:
        @hookspec.processor
        def record(ctx: OutputContext) -> Any:
            seen[where].append(ctx)
            return (
                default_mtp_loss(ctx)
                if ctx.mtp_depth
                else ctx.hidden_states.sum(-1).transpose(0, 1)
            )

        return record

    model = enable_output_processor(build_mtp_gpt()).eval()
    batch = tiny_batch()
    batch.pop("labels")
    batch.pop("loss_mask")
    model(
        batch["input_ids"],
        batch["position_ids"],
        None,
        output_processor=recorder("forward"),
        mtp_processor=recorder("forward"),
    )
    plan = post_node(
        model, batch, output_processor=recorder("plan"), mtp_processor=recorder("plan")
    )
    hidden = decoder_output(model, batch)
    rolled = torch.roll(batch["input_ids"], -2, dims=-1)  # two MTP layers rolled them twice
    plan.state.input_ids = rolled
    plan.post_process.forward_impl(hidden)
    assert plan.state.input_ids is rolled  # the chunk state is left as the schedule had it
    assert len(seen["plan"]) == len(seen["forward"]) == 3
    for got, want in zip(seen["plan"], seen["forward"]):
        assert got.mtp_depth == want.mtp_depth
        assert torch.equal(got.input_ids, batch["input_ids"])
        assert (
            torch.equal(got.labels, want.labels) if want.labels is not None else got.labels is None
        )
        assert torch.equal(got.loss_mask, want.loss_mask) if want.loss_mask is not None else True


@hookspec.processor
def logprobs_and_entropy(ctx: OutputContext) -> Any:
    logits = torch.einsum("sbh,vh->bsv", ctx.hidden_states, ctx.vocab_weight).float()
    logp = torch.log_softmax(logits, -1)
    chosen = logp.gather(-1, ctx.labels.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return {"logprobs": chosen, "entropy": entropy, "loss": -chosen.mean()}


def test_mapping_result_crosses_the_plan_packed() -> None:
    model = enable_output_processor(build_tiny_gpt()).eval()
    batch = tiny_batch()
    want = model(
        batch["input_ids"],
        batch["position_ids"],
        None,
        labels=batch["labels"],
        output_processor=logprobs_and_entropy,
    )
    (want["loss"] * 2.0).backward()
    want_grad = model.output_layer.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    plan = post_node(model, batch, output_processor=logprobs_and_entropy)
    received: list[Any] = []

    def loss_func(output: Any, *, scale: float = 1.0) -> Any:
        received.append(output)
        return output["loss"] * scale, {"lm loss": output["loss"].detach()}

    wrapped = plan_loss_func(plan, loss_func)
    packed = plan.post_process.forward_impl(decoder_output(model, batch))
    assert (
        isinstance(packed, tuple) and len(packed) == 2
    )  # logprobs and loss require grad; entropy rides along
    assert plan_outputs(plan).packed == ("logprobs", "loss")
    # what combined_1f1b does: the loss node takes detached inputs, its grads go to the node's
    # backward
    inputs = [t.detach().requires_grad_(True) for t in packed]
    loss, _ = wrapped(*inputs, scale=2.0)
    (output,) = received
    assert list(output) == ["logprobs", "entropy", "loss"]
    for key in want:
        assert torch.equal(output[key], want[key]), key
    assert torch.equal(loss, want["loss"] * 2.0)
    loss.backward()
    grads = tuple(t.grad for t in inputs)
    assert grads[0] is None  # the loss did not use the logprobs
    plan.post_process.backward_func(packed, grads)
    assert torch.equal(model.output_layer.weight.grad, want_grad)


def test_tensor_result_reaches_the_loss_function_unchanged() -> None:
    model = enable_output_processor(build_tiny_gpt()).eval()
    batch = tiny_batch()
    plan = post_node(model, batch, output_processor=stock_loss)
    out = plan.post_process.forward_impl(decoder_output(model, batch))
    assert isinstance(out, torch.Tensor)
    assert plan_loss_func(plan, lambda x: x)(out) is out


def test_mapping_result_without_the_loss_wrapper_is_refused() -> None:
    model = enable_output_processor(build_tiny_gpt()).eval()
    batch = tiny_batch()
    plan = post_node(model, batch, output_processor=logprobs_and_entropy)
    with pytest.raises(ContractError) as err:
        plan.post_process.forward_impl(decoder_output(model, batch))
    assert err.value.field == "schedule plan output" and "plan_loss_func" in err.value.hint
    assert "a mapping with keys ['entropy', 'logprobs', 'loss']" in str(err.value.actual)


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (
            lambda **kw: [kw["hidden_states"].sum()],
            "a tensor, a tuple of tensors or a mapping of tensors",
        ),
        (
            hookspec.processor(
                lambda ctx: {"entropy": ctx.hidden_states.detach().sum(-1).T}, name="no_grad"
            ),
            "at least one value that requires grad",
        ),
    ],
    ids=["list", "nothing-differentiable"],
)
def test_results_the_plan_cannot_carry(result: Any, expected: str) -> None:
    model = enable_output_processor(build_tiny_gpt()).eval()
    batch = tiny_batch()
    plan = post_node(model, batch, output_processor=result)
    plan_loss_func(plan, lambda x: x)
    with pytest.raises(ContractError, match=expected):
        plan.post_process.forward_impl(decoder_output(model, batch))


def test_bad_processors_are_refused_before_the_plan_is_built() -> None:
    model = enable_output_processor(build_tiny_gpt()).eval()
    batch = tiny_batch()
    args = (batch["input_ids"], batch["position_ids"], None)
    with pytest.raises(ContractError, match="mtp_processor: expected a model with MTP layers"):
        build_schedule_plan(model, *args, mtp_processor=default_mtp_loss)
    with pytest.raises(ContractError, match="output_processor: expected a callable"):
        build_schedule_plan(model, *args, output_processor=3)
    with pytest.raises(ContractError, match="model: expected a model enabled"):
        build_schedule_plan(build_tiny_gpt(), *args, output_processor=stock_loss)


# ---- the whole plan, on a GPU ------------------------------------------------
# Megatron's own ``TransformerModelChunkSchedulePlan.run``, with its streams and
# events, and the loss node as ``combined_1f1b`` builds it. Portable across
# 0.16.1 and 0.19.2: ``set_streams()`` before the plan is built (0.16 takes its
# streams then) and ``get_comp_stream()``, a stream object (0.16's
# ``ScheduleNode`` takes no getter). The tiny models of ``test_plan_whole.py``,
# fp32, one GPU, expert parallel size 1.
#
# Tolerance: fp32's default (rtol 1.3e-6, atol 1e-5), not bitwise as on the CPU
# (test_plan_whole.py): on a GPU two runs of the same computation may accumulate
# in another order (the MoE unpermute is an atomic ``scatter_add``; the
# attention backward may be nondeterministic). The missing norm these tests
# must catch moves the result by about 0.36 (asserted below).

GPU_MODELS: dict[str, tuple[Any, bool]] = {
    "dense": (lambda: build_tiny_gpt(), False),
    "moe-last": (lambda: build_tiny_moe_gpt([0, 1]), True),
}


def _gpu_loss(output: Any) -> torch.Tensor:
    return output["loss"] + output["logprobs"].sum() if isinstance(output, dict) else output.sum()


def _gpu_batch() -> dict[str, Any]:
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in tiny_batch().items()}


def _gpu_inputs(batch: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (batch["input_ids"], batch["position_ids"], None), {
        "labels": batch["labels"],
        "loss_mask": batch["loss_mask"],
    }


def _gpu_grads(model: Any) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _keep_inputs(plan: Any) -> None:
    """With expert parallel size 1 the MoE dispatch and combine all-to-alls are
    identities, so the nodes' early release of their inputs (``free_input``)
    would free their outputs too; Megatron allows this schedule only with
    ``expert_model_parallel_size > 1``. Keep the inputs (memory only)."""
    from tests.support.plan_driver import layer_nodes

    for i in range(plan.num_layers()):
        for node in layer_nodes(plan.get_layer(i)):
            if hasattr(node, "free_input"):
                node.free_input = False


def _whole_plan_step(plan: Any, loss_func: Any) -> Any:
    """One microbatch through the plan the way ``combined_1f1b`` drives it:
    ``run(plan, None)``, the loss node, the loss's backward, ``run(None, plan, b_grad)``."""
    from megatron.core.pipeline_parallel.utils import ScheduleNode, get_comp_stream

    _keep_inputs(plan)
    output = type(plan).run(plan, None)
    loss_node = ScheduleNode(loss_func, get_comp_stream(), plan.event, name="loss_func")
    loss = loss_node.forward(output)
    torch.autograd.backward(loss)
    type(plan).run(None, plan, b_grad=loss_node.get_grad())
    torch.cuda.synchronize()
    return loss


def _gpu_forward(model: Any, processor: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    args, kw = _gpu_inputs(_gpu_batch())
    if processor is not None:
        model = enable_output_processor(model)
        kw["output_processor"] = processor
    out = model(*args, **kw)
    _gpu_loss(out).backward()
    return out, _gpu_grads(model)


def _gpu_plan(
    model: Any, processor: Any, *, stock: bool = False, **options: Any
) -> tuple[Any, dict[str, torch.Tensor]]:
    from megatron.core.pipeline_parallel.utils import set_streams

    set_streams()
    args, kw = _gpu_inputs(_gpu_batch())
    received: list[Any] = []

    def loss_func(output: Any) -> torch.Tensor:
        received.append(output)
        return _gpu_loss(output)

    if stock:  # Megatron's plan on a model that was never enabled
        plan = model.build_schedule_plan(*args, **kw)
        _whole_plan_step(plan, loss_func)
    else:
        model = enable_output_processor(model)
        plan = build_schedule_plan(model, *args, **kw, output_processor=processor, **options)
        _whole_plan_step(plan, plan_loss_func(plan, loss_func))
    (out,) = received
    return out, _gpu_grads(model)


def _gpu_compare(got: Any, want: Any) -> None:
    (out, grads), (want_out, want_grads) = got, want
    tol = {"rtol": 1.3e-6, "atol": 1e-5}
    outs = out if isinstance(out, dict) else {"result": out}
    wants = want_out if isinstance(want_out, dict) else {"result": want_out}
    assert list(outs) == list(wants)
    for key in wants:
        torch.testing.assert_close(outs[key], wants[key], **tol, msg=key)
    assert grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], **tol, msg=name)


def _gpu_model(name: str) -> Any:
    build, _ = GPU_MODELS[name]
    return build().cuda()


@pytest.fixture
def gpu_moe() -> Iterator[None]:
    """0.16.1's MoE router without Transformer Engine: see docs/upstream.md."""
    from tests.support.plan_driver import moe_without_te

    with moe_without_te():
        yield


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_moe")
@pytest.mark.parametrize("name", list(GPU_MODELS))
def test_stock_plan_on_gpu_against_forward(name: str) -> None:
    """Megatron's plan: the missing norm on a dense last layer, none on a MoE one."""
    _, megatron_norms = GPU_MODELS[name]
    got = _gpu_plan(_gpu_model(name), None, stock=True)
    want = _gpu_forward(_gpu_model(name), None)
    if megatron_norms:
        _gpu_compare(got, want)
    else:
        assert (got[0] - want[0]).abs().max() > 1e-2


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_moe")
@pytest.mark.parametrize("processor", [stock_loss, logprobs_and_entropy], ids=["tensor", "mapping"])
@pytest.mark.parametrize("name", list(GPU_MODELS))
def test_whole_plan_on_gpu_matches_forward(name: str, processor: Any) -> None:
    """The adapted plan (final norm added where Megatron's plan leaves it out) is forward."""
    _gpu_compare(_gpu_plan(_gpu_model(name), processor), _gpu_forward(_gpu_model(name), processor))


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_moe")
@pytest.mark.parametrize("processor", [stock_loss, logprobs_and_entropy], ids=["tensor", "mapping"])
@pytest.mark.parametrize("name", list(GPU_MODELS))
def test_whole_plan_on_gpu_without_the_fix_is_megatrons_plan(name: str, processor: Any) -> None:
    """``apply_final_norm=False``: the tensor result (Megatron's loss through the
    hook) equals Megatron's own plan; a mapping result equals ``forward`` on what Megatron's
    plan computes, the model without its final norm where the plan leaves it out."""
    got = _gpu_plan(_gpu_model(name), processor, apply_final_norm=False)
    if processor is stock_loss:
        _gpu_compare(got, _gpu_plan(_gpu_model(name), None, stock=True))
        return
    reference = _gpu_model(name)
    if missing_final_norm(reference) is not None:
        reference.decoder.final_layernorm = None
    _gpu_compare(got, _gpu_forward(reference, processor))


@pytest.mark.parametrize("plan", [3, None, object()])
def test_plan_loss_func_refuses_what_is_not_a_plan(plan: Any) -> None:
    with pytest.raises(ContractError, match=r"^plan: expected a schedule plan"):
        plan_loss_func(plan, lambda out: out)
