"""Every example in README.md and docs/ is code that runs.

Each ```python block of ``README.md``, ``docs/*.md`` and ``notebooks/README.md`` is
one test, chosen by the HTML comment on the line before its fence (none: run as
written, in a fresh namespace):

- ``<!-- include: PATH -->``: the block is the text of the file ``PATH`` (relative to
  the repository root); ``<!-- include: PATH:NAME -->``: the lines of ``PATH`` between
  ``# --- NAME start ---`` and ``# --- NAME end ---``. The test asserts the block
  equals that text; the file is run by a test of its own (``docs/examples/my_*.py``:
  :func:`test_example_pair_passes_hookcheck` below).
- ``<!-- runs-with: SETUP -->``: run after the names of a setup are defined
  (:data:`SETUPS`: a tiny Megatron GPT and its batch, built on the CPU).
- ``<!-- not-run: REASON -->``: a fragment by design (pseudocode, the body of a
  function shown in place); skipped with the reason. There are few
  (:data:`MAX_NOT_RUN`).

A block that imports jax or ``jax_ref`` is skipped, with that reason, where jax is
not installed; one that needs Megatron where it is not.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "notebooks" / "README.md")
MAX_NOT_RUN = 6
HAS_JAX = importlib.util.find_spec("jax") is not None and importlib.util.find_spec("flax") is not None
HAS_MEGATRON = importlib.util.find_spec("megatron") is not None

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*(include|runs-with|not-run):\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One ```python block: where it is, its code, and the marker before it."""

    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    kind: str  # "run", "include", "runs-with" or "not-run"
    arg: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown file, each with the marker on the line before it."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if fence.group(1) == "python":
            marker = _MARKER.match(lines[i - 1]) if i > 0 else None
            kind, arg = (marker.group(1), marker.group(2)) if marker else ("run", "")
            blocks.append(Block(path, i + 1, "\n".join(lines[i + 1 : end]) + "\n", kind, arg))
        i = end + 1
    return blocks


BLOCKS = [b for path in DOCS if path.exists() for b in python_blocks(path)]


def included_text(spec: str) -> str:
    """The text ``<!-- include: PATH[:NAME] -->`` names."""
    rel, _, name = spec.partition(":")
    text = (ROOT / rel).read_text()
    if not name:
        return text
    lines = text.splitlines()
    start, end = f"# --- {name} start ---", f"# --- {name} end ---"
    stripped = [ln.strip() for ln in lines]
    assert start in stripped and end in stripped, f"{rel} has no {start!r} ... {end!r} region"
    i, j = stripped.index(start), stripped.index(end)
    body = lines[i + 1 : j]
    indent = min((len(ln) - len(ln.lstrip()) for ln in body if ln.strip()), default=0)
    return "\n".join(ln[indent:] for ln in body) + "\n"


# ---- setups: the names a `runs-with` block may use ----


def _gpt_batch(model: Any, *, enabled: bool = False) -> dict[str, Any]:
    import torch

    import torch_impl
    from torch_impl.testing.tiny import tiny_batch

    if enabled:
        model = torch_impl.enable_output_processor(model)
    names: dict[str, Any] = {"torch": torch, "torch_impl": torch_impl, "model": model, "temperature": 0.7}
    names.update(tiny_batch(batch=2, seq=8, vocab_size=64))
    return names


def _tiny_gpt(*, mtp: bool) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from torch_impl.testing.tiny import TinyGPTShape, build_tiny_gpt, cpu_layer_spec, tiny_config

    if not mtp:
        return build_tiny_gpt()
    config = tiny_config(TinyGPTShape(), mtp_num_layers=1)
    spec = get_gpt_mtp_block_spec(config, cpu_layer_spec(), use_transformer_engine=False)
    return build_tiny_gpt(mtp_block_spec=spec, mtp_num_layers=1).eval()


def _gpt_rl() -> dict[str, Any]:
    """``gpt`` and an RL batch: ``old``, ``ref`` (logprobs near the model's), ``adv``, ``mask``."""
    import torch

    names = _gpt_batch(_tiny_gpt(mtp=False))
    g = torch.Generator().manual_seed(1)
    b, s = names["labels"].shape
    old = -4.0 + 0.1 * torch.randn(b, s, generator=g)
    names.update(old=old, ref=old + 0.05 * torch.randn(b, s, generator=g), adv=torch.randn(b, s, generator=g))
    names["mask"] = names["loss_mask"]
    return names


def _critic() -> dict[str, Any]:
    """``gpt``'s batch, a ``critic`` model (a tiny GPT, not enabled), its ``hidden_size``,
    and the PPO value targets ``returns``, ``old_values``, ``mask``."""
    import torch

    names = _gpt_batch(_tiny_gpt(mtp=False))
    critic = names.pop("model")
    g = torch.Generator().manual_seed(2)
    b, s = names["labels"].shape
    names.update(
        critic=critic,
        hidden_size=critic.config.hidden_size,
        returns=torch.randn(b, s, generator=g),
        old_values=torch.randn(b, s, generator=g),
        mask=names["loss_mask"],
    )
    return names


