"""Where Megatron Core releases differ under the adapter, decided from the installed code.

Everything read from the installed Megatron Core lives in ONE object,
:func:`installed_megatron` (a frozen :class:`InstalledMegatron`, computed once
per process): its release, the native hook, where the MTP losses are computed
and with which semantics, the process-group API, the ``roll_tensor`` keywords,
the ``_reduce`` defect, ``HybridModel`` and the schedule plan. The doctor, the
MTP code and the adapter read it; none works it out again. Every field reads a
signature, an attribute or a syntax tree, never a version string.

The functions below are thin readers of that object (kept for their callers),
each naming the upstream function whose behaviour the adapter follows:

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
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import textwrap
import weakref
from typing import Any, NamedTuple

import torch
from megatron.core.transformer import multi_token_prediction as _mtp

from hookspec import ContractError

__all__ = [
    "InstalledMegatron",
    "ProcessGroups",
    "installed_megatron",
    "check_mtp_processor",
    "model_process_groups",
    "mtp_cp_group",
    "mtp_loss_in_block",
    "reduce_keeps_noncontiguous_result",
    "roll_accepts",
    "roll_tensor",
]


@dataclasses.dataclass(frozen=True)
class InstalledMegatron:
    """What the adapter, the MTP code and the doctor need to know of the installed
    Megatron Core, each field read once from its code (:func:`installed_megatron`).

    - ``release``: the distribution's version (metadata, no git suffix);
      ``package``: the directory of the imported ``megatron.core``;
      ``shadowed``: the metadata found first belongs to another copy.
    - ``native_hook``: ``GPTModel.forward`` takes ``output_processor`` (0.18+).
    - ``mtp_loss_in_block``: ``MultiTokenPredictionBlock.forward`` takes
      ``compute_language_model_loss`` and computes the MTP losses (0.13).
    - ``mtp_loss_site``: where the MTP losses are computed, in words (the
      doctor's facts row); ``mtp_labels_from_input_ids``: MTP labels are
      derived from ``input_ids`` when ``labels`` is None (``process_mtp_loss``
      takes ``input_ids``).
    - ``mtp_mup_scaling``: ``process_mtp_loss`` takes ``scale_logits_fn``;
      ``mtp_clamped_counts``: ``process_mtp_loss`` exists (token counts clamped
      to >= 1); ``mtp_logs_acceptance``: ``MTPLossLoggingHelper`` has
      ``save_metrics_to_tracker`` (the MTP semantics).
    - ``process_groups``: how a model holds its groups: ``"pg_collection"``
      (0.15+), ``"model_comm_pgs"`` (0.14), ``"parallel_state"`` (0.13: the
      globals), from ``GPTModel.__init__``'s parameters.
    - ``roll_keywords``: the parameters of ``multi_token_prediction.roll_tensor``.
    - ``reduce_keeps_noncontiguous_result``: ``tensor_parallel.mappings._reduce``
      returns the reduced tensor for a non-contiguous input (0.19).
    - ``hybrid_model``: ``megatron.core.models.hybrid`` exists;
      ``hybrid_native_hook``: its ``HybridModel.forward`` takes ``output_processor``.
    - ``schedule_plan``: ``GPTModel.build_schedule_plan`` and its nodes'
      ``stream``, in words; ``plan_mtp_overwrites_ids``: the plan's MTP
      pre-dispatch writes rolled ids into ``chunk_state.input_ids``.
    - ``native_mtp_hook``: ``process_mtp_loss`` takes ``mtp_output_processor``
      (the per-depth MTP callable of the patch series in ``upstream/``; no
      release has it). Which models hand it on is read per class, from their
      ``forward`` (the series gives it to ``HybridModel`` only: ``GPTModel``
      takes no new features); ``plan_native_mtp_hook``:
      ``GPTModel.build_schedule_plan`` takes it (no version of the series does).
    - ``plan_final_norm_after_dense``: the plan's step for a dense layer's MLP
      applies the decoder's final norm after the last layer, as its MoE combine
      step does (the same series, as ``finalize_decoder_layer_output``, a port of
      ``dev``'s; no release does).
    """

    release: str
    package: str
    shadowed: bool
    native_hook: bool
    mtp_loss_in_block: bool
    mtp_loss_site: str
    mtp_labels_from_input_ids: bool
    mtp_mup_scaling: bool
    mtp_clamped_counts: bool
    mtp_logs_acceptance: bool
    process_groups: str
    roll_keywords: frozenset[str]
    reduce_keeps_noncontiguous_result: bool
    hybrid_model: bool
    hybrid_native_hook: bool
    schedule_plan: str
    plan_mtp_overwrites_ids: bool
    native_mtp_hook: bool
    plan_native_mtp_hook: bool
    plan_final_norm_after_dense: bool

    def workarounds(self) -> tuple[str, ...]:
        """The Megatron defects present here that the adapter works around, or
        refuses with a ``ContractError`` (the last column of the facts row)."""
        found: list[str] = []
        if not self.reduce_keeps_noncontiguous_result:
            found.append(
                "TP: `_reduce` leaves a non-contiguous gradient unreduced (adapter hands it a "
                "contiguous one)"
            )
        if not self.mtp_loss_in_block and not self.mtp_labels_from_input_ids:
            found.append("MTP with `labels=None` crashes (adapter derives them from `input_ids`)")
        if self.mtp_loss_in_block:
            found.append("MTP loss fixed inside the block (per-depth `mtp_processor` refused)")
        if self.hybrid_model and not self.hybrid_native_hook:
            found.append("`HybridModel` has no hook (adapter adds one)")
        if self.schedule_plan != "no" and self.plan_mtp_overwrites_ids:
            found.append(
                "MTP in the plan hands the hook rolled `input_ids` (adapter restores them)"
            )
        return tuple(found)


@functools.cache
def installed_megatron() -> InstalledMegatron:
    """The :class:`InstalledMegatron` of this process, read once."""
    from megatron.core.models.gpt import GPTModel

    release, package, shadowed = _distribution()
    forward = _mtp.MultiTokenPredictionBlock.forward
    in_block = "compute_language_model_loss" in inspect.signature(forward).parameters
    process = getattr(_mtp, "process_mtp_loss", None)
    process_params = inspect.signature(process).parameters if process is not None else {}
    if in_block:
        site, derives = "`MultiTokenPredictionBlock.forward` (labels required)", False
    elif process is not None:
        site, derives = "`process_mtp_loss`", "input_ids" in process_params
    elif "MTPLossAutoScaler" in inspect.getsource(GPTModel._postprocess):
        site, derives = "inline in `GPTModel._postprocess`", False
    else:
        site, derives = "not found", False
    init = inspect.signature(GPTModel.__init__).parameters
    groups = next((n for n in ("pg_collection", "model_comm_pgs") if n in init), "parallel_state")
    hybrid = importlib.util.find_spec("megatron.core.models.hybrid") is not None
    hybrid_hook = False
    if hybrid:
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        hybrid_hook = "output_processor" in inspect.signature(HybridModel.forward).parameters
    plan = _schedule_plan(GPTModel)
    build_plan = getattr(GPTModel, "build_schedule_plan", None)
    return InstalledMegatron(
        release=release,
        package=package,
        shadowed=shadowed,
        native_hook="output_processor" in inspect.signature(GPTModel.forward).parameters,
        mtp_loss_in_block=in_block,
        mtp_loss_site=site,
        mtp_labels_from_input_ids=derives,
        mtp_mup_scaling="scale_logits_fn" in process_params,
        mtp_clamped_counts=process is not None,
        mtp_logs_acceptance=hasattr(_mtp.MTPLossLoggingHelper, "save_metrics_to_tracker"),
        process_groups=groups,
        roll_keywords=frozenset(inspect.signature(_mtp.roll_tensor).parameters),
        reduce_keeps_noncontiguous_result=_reduce_keeps_noncontiguous_result(),
        hybrid_model=hybrid,
        hybrid_native_hook=hybrid_hook,
        schedule_plan=plan,
        plan_mtp_overwrites_ids=plan != "no" and _plan_mtp_overwrites_ids(),
        native_mtp_hook="mtp_output_processor" in process_params,
        plan_native_mtp_hook=build_plan is not None
        and "mtp_output_processor" in inspect.signature(build_plan).parameters,
        plan_final_norm_after_dense=plan != "no" and _plan_dense_step_applies_final_norm(),
    )


def _distribution() -> tuple[str, str, bool]:
    """The release of the ``megatron.core`` that imports (``__version__`` appends a
    git hash in some builds; the distribution metadata does not), its directory,
    and whether the metadata found first belongs to another copy."""
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or spec.origin is None:
        raise ImportError("megatron.core is not installed")
    package = os.path.dirname(os.path.realpath(spec.origin))
    dist = importlib.metadata.distribution("megatron-core")
    located = os.path.realpath(str(dist.locate_file("megatron/core")))
    return dist.version, package, located != package


def _schedule_plan(gpt_model: type) -> str:
    if not hasattr(gpt_model, "build_schedule_plan"):
        return "no"
    from megatron.core.pipeline_parallel.utils import ScheduleNode

    # 0.17+ resolve a stream getter on first use (`self.stream = self.stream()`).
    lazy = _assigns_call_of_itself(ScheduleNode, "stream")
    return "yes: a getter, called on first use" if lazy else "yes: a CUDA stream, taken when built"


def _assigns_call_of_itself(cls: type, attribute: str) -> bool:
    """Some method of ``cls`` runs ``self.<attribute> = self.<attribute>()``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Attribute)
            and node.targets[0].attr == attribute
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and node.value.func.attr == attribute
        ):
            return True
    return False


