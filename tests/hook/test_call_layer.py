"""The shape of the calling layer: imports run one way, no private name
crosses a module, the adapter's attributes are read where they are set, and
an upstream-style callable's keywords are checked when a forward receives it."""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import pytest
import torch

import hookspec
import torch_impl
from hookspec import ContractError
from tests.support.hook_cases import model_inputs
from torch_impl.testing.tiny import build_tiny_gpt, tiny_batch

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The contract and the call layer (torch_impl.processors has its own door and tests).
CALL_LAYER = (
    "__init__",
    "_call",
    "_adapter",
    "_postprocess",
    "mtp",
    "hybrid",
    "enable",
    "schedule_plan",
)
MODULES = sorted(
    [
        *(ROOT / "hookspec").glob("*.py"),
        *(ROOT / "torch_impl" / f"{name}.py" for name in (*CALL_LAYER, "context", "collectives")),
    ]
)


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(path: pathlib.Path) -> list[tuple[str, list[str], bool]]:
    """(imported module, names, at module level) for each import of the file."""
    module = _module_name(path)
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    guarded = {
        id(sub)
        for n in tree.body
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
        for sub in ast.walk(n)
    }
    out = []
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.ImportFrom):
            target = _resolve(module, path.name == "__init__.py", node)
            out.append((target, [a.name for a in node.names], id(node) in top))
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], id(node) in top) for a in node.names)
    return out


def _ours(name: str) -> bool:
    return name.split(".")[0] in ("hookspec", "torch_impl") and not name.startswith(
        "torch_impl.processors"
    )


def test_module_level_imports_form_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    names = {_module_name(p) for p in MODULES}
    for path in MODULES:
        deps = set()
        for target, imported, _ in _imports(path):
            if not _ours(target):
                continue
            for name in imported:  # `from . import enable` names a module
                if f"{target}.{name}" in names:
                    deps.add(f"{target}.{name}")
            deps.add(target)
        graph[_module_name(path)] = {d for d in deps if d in names and d != _module_name(path)}
    # a package's __init__ imports its modules; a module importing its package's door is the cycle
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep in ("hookspec", "torch_impl") and node.startswith(dep + "."):
                continue  # the door, imported for its names from below: checked by its own __init__
            if state.get(dep) == 1:
                raise AssertionError(f"import cycle: {' -> '.join([*trail, node, dep])}")
            if state.get(dep) is None:
                visit(dep, [*trail, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_level_import_of_our_modules(path: pathlib.Path) -> None:
    late = [t for t, _, top in _imports(path) if not top and _ours(t)]
    assert not late, f"{path.name} imports {late} inside a function"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_name_crosses_a_module(path: pathlib.Path) -> None:
    crossing = [
        f"{t}.{n}" for t, names, _ in _imports(path) if _ours(t) for n in names if n.startswith("_")
    ]
    assert not crossing, f"{path.name} imports private names {crossing}"


LIBRARY = sorted(
    p
    for package in ("hookspec", "torch_impl", "jax_ref")
    for p in (ROOT / package).rglob("*.py")
    if "testing" not in p.relative_to(ROOT).parts  # test support is not library code
)


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_name_crosses_a_module_in_the_library(path: pathlib.Path) -> None:
    """The same rule for every library module, the processors and ``jax_ref`` included: a
    module imports another's public names (a package's private modules, ``._engine``,
    are its own structure; their private names are not)."""
    crossing = [
        f"{t}.{n}"
        for t, names, _ in _imports(path)
        if t.split(".")[0] in ("hookspec", "torch_impl", "jax_ref")
        for n in names
        if n.startswith("_") and f"{t}.{n}".replace(".", "/") + ".py" not in _MODULE_FILES
    ]
    assert not crossing, f"{path.name} imports private names {crossing}"


_MODULE_FILES = {str(p.relative_to(ROOT).with_suffix(".py")) for p in LIBRARY}


def _hookspec_attributes(path: pathlib.Path) -> set[str]:
    """The ``_hookspec_*`` attribute names a module reads or sets (attributes and strings)."""
    tree = ast.parse(path.read_text())
    names = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr.startswith("_hookspec_")
    }
    names |= {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and n.value.startswith("_hookspec_")
    }
    names |= {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name.startswith("_hookspec_")
    }
    names |= {
        n.target.id
        for n in ast.walk(tree)
        if isinstance(n, ast.AnnAssign)
        and isinstance(n.target, ast.Name)
        and n.target.id.startswith("_hookspec_")
    }
    return names


# A method of the model adapter that HybridModel's adapter overrides (its own class).
SHARED_ATTRIBUTES = {"_hookspec_run": {"_adapter.py", "hybrid.py"}}


def test_adapter_attributes_are_read_where_they_are_set() -> None:
    """Each ``_hookspec_*`` attribute an adapter puts on a model or layer is read in the
    module that sets it and nowhere else: the model adapter's in ``_adapter``/``_call``,
    the MTP layer adapter's in ``mtp``, the schedule plan's in ``schedule_plan``."""
    users: dict[str, set[str]] = {}
    for path in MODULES:
        for name in _hookspec_attributes(path):
            users.setdefault(name, set()).add(path.name)
    crossing = {
        name: sorted(files)
        for name, files in users.items()
        if len(files) > 1 and files != SHARED_ATTRIBUTES.get(name)
    }
    assert users, "no _hookspec_ attribute found: the scan reads nothing"
    assert not crossing, f"attributes read outside the module that sets them: {crossing}"


def _upstream(
    *, hidden_states: Any, output_layer: Any, labels: Any, nonsense: Any = None, **_: Any
) -> Any:
    return hidden_states.sum()


def _typed(ctx: hookspec.OutputContext) -> Any:
    return ctx.hidden_states.sum()


@pytest.mark.usefixtures("megatron_single")
def test_an_unknown_upstream_keyword_is_named_before_the_model_runs() -> None:
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    batch = tiny_batch()
    with pytest.raises(ContractError) as info:
        model(*model_inputs(batch), labels=batch["labels"], output_processor=_upstream)
    err = info.value
    assert err.field == "output_processor" and "['nonsense']" in str(err.actual)
    assert "_upstream" in str(err.actual) and "hidden_states" in str(err.expected)


@pytest.mark.usefixtures("megatron_single")
def test_a_plain_function_of_the_context_is_told_to_decorate() -> None:
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    batch = tiny_batch()
    with pytest.raises(ContractError, match=r"decorate it with @hookspec\.processor") as info:
        model(*model_inputs(batch), labels=batch["labels"], output_processor=_typed)
    assert info.value.field == "output_processor" and "_typed(ctx)" in str(info.value.actual)
    # decorated, the same function runs
    out = model(
        *model_inputs(batch), labels=batch["labels"], output_processor=hookspec.processor(_typed)
    )
    assert out.shape == () and torch.isfinite(out)


def test_upstream_keyword_check_accepts_what_the_hook_passes() -> None:
    def verl_style(
        *, hidden_states: Any, output_weight: Any, labels: Any, context: Any, **_: Any
    ) -> None:
        return None

    def every(**kwargs: Any) -> None:
        return None

    for fn in (verl_style, every):
        hookspec.check_upstream_processor(fn)
    with pytest.raises(ContractError, match=r"\['hidden_states', 'positional_only'\]"):

        def pos(hidden_states: Any, positional_only: Any, /, **_: Any) -> None:
            return None

        hookspec.check_upstream_processor(pos)
