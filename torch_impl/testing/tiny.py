"""The tiny CPU GPT, for the tests: the names of :mod:`torch_impl.tiny`, its
supported home, re-exported so that test code keeps one import for its support."""

from __future__ import annotations

from torch_impl.tiny import (
    CPUCoreAttention,
    TinyGPTShape,
    build_tiny_gpt,
    cpu_layer_spec,
    free_port,
    megatron_parallel,
    tiny_batch,
    tiny_config,
)

__all__ = [
    "CPUCoreAttention",
    "TinyGPTShape",
    "build_tiny_gpt",
    "cpu_layer_spec",
    "free_port",
    "megatron_parallel",
    "tiny_batch",
    "tiny_config",
]
