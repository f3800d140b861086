"""The library's layout rules, checked on its source: a reader finds the step they need.

- No function in ``torch_impl`` runs past :data:`MAX_LINES` lines (its ``def`` line to
  its last line, docstring included), except the ``@triton.jit`` kernels, and each of
  those past it says its steps as numbered comments (``# 1. ...``).
- Every Triton launch (``kernel[grid](...)``) passes its arguments by name: no
  positional tuple that must match the kernel's parameter order.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.release_independent  # no Megatron release in the outcome

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "torch_impl"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_LINES = 60
STEP = re.compile(r"^\s*# (\d+)\. ", re.M)


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _is_triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated ``@triton.jit`` (``triton.heuristics`` may wrap it)."""
    return any(ast.unparse(d).startswith("triton.jit") for d in fn.decorator_list)


def _length(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return (fn.end_lineno or fn.lineno) - fn.lineno + 1


def long_functions(source: str, name: str) -> list[str]:
    """``name:qualified line (n lines)`` of each function past :data:`MAX_LINES` lines
    that is not a Triton kernel."""
    return [
        f"{name}:{fn.lineno} {fn.name} ({_length(fn)} lines)"
        for fn in _functions(ast.parse(source))
        if _length(fn) > MAX_LINES and not _is_triton_kernel(fn)
    ]


def unnumbered_kernels(source: str, name: str) -> list[str]:
    """The long Triton kernels whose body does not number its steps from 1."""
    lines = source.splitlines()
    found = []
    for fn in _functions(ast.parse(source)):
        if _is_triton_kernel(fn) and _length(fn) > MAX_LINES:
            body = "\n".join(lines[fn.lineno - 1 : fn.end_lineno])
            steps = [int(n) for n in STEP.findall(body)]
            if steps[:2] != [1, 2]:
                found.append(f"{name}:{fn.lineno} {fn.name}")
    return found


def _launches(tree: ast.AST) -> list[ast.Call]:
    """The calls ``kernel[grid](...)``: a subscripted name that ends in ``kernel`` (a
    table of functions, ``MODES[mode](...)``, is not a launch)."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Subscript)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id.endswith("kernel")
    ]


def positional_launches(source: str, name: str) -> list[str]:
    """Each launch with a positional argument."""
    return [f"{name}:{call.lineno}" for call in _launches(ast.parse(source)) if call.args]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_runs_past_the_limit(path: Path) -> None:
    name = str(path.relative_to(ROOT))
    assert long_functions(path.read_text(), name) == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_long_kernel_numbers_its_steps(path: Path) -> None:
    name = str(path.relative_to(ROOT))
    assert unnumbered_kernels(path.read_text(), name) == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_kernel_launch_passes_its_arguments_by_name(path: Path) -> None:
    name = str(path.relative_to(ROOT))
    assert positional_launches(path.read_text(), name) == []


def test_the_scans_see_what_they_look_for() -> None:
    """Each scan fails on the thing it forbids, and passes what it allows: a long
    function, a long kernel without steps (with a heuristics wrapper above it), a
    positional launch."""
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    long_def = f"def long():\n{body}"
    assert long_functions(long_def, "m") == [f"m:1 long ({MAX_LINES + 1} lines)"]
    assert long_functions(f"def short():\n{body[: -len('    x59 = 59') - 1]}", "m") == []
    kernel = f"@triton.heuristics({{}})\n@triton.jit\ndef kernel():\n{body}"
    assert long_functions(kernel, "m") == []
    assert unnumbered_kernels(kernel, "m") == ["m:3 kernel"]
    numbered = kernel.replace("    x0 = 0\n", "    # 1. one\n    x0 = 0\n    # 2. two\n")
    assert unnumbered_kernels(numbered, "m") == []
    assert positional_launches("kernel[(1,)](a, b=1)\n", "m") == ["m:1"]
    assert positional_launches("kernel[(1,)](a=a, b=1)\nf(a)\nMODES[m](a)\n", "m") == []


def test_the_triton_kernels_are_found() -> None:
    """The kernels module is scanned: it holds long kernels, launched (so the rules above
    read real code, not an empty list)."""
    source = (PACKAGE / "processors" / "_triton_kernels.py").read_text()
    tree = ast.parse(source)
    kernels = [fn for fn in _functions(tree) if _is_triton_kernel(fn)]
    assert any(_length(fn) > MAX_LINES for fn in kernels)
    assert _launches(tree)