def _assigns_attribute(function: Any, owner: str, attribute: str) -> bool:
    """``function``'s body assigns ``<...>.{owner}.{attribute}``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr == attribute
                    and isinstance(target.value, ast.Attribute)
                    and target.value.attr == owner
                ):
                    return True
    return False


def _plan_mtp_overwrites_ids() -> bool:
    """The plan's MTP pre-dispatch writes rolled ids into ``chunk_state.input_ids``."""
    for name in (
        "megatron.core.models.common.fine_grained_callables",
        "megatron.core.models.gpt.fine_grained_callables",
    ):
        if importlib.util.find_spec(name) is None:
            continue
        module = importlib.import_module(name)
        for _, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ == name and _assigns_attribute(
                function, "chunk_state", "input_ids"
            ):
                return True
    return False


def _plan_dense_step_applies_final_norm() -> bool:
    """The plan's callable for a dense layer's MLP (the ``else`` branch of
    ``mlp_func = <MoE step> if is_moe else <dense step>`` in
    ``gpt.fine_grained_callables.build_transformer_layer_callables``), or a
    function it calls, nested there or defined in that module (the series'
    ``finalize_decoder_layer_output``), reads ``final_layernorm``. Read from
    the syntax tree; ``False`` where the structure is not found."""
    from megatron.core.models.gpt import fine_grained_callables

    build = getattr(fine_grained_callables, "build_transformer_layer_callables", None)
    if build is None:
        return False
    module = ast.parse(inspect.getsource(fine_grained_callables))
    tree = ast.parse(textwrap.dedent(inspect.getsource(build)))
    nested = {n.name: n for n in module.body if isinstance(n, ast.FunctionDef)}
    nested.update({n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)})
    dense = None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "mlp_func" for t in node.targets)
            and isinstance(node.value, ast.IfExp)
            and isinstance(node.value.orelse, ast.Name)
        ):
            dense = node.value.orelse.id
    seen: set[str] = set()

    def reads_norm(name: str) -> bool:
        if name in seen or name not in nested:
            return False
        seen.add(name)
        for node in ast.walk(nested[name]):
            if isinstance(node, ast.Attribute) and node.attr == "final_layernorm":
                return True
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and reads_norm(node.func.id)
            ):
                return True
        return False

    return dense is not None and reads_norm(dense)


