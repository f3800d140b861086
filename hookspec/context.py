"""The typed output context a processor receives."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any

from .arrays import Array, shape_of
from .collectives import Collectives, SingleProcessCollectives, checked_collectives
from .conventions import IGNORE_INDEX
from .errors import ContractError

__all__ = [
    "OutputContext",
    "ParallelLayout",
    "VocabShard",
]


def _is_int(value: object) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _shown(value: object) -> str:
    return (
        repr(value)
        if isinstance(value, (str, int, float)) or value is None
        else type(value).__name__
    )


def _check_rank(field: str, rank: int, size: int) -> None:
    if not (_is_int(size) and size >= 1):
        raise ContractError(f"{field}_size", expected="an int >= 1", actual=_shown(size))
    if not (_is_int(rank) and 0 <= rank < size):
        raise ContractError(f"{field}_rank", expected=f"an int in [0, {size})", actual=_shown(rank))


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Sizes and ranks of the parallel groups this rank belongs to.

    ``tp``: tensor parallel, which also shards the vocabulary; ``cp``: context
    parallel (each rank holds ``s/cp`` of every sequence); ``pp``: pipeline
    parallel (processors run on the last stage only). ``sequence_parallel``:
    hidden states arrive split along the sequence, ``[s/tp, b, h]``.
    """

    tp_size: int = 1
    tp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        _check_rank("parallel.tp", self.tp_rank, self.tp_size)
        _check_rank("parallel.cp", self.cp_rank, self.cp_size)
        _check_rank("parallel.pp", self.pp_rank, self.pp_size)
        if not isinstance(self.sequence_parallel, bool):
            raise ContractError(
                "parallel.sequence_parallel",
                expected="a bool",
                actual=_shown(self.sequence_parallel),
            )
        for name in ("tp_size", "tp_rank", "cp_size", "cp_rank", "pp_size", "pp_rank"):
            object.__setattr__(self, name, int(getattr(self, name)))  # a NumPy int becomes an int


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """This rank's slice ``[start, end)`` of a vocabulary of ``size`` ids.

    The local output weight has ``end - start`` rows; token id ``y`` lives on
    this rank when ``start <= y < end``, at local row ``y - start``.
    """

    start: int
    end: int
    size: int

    def __post_init__(self) -> None:
        for name in ("start", "end", "size"):
            value = getattr(self, name)
            if not _is_int(value):
                raise ContractError(f"vocab.{name}", expected="an int", actual=_shown(value))
            object.__setattr__(self, name, int(value))
        if not (0 <= self.start < self.end <= self.size):
            raise ContractError(
                "vocab",
                expected="0 <= start < end <= size",
                actual=f"start={self.start}, end={self.end}, size={self.size}",
            )

    @property
    def local_size(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class OutputContext:
    """Everything Megatron's output hook passes, typed, plus what processors need.

    The first sixteen fields carry the upstream hook's keywords under their
    upstream names (``hookspec.UPSTREAM_HOOK_KEYWORDS``); shapes use ``s`` for
    the local sequence (``s/cp`` of each sequence under context parallel, the
    packed token count for THD input), ``b`` batch, ``h`` hidden, ``V`` the
    global vocabulary, ``V_local = vocab.end - vocab.start`` this rank's rows
    of it (``V / tp`` under tensor parallel).

    Which fields may be ``None``, and when: through an enabled model,
    ``labels``, ``loss_mask``, ``context``, ``position_ids``, ``attention_mask``,
    ``padding_mask``, ``decoder_input``, ``inference_context``,
    ``packed_seq_params`` and ``runtime_gather_output`` are ``None`` wherever the
    forward got none (Megatron's forward takes each as optional: a plain
    ``model(input_ids, position_ids, attention_mask, labels=labels,
    output_processor=...)`` passes no ``loss_mask`` and no user ``context``);
    ``input_ids`` on a pipeline stage that did not receive them;
    ``output_weight`` unless the embeddings are tied. ``output_layer``,
    ``compute_language_model_loss``, ``scale_logits``, ``config``,
    ``vocab_weight`` and ``vocab`` are set by an enabled model and ``None`` only
    in a context built by hand. A processor handles ``None`` in each field it
    reads, or refuses it with a :class:`~hookspec.ContractError` naming the
    field, as the built-in processors do (a ``None`` ``loss_mask``: every token
    counts; a user ``context`` of another type than the one read: refused).

    Attributes:
        hidden_states: ``[s, b, h]``, or ``[s/tp, b, h]`` under sequence
            parallel; after the final layernorm (and, for ``mtp_depth = k``,
            after MTP layer ``k``). Use ``collectives.gather_hidden_states``
            before multiplying by the vocab shard.
        output_layer: the model's output layer, a ``ColumnParallelLinear``
            called as ``output_layer(h, weight=..., runtime_gather_output=...)
            -> (logits [s, b, V_local], bias)``; its ``weight`` is absent with
            tied embeddings. ``None`` only in a context built by hand.
        output_weight: upstream's value: the tied embedding weight
            ``[V_local, h]`` when the embeddings are tied, else ``None``. Prefer
            ``vocab_weight``, which is always the weight in use.
        labels: ``[b, s]`` global token ids, or ``None`` where the forward
            got no ``labels=`` (RL rollouts and inference: the processor
            derives what it needs from ``input_ids``, or refuses).
        loss_mask: ``[b, s]``, 1 where a token counts, or ``None`` where the
            forward got no ``loss_mask=`` (the usual plain call; a schedule
            recipe may carry its mask in the user context): then every token
            counts but those labelled ``ignore_index``.
        input_ids: ``[b, s]`` the token ids the model was given, or ``None``
            on a pipeline stage that did not receive them.
        position_ids: ``[b, s]``, or ``None`` where the forward got none.
        attention_mask: Megatron's mask as the model received it (``[b, 1, s,
            s]`` bool, True masks out), or ``None`` for causal kernels.
        decoder_input: the embedded input ``[s, b, h]`` when the caller passed
            one instead of ``input_ids``, else ``None``.
        inference_context: Megatron's inference context (KV cache and its
            batching state), ``None`` in training.
        packed_seq_params: Megatron's ``PackedSeqParams`` for packed (THD)
            sequences (``cu_seqlens_q`` and friends), else ``None``.
        runtime_gather_output: the caller's request to all-gather the logits
            over tensor parallel (``None``: the output layer's own setting).
        context: the caller's ``output_processor_context``, untouched;
            ``None`` where the caller passed none. A processor that reads one
            checks its type and raises ``ContractError("context", ...)``
            otherwise, as ``policy_loss`` (a ``PolicyBatch``) and
            ``distillation_loss`` (a teacher) do.
        compute_language_model_loss: Megatron's ``(labels [b, s], logits
            [s, b, V_local]) -> loss [b, s]`` (vocab-parallel cross entropy).
            ``None`` only in a context built by hand.
        scale_logits: the model's logit scaling, ``logits -> logits``,
            elementwise: ``logits * config.mup_output_mult`` where the model
            uses MuP (``config.use_mup``), else the identity (also where the
            release has none). A processor that forms logits from
            ``vocab_weight`` applies it to them, before any temperature, as
            the stock head does before its loss; otherwise its logits differ
            from the model's under MuP. (The built-in processors apply the
            same factor as ``logit_scale``.) ``None`` only in a context
            built by hand (no scaling).
        config: the model's ``TransformerConfig``; ``None`` only in a context
            built by hand.
        vocab_weight: ``[V_local, h]``, this rank's rows of the vocabulary
            (row ``r`` is token ``vocab.start + r``): ``output_weight`` when
            the embeddings are tied, else the output layer's weight. An enabled model always
            sets it; ``None`` only in a context built by hand without a
            weight, and a processor that multiplies by it must then refuse.
        padding_mask: ``[b, s]``, True at padding, or ``None`` where the
            forward got none.
        parallel: the :class:`ParallelLayout` of this rank.
        vocab: the :class:`VocabShard` of this rank. An enabled model always
            sets it; ``None`` only in a context built by hand without a vocab
            range, where the label range is not checked and the whole
            ``vocab_weight`` is taken as the vocabulary (one rank).
        mtp_depth: ``0`` for the main head, ``k`` for the MTP head predicting
            token ``t + k + 1`` (labels and mask already rolled for it).
        ignore_index: the label that selects no token.
        collectives: the :class:`Collectives` over the vocab-parallel group
            (and its sum over the context-parallel group, spec 1.2), held
            checked: a custom implementation is wrapped by
            :func:`~hookspec.collectives.checked_collectives`, so each result's
            type, shape and dtype are checked where it returns (the object
            given is ``collectives.inner``; ``SingleProcessCollectives`` and
            ``torch_impl.TorchCollectives`` are held as given).
        check_values: whether a processor checks the values it reads (a
            per-token temperature's sign, the label range unless
            ``labels_checked``). ``False`` only where the model was enabled
            with ``check_values=False``: then no value is checked anywhere,
            no extra work. (Added in spec 1.1.)
        labels_checked: ``True`` where whoever built the context has checked
            the labels' range (the hook does, once per call, when
            ``check_values``); a processor then does not read them again.
            ``False`` in a context built by hand, so that a processor called
            directly checks them. (Added in spec 1.1.)
    """

    hidden_states: Array
    output_layer: Any = None
    output_weight: Array | None = None
    labels: Array | None = None
    loss_mask: Array | None = None
    input_ids: Array | None = None
    position_ids: Array | None = None
    attention_mask: Array | None = None
    decoder_input: Array | None = None
    inference_context: Any = None
    packed_seq_params: Any = None
    runtime_gather_output: bool | None = None
    context: Any = None
    compute_language_model_loss: Callable[..., Any] | None = None
    scale_logits: Callable[[Any], Any] | None = None
    config: Any = None
    # ---- what the upstream hook omits ----
    vocab_weight: Array | None = None
    padding_mask: Array | None = None
    parallel: ParallelLayout = dataclasses.field(default_factory=ParallelLayout)
    vocab: VocabShard | None = None
    mtp_depth: int = 0
    ignore_index: int = IGNORE_INDEX
    collectives: Collectives = dataclasses.field(default_factory=SingleProcessCollectives)
    check_values: bool = True
    labels_checked: bool = False

    def __post_init__(self) -> None:
        layout = self.parallel
        if isinstance(layout, ParallelLayout):  # else validate_context names it
            checked = checked_collectives(
                self.collectives, tp_size=layout.tp_size, sequence_parallel=layout.sequence_parallel
            )
            object.__setattr__(self, "collectives", checked)

    @property
    def batch_size(self) -> int:
        """``b``: from the labels if present, else from the hidden states."""
        if self.labels is not None:
            return shape_of(self.labels)[0]
        return shape_of(self.hidden_states)[1]

    @property
    def seq_len(self) -> int:
        """``s``: the local sequence length after any sequence-parallel gather."""
        if self.labels is not None:
            return shape_of(self.labels)[1]
        factor = self.parallel.tp_size if self.parallel.sequence_parallel else 1
        return shape_of(self.hidden_states)[0] * factor

    def replace(self, **changes: Any) -> OutputContext:
        """A copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)
