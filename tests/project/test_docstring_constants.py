"""Every constant a docstring of the library names exists, with the value it states.

A docstring (module, class, function, or an attribute's string) that names an
UPPER_CASE identifier in backticks (````NAME````, ``:data:`NAME```) names a module-level
constant of ``hookspec``, ``torch_impl`` or ``jax_ref``, a parameter of one of their
functions (a kernel's ``BLOCK_M``), or an environment variable the code reads. Where it
states the value (````NAME = 2**-126````), the value is the constant's. ``policy_loss``
named ``FUSED_TILE_ELEMENTS``, which never existed.
"""

from __future__ import annotations

import ast
import importlib
import operator
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hookspec", "torch_impl", "jax_ref")
NAMED = re.compile(
    r"(?:``|:data:`|:const:`|(?<![`\w])`)"
    r"([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+|[A-Z]{3,}[0-9]*)(?:\s*=\s*([^`]+?))?`"
)
ENVIRONMENT = re.compile(
    r"os\.environ(?:\.get|\.setdefault|\.pop)?\s*[\[(]\s*[\"']([A-Z][A-Z0-9_]+)[\"']"
)

_OPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.LShift: operator.lshift,
    ast.USub: operator.neg,
}


def _number(node: ast.AST) -> Any:
    """The value of an arithmetic literal (``2**-126``, ``32 << 20``), else raise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_number(node.left), _number(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_number(node.operand))
    raise ValueError(ast.dump(node))


def _sources() -> list[Path]:
    return [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _known_names() -> tuple[dict[str, list[str]], set[str]]:
    """Module-level UPPER_CASE names -> the modules defining them; and the names of every
    function parameter and every environment variable the library reads."""
    constants: dict[str, list[str]] = {}
    others: set[str] = set()
    for path in _sources():
        text = path.read_text()
        tree = ast.parse(text)
        for node in tree.body:
            targets = (
                node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            )
            for target in targets:
                if isinstance(target, ast.Name):
                    constants.setdefault(target.id, []).append(_module(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                others |= {a.arg for a in node.args.args + node.args.kwonlyargs}
            elif isinstance(
                node, ast.ClassDef
            ):  # a class's constants: Enum members, class attributes
                others |= {
                    t.id
                    for item in node.body
                    if isinstance(item, ast.Assign | ast.AnnAssign)
                    for t in (item.targets if isinstance(item, ast.Assign) else [item.target])
                    if isinstance(t, ast.Name)
                }
        others |= set(ENVIRONMENT.findall(text))
    return constants, others


def _docstrings(path: Path) -> list[tuple[int, str]]:
    """Every docstring and attribute string: ``(line, text)``."""
    return [
        (node.lineno, node.value.value)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]


def named_constants() -> list[tuple[str, str, str]]:
    """``(where, name, stated value or "")`` of every constant a docstring names."""
    found = []
    for path in _sources():
        for line, text in _docstrings(path):
            for name, value in NAMED.findall(text):
                found.append((f"{path.relative_to(ROOT)}:{line}", name, value.strip()))
    return found


# environment variables the library names for torch's rendezvous, which torch reads, not it
READ_BY_TORCH = {"MASTER_ADDR", "MASTER_PORT"}
SIZE = re.compile(r"(\d+) (KiB|MiB|GiB) on (a CPU|CUDA)")
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def test_every_named_constant_exists() -> None:
    constants, others = _known_names()
    known = constants.keys() | others | READ_BY_TORCH
    missing = [f"{where}: {name}" for where, name, _ in named_constants() if name not in known]
    assert missing == []


def stated_sizes(text: str, name: str) -> list[tuple[str, int]]:
    """``(device type, bytes)`` stated in the sentence after each backticked ``name``:
    "``TILE_BYTES`` of fp32 logits, 32 MiB on a CPU and 256 MiB on CUDA"."""
    out = []
    for match in re.finditer(rf"``{name}``|:data:`{name}`", text):
        sentence = re.split(r"[.;)]\s", text[match.end() : match.end() + 200])[0]
        for number, unit, device in SIZE.findall(sentence):
            out.append(("cpu" if device == "a CPU" else "cuda", int(number) * UNITS[unit]))
    return out


def test_every_stated_size_of_a_per_device_budget_is_its_value() -> None:
    """``policy_loss`` said "1 GiB of fp32 logits on CUDA" where ``TILE_BYTES`` is 256 MiB."""
    from torch_impl.processors import GRAD_BUFFER_BYTES, TILE_BYTES

    budgets = {"TILE_BYTES": TILE_BYTES, "GRAD_BUFFER_BYTES": GRAD_BUFFER_BYTES}
    wrong, checked = [], 0
    for path in _sources():
        for line, text in _docstrings(path):
            for name, value in budgets.items():
                for device, size in stated_sizes(text, name):
                    checked += 1
                    if value[device] != size:
                        wrong.append(
                            f"{path.relative_to(ROOT)}:{line}: {name}[{device!r}] "
                            f"is {value[device]}, stated {size}"
                        )
    assert wrong == []
    assert checked >= 2  # policy_loss states both devices
    stale = "``TILE_BYTES`` of fp32 logits, 32 MiB on a CPU, 1 GiB on CUDA"
    assert stated_sizes(stale, "TILE_BYTES") == [
        ("cpu", 32 << 20),
        ("cuda", 1 << 30),
    ]  # the scan sees it


def test_every_stated_value_is_the_constants() -> None:
    constants, _ = _known_names()
    wrong, checked = [], 0
    for where, name, stated in named_constants():
        if not stated or name not in constants:
            continue
        try:
            want = _number(ast.parse(stated, mode="eval").body)
        except (SyntaxError, ValueError):
            continue  # not a number: a formula of other names
        for module in constants[name]:
            actual = getattr(importlib.import_module(module), name)
            checked += 1
            if actual != want:
                wrong.append(f"{where}: {name} = {stated} ({want}), {module}.{name} is {actual}")
    assert wrong == []
    assert checked >= 1, (
        "the scan reads stated values (TAIL_FLOOR = 2**-126 in hookspec.conventions)"
    )


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("``FUSED_TILE_ELEMENTS`` on a CPU", ["FUSED_TILE_ELEMENTS"]),
        (":data:`TILE_BYTES` of fp32", ["TILE_BYTES"]),
        ("``TAIL_FLOOR = 2**-126``", ["TAIL_FLOOR"]),
        ("``logit_scale`` and ``T``", []),
    ],
)
def test_the_scan_sees_a_named_constant(text: str, names: list[str]) -> None:
    """The pattern itself: a stale name like the one ``policy_loss`` had is seen."""
    assert [m[0] for m in NAMED.findall(text)] == names
    constants, others = _known_names()
    assert "FUSED_TILE_ELEMENTS" not in constants and "FUSED_TILE_ELEMENTS" not in others
