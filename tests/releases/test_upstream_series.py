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
import tomllib
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

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = ROOT / "upstream"
SERIES = ("series", "series-main", "series-0.18.2", "series-dev")
# The newest Megatron-LM main and dev the series was checked on ("# snapshot:").
SNAPSHOTS = {
    "series-main": ("d98e8a64ddf34856e74b24714e3bedb2f5a39553", "2026-08-22"),
    "series-dev": ("d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1", "2026-08-21"),
}
# Patches of series-main only: the defect they fix is newer than 0.19.2.
MAIN_ONLY = ("0006-inference-linears-without-te.patch",)
# The line each patch's message and description link the upstream threads with.
LINKS = {
    "0006": "Fixes #ISSUE_B",
    "0002": "Fixes #ISSUE_A",
    "0004": "#5471",
    "0005": "Fixes #1450",
    "0001": "Refs #7008",
    "0003": "Closes #ISSUE_C",
}
# Megatron's pull-request template, and what the description adds to it.
SECTIONS = (
    "# What does this PR do?",
    "## Issue tracking",
    "## Problem",
    "## Change",
    "## Tests",
    "How they were run:",
    "### Pre-checks",
)
# Words that point outside Megatron: the descriptions and messages stand alone.
OUTSIDE = (
    "upstream/",
    "scripts/",
    "report ",
    "hookspec",
    "this project",
    "adapter",
    "Pull-request",
)
IMPERATIVE = ("Add", "Apply", "Keep", "Post", "Return")
PLACEHOLDER_AUTHOR = "From: Submitter <submitter@example.invalid>"
FACTS = installed_megatron()
PATCHED = FACTS.native_mtp_hook


