"""What the MTP tests share: a tiny GPT with MTP layers, and a watch on the logits."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

from torch_impl.testing.tiny import TinyGPTShape, build_tiny_gpt, cpu_layer_spec, tiny_config

DEPTHS = 2


def build_mtp_gpt(
    depths: int = DEPTHS, *, seed: int = 1234, tied: bool = False, vocab: int = 64, **overrides: Any
) -> Any:
    """A tiny GPT with ``depths`` MTP layers of Megatron's local MTP spec."""
    shape = TinyGPTShape(vocab_size=vocab)
    config = tiny_config(shape, mtp_num_layers=depths, **overrides)
    spec = get_gpt_mtp_block_spec(config, cpu_layer_spec(), use_transformer_engine=False)
    return build_tiny_gpt(
        shape,
        seed=seed,
        mtp_block_spec=spec,
        mtp_num_layers=depths,
        share_embeddings_and_output_weights=tied,
        **overrides,
    )


class LogitWatch(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the most rows of any tensor produced whose last dim is the vocabulary
    (the weight's transpose ``[h, V]`` and its gradient aside)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.hidden, self.rows = vocab, hidden, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                if tuple(t.shape) == (self.hidden, self.vocab):
                    continue
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out
