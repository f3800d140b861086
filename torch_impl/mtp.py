"""Multi-token prediction under the output hook (see docs/mtp.md)."""

from __future__ import annotations

from typing import Any

import torch

from hookspec import ContractError

__all__ = ["attach_mtp_losses"]


def attach_mtp_losses(model: Any, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Compute the MTP losses and attach them to the main hidden states."""
    raise ContractError(
        "model.config.mtp_num_layers",
        expected="None on a Megatron Core without the native hook",
        actual=model.config.mtp_num_layers,
        hint="MTP with an output processor on this release is not supported yet",
    )
