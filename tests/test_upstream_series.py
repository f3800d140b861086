"""The patch series of ``upstream/``: its files and descriptions on every release, and,
where the installed Megatron Core carries it (``scripts/upstream_check.sh``), the
adapter handing Megatron's native hooks its calls.

On a stock release the detectors of ``torch_impl._compat`` read the series' hooks as
absent; on the patched copy as present, and the adapter then uses them:
``ForwardCall.mtp_hook`` once per MTP depth on ``HybridModel``, the native hook of
``HybridModel``, the native plan keyword and no added final norm. ``GPTModel`` gets no
MTP hook from the series (it takes no new features upstream): the adapter keeps
bridging its MTP processor, with the same result.
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
# The newest Megatron-LM main the series was checked on (series-main's "# snapshot:").
MAIN_SNAPSHOT = ("d98e8a64ddf34856e74b24714e3bedb2f5a39553", "2026-08-22")
# The upstream threads each description must name (with what the patch takes from them).
THREADS = ("#7008", "#4942", "#4943", "#5471", "#5271", "#7000", "#5911", "#4590")
# Patches of series-main only: the defect they fix is newer than 0.19.2.
MAIN_ONLY = ("0006-inference-linears-without-te.patch",)
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
    main = [Path(p).name for p in _series("series-main")]
    assert [name for name in main if name not in MAIN_ONLY] == [
        Path(p).name for p in _series("series")
    ]
    assert set(_series("series-0.18.2")) <= set(_series("series"))


def test_series_main_records_its_snapshot_and_date() -> None:
    recorded = re.findall(
        r"^# snapshot: (\S+) (\S+)$", (UPSTREAM / "series-main").read_text(), flags=re.M
    )
    assert recorded == [MAIN_SNAPSHOT]
    for doc in (UPSTREAM / "README.md", ROOT / "docs" / "upstream.md"):
        text = doc.read_text()
        assert MAIN_SNAPSHOT[0] in text and MAIN_SNAPSHOT[1] in text, doc.name


def _descriptions() -> list[tuple[str, str]]:
    names = dict.fromkeys(Path(p).name for name in SERIES for p in _series(name))
    return [(name, (UPSTREAM / name).with_suffix(".md").read_text()) for name in names]


def test_each_patch_has_a_pull_request_description() -> None:
    for name in SERIES:
        for patch in _series(name):
            text = (UPSTREAM / Path(patch).name).with_suffix(".md").read_text()
            for section in SECTIONS:
                assert section in text, (patch, section)
            tests = [path for path in _touched(UPSTREAM / patch) if path.startswith("tests/")]
            assert tests, patch
            for path in tests:  # the description names the patch's own tests
                assert Path(path).name in text, (patch, path)


def test_each_description_names_the_upstream_threads_and_its_failures() -> None:
    """Every thread named, with what the patch takes from it; and the tests that fail
    without the fix listed for scripts/upstream_check.sh to require."""
    for name, text in _descriptions():
        section = text.split("## Upstream threads", 1)[-1].split("\n## ", 1)[0]
        assert "## Upstream threads" in text, name
        for thread in THREADS:
            assert thread in section, (name, thread)
        failing = text.split("### Fails without the fix", 1)
        assert len(failing) == 2, name
        block = failing[1].split("```")[1]
        ids = [line for line in block.splitlines()[1:] if line.strip()]
        assert ids and all(line.startswith("tests/unit_tests/") and "::" in line for line in ids), (
            name
        )


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
    assert found == (True, False, True)  # no MTP keyword on GPTModel's plan
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
    """On ``HybridModel``, Megatron calls the adapter's ``mtp_hook`` once per depth; the
    processor sees the labels rolled ``k`` times; loss and gradients equal the stock
    model's bitwise."""
    from torch_impl.testing.tiny import tiny_batch
    from torch_impl.testing.tiny_hybrid import build_tiny_hybrid

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
    stock = build_tiny_hybrid("*-/-/-").eval()  # eval: MTP logging allocates on CUDA
    want = stock(batch["input_ids"], batch["position_ids"], None, **kw)
    want.sum().backward()
    model = enable_output_processor(build_tiny_hybrid("*-/-/-")).eval()
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
def test_gpt_mtp_processor_stays_the_adapters(monkeypatch: pytest.MonkeyPatch) -> None:
    """``GPTModel`` has no MTP hook in the series (no new features upstream): the adapter
    bridges its MTP processor itself, with the stock model's loss and gradients."""
    from torch_impl.testing.tiny import tiny_batch

    def refused(self: ForwardCall, **kwargs: Any) -> Any:
        raise AssertionError("GPTModel called a native MTP hook")

    monkeypatch.setattr(ForwardCall, "mtp_hook", refused)
    batch = tiny_batch()
    kw = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]}
    stock = _mtp_gpt()
    want = stock(batch["input_ids"], batch["position_ids"], None, **kw)
    want.sum().backward()
    model = enable_output_processor(_mtp_gpt())
    got = model(
        batch["input_ids"], batch["position_ids"], None, **kw, mtp_processor=default_mtp_loss
    )
    got.sum().backward()
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
    want = build_tiny_hybrid("*-*-/*-").eval()(
        batch["input_ids"], batch["position_ids"], None, **kw
    )
    model = enable_output_processor(build_tiny_hybrid("*-*-/*-")).eval()
    got = model(
        batch["input_ids"], batch["position_ids"], None, **kw, mtp_processor=default_mtp_loss
    )
    assert torch.equal(got, want)


@patched_only
@pytest.mark.usefixtures("megatron_single")
def test_schedule_plan_takes_megatrons_hooks() -> None:
    from torch_impl._plan_final_norm import missing_final_norm
    from torch_impl.schedule_plan import prepare_plan_hook
    from torch_impl.testing.tiny import build_tiny_gpt

    assert missing_final_norm(build_tiny_gpt()) is None  # the dense last layer's step normalises
    model = enable_output_processor(_mtp_gpt())
    native, hook = prepare_plan_hook(model, {})
    assert hook.stash is None  # nothing for the adapter's own _postprocess
    assert native["output_processor"].__class__ is ForwardCall
    # GPTModel's plan takes no MTP hook: the adapter's _postprocess runs the MTP processor
    native, hook = prepare_plan_hook(model, {}, mtp_processor=default_mtp_loss)
    assert native == {} and hook.stash is not None
