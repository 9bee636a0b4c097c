"""Framework glue. Importing this package needs no framework; ``ZckptPushCallback`` imports transformers."""

from __future__ import annotations

import importlib

_LAZY = {"ZckptPushCallback": "zckpt.integrations.trainer", "resume_anywhere": "zckpt.integrations.resume",
         "patch_deepspeed": "zckpt.integrations.resume", "unpatch_deepspeed": "zckpt.integrations.resume"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zckpt.integrations' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
