"""Readers of DeepSpeed's on-disk formats (discovery, ZeRO-1/2, BF16 optimizer, ZeRO-3), and resuming a live
engine at another world size or stage (:func:`load_checkpoint`, imported lazily: it needs DeepSpeed)."""

from __future__ import annotations

import importlib

_LAZY = {"load_checkpoint": "zckpt.deepspeed.resume", "resume_anywhere": "zckpt.deepspeed.resume",
         "patch_deepspeed": "zckpt.deepspeed.resume", "unpatch_deepspeed": "zckpt.deepspeed.resume"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zckpt.deepspeed' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
