"""The blocks of ours that restate a Megatron Core function, fenced.

Each entry pins the sha256 of ``inspect.getsource`` of an upstream function
on a pinned release and names the blocks here that follow it. When the
installed release is pinned and its source differs, the test fails and names
the blocks to re-read against the new source (then re-pin). Each block's
docstring names the upstream function and release it follows.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
from typing import Any

import pytest

# release -> upstream "module:qualname" -> (sha256 of its source, our blocks that follow it)
PINS: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    "0.16.1": {
        "megatron.core.models.gpt.gpt_model:GPTModel._postprocess": (
            "a5f7de0bfb1cad97b680b964bdea46140959571a1b74a68651fefe5a276363df",
            (
                "torch_impl._postprocess:finish_postprocess",
                "torch_impl._call:default_output",
                "torch_impl.mtp:attach_mtp_losses",
                "torch_impl.mtp:_log",
            ),
        ),
    },
    "0.19.2": {
        "megatron.core.models.gpt.gpt_model:GPTModel._postprocess": (
            "41700c5f809c197c24d995bcb23b1638edc799c3542fec904567f32ce5af8f19",
            (
                "torch_impl._postprocess:hook_keywords",
                "torch_impl._postprocess:finish_postprocess",
                "torch_impl._call:default_output",
            ),
        ),
        "megatron.core.transformer.multi_token_prediction:process_mtp_loss": (
            "7a459bac5884e8bf3bf19381b3eb2b02f1d443e7e5c48bae78b90c2b4ee52767",
            ("torch_impl.mtp:attach_mtp_losses", "torch_impl.mtp:_log"),
        ),
        "megatron.core.transformer.multi_token_prediction:_compute_mtp_acceptance_counts": (
            "cf771eb0e275b10889fa7fdb621de55ee3a328a8b7c46d170e476ec1d50a0a61",
            ("torch_impl.mtp:_top1_accepted",),
        ),
        "megatron.core.transformer.multi_token_prediction:_mtp_logits_are_vocab_sharded": (
            "fd873afcc7128cced3232721fcda94170a53bb522e927b058c7cea5ebf397860",
            ("torch_impl.mtp:_top1_accepted",),
        ),
        "megatron.core.transformer.multi_token_prediction:_vocab_parallel_argmax": (
            "577c5897ba625a6c805bfe6b7477038ae2eb3d4cf7f78e735613fc9589e4fa44",
            ("torch_impl.mtp:_top1_accepted",),
        ),
        "megatron.core.models.hybrid.hybrid_model:HybridModel.forward": (
            "5115982845f77289edb8590befb8a00b023e5d2ff0a84ce8099029ffddbd4194",
            ("torch_impl.hybrid:HybridOutputHookAdapter._hookspec_run",),
        ),
    },
}

INSTALLED = importlib.metadata.version("megatron-core")
ALL = sorted({(release, name) for release, pins in PINS.items() for name in pins})


def _resolve(path: str) -> Any:
    module, qualname = path.split(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _source_hash(obj: Any) -> str:
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()


@pytest.mark.parametrize(("release", "upstream"), ALL, ids=[f"{r}:{u.split(':')[1]}" for r, u in ALL])
def test_mirrored_upstream_source_is_the_pinned_one(release: str, upstream: str) -> None:
    if release != INSTALLED:
        pytest.skip(f"pinned on megatron-core {release}; installed {INSTALLED}")
    want, blocks = PINS[release][upstream]
    got = _source_hash(_resolve(upstream))
    assert got == want, (
        f"megatron-core {release}'s {upstream} changed (sha256 {got[:12]}, pinned {want[:12]}): "
        f"re-read {', '.join(blocks)} against it, then re-pin the hash in tests/test_upstream_mirror.py"
    )


@pytest.mark.parametrize(("release", "upstream"), ALL, ids=[f"{r}:{u.split(':')[1]}" for r, u in ALL])
def test_each_mirrored_block_names_what_it_follows(release: str, upstream: str) -> None:
    """Our side of the fence: each block's docstring names the function and release."""
    function = upstream.split(":")[1].split(".")[-1]
    for block in PINS[release][upstream][1]:
        doc = inspect.getdoc(_resolve(block)) or ""
        assert function in doc and release in doc, (block, function, release)


def test_the_installed_release_is_pinned_or_says_so() -> None:
    """A release outside the pins runs the mirrors unfenced: name it."""
    if INSTALLED not in PINS:
        pytest.skip(f"megatron-core {INSTALLED} has no pinned sources; the mirror is unchecked on it")
    assert PINS[INSTALLED]
