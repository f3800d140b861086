"""A pytest plugin for the run against Megatron Core with the patch series of ``upstream/``
(``scripts/upstream_check.sh`` loads it with ``-p tests.support.stand_aside``).

There Megatron has every hook the adapter bridges (the output hook on ``HybridModel``,
the per-depth MTP hook on ``HybridModel``, the plan's final norm after a dense last
layer), and the adapter must stand aside: each test fails if it entered one of the
adapter's own paths, unless it is listed in :data:`OWN_PATH_EXPECTED` with the reason.
One path stays the adapter's by design: ``GPTModel`` is deprecated upstream ("only
accepting critical bug fixes, no new features"), so the series gives it no MTP hook and
the adapter keeps bridging its MTP processor; a post-processing entered for a
``GPTModel``, and the MTP loss loop inside it, are not counted. The paths, counted by
wrapping the module attributes the adapter calls them through:

- ``finish_postprocess`` (``torch_impl._adapter`` and ``torch_impl.hybrid``): the
  adapter's own post-processing after Megatron's ``_postprocess`` or ``forward`` ran
  as an inner stage;
- ``attach_mtp_losses`` (``torch_impl._postprocess``): the adapter's MTP loss loop;
- ``_normed`` (``torch_impl._plan_final_norm``): the final norm the adapter adds to a plan.

Outside that run (Megatron without the series) the plugin is not loaded.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# test node id (without parameters) -> why the adapter's own path runs there
OWN_PATH_EXPECTED: dict[str, str] = {
    "tests/hook/test_mtp.py::test_rolled_per_token_normalization_on_every_release": (
        "MTPOptions(per_token_normalization='rolled') keeps the adapter's MTP loop"
    ),
    "tests/hook/test_mtp_tp.py::test_mtp_rolls_over_the_micro_batch_cp_group": (
        "MTPOptions(cp_group_from_packed=True): Megatron rolls over the model's CP group only"
    ),
}

_WATCHED = (
    ("torch_impl._adapter", "finish_postprocess"),
    ("torch_impl.hybrid", "finish_postprocess"),
    ("torch_impl._postprocess", "attach_mtp_losses"),
    ("torch_impl._plan_final_norm", "_normed"),
)


def _counting(
    counts: collections.Counter[str], name: str, fn: Callable[..., Any], bridged: list[bool]
) -> Callable[..., Any]:
    """``fn``, counting its calls under ``name``; a ``finish_postprocess`` for a
    ``GPTModel`` (whose MTP the adapter keeps bridging) and whatever runs inside it
    are not counted."""
    from megatron.core.models.gpt import GPTModel

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        gpt = name.endswith(".finish_postprocess") and bool(args) and isinstance(args[0], GPTModel)
        if not (gpt or bridged):
            counts[name] += 1
        if gpt:
            bridged.append(True)
        try:
            return fn(*args, **kwargs)
        finally:
            if gpt:
                bridged.pop()

    return wrapper


@pytest.fixture(autouse=True)
def adapter_stands_aside(request: pytest.FixtureRequest) -> Iterator[collections.Counter[str]]:
    """Counts the adapter's own paths during the test; fails the test if any ran
    and the test is not in :data:`OWN_PATH_EXPECTED`."""
    import importlib

    from torch_impl._compat import installed_megatron

    facts = installed_megatron()
    if not (
        facts.native_mtp_hook and facts.hybrid_native_hook and facts.plan_final_norm_after_dense
    ):
        raise pytest.UsageError(
            "tests.support.stand_aside is for Megatron Core with the upstream/ patch series; "
            f"{facts.package} lacks it"
        )
    counts: collections.Counter[str] = collections.Counter()
    bridged: list[bool] = []
    with pytest.MonkeyPatch.context() as patch:
        for module_name, attribute in _WATCHED:
            module = importlib.import_module(module_name)
            name = f"{module_name}.{attribute}"
            patch.setattr(
                module, attribute, _counting(counts, name, getattr(module, attribute), bridged)
            )
        yield counts
    test = request.node.nodeid.split("[")[0]
    if counts and test not in OWN_PATH_EXPECTED:
        pytest.fail(f"the adapter's own path ran where Megatron has the hook: {dict(counts)}")
