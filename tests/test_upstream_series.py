"""The patch series of ``upstream/``: its files and descriptions on every release, and,
where the installed Megatron Core carries it (``scripts/upstream_check.sh``), the
adapter handing Megatron's native hooks its calls.

On a stock release the detectors of ``torch_impl._compat`` read the series' hooks as
absent; on the patched copy as present, and the adapter then uses them:
``ForwardCall.mtp_hook`` once per MTP depth, the native hook of ``HybridModel``, the
native plan keywords and no added final norm.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

import hookspec
from hookspec import OutputContext
from torch_impl import enable_output_processor
from torch_impl._call import ForwardCall
from torch_impl._compat import installed_megatron
from torch_impl.mtp import default_mtp_loss

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = ROOT / "upstream"
SERIES = ("series", "series-main", "series-0.18.2")
SECTIONS = ("## Problem", "## Design", "## What stays Megatron's", "## Compatibility", "## Tests")
FACTS = installed_megatron()
PATCHED = FACTS.native_mtp_hook


def _series(name: str) -> list[str]:
    lines = (UPSTREAM / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _touched(patch: Path) -> list[str]:
    return re.findall(r"^diff --git a/(\S+) b/\S+$", patch.read_text(), flags=re.M)


def test_every_series_lists_patches_that_exist_in_order() -> None:
    for name in SERIES:
        patches = _series(name)
        assert patches, name
        for patch in patches:
            assert (UPSTREAM / patch).is_file(), (name, patch)
        numbers = [Path(p).name[:4] for p in patches]
        assert numbers == sorted(numbers), name
    assert [Path(p).name for p in _series("series-main")] == [Path(p).name for p in _series("series")]
    assert set(_series("series-0.18.2")) <= set(_series("series"))


def test_each_patch_has_a_pull_request_description() -> None:
    for patch in _series("series"):
        description = (UPSTREAM / patch).with_suffix(".md")
        text = description.read_text()
        for section in SECTIONS:
            assert section in text, (description.name, section)
        tests = [path for path in _touched(UPSTREAM / patch) if path.startswith("tests/")]
        assert tests, patch
        for path in tests:  # the description names the patch's own tests
            assert Path(path).name in text, (description.name, path)


def test_patches_touch_only_megatron_core_and_its_unit_tests() -> None:
    for name in SERIES:
        for patch in _series(name):
            for path in _touched(UPSTREAM / patch):
                assert path.startswith(("megatron/core/", "tests/unit_tests/")), (patch, path)


def test_the_docs_name_every_patch() -> None:
    doc = (ROOT / "docs" / "upstream.md").read_text()
    for patch in _series("series"):
        assert f"upstream/{patch}" in doc, patch
    assert "upstream/" in (ROOT / "README.md").read_text()


def test_the_detectors_read_the_installed_code() -> None:
    """Stock release: none of the series' hooks. Patched copy: all of them, and the
    adapter's workarounds for the gaps they close are gone."""
    found = (FACTS.native_mtp_hook, FACTS.plan_native_mtp_hook, FACTS.plan_final_norm_after_dense)
    if not PATCHED:
        assert found == (False, False, False)
        return
    assert found == (True, True, True)
    assert FACTS.hybrid_native_hook and not FACTS.plan_mtp_overwrites_ids
    assert FACTS.workarounds() == ()


patched_only = pytest.mark.skipif(not PATCHED, reason="Megatron Core without the upstream/ series")


def _mtp_gpt(depths: int = 2) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from torch_impl.testing.tiny import TinyGPTShape, build_tiny_gpt, cpu_layer_spec, tiny_config

    shape = TinyGPTShape()
    spec = get_gpt_mtp_block_spec(
        tiny_config(shape, mtp_num_layers=depths), cpu_layer_spec(), use_transformer_engine=False
    )
    return build_tiny_gpt(shape, mtp_block_spec=spec, mtp_num_layers=depths).eval()


@patched_only
@pytest.mark.usefixtures("megatron_single")
def test_mtp_processor_through_megatrons_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron calls the adapter's ``mtp_hook`` once per depth; the processor sees the
    labels rolled ``k`` times; loss and gradients equal the stock model's bitwise."""
    from torch_impl.testing.tiny import tiny_batch

    depths_called: list[int] = []
    own = ForwardCall.mtp_hook

    def counting(self: ForwardCall, *, mtp_depth: int, **kwargs: Any) -> Any:
        depths_called.append(mtp_depth)
        return own(self, mtp_depth=mtp_depth, **kwargs)

    monkeypatch.setattr(ForwardCall, "mtp_hook", counting)
    seen: list[OutputContext] = []

    @hookspec.processor
    def recording(ctx: OutputContext) -> Any:
        seen.append(ctx)
        return default_mtp_loss(ctx)

    batch = tiny_batch()
    kw = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]}
    stock = _mtp_gpt()
    want = stock(batch["input_ids"], batch["position_ids"], None, **kw)
    want.sum().backward()
    model = enable_output_processor(_mtp_gpt())
    got = model(batch["input_ids"], batch["position_ids"], None, **kw, mtp_processor=recording)
    got.sum().backward()
    assert depths_called == [1, 2] and [c.mtp_depth for c in seen] == [1, 2]
    for k, ctx in enumerate(seen, start=1):
        labels = torch.zeros_like(batch["labels"])
        labels[:, :-k] = batch["labels"][:, k:]
        assert torch.equal(ctx.labels, labels)
    assert torch.equal(got, want)
    for (name, p), q in zip(model.named_parameters(), stock.parameters()):
        assert torch.equal(p.grad, q.grad), name


@patched_only
@pytest.mark.usefixtures("megatron_single")
def test_hybrid_model_through_megatrons_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_impl.hybrid import HybridOutputHookAdapter
    from torch_impl.testing.tiny import tiny_batch
    from torch_impl.testing.tiny_hybrid import build_tiny_hybrid

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the adapter ran HybridModel.forward as an inner stage")

    monkeypatch.setattr(HybridOutputHookAdapter, "_hookspec_run", refused)
    batch = tiny_batch()
    kw = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]}
    want = build_tiny_hybrid("*-*-/*-").eval()(batch["input_ids"], batch["position_ids"], None, **kw)
    model = enable_output_processor(build_tiny_hybrid("*-*-/*-")).eval()
    got = model(batch["input_ids"], batch["position_ids"], None, **kw, mtp_processor=default_mtp_loss)
    assert torch.equal(got, want)


@patched_only
@pytest.mark.usefixtures("megatron_single")
def test_schedule_plan_takes_megatrons_hooks() -> None:
    from torch_impl._plan_final_norm import missing_final_norm
    from torch_impl.schedule_plan import prepare_plan_hook
    from torch_impl.testing.tiny import build_tiny_gpt

    assert missing_final_norm(build_tiny_gpt()) is None  # the dense last layer's step normalises
    model = enable_output_processor(_mtp_gpt())
    native, hook = prepare_plan_hook(model, {}, mtp_processor=default_mtp_loss)
    assert hook.stash is None  # nothing for the adapter's own _postprocess
    assert native["output_processor"] is None
    assert native["mtp_output_processor"].__func__ is ForwardCall.mtp_hook
