"""A pytest plugin for running the series' unit tests on Megatron-LM main on a CPU
(``scripts/upstream_check.sh --main``), where Transformer Engine is absent.

Main's ``MultiTokenPredictionLayer.__init__`` calls
``is_inference_column_parallel_linear(module)``, an ``isinstance`` check against
classes that derive from Transformer Engine's modules. Without Transformer Engine
those names are its import stand-ins (not classes), so the check raises
``TypeError`` and no MTP layer can be built. Here the check answers ``False``, as
it does for every module when Transformer Engine is absent (no module can be an
instance of the inference linears), for the length of each test. Nothing changes
where Transformer Engine is installed or the function does not exist.
"""

from __future__ import annotations

from collections.abc import Iterator
from unittest import mock

import pytest


@pytest.fixture(autouse=True)
def _inference_linears_without_transformer_engine() -> Iterator[None]:
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_token_prediction

    name = "is_inference_column_parallel_linear"
    if getattr(transformer_engine, "HAVE_TE", True) or not hasattr(multi_token_prediction, name):
        yield
        return
    with mock.patch.object(multi_token_prediction, name, return_value=False):
        yield
