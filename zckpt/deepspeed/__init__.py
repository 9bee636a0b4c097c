"""Readers of DeepSpeed's on-disk formats (discovery, ZeRO-0/1/2/3, BF16 optimizer, pipeline, MoE, AutoTP,
universal) and DeepSpeed's partition maths. ``zckpt.deepspeed.load_checkpoint`` (resume a live engine at another
world size or stage) is the public name of :func:`zckpt.ops.resume.load_checkpoint`, looked up on first use (it
needs DeepSpeed, and it is an operation built on the reshard planner, a layer above the readers)."""

from __future__ import annotations

import importlib

_LAZY = {"load_checkpoint": "zckpt.ops.resume", "resume_anywhere": "zckpt.ops.resume",
         "patch_deepspeed": "zckpt.ops.resume", "unpatch_deepspeed": "zckpt.ops.resume"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zckpt.deepspeed' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
