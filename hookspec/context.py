"""The typed output context a processor receives."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .arrays import Array
from .collectives import Collectives, SingleProcessCollectives
from .conventions import IGNORE_INDEX

__all__ = [
    "OutputContext",
    "ParallelLayout",
    "VocabShard",
]


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
        from .validation import check_rank

        check_rank("parallel.tp", self.tp_rank, self.tp_size)
        check_rank("parallel.cp", self.cp_rank, self.cp_size)
        check_rank("parallel.pp", self.pp_rank, self.pp_size)


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
        from .validation import check_vocab_shard

        check_vocab_shard(self)

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
    global vocabulary.

    Attributes:
        hidden_states: ``[s, b, h]``, or ``[s/tp, b, h]`` under sequence
            parallel; after the final layernorm. Use
            ``collectives.gather_hidden_states`` before multiplying by the
            vocab shard.
        output_layer: the model's output layer (its ``weight`` may be absent
            with tied embeddings).
        output_weight: upstream's value: the tied embedding weight, else
            ``None``. Prefer ``vocab_weight``.
        labels: ``[b, s]`` global token ids, or ``None``.
        loss_mask: ``[b, s]``, or ``None``.
        context: the caller's ``output_processor_context``, untouched.
        compute_language_model_loss: Megatron's ``(labels [b, s], logits
            [s, b, V/tp]) -> loss [b, s]``.
        scale_logits: the model's logit scaling (MuP); the identity where the
            release has none.
        config: the model's ``TransformerConfig``.
        vocab_weight: ``[V/tp, h]``, always set: ``output_weight`` when the
            embeddings are tied, else the output layer's weight.
        padding_mask: ``[b, s]``, True at padding, or ``None``.
        parallel: the :class:`ParallelLayout` of this rank.
        vocab: the :class:`VocabShard` of this rank.
        mtp_depth: ``0`` for the main head, ``k`` for the MTP head predicting
            token ``t + k + 1`` (labels and mask already rolled for it).
        ignore_index: the label that selects no token.
        collectives: the :class:`Collectives` over the vocab-parallel group.
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

    @property
    def batch_size(self) -> int:
        """``b``: from the labels if present, else from the hidden states."""
        from .arrays import shape_of

        if self.labels is not None:
            return shape_of(self.labels)[0]
        return shape_of(self.hidden_states)[1]

    @property
    def seq_len(self) -> int:
        """``s``: the local sequence length after any sequence-parallel gather."""
        from .arrays import shape_of

        if self.labels is not None:
            return shape_of(self.labels)[1]
        factor = self.parallel.tp_size if self.parallel.sequence_parallel else 1
        return shape_of(self.hidden_states)[0] * factor

    def replace(self, **changes: Any) -> OutputContext:
        """A copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)
