"""A pytest plugin for running the series' unit tests on Megatron-LM main on a CPU
(``scripts/upstream_check.sh --main``), needed only where patch 0006 is absent.

Main's ``MultiTokenPredictionLayer.__init__`` calls
``is_inference_column_parallel_linear(module)``, an ``isinstance`` check against
classes that derive from Transformer Engine's modules. Without Transformer Engine
those names are its import stand-ins (not classes), so the check raises
``TypeError`` and no MTP layer can be built (report 6 of docs/upstream.md). Patch
``0006-inference-linears-without-te.patch`` makes the function answer ``False``
there. Where the installed function still raises (main without 0006: the runs of
the patches before it, and the unpatched copy), this plugin answers ``False`` for
the length of each test, as the fixed function does. It changes nothing where
Transformer Engine is installed, where the function does not exist (0.19.2 and
older), or where it already answers without raising (0006 applied).
"""

from __future__ import annotations

from collections.abc import Iterator
from unittest import mock

import pytest


def _check_raises_without_te() -> bool:
    """``is_inference_column_parallel_linear`` exists here and raises ``TypeError``
    on a module that cannot be an inference linear."""
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_token_prediction

    check = getattr(multi_token_prediction, "is_inference_column_parallel_linear", None)
    if check is None or getattr(transformer_engine, "HAVE_TE", True):
        return False
    import torch

    try:
        check(torch.nn.Identity())
    except TypeError:
        return True
    return False


@pytest.fixture(autouse=True)
def _inference_linears_without_transformer_engine(request: pytest.FixtureRequest) -> Iterator[None]:
    # 0006's own tests see the function as it is: they must fail where the fix is absent.
    if (
        request.node.path.name == "test_inference_layers_without_te.py"
        or not _check_raises_without_te()
    ):
        yield
        return
    from megatron.core.transformer import multi_token_prediction

    with mock.patch.object(
        multi_token_prediction, "is_inference_column_parallel_linear", return_value=False
    ):
        yield
