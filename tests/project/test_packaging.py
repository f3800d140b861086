"""One distribution; hookspec needs nothing, the extras bring each framework."""

from __future__ import annotations

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_hookspec_installs_with_no_dependency() -> None:
    assert _project()["dependencies"] == []


def test_extras_bring_the_frameworks() -> None:
    extras = {
        k: {r.split(">")[0].split("=")[0].split("[")[0] for r in v}
        for k, v in _project()["optional-dependencies"].items()
    }
    assert {"torch", "megatron-core"} <= extras["torch"]
    assert {"jax", "flax"} <= extras["jax"]
    assert (
        "mcore-hookspec" in extras["jax"]
    )  # with [torch]: hookcheck runs the processors under test
    assert "mcore-hookspec[torch]" in _project()["optional-dependencies"]["jax"]
    assert _project()["scripts"]["hookcheck"] == "jax_ref.check.hookcheck:main"
    assert {"nbclient", "nbformat", "ipykernel"} <= extras[
        "notebooks"
    ]  # what test_notebooks executes with


def test_requirements_pin_the_two_megatron_releases_and_the_gpu_machines_torch() -> None:
    py312 = (ROOT / "requirements" / "py312.txt").read_text().split()
    py311 = (ROOT / "requirements" / "py311.txt").read_text().split()
    assert "megatron-core==0.19.2" in py312 and "torch==2.11.0" in py312  # the GPU machine's
    assert "triton==3.6.0" in py312
    assert "megatron-core==0.16.1" in py311 and "torch==2.13.0" in py311


def test_changelog_top_entry_is_the_version() -> None:
    """``CHANGELOG.md``'s first ``## <version>`` is ``pyproject.toml``'s version: a
    version is not bumped without its entry, nor an entry written for another. Above it
    may stand one ``## Unreleased`` entry, what the next version will hold."""
    heads = re.findall(r"^## (\S+)\s*$", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    if heads[:1] == ["Unreleased"]:
        heads = heads[1:]
    assert heads, "CHANGELOG.md has no '## <version>' entry"
    assert heads[0] == _project()["version"], (heads[0], _project()["version"])
    assert all(re.fullmatch(r"\d+\.\d+\.\d+", v) for v in heads), heads  # semantic versions
    versions = [tuple(map(int, v.split("."))) for v in heads]
    assert versions == sorted(versions, reverse=True), heads  # newest first


def test_every_package_is_marked_typed() -> None:
    """PEP 561: each package ships ``py.typed`` (test_install_wheel.py checks the wheel)."""
    for package in ("hookspec", "torch_impl", "jax_ref"):
        assert (ROOT / package / "py.typed").is_file(), package
