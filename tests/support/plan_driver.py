"""Drive a whole combined-1F1B schedule plan on a CPU, without streams.

:func:`run_plan` runs one microbatch through a plan in the order Megatron's
``TransformerModelChunkSchedulePlan.run`` runs it (``run(plan, None)``: the
pre-process node, each layer's nodes, the post-process node), then the loss
node as ``combined_1f1b.combined_forward_backward_step`` builds it (a
``ScheduleNode`` over the loss function: detached inputs, ``backward`` of the
loss, the inputs' grads), then ``run(None, plan, b_grad)``: the post-process
node's backward, each layer's nodes backwards in reverse, the pre-process
node's backward. Each node is driven as ``ScheduleNode._forward`` and
``_backward`` drive it (inputs made viewless and detached, ``forward_func``,
then ``backward_func`` and the inputs' grads), without the stream and event
contexts and without the early release of inputs (``free_input``), which only
manages memory. (With expert parallel size 1, as here, the MoE dispatch and
combine all-to-alls are identities, so that release would free their outputs
too: Megatron requires ``expert_model_parallel_size > 1`` for this schedule.)
The GPU test runs the real ``run``.

:func:`cpu_stand_ins` supplies what the plan touches of CUDA on a CPU: the
plan's ``torch.cuda.Event`` (built, never recorded here; a CPU-only torch
cannot build one), ``torch.cuda.current_device`` (the MoE router moves a CPU
gate weight there: answered ``"cpu"``), ``torch.cuda.current_stream`` and
``Tensor.record_stream`` (the MoE combine step records its residual on the
current stream: no-ops). :func:`moe_without_te` (also inside
:func:`cpu_stand_ins`) gives 0.16.1's ``moe_utils`` the ``te_general_gemm =
None`` that 0.19 defines without Transformer Engine (0.16.1 leaves the name
undefined and its router raises ``NameError``; see ``docs/upstream.md``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from megatron.core.pipeline_parallel.utils import NoopScheduleNode, make_viewless

__all__ = ["cpu_stand_ins", "layer_nodes", "moe_without_te", "run_plan"]


class _CPUEvent:
    """Stands in for the plan's CUDA event; nothing records or waits on it here."""

    def record(self, *_: Any) -> None:
        raise AssertionError("the CPU driver never records the plan's event")

    def wait(self, *_: Any) -> None:
        raise AssertionError("the CPU driver never waits on the plan's event")


@contextlib.contextmanager
def moe_without_te() -> Iterator[None]:
    """``moe_utils.te_general_gemm = None`` where the release leaves it undefined
    (0.16.1 without Transformer Engine), for the ``with`` block only."""
    from megatron.core.transformer.moe import moe_utils

    with pytest.MonkeyPatch.context() as patch:
        if not hasattr(moe_utils, "te_general_gemm"):
            patch.setattr(moe_utils, "te_general_gemm", None, raising=False)
        yield


@contextlib.contextmanager
def cpu_stand_ins() -> Iterator[None]:
    """The CUDA stand-ins named in the module docstring, for the ``with`` block
    only; nothing is replaced where CUDA is available."""
    with moe_without_te(), pytest.MonkeyPatch.context() as patch:
        if not torch.cuda.is_available():
            patch.setattr(torch.cuda, "Event", _CPUEvent)
            patch.setattr(torch.cuda, "current_device", lambda: "cpu")
            patch.setattr(torch.cuda, "current_stream", lambda *_, **__: None)
            patch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
        yield


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def _single(values: tuple[Any, ...]) -> Any:
    return values[0] if len(values) == 1 else values


def _forward(node: Any, inputs: Any) -> Any:
    """``ScheduleNode.forward`` without its stream, event and input release."""
    if isinstance(node, NoopScheduleNode):
        return inputs
    inputs = _as_tuple(inputs)
    node.inputs = [make_viewless(e).detach() if e is not None else None for e in inputs]
    for detached, given in zip(node.inputs, inputs):
        if detached is not None:
            detached.requires_grad = given.requires_grad
    data = node.forward_func(*node.inputs)
    if isinstance(data, tuple):
        node.output = tuple(make_viewless(e) if isinstance(e, torch.Tensor) else e for e in data)
    else:
        node.output = make_viewless(data)
    return node.output


def _backward(node: Any, output_grad: Any) -> Any:
    """``ScheduleNode.backward`` without its stream and event: the node's
    backward function, then the grads of its inputs."""
    if isinstance(node, NoopScheduleNode):
        return output_grad
    outputs = _as_tuple(node.output)
    grads = _as_tuple(output_grad)
    assert len(outputs) == len(grads), (len(outputs), len(grads))
    node.backward_func(outputs, grads)
    return _single(tuple(e.grad if e is not None else None for e in node.inputs))


def layer_nodes(layer: Any) -> tuple[Any, ...]:
    """A layer plan's nodes in forward order (0.16 names the first ``attn``)."""
    first = getattr(layer, "pre_dispatch_computation", None) or layer.attn
    return (first, layer.moe_dispatch, layer.mlp, layer.moe_combine, layer.mtp_post_process)


def run_plan(plan: Any, loss_func: Callable[..., Any]) -> tuple[Any, Any]:
    """One microbatch through ``plan`` (forward, loss node, backward; see the
    module docstring). Returns the post-process node's output and the loss."""
    layers = [plan.get_layer(i) for i in range(plan.num_layers())]
    hidden = _forward(plan.pre_process, ())
    for layer in layers:
        for node in layer_nodes(layer):
            hidden = _forward(node, hidden)
    output = _forward(plan.post_process, hidden)

    loss_inputs = [make_viewless(e).detach() for e in _as_tuple(output)]
    for detached, given in zip(loss_inputs, _as_tuple(output)):
        detached.requires_grad = given.requires_grad
    loss = loss_func(*loss_inputs)
    torch.autograd.backward(loss[0] if isinstance(loss, tuple) else loss)
    grad = _single(tuple(e.grad for e in loss_inputs))

    grad = _backward(plan.post_process, grad)
    for layer in reversed(layers):
        first, dispatch, mlp, combine, mtp_post = layer_nodes(layer)
        grad = _backward(mtp_post, grad)
        grad = _backward(combine, grad)
        grad = _backward(mlp, grad)
        if not isinstance(mlp, NoopScheduleNode):
            mlp.backward_dw()
        grad = _backward(dispatch, grad)
        grad = _backward(first, grad)
        first.backward_dw()
    _backward(plan.pre_process, grad)
    return output, loss
