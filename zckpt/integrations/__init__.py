"""Framework glue. Importing this package needs no framework; ``ZckptPushCallback`` imports transformers."""

from __future__ import annotations

from zckpt.lazy import lazy_exports

_LAZY = {"ZckptPushCallback": "zckpt.integrations.trainer", "resume_anywhere": "zckpt.integrations.resume",
         "patch_deepspeed": "zckpt.integrations.resume", "unpatch_deepspeed": "zckpt.integrations.resume"}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
