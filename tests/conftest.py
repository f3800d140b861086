from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

HAS_TORCH = (
    importlib.util.find_spec("torch") is not None
    and importlib.util.find_spec("megatron") is not None
)

# One intra-op thread per process unless asked otherwise, set before torch loads: the tests'
# tensors are tiny, and on a small CPU the spinning threads of two processes (pytest-xdist
# workers, gloo ranks, which inherit it) cost more than they give (docs/testing.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Triton decides interpreted or compiled when it is first imported, and any test module
# (or Megatron, or a benchmark) may import it during collection: without a GPU, its
# interpreter is switched on here, before any of them.
if importlib.util.find_spec("torch") is not None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=["torch", "triton"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each of the processors' backends in turn, through ``backend="auto"`` (a module's
    own ``backend`` fixture or parameter takes precedence)."""
    from tests.support.backend_support import force_backend

    return force_backend(monkeypatch, request.param)


@pytest.fixture
def megatron_single() -> Iterator[None]:
    """torch.distributed (gloo, world size 1) and Megatron's groups, torn down after."""
    from torch_impl.testing.tiny import megatron_parallel

    with megatron_parallel():
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_first(items)
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def slow_first(items: list[pytest.Item]) -> None:
    """The files that hold a test marked ``slow`` first, each file's tests in their order:
    pytest-xdist's ``loadfile`` hands out files in collection order, so a slow file left
    for last keeps one worker busy while the other has nothing to do."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
