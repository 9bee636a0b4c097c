"""zckpt: a toolkit for DeepSpeed ZeRO checkpoints.

Public API (imported lazily, so ``import zckpt`` is cheap)::

    zckpt.open_checkpoint(path, tag=None) -> Checkpoint   # metadata only, no tensor bytes
    zckpt.merge(path, out, fmt="safetensors", dtype="fp32", ...)
    zckpt.iter_tensors(path, dtype="fp32") -> iterator of (name, tensor)
    zckpt.load_state_dict(path, dtype="fp32") -> dict
    zckpt.load_into_module(module, path, strict=True)
    zckpt.reshard(path, out, world_size=..., stage=None, ...)
    zckpt.estimate(...)
"""

from __future__ import annotations

import importlib
import sys
import types

__version__ = "0.1.0"

_LAZY = {
    "open_checkpoint": "zckpt.deepspeed.layout",
    "Checkpoint": "zckpt.deepspeed.layout",
    "verify": "zckpt.verify",
    "merge": "zckpt.merge",
    "iter_tensors": "zckpt.merge",
    "load_state_dict": "zckpt.merge",
    "load_into_module": "zckpt.merge",
    "reshard": "zckpt.reshard",
    "estimate": "zckpt.estimate",
    "push": "zckpt.push",
    "Pusher": "zckpt.push",
}

from zckpt.errors import (  # noqa: E402, F401  (re-exported)
    CheckpointNotFound,
    CorruptFile,
    IncompleteCheckpoint,
    InvalidArgument,
    OutputExists,
    StorageError,
    UnsafePickle,
    UnsupportedLayout,
    ZckptError,
)


__all__ = sorted(list(_LAZY) + [
    "CheckpointNotFound", "CorruptFile", "IncompleteCheckpoint", "InvalidArgument", "OutputExists", "StorageError",
    "UnsafePickle", "UnsupportedLayout", "ZckptError", "__version__",
])


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zckpt' has no attribute {name!r}")


class _Package(types.ModuleType):
    """Keeps ``zckpt.merge`` (and friends) the API function even after ``import zckpt.merge``: the import system
    sets a parent attribute to each submodule it loads, which would otherwise hide the function of the same name.
    Import submodules with ``from zckpt.merge import ...`` (or ``sys.modules``); ``zckpt.merge`` is the function."""

    def __setattr__(self, name, value):
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
