"""A package's public names loaded on first use (PEP 562 module ``__getattr__``), so importing
the package (for one torch-free submodule, as the ingress does) does not import every module
behind its names, and torch with them (tests/test_ingress_imports.py)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_names(package: str, modules: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: name ``n`` is imported from the module
    ``modules[n]`` (relative to ``package``) when first asked for, then kept in the package."""

    def __getattr__(name: str) -> object:
        if name not in modules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(modules[name], package), name)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(modules))

    return __getattr__, __dir__