def _reduce_keeps_noncontiguous_result() -> bool:
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
    name = installed_megatron().process_groups
    groups = getattr(model, name, None) if name != "parallel_state" else None
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


def roll_accepts() -> frozenset[str]:
    """The parameter names of the installed ``multi_token_prediction.roll_tensor``
    (``installed_megatron().roll_keywords``)."""
    return installed_megatron().roll_keywords


def mtp_loss_in_block() -> bool:
    """True where ``MultiTokenPredictionBlock.forward`` computes the MTP losses
    (it takes ``compute_language_model_loss`` and returns the main hidden states
    with the losses attached): the adapter then leaves them to the block
    (``installed_megatron().mtp_loss_in_block``)."""
    return installed_megatron().mtp_loss_in_block


def check_mtp_processor(mtp_processor: Any) -> None:
    """Refuse a per-depth ``mtp_processor`` where :func:`mtp_loss_in_block`: the
    block computes the MTP losses with the output layer it is handed, and a main
    processor still runs there (the block's stock MTP losses are kept)."""
    if mtp_processor is not None and mtp_loss_in_block():
        raise ContractError(
            "mtp_processor",
            expected="None on this Megatron Core",
            actual=getattr(
                mtp_processor,
                "name",
                getattr(mtp_processor, "__name__", type(mtp_processor).__name__),
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


def reduce_keeps_noncontiguous_result() -> bool:
    """Whether ``megatron.core.tensor_parallel.mappings._reduce`` all-reduces the
    tensor it returns (``installed_megatron().reduce_keeps_noncontiguous_result``)."""
    return installed_megatron().reduce_keeps_noncontiguous_result