def _series(name: str) -> list[str]:
    lines = (UPSTREAM / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _names(name: str) -> list[str]:
    return [Path(p).name for p in _series(name)]


def _touched(patch: Path) -> list[str]:
    return re.findall(r"^diff --git a/(\S+) b/\S+$", patch.read_text(), flags=re.M)


def _message(patch: Path) -> str:
    """The commit message: the subject (unfolded) and the body, up to the diffstat."""
    head = patch.read_text().split("\n---\n", 1)[0]
    subject, body = head.split("Subject: ", 1)[1].split("\n\n", 1)
    return subject.replace("\n ", " ") + "\n\n" + body


def _all_patches() -> list[Path]:
    return sorted({UPSTREAM / p for name in SERIES for p in _series(name)})


def test_every_series_lists_patches_that_exist() -> None:
    for name in SERIES:
        assert _series(name), name
        for patch in _series(name):
            assert (UPSTREAM / patch).is_file(), (name, patch)
    main = _names("series-main")
    assert [p for p in main if p not in MAIN_ONLY] == _names("series")
    assert set(_series("series-0.18.2")) <= set(_series("series"))
    assert set(_names("series-dev")) <= set(main)


def test_the_submission_order_is_the_readme_s() -> None:
    """series-main is the order the patches are filed in, the one upstream/README.md
    gives: 0006, 0002 (with its dev counterpart), 0004, 0005, 0001 (into #7008), 0003."""
    readme = (UPSTREAM / "README.md").read_text().split("## Submission order", 1)[1]
    table = readme.split("\n## ", 1)[0]
    order = re.findall(r"^\| \d \| \[(\d{4})\]", table, flags=re.M)
    assert order == ["0006", "0002", "0004", "0005", "0001", "0003"]
    assert [p[:4] for p in _names("series-main")] == order


def test_the_checkout_series_record_their_snapshot_and_date() -> None:
    for name, snapshot in SNAPSHOTS.items():
        recorded = re.findall(
            r"^# snapshot: (\S+) (\S+)$", (UPSTREAM / name).read_text(), flags=re.M
        )
        assert recorded == [snapshot], name
        for doc in (UPSTREAM / "README.md", ROOT / "docs" / "upstream.md"):
            text = doc.read_text()
            assert snapshot[0] in text and snapshot[1] in text, (doc.name, name)


def test_each_commit_is_one_signed_off_by_its_submitter() -> None:
    """One commit per patch, the placeholder author that --reset-author replaces, no
    sign-off (the submitter's git am --signoff adds theirs), an imperative subject, no
    pointer outside Megatron."""
    for patch in _all_patches():
        text = patch.read_text()
        assert text.count("\nSubject: [PATCH] ") == 1, patch.name
        assert PLACEHOLDER_AUTHOR in text.splitlines()[:3], patch.name
        message = _message(patch)
        assert "Signed-off-by" not in message, patch.name
        subject = message.split("\n", 1)[0].removeprefix("[PATCH] ").removeprefix("[dev] ")
        assert subject.split()[0] in IMPERATIVE and len(subject) <= 72, subject
        for word in OUTSIDE:
            assert word not in message, (patch.name, word)
        assert LINKS[patch.name[:4]] in message, patch.name


def test_each_patch_has_a_description_that_stands_alone() -> None:
    for name in _names("series-main"):
        text = (UPSTREAM / name).with_suffix(".md").read_text()
        for section in SECTIONS:
            assert section in text, (name, section)
        for word in OUTSIDE:
            assert word not in text, (name, word)
        assert LINKS[name[:4]] in text, name
        tests = [p for p in _touched(UPSTREAM / name) if p.startswith("tests/")]
        assert tests, name
        for path in tests:  # the description names the patch's own tests
            assert Path(path).name in text, (name, path)


def test_every_issue_placeholder_has_its_draft() -> None:
    doc = (ROOT / "docs" / "upstream.md").read_text()
    used = set()
    for patch in _all_patches():
        used |= set(re.findall(r"#ISSUE_([A-Z])", patch.read_text()))
    assert used == {"A", "B", "C"}
    for letter in used:
        assert f"#### Draft {letter} " in doc, letter


def test_every_patch_has_its_cpu_checks() -> None:
    """upstream/checks.toml names, for every patch, tests that exist and the failures
    scripts/upstream_check.sh requires without it."""
    checks = tomllib.loads((UPSTREAM / "checks.toml").read_text())
    for patch in _all_patches():
        entry = checks[patch.name]
        own = [p for p in _touched(patch) if p.startswith("tests/")]
        files = entry.get("cpu", []) + entry.get("unit", []) + entry.get("unit2", [])
        assert files and entry["fails"], patch.name
        for path in entry.get("cpu", []):
            assert path.startswith("upstream/cpu_tests/") and (ROOT / path).is_file(), path
        for path in entry.get("unit", []) + entry.get("unit2", []):
            assert path in own, (patch.name, path)
        for node in entry["fails"] + entry.get("fails_main", []):
            assert node.split("::", 1)[0] in files, (patch.name, node)


def test_the_cpu_checks_share_one_harness() -> None:
    """No CPU check carries its own core attention or process group, and no Megatron test
    of the series mocks CUDA: cpu_harness.py stands in for both."""
    for path in sorted((UPSTREAM / "cpu_tests").glob("test_*.py")):
        text = path.read_text()
        assert "from cpu_harness import" in text, path.name
        for own in ("CoreAttention(", "init_process_group", "mock.patch"):
            assert own not in text, (path.name, own)
    for patch in _all_patches():
        added = [line for line in patch.read_text().splitlines() if line.startswith("+")]
        assert not any("torch.cuda" in line and "patch" in line for line in added), patch.name


def test_patches_touch_only_megatron_core_and_its_unit_tests() -> None:
    for patch in _all_patches():
        for path in _touched(patch):
            assert path.startswith(("megatron/core/", "tests/unit_tests/")), (patch.name, path)


def test_the_docs_name_every_patch() -> None:
    doc = (ROOT / "docs" / "upstream.md").read_text()
    for patch in _series("series-main") + _series("series-dev"):
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
