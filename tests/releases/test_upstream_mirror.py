"""The blocks of ours that restate a Megatron Core function, fenced on every
release of the matrix.

Each entry pins the sha256 of ``inspect.getsource`` of an upstream function on
a release and names the blocks here that follow it. Every release the matrix
installs (``scripts/matrix.sh``, ``torch_impl.doctor.MATRIX_RELEASES``) has its
pins, and this file runs there (``release_matrix``). When the installed
release's source differs from its pin, the test fails and names the blocks to
re-read against the new source (then re-pin); on a release with no pins at all
it fails too, rather than skipping. Each block's docstring names the upstream
function and the releases it was read against (:data:`READ_AGAINST`); on the
other releases the pins fence the source the release-matrix tests (bitwise
stock, ``tests/releases/test_release_matrix.py``) passed on.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import pathlib
import re
from typing import Any

import pytest

pytestmark = pytest.mark.release_matrix

_POSTPROCESS = "megatron.core.models.gpt.gpt_model:GPTModel._postprocess"
_PROCESS_MTP_LOSS = "megatron.core.transformer.multi_token_prediction:process_mtp_loss"
_HYBRID_FORWARD = "megatron.core.models.hybrid.hybrid_model:HybridModel.forward"
_MTP = "megatron.core.transformer.multi_token_prediction"

# upstream "module:qualname" -> our blocks that follow it
BLOCKS: dict[str, tuple[str, ...]] = {
    _POSTPROCESS: (
        "torch_impl._postprocess:hook_keywords",
        "torch_impl._postprocess:finish_postprocess",
        "torch_impl._call:default_output",
        "torch_impl.mtp:attach_mtp_losses",
        "torch_impl.mtp:_mtp_labels",
        "torch_impl.mtp:_scaled_mtp_loss",
        "torch_impl.mtp:_log",
    ),
    _PROCESS_MTP_LOSS: (
        "torch_impl.mtp:attach_mtp_losses",
        "torch_impl.mtp:_mtp_labels",
        "torch_impl.mtp:_scaled_mtp_loss",
        "torch_impl.mtp:_log",
    ),
    f"{_MTP}:_compute_mtp_acceptance_counts": ("torch_impl.mtp:_top1_accepted",),
    f"{_MTP}:_mtp_logits_are_vocab_sharded": ("torch_impl.mtp:_top1_accepted",),
    f"{_MTP}:_vocab_parallel_argmax": ("torch_impl.mtp:_top1_accepted",),
    _HYBRID_FORWARD: ("torch_impl.hybrid:HybridOutputHookAdapter._hookspec_run",),
}

# release -> upstream "module:qualname" -> sha256 of its source; a function absent on a
# release (process_mtp_loss before 0.17, HybridModel before 0.18) has no pin there
PINS: dict[str, dict[str, str]] = {
    "0.13.1": {_POSTPROCESS: "9864305a41a4176b26d181bcb2af89537362c536c812ee95badd9265b03d0be0"},
    "0.14.0": {_POSTPROCESS: "31141c79951b4b7cc1072618c6ee3ac670068cefee9edbd4ede3c322fd674053"},
    "0.15.3": {_POSTPROCESS: "6e0fe65f619523fa625956fbd432990374cb0578a1a8a3f8fadb67eba1802621"},
    "0.16.1": {_POSTPROCESS: "a5f7de0bfb1cad97b680b964bdea46140959571a1b74a68651fefe5a276363df"},
    "0.17.1": {
        _POSTPROCESS: "4ae592221f4fd816c8ee1ac63bb63e47658eaf6333a09e21475e157e5426997b",
        _PROCESS_MTP_LOSS: "0a0fdf623bd095c1bc5db420074e87e29629743cc36444bc792d3e4b045fe405",
    },
    "0.18.2": {
        _POSTPROCESS: "de4dbfb0d7d4108832bed19ffdd04a2a19811275288122d0b0bf06f9e1fdaa54",
        _PROCESS_MTP_LOSS: "55b7a80ffcbc078cfc0bdea30b961160aad1f2b908829e2e562ee06609b58256",
        _HYBRID_FORWARD: "22add75817fb49b175887b31eb7e1b97e2b822585d3852eab7b459ea573cd5c9",
    },
    "0.19.2": {
        _POSTPROCESS: "41700c5f809c197c24d995bcb23b1638edc799c3542fec904567f32ce5af8f19",
        _PROCESS_MTP_LOSS: "7a459bac5884e8bf3bf19381b3eb2b02f1d443e7e5c48bae78b90c2b4ee52767",
        f"{_MTP}:_compute_mtp_acceptance_counts": (
            "cf771eb0e275b10889fa7fdb621de55ee3a328a8b7c46d170e476ec1d50a0a61"
        ),
        f"{_MTP}:_mtp_logits_are_vocab_sharded": (
            "fd873afcc7128cced3232721fcda94170a53bb522e927b058c7cea5ebf397860"
        ),
        f"{_MTP}:_vocab_parallel_argmax": (
            "577c5897ba625a6c805bfe6b7477038ae2eb3d4cf7f78e735613fc9589e4fa44"
        ),
        _HYBRID_FORWARD: "5115982845f77289edb8590befb8a00b023e5d2ff0a84ce8099029ffddbd4194",
    },
}

# the releases each block was read against, which its docstring names
READ_AGAINST: dict[str, tuple[str, ...]] = {
    "torch_impl._postprocess:hook_keywords": ("0.19.2",),
    "torch_impl._postprocess:finish_postprocess": ("0.16.1", "0.19.2"),
    "torch_impl._call:default_output": ("0.16.1", "0.19.2"),
    "torch_impl.mtp:attach_mtp_losses": ("0.16.1", "0.19.2"),
    "torch_impl.mtp:_mtp_labels": ("0.16.1", "0.19.2"),
    "torch_impl.mtp:_scaled_mtp_loss": ("0.16.1", "0.19.2"),
    "torch_impl.mtp:_log": ("0.16.1", "0.19.2"),
    "torch_impl.mtp:_top1_accepted": ("0.19.2",),
    "torch_impl.hybrid:HybridOutputHookAdapter._hookspec_run": ("0.19.2",),
}

ROOT = pathlib.Path(__file__).resolve().parents[2]
INSTALLED = importlib.metadata.version("megatron-core")
INSTALLED_PINS = sorted(PINS.get(INSTALLED, {}))


def _resolve(path: str) -> Any:
    module, qualname = path.split(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _source_hash(obj: Any) -> str:
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()


def _exists(path: str) -> bool:
    try:
        _resolve(path)
    except (ImportError, AttributeError):
        return False
    return True


def test_the_installed_release_is_pinned() -> None:
    """A release without pins runs the mirrors unfenced: fail, naming it, never skip."""
    assert INSTALLED in PINS, (
        f"megatron-core {INSTALLED} has no pinned sources in "
        "tests/releases/test_upstream_mirror.py: "
        f"read {', '.join(sorted({b for bs in BLOCKS.values() for b in bs}))} against it, "
        "then pin its sources (and add it to the release matrix)"
    )


@pytest.mark.parametrize("upstream", INSTALLED_PINS, ids=[u.split(":")[1] for u in INSTALLED_PINS])
def test_mirrored_upstream_source_is_the_pinned_one(upstream: str) -> None:
    want = PINS[INSTALLED][upstream]
    got = _source_hash(_resolve(upstream))
    assert got == want, (
        f"megatron-core {INSTALLED}'s {upstream} changed (sha256 {got[:12]}, pinned {want[:12]}): "
        f"re-read {', '.join(BLOCKS[upstream])} against it, then re-pin the hash in "
        "tests/releases/test_upstream_mirror.py"
    )


@pytest.mark.parametrize("upstream", sorted(BLOCKS), ids=[u.split(":")[1] for u in sorted(BLOCKS)])
def test_every_mirrored_function_present_here_is_pinned_here(upstream: str) -> None:
    """A function our blocks follow that the installed release has is pinned on it
    (and one it lacks is not): a release that gains one fails until it is read."""
    assert _exists(upstream) == (upstream in PINS.get(INSTALLED, {})), (
        f"{upstream} is {'present' if _exists(upstream) else 'absent'} on megatron-core {INSTALLED}"
    )


@pytest.mark.parametrize("block", sorted(READ_AGAINST))
def test_each_mirrored_block_names_what_it_follows(block: str) -> None:
    """Our side of the fence: each block's docstring names the functions it follows
    and the releases it was read against."""
    doc = " ".join((inspect.getdoc(_resolve(block)) or "").split())
    for upstream, blocks in BLOCKS.items():
        if block in blocks and any(upstream in PINS[r] for r in READ_AGAINST[block]):
            function = upstream.split(":")[1].split(".")[-1]
            assert function in doc, (block, function)
    for release in READ_AGAINST[block]:
        assert release in doc, (block, release)


def test_the_pins_cover_the_release_matrix() -> None:
    from torch_impl.doctor import MATRIX_RELEASES

    script = (ROOT / "scripts" / "matrix.sh").read_text()
    in_script = re.findall(r'^\s+"(\d+\.\d+\.\d+) py3\d+"$', script, flags=re.M)
    assert sorted(PINS) == sorted(MATRIX_RELEASES) == sorted(in_script)
    tests = re.search(r"^TESTS=\((.*)\)$", script, flags=re.M)
    assert tests is not None and "tests/releases/test_upstream_mirror.py" in tests.group(1).split()
