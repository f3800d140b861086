"""The design page's model (``benchmarks/gpu_model.py``, ``docs/gpu-design.md``): the
page's tables are what the model prints from the code's tile sizes, the chosen designs
meet the targets on paper, and the model follows the code when a size changes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import gpu_model
from torch_impl import processors

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "gpu-design.md"
VERL_TRITON_PEAK = 2.8e9  # bytes: veRL's Triton kernel, logprobs + entropy, H200 (docs/gpu-results.md)


def test_the_page_shows_what_the_model_computes() -> None:
    page = PAGE.read_text()
    block = re.search(r"<!-- gpu-model:tables -->\n(.*?)\n<!-- gpu-model:tables end -->", page, re.S)
    assert block is not None
    assert block.group(1) == gpu_model.markdown(), "regenerate: python -m benchmarks.gpu_model --markdown"


@pytest.mark.parametrize("design", ["logprobs_entropy", "fused_single_pass"])
def test_the_chosen_designs_meet_the_targets_on_paper(design: str) -> None:
    p = gpu_model.predict(design)
    for dev in gpu_model.DEVICES:
        assert p.ratio(dev) <= 1.1, (design, dev.name, p.ratio(dev))
    assert p.peak_extra_bytes <= VERL_TRITON_PEAK, p.peak_extra_bytes


def test_the_earlier_design_misses_them() -> None:
    """The model tells designs apart: the previous fused loss is over 1.1x on an H100
    and over the memory budget."""
    before = gpu_model.predict("fused_before")
    assert before.ratio(gpu_model.DEVICES[0]) > 1.1
    assert before.peak_extra_bytes > VERL_TRITON_PEAK


@pytest.mark.parametrize("design", list(gpu_model.DESIGNS))
def test_every_design_does_its_gemms_once(design: str) -> None:
    """The GEMM flops add up to the design's floor exactly (each product once)."""
    p = gpu_model.predict(design)
    w = gpu_model.WORKLOAD
    flops = sum(q.count * q.flops for q in p.passes)
    assert flops == pytest.approx(p.floor_gemms * 2 * w.n * w.h * w.v, rel=1e-12)


def test_the_model_follows_the_codes_tile_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Halving ``TILE_BYTES`` doubles the row sweep's logits GEMMs (each reads all of W)
    and shrinks the tile buffer in the predicted peak."""
    before = gpu_model.predict("fused_single_pass")
    monkeypatch.setitem(processors.TILE_BYTES, "cuda", processors.TILE_BYTES["cuda"] // 2)
    after = gpu_model.predict("fused_single_pass")
    count = {p: sum(q.count for q in p.passes if q.name == "logits") for p in (before, after)}
    assert count[after] > count[before]
    assert after.peak_extra_bytes < before.peak_extra_bytes


def test_predicted_ms_names_the_measured_passes() -> None:
    from benchmarks.gpu_measure import __doc__ as measure_doc

    assert measure_doc is not None
    for cls in gpu_model.DEVICE_CLASSES:
        got = gpu_model.predicted_ms(cls)
        for name in got:
            assert f'"{name}"' in " ".join(measure_doc.split()), name
        assert got["floor3"] == pytest.approx(3 * 2 * 8192 * 4096 * 151936 / 800e12 * 1e3)
    assert gpu_model.predicted_ms("A100") == {}