def _teacher_student() -> dict[str, Any]:
    """``gpt``'s batch and ``mask``; an enabled ``teacher`` (the tiny GPT) and an enabled,
    smaller ``student`` (hidden 16) over the same vocabulary."""
    import torch_impl
    from torch_impl.testing.tiny import TinyGPTShape, build_tiny_gpt

    names = _gpt_batch(_tiny_gpt(mtp=False), enabled=True)
    names["teacher"] = names.pop("model")
    names["student"] = torch_impl.enable_output_processor(
        build_tiny_gpt(TinyGPTShape(hidden_size=16), seed=7)
    )
    names["mask"] = names["loss_mask"]
    return names


SETUPS: dict[str, Callable[[], dict[str, Any]]] = {
    # `torch`, `torch_impl`, `model` (a tiny megatron GPTModel on the CPU: 2 layers, hidden 32,
    # V 64, not enabled) and its batch: `input_ids`, `position_ids`, `attention_mask` (None),
    # `labels`, `loss_mask` ([b, s] = [2, 8]); a sampling `temperature` (0.7)
    "gpt": lambda: _gpt_batch(_tiny_gpt(mtp=False)),
    # the same, `model` already enabled (a page that enabled it in an earlier block)
    "gpt-enabled": lambda: _gpt_batch(_tiny_gpt(mtp=False), enabled=True),
    # the same with one MTP layer, in eval mode (MTP loss logging needs CUDA), not enabled
    "gpt-mtp": lambda: _gpt_batch(_tiny_gpt(mtp=True)),
    # `gpt` and an RL batch [b, s]: `old` and `ref` logprobs, advantages `adv`, `mask`
    "gpt-rl": _gpt_rl,
    # a critic: `critic` (a tiny GPT, not enabled), `hidden_size`, `returns`, `old_values`, `mask`
    "critic": _critic,
    # distillation: an enabled `teacher` (the tiny GPT) and a smaller enabled `student`
    # (hidden 16, same V), `gpt`'s batch and `mask`
    "teacher-student": _teacher_student,
}


def _needs(code: str) -> str | None:
    """Why a block cannot run here, or None."""
    if re.search(r"^\s*(import|from)\s+(jax|jax_ref|flax)\b", code, re.M) and not HAS_JAX:
        return "needs jax and flax (the [jax] extra)"
    if re.search(r"\b(torch_impl|megatron)\b", code) and not HAS_MEGATRON:
        return "needs megatron-core"
    return None


