"""The suite's own rules, checked on its source: a test that cannot fail is a defect.

Each rule names what was found before it: ``raises((RuntimeError,
AssertionError))`` that passed on any error, ``raises(Exception, match=...)``,
test modules importing truths from other test modules, ``TRITON_INTERPRET`` set
at import in four modules though ``conftest.py`` sets it, and a module silencing
every warning (``filterwarnings("ignore")``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
MODULES = sorted(TESTS.rglob("*.py"))


def _name(path: Path) -> str:
    """The module's dotted name: ``tests.support.fuzz_world`` for its file."""
    return ".".join(("tests", *path.relative_to(TESTS).with_suffix("").parts))


def _id(path: Path) -> str:
    return path.relative_to(TESTS).as_posix()


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.name}:{getattr(node, 'lineno', 0)}"


def _is_pytest_call(node: ast.AST, name: str) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == name
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "pytest"
    )


@pytest.mark.parametrize("path", MODULES, ids=_id)
def test_raises_names_one_exception_type(path: Path) -> None:
    """``pytest.raises`` of a tuple, of ``Exception`` or of ``BaseException`` passes
    on errors the test did not mean; name the one type (and match its message)."""
    found = []
    for node in ast.walk(_tree(path)):
        if _is_pytest_call(node, "raises") and node.args:  # type: ignore[attr-defined]
            first = node.args[0]  # type: ignore[attr-defined]
            if isinstance(first, ast.Tuple) or (
                isinstance(first, ast.Name) and first.id in ("Exception", "BaseException")
            ):
                found.append(_where(path, node))
    assert found == []


@pytest.mark.parametrize("path", MODULES, ids=_id)
def test_no_test_module_imports_another(path: Path) -> None:
    """Shared truths live in support modules (``tests/support/``: ``policy_truth.py``,
    ``hook_cases.py``, the ``*_support.py`` modules), not in test modules."""
    own = _name(path)
    package = own.rpartition(".")[0]
    found = []
    for node in ast.walk(_tree(path)):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            names = [node.module or ""] if not node.level else [f"{base}.{node.module}"]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if (
                name.startswith("tests.")
                and name.rpartition(".")[2].startswith("test_")
                and (name != own)
            ):
                found.append(f"{_where(path, node)} imports {name}")
    assert found == []


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "conftest.py"], ids=_id)
def test_only_conftest_sets_triton_interpret(path: Path) -> None:
    """Triton reads ``TRITON_INTERPRET`` once, at its first import: ``conftest.py``
    sets it before any test module is collected; a module setting it again at
    import does nothing but suggest otherwise."""
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Subscript)
                    and ast.unparse(target) == "os.environ['TRITON_INTERPRET']"
                ):
                    found.append(_where(path, node))
    assert found == []


@pytest.mark.parametrize("path", MODULES, ids=_id)
def test_no_module_silences_every_warning(path: Path) -> None:
    """``filterwarnings("ignore")`` hides every warning, the new ones too; filter
    the named, known ones (``pyproject.toml`` lists Megatron Core's)."""
    found = []
    for node in ast.walk(_tree(path)):
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("filterwarnings")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in ("ignore", "ignore::Warning", "ignore::UserWarning")
        ):
            found.append(_where(path, node))
    assert found == []
