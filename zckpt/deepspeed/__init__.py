"""DeepSpeed's on-disk formats, read and written as a peer of the other formats (docs/architecture.md).

Reader: :mod:`zckpt.deepspeed.reader` (the opener's ``claims`` / ``read``; discovery, then ZeRO-0/1/2/3, BF16
optimizer, pipeline, MoE, AutoEP, AutoTP or universal). Writer: :mod:`zckpt.deepspeed.writer` (native rank files
at any world size and stage, or the universal layout; DeepSpeed's partition maths in
:mod:`zckpt.deepspeed.partition`). ``zckpt.deepspeed.load_checkpoint`` (resume a live engine at another
world size or stage) is the public name of :func:`zckpt.ops.resume.load_checkpoint`, looked up on first use (it
needs DeepSpeed, and it is an operation built on the reshard planner, a layer above the readers)."""

from __future__ import annotations

from zckpt.lazy import lazy_exports

_LAZY = {"load_checkpoint": "zckpt.ops.resume", "resume_anywhere": "zckpt.ops.resume",
         "patch_deepspeed": "zckpt.ops.resume", "unpatch_deepspeed": "zckpt.ops.resume"}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
