"""Package attributes imported on first use (PEP 562), so ``import zckpt`` and its subpackages stay cheap."""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, table: dict[str, str]):
    """``__getattr__`` and ``__dir__`` for ``package``: ``table`` maps an attribute to the module defining it. The
    first lookup imports that module and caches the value on the package."""

    def __getattr__(name):
        if name in table:
            value = getattr(importlib.import_module(table[name]), name)
            setattr(sys.modules[package], name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
