"""The decoder's final norm that Megatron's combined-1F1B plan leaves out.

Plain ``forward`` normalises the decoder's output once, at the end of
``TransformerBlock.forward`` (``decoder.final_layernorm``), before the output
layer and before the MTP layers. The schedule plan has no block: in 0.16.1 and
0.19.2 it applies the norm only

- in the MoE combine step of the decoder's last layer
  (``models/gpt/fine_grained_callables.py``: ``submodule_combine_forward``,
  used only for a layer whose ``mlp`` is a ``MoELayer``), and
- in ``PostProcessNode.forward_impl`` when the decoder holds no layers and the
  model has no MTP layers.

So when the chunk's last decoder layer is dense (say ``moe_layer_freq=2`` with
an even ``num_layers``), the output layer and the MTP layers receive
hidden states that were never normalised. This module decides that case from
the layers themselves (never from a version string) and adds the norm to the
plan's node that first consumes the decoder's output:

- the post-process node, when the chunk holds no MTP layers;
- the MLP node of the decoder's last layer when the chunk holds MTP layers:
  the MTP layers take the decoder's output as their input, so the
  post-process node would be too late for them. This is where Megatron's MoE
  combine step applies it. (Not the first MTP layer's node: that node keeps
  the main slice of its input in the chunk state for the MTP post-process
  node, so the norm's graph would be crossed by two nodes' backwards.)

The norm is applied inside the chosen node's own forward function (to its
input in the post-process node, to its output in the MLP node), so its
backward runs in that node's backward, as every node's does.

    h_norm = final_layernorm(h)      h: [s, b, hidden]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.utils import make_viewless_tensor

from hookspec import ContractError

from ._compat import installed_megatron

__all__ = ["add_missing_final_norm", "check_apply_final_norm", "missing_final_norm"]


def check_apply_final_norm(value: Any) -> bool:
    """The ``apply_final_norm`` option, validated: a ``bool``."""
    if not isinstance(value, bool):
        raise ContractError(
            "apply_final_norm",
            expected="a bool (True: the plan normalises like forward; False: Megatron's plan as "
            "it is)",
            actual=repr(value),
        )
    return value


def _mtp_layers(model: Any) -> int:
    mtp = getattr(model, "mtp", None)
    return 0 if mtp is None else len(mtp.layers)


def missing_final_norm(model: Any) -> Any:
    """The decoder's final norm where Megatron's plan for ``model`` never applies
    it, else ``None``.

    ``None`` when the chunk has no post-process (not the last pipeline stage),
    when its decoder holds no final norm, or where Megatron applies it: the
    decoder's last layer is a MoE layer (its combine step normalises), or the
    decoder is empty and the chunk holds no MTP layers (the post-process node
    normalises), or the installed plan's dense MLP step normalises too (the
    patch series of ``upstream/``, read from its code).
    """
    if not getattr(model, "post_process", False):
        return None
    decoder = model.decoder
    norm = getattr(decoder, "final_layernorm", None)
    if norm is None:
        return None
    layers = decoder.layers
    if len(layers) == 0:
        return norm if _mtp_layers(model) else None
    if installed_megatron().plan_final_norm_after_dense:
        return None
    return None if isinstance(layers[-1].mlp, MoELayer) else norm


def _normed(norm: Any, hidden_states: Any) -> Any:
    """``norm(hidden_states)`` as ``TransformerBlock.forward`` applies it (then a viewless
    tensor)."""
    return make_viewless_tensor(inp=norm(hidden_states), requires_grad=True, keep_graph=True)


def _norm_input(forward_func: Callable[..., Any], norm: Any) -> Callable[..., Any]:
    """``forward_func`` whose input goes through ``norm`` first."""

    def forward(hidden_states: Any) -> Any:
        return forward_func(_normed(norm, hidden_states))

    return forward


def _norm_output(forward_func: Callable[..., Any], norm: Any) -> Callable[..., Any]:
    """``forward_func`` whose output goes through ``norm``."""

    def forward(*inputs: Any) -> Any:
        return _normed(norm, forward_func(*inputs))

    return forward


def add_missing_final_norm(plan: Any, model: Any) -> None:
    """Add the final norm Megatron's ``plan`` leaves out (see the module docstring),
    if it leaves it out: adapts one node instance of ``plan`` (its
    ``forward_func``). Call it after every other adaptation of that node.
    """
    norm = missing_final_norm(model)
    if norm is None:
        return
    layers = len(model.decoder.layers)
    if not _mtp_layers(model):
        node = plan.post_process
        node.forward_func = _norm_input(node.forward_func, norm)
    elif layers:
        node = plan.get_layer(layers - 1).mlp
        node.forward_func = _norm_output(node.forward_func, norm)
    else:
        raise ContractError(
            "model",
            expected="a chunk whose MTP layers follow decoder layers (where the plan can add the "
            "final norm)",
            actual="MTP layers after an empty decoder, where Megatron's plan applies no final norm",
            hint="Build the plan with apply_final_norm=False (Megatron's plan as it is)",
        )
