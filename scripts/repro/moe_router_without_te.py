"""Megatron Core 0.16: without Transformer Engine, every MoE router call raises
``NameError: name 'te_general_gemm' is not defined``.

``transformer/moe/moe_utils.py`` imports ``te_general_gemm`` inside a ``try``
whose ``except ImportError`` sets only ``HAVE_TE = False``; the router's gating
GEMM (``RouterGatingLinearFunction``, reached from ``TopKRouter.gating``
through ``router_gating_linear``) then tests ``te_general_gemm is not None``.
Runs on a CPU with torch and megatron-core only, on the function the router
calls. Prints one JSON line:

- ``defect``: ``router_gating_linear`` raised the ``NameError``;
- ``transformer_engine``: whether Transformer Engine imports here (with it the
  name is defined and the defect cannot show);
- ``matches_matmul``: where it ran, whether the logits equal ``inp @ weight.T``.

See docs/upstream.md. Exit status 0 whether or not the defect shows.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import torch
from megatron.core.transformer.moe.moe_utils import router_gating_linear


def main() -> None:
    g = torch.Generator().manual_seed(0)
    inp = torch.randn(6, 8, generator=g)
    weight = torch.randn(4, 8, generator=g)
    report: dict[str, object] = {
        "megatron_core": importlib.metadata.version("megatron-core"),
        "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
    }
    try:
        logits = router_gating_linear(inp, weight, None, torch.float32)
    except NameError as err:
        report.update(defect="te_general_gemm" in str(err), error=str(err))
    else:
        report.update(defect=False, matches_matmul=bool(torch.equal(logits, inp @ weight.t())))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
