"""Megatron Core (main after 0.19): without Transformer Engine, no multi-token
prediction layer builds: ``is_inference_column_parallel_linear`` raises ``TypeError``.

Runs on a CPU with torch and megatron-core only (on a Megatron-LM checkout, with its
folder first on ``PYTHONPATH``). ``MultiTokenPredictionLayer.__init__`` asks
``tensor_parallel.inference_layers.is_inference_column_parallel_linear`` of its
projection; the function is an ``isinstance`` against two classes that derive from
Transformer Engine's modules, which without Transformer Engine are its import
stand-ins, not classes. Prints one JSON line:

- ``defect``: the check raises ``TypeError`` for a plain module;
- ``function_present``: the release has the function (releases up to 0.19.2 do not,
  and show no defect);
- ``transformer_engine``: Transformer Engine imports here;
- ``check_error``: the exception the check raised, if any;
- ``mtp_model_builds``: a one-layer ``GPTModel`` with one MTP layer, Megatron's local
  modules, builds; ``mtp_build_error``: its exception otherwise.

See docs/upstream.md. Exit status 0 whether or not the defect shows.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import socket

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.transformer_config import TransformerConfig


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()

    try:
        module = importlib.import_module("megatron.core.tensor_parallel.inference_layers")
    except ImportError:
        module = None
    check = getattr(module, "is_inference_column_parallel_linear", None)
    report: dict[str, object] = {
        "megatron_core": importlib.metadata.version("megatron-core"),
        "defect": False,
        "function_present": check is not None,
        "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
        "check_error": None,
    }
    if check is not None:
        try:
            check(torch.nn.Linear(2, 2))
        except TypeError as error:
            report["defect"] = True
            report["check_error"] = describe(error)

    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=4,
        use_cpu_initialization=True,
        mtp_num_layers=1,
    )
    layer = get_gpt_layer_local_spec()
    try:
        GPTModel(
            config=config,
            transformer_layer_spec=layer,
            vocab_size=32,
            max_sequence_length=8,
            mtp_block_spec=get_gpt_mtp_block_spec(config, layer, use_transformer_engine=False),
        )
        report["mtp_model_builds"], report["mtp_build_error"] = True, None
    except Exception as error:  # the defect's consequence, reported, not raised
        report["mtp_model_builds"], report["mtp_build_error"] = False, describe(error)

    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
