"""Where Megatron Core releases differ under the adapter, decided from the installed code.

Every predicate here reads a signature or an attribute of the installed
Megatron Core, never a version string, and names the upstream function whose
behaviour the adapter follows on that release:

- :func:`mtp_loss_in_block`: the MTP block computes and attaches the MTP
  losses itself (``MultiTokenPredictionBlock.forward`` takes
  ``compute_language_model_loss``; 0.13) instead of ``GPTModel._postprocess``
  (inline, 0.14 to 0.16) or ``process_mtp_loss`` (0.17+);
- :func:`model_process_groups`: the model's process groups: ``pg_collection``
  (0.15+), ``model_comm_pgs`` (0.14), else Megatron's global groups in
  ``parallel_state``, which the 0.13 model and its layers use;
- :func:`mtp_cp_group`: the context-parallel group ``GPTModel._postprocess``
  hands ``roll_tensor`` (``LanguageModule.cp_group``; 0.14+);
- :func:`roll_tensor`: Megatron's ``roll_tensor`` with the keywords the
  installed one takes (``cp_group`` from 0.14, ``packed_seq_params`` from 0.16);
- :func:`reduce_keeps_noncontiguous_result`: whether
  ``tensor_parallel.mappings._reduce`` returns the all-reduced tensor when its
  input was not contiguous (0.19) or the unreduced input (0.13 to 0.18).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import weakref
from typing import Any, NamedTuple

import torch
from megatron.core.transformer import multi_token_prediction as _mtp

from hookspec import ContractError

__all__ = [
    "ProcessGroups",
    "check_mtp_processor",
    "model_process_groups",
    "mtp_cp_group",
    "mtp_loss_in_block",
    "reduce_keeps_noncontiguous_result",
    "roll_accepts",
    "roll_tensor",
]


class ProcessGroups(NamedTuple):
    """Tensor, context and pipeline parallel groups, as ``pg_collection`` names them."""

    tp: Any
    cp: Any
    pp: Any


_GLOBAL_GROUPS: weakref.WeakKeyDictionary[Any, ProcessGroups] = weakref.WeakKeyDictionary()


def model_process_groups(model: Any) -> Any:
    """The object whose ``tp``, ``cp`` and ``pp`` are ``model``'s process groups.

    ``model.pg_collection`` (``LanguageModule``, 0.15+), ``model.model_comm_pgs``
    (0.14), else a :class:`ProcessGroups` of ``parallel_state``'s groups, which a
    model without either uses (0.13); the same object for a model while its
    groups stay the same.
    """
    for name in ("pg_collection", "model_comm_pgs"):
        groups = getattr(model, name, None)
        if groups is not None:
            return groups
    from megatron.core import parallel_state

    current = ProcessGroups(
        tp=parallel_state.get_tensor_model_parallel_group(check_initialized=False),
        cp=parallel_state.get_context_parallel_group(check_initialized=False),
        pp=parallel_state.get_pipeline_model_parallel_group(check_initialized=False),
    )
    cached = _GLOBAL_GROUPS.get(model)
    if cached is None or any(a is not b for a, b in zip(cached, current)):
        _GLOBAL_GROUPS[model] = cached = current
    return cached


@functools.cache
def roll_accepts() -> frozenset[str]:
    """The parameter names of the installed ``multi_token_prediction.roll_tensor``."""
    return frozenset(inspect.signature(_mtp.roll_tensor).parameters)


@functools.cache
def mtp_loss_in_block() -> bool:
    """True where ``MultiTokenPredictionBlock.forward`` computes the MTP losses
    (it takes ``compute_language_model_loss`` and returns the main hidden states
    with the losses attached): the adapter then leaves them to the block."""
    forward = _mtp.MultiTokenPredictionBlock.forward
    return "compute_language_model_loss" in inspect.signature(forward).parameters


def check_mtp_processor(mtp_processor: Any) -> None:
    """Refuse a per-depth ``mtp_processor`` where :func:`mtp_loss_in_block`: the
    block computes the MTP losses with the output layer it is handed, and a main
    processor still runs there (the block's stock MTP losses are kept)."""
    if mtp_processor is not None and mtp_loss_in_block():
        raise ContractError(
            "mtp_processor",
            expected="None on this Megatron Core",
            actual=getattr(
                mtp_processor, "name", getattr(mtp_processor, "__name__", type(mtp_processor).__name__)
            ),
            hint="its MultiTokenPredictionBlock.forward computes the MTP losses itself "
            "(it takes compute_language_model_loss); a per-depth MTP processor needs "
            "megatron-core 0.14+, where GPTModel._postprocess computes them",
        )


def mtp_cp_group(model: Any) -> Any:
    """The context-parallel group ``GPTModel._postprocess`` passes to ``roll_tensor``:
    ``model.cp_group`` (``LanguageModule``), or ``None`` where the model has none."""
    return getattr(model, "cp_group", None)


def roll_tensor(
    tensor: torch.Tensor, /, *, cp_group: Any, packed_seq_params: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``roll_tensor(tensor, shifts=-1, dims=-1, ...)`` as the installed
    ``GPTModel._postprocess`` calls it: ``(rolled [b, s], rolled.sum())`` with the
    last position zeroed; per sequence for packed (THD) input.

    Where the installed ``roll_tensor`` takes no ``packed_seq_params`` (before
    0.16) it would roll packed sequences across their boundaries; packed THD
    input is refused there with a ``ContractError``.
    """
    accepts = roll_accepts()
    kwargs: dict[str, Any] = {"shifts": -1, "dims": -1}
    if "cp_group" in accepts:
        kwargs["cp_group"] = cp_group
    if "packed_seq_params" in accepts:
        kwargs["packed_seq_params"] = packed_seq_params
    elif packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd":
        raise ContractError(
            "packed_seq_params",
            expected="no packed (THD) sequences for MTP on this Megatron Core",
            actual="qkv_format='thd'",
            hint="its roll_tensor takes no packed_seq_params and would roll labels across "
            "sequence boundaries; megatron-core 0.16+ rolls each packed sequence on its own",
        )
    rolled, total = _mtp.roll_tensor(tensor, **kwargs)
    return rolled, total


@functools.cache
def reduce_keeps_noncontiguous_result() -> bool:
    """Whether ``megatron.core.tensor_parallel.mappings._reduce`` all-reduces the
    tensor it returns. Read from its syntax tree: where the argument of
    ``all_reduce`` is an expression (``input_.contiguous()``) rather than the
    name it returns, a non-contiguous input is returned unreduced."""
    from megatron.core.tensor_parallel import mappings

    tree = ast.parse(textwrap.dedent(inspect.getsource(mappings._reduce)))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "all_reduce"
            and node.args
        ):
            return isinstance(node.args[0], ast.Name)
    return True
