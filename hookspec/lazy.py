"""Names a package loads on first use (PEP 562), written once for every package's
``__init__`` (``torch_impl``, ``jax_ref``, ``jax_ref.check``)::

    _LAZY = LazyNames(__name__, {"name": ".module", ...})

    def __getattr__(name: str) -> Any:
        return _LAZY.load(name)

    def __dir__() -> list[str]:
        return _LAZY.names()

Imports the standard library only, as the rest of ``hookspec``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["LazyNames"]


class LazyNames:
    """The names of package ``package`` that load on first use: ``where`` maps each to
    the module holding it (absolute, or relative to the package: ``".enable"``);
    ``submodules`` load as ``package.<name>``. A loaded name is bound in the package, so
    that later lookups do not come here."""

    def __init__(
        self, package: str, where: Mapping[str, str], *, submodules: Iterable[str] = ()
    ) -> None:
        self.package = package
        self.where = dict(where)
        self.submodules = frozenset(submodules)

    def load(self, name: str) -> Any:
        """The value of ``package.name``, imported now; ``AttributeError`` for a name the
        package does not have."""
        if name in self.submodules:
            return importlib.import_module(f"{self.package}.{name}")  # binds package.<name> as well
        module = self.where.get(name)
        if module is None:
            raise AttributeError(f"module {self.package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, self.package), name)
        setattr(sys.modules[self.package], name, value)
        return value

    def names(self) -> list[str]:
        """``dir(package)``: what it holds, and what would load."""
        return sorted(set(vars(sys.modules[self.package])) | set(self.where) | self.submodules)
