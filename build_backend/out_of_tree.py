"""The project's PEP 517 build backend: setuptools' own, run on a copy of the
sources so that building from a checkout writes nothing into it.

``setuptools.build_meta`` writes ``build/`` and ``*.egg-info`` into the source
tree while it builds a wheel or an sdist; a read-only or shared checkout (a
container image, a cluster's software tree) must stay as it was. Here the wheel,
the sdist and the wheel's metadata are built by ``setuptools.build_meta`` in a
temporary copy of the files a distribution holds (:data:`SOURCES`), and only
the artefact lands in the directory the frontend asked for. An editable install
(``pip install -e .``) works in place, as setuptools' does: it is the checkout.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from setuptools import build_meta as _setuptools

__all__ = [
    "SOURCES",
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]

SOURCES = ("pyproject.toml", "README.md", "LICENSE", "hookspec", "torch_impl", "jax_ref")
"""What a distribution is built from (the packages of ``[tool.setuptools.packages.find]``)."""

_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")


@contextlib.contextmanager
def _in_a_copy() -> Iterator[None]:
    """Run the body in a temporary copy of :data:`SOURCES` of the current directory."""
    here = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="mcore-hookspec-build-") as tmp:
        for name in SOURCES:
            source = here / name
            if source.is_dir():
                shutil.copytree(source, Path(tmp) / name, ignore=_SKIP)
            elif source.is_file():
                shutil.copy2(source, Path(tmp) / name)
        os.chdir(tmp)
        try:
            yield
        finally:
            os.chdir(here)


def _absolute(directory: str) -> str:
    return os.path.abspath(directory)


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    with _in_a_copy():
        return list(_setuptools.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_sdist(config_settings: dict[str, Any] | None = None) -> list[str]:
    with _in_a_copy():
        return list(_setuptools.get_requires_for_build_sdist(config_settings))


def prepare_metadata_for_build_wheel(
    metadata_directory: str, config_settings: dict[str, Any] | None = None
) -> str:
    out = _absolute(metadata_directory)
    with _in_a_copy():
        return str(_setuptools.prepare_metadata_for_build_wheel(out, config_settings))


def build_wheel(
    wheel_directory: str,
    config_settings: dict[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    out = _absolute(wheel_directory)
    meta = None if metadata_directory is None else _absolute(metadata_directory)
    with _in_a_copy():
        return str(_setuptools.build_wheel(out, config_settings, meta))


def build_sdist(sdist_directory: str, config_settings: dict[str, Any] | None = None) -> str:
    out = _absolute(sdist_directory)
    with _in_a_copy():
        return str(_setuptools.build_sdist(out, config_settings))


# An editable install is the checkout itself: setuptools' hooks, in place.
get_requires_for_build_editable = _setuptools.get_requires_for_build_editable
prepare_metadata_for_build_editable = _setuptools.prepare_metadata_for_build_editable
build_editable = _setuptools.build_editable