@pytest.fixture
def setup_names(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    block: Block = request.param
    if block.kind != "runs-with":
        yield {}
        return
    from torch_impl.testing.tiny import megatron_parallel

    with megatron_parallel():
        yield SETUPS[block.arg]()


@pytest.mark.parametrize("setup_names", BLOCKS, ids=[b.id for b in BLOCKS], indirect=True)
def test_block(setup_names: dict[str, Any], request: pytest.FixtureRequest) -> None:
    block: Block = request.node.callspec.params["setup_names"]
    if block.kind == "not-run":
        assert block.arg, f"{block.id}: a not-run marker states its reason"
        pytest.skip(f"not run by design: {block.arg}")
    if block.kind == "include":
        assert block.code == included_text(block.arg), (
            f"{block.id} differs from {block.arg}: paste the file's text into the block"
        )
        return
    if block.kind == "runs-with":
        assert block.arg in SETUPS, f"{block.id}: unknown setup {block.arg!r}, known: {sorted(SETUPS)}"
    reason = _needs(block.code)
    if reason:
        pytest.skip(reason)
    names = {"__name__": f"docs_block_{block.line}", **setup_names}
    exec(compile(block.code, block.id, "exec"), names)


def test_markers_are_few_and_known() -> None:
    """Fragments are the exception: at most MAX_NOT_RUN, each with a reason; every
    marker names an existing file or setup."""
    not_run = [b.id for b in BLOCKS if b.kind == "not-run"]
    assert len(not_run) <= MAX_NOT_RUN, not_run
    for b in BLOCKS:
        if b.kind == "include":
            assert (ROOT / b.arg.partition(":")[0]).is_file(), f"{b.id}: no file {b.arg}"
        if b.kind == "runs-with":
            assert b.arg in SETUPS, f"{b.id}: unknown setup {b.arg!r}"
    assert any(b.kind == "include" and b.arg == "docs/examples/my_processor.py" for b in BLOCKS)


def test_markers_are_read(tmp_path: Path) -> None:
    """The parser sees each marker kind, and a block without one runs as written."""
    md = tmp_path / "x.md"
    md.write_text(
        "text\n```python\na = 1\n```\n<!-- not-run: pseudocode -->\n```python\nfor k in 1..K\n```\n"
        "<!-- runs-with: gpt -->\n```python\nmodel\n```\n```bash\nls\n```\n"
    )
    got = [(b.line, b.kind, b.arg, b.code) for b in python_blocks(md)]
    assert got == [
        (2, "run", "", "a = 1\n"),
        (6, "not-run", "pseudocode", "for k in 1..K\n"),
        (10, "runs-with", "gpt", "model\n"),
    ]


# ---- the README's processor and its reference: one pair that passes hookcheck ----

PAIR = [
    "--processor",
    "docs.examples.my_processor:tempered_logprobs",
    "--reference",
    "docs.examples.my_reference:tempered_logprobs_reference",
    "--context",
    "docs.examples.my_processor:make_context",
]


@pytest.mark.skipif(not (HAS_JAX and HAS_MEGATRON), reason="hookcheck needs jax, flax and megatron-core")
@pytest.mark.parametrize("tp", [1, 2])
def test_example_pair_passes_hookcheck(tp: int) -> None:
    """``python -m jax_ref.check.hookcheck`` on the README's pair, as the README
    shows it: every comparison passes (tp=1: fp32, bf16, fp16, tied, synthetic
    cases; tp=2: two gloo ranks against the reference sharded over two devices)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "jax_ref.check.hookcheck", *PAIR, "--tp", str(tp), "--quiet"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"hookcheck: all \d+ comparisons passed", out), out
    assert "tempered_logprobs" in out and (tp == 1 or "gpt tp2 rank1" in out), out
    if tp == 2:  # the README shows this run's table: its header and rows are what hookcheck prints
        shown = _readme_hookcheck_table()
        assert shown[0] in out.splitlines(), (shown[0], out)
        for row in shown[2:-1]:  # every column but the errors, which vary in their last digits
            assert any(_words(line) == _words(row) for line in out.splitlines()), (row, out)
        assert shown[-1] in out, (shown[-1], out)


def _words(line: str) -> list[str]:
    return [w for w in line.split() if not re.fullmatch(r"[-+.\deinfa]+", w)]


def _readme_hookcheck_table() -> list[str]:
    """The lines of the README's ```text block that shows the pair's ``hookcheck --tp 2`` output."""
    text = (ROOT / "README.md").read_text()
    after = text.split("--context docs.examples.my_processor:make_context --tp 2", 1)[1]
    block = after.split("```text\n", 1)[1].split("```", 1)[0]
    return block.rstrip("\n").splitlines()


@pytest.mark.skipif(not (HAS_JAX and HAS_MEGATRON), reason="needs jax, flax and megatron-core")
def test_example_pair_check_can_fail() -> None:
    """The check the pair passes is one that fails: the processor with the defect
    of the README's earlier example (``z_y - lse``, i.e. ``-lse``, where the label
    is ignored, where the contract defines 0) fails against the same reference."""
    import torch

    import hookspec
    from docs.examples.my_processor import make_context, tempered_logprobs
    from docs.examples.my_reference import tempered_logprobs_reference
    from jax_ref.check import cross_check, synthetic_context

    ctx = synthetic_context("masked", seed=3)
    ctx = ctx.replace(context=make_context(ctx))
    assert cross_check(tempered_logprobs, tempered_logprobs_reference, ctx).passed

    @hookspec.processor
    def no_zero_at_ignored(ctx: hookspec.OutputContext) -> dict[str, torch.Tensor]:
        coll, vocab, y = ctx.collectives, ctx.vocab, ctx.labels
        h = coll.gather_hidden_states(ctx.hidden_states)
        z = torch.einsum("sbh,vh->bsv", h.float(), ctx.vocab_weight.float())
        z = ctx.scale_logits(z) / ctx.context["temperature"][..., None]
        m = coll.all_reduce_max(z.detach().amax(-1))
        lse = m + torch.log(coll.all_reduce_sum(torch.exp(z - m[..., None]).sum(-1)))
        here = (y >= vocab.start) & (y < vocab.end)
        row = torch.where(here, y - vocab.start, 0)
        logprobs = coll.all_reduce_sum(z.gather(-1, row[..., None]).squeeze(-1) * here) - lse
        mask = ctx.loss_mask * (y != ctx.ignore_index)
        return {"logprobs": logprobs, "loss": -(logprobs * mask).sum() / mask.sum().clamp(min=1)}

    report = cross_check(no_zero_at_ignored, tempered_logprobs_reference, ctx)
    assert not report.passed
    failed = {(r.output, r.quantity) for r in report.failures()}
    assert ("logprobs", "value") in failed and not any(out == "loss" for out, _ in failed), str(report)


@pytest.mark.skipif(not HAS_JAX, reason="needs jax and flax")
def test_jax_ref_submodules_load_on_first_use() -> None:
    """``import jax_ref`` then ``jax_ref.processors...`` works, as the docs write it
    (it raised AttributeError), and loads neither torch nor ``jax_ref.check``."""
    code = (
        "import sys, jax_ref\n"
        "assert 'jax_ref.processors' not in sys.modules\n"
        "f = jax_ref.processors.token_logprobs_of\n"
        "assert jax_ref.references.aggregate and jax_ref.sharded.shard_reference\n"
        "assert 'torch' not in sys.modules and 'jax_ref.check' not in sys.modules, sorted(sys.modules)\n"
        "try:\n    jax_ref.no_such_name\nexcept AttributeError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "module 'jax_ref' has no attribute 'no_such_name'" in out.stdout
