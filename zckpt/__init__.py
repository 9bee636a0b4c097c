"""zckpt: a toolkit for DeepSpeed ZeRO checkpoints.

Public API (imported lazily, so ``import zckpt`` is cheap)::

    zckpt.open_checkpoint(path, tag=None) -> Checkpoint   # metadata only, no tensor bytes
    zckpt.merge(path, out, fmt="safetensors", dtype="fp32", ...)
    zckpt.iter_tensors(path, dtype="fp32") -> iterator of (name, tensor)
    zckpt.load_state_dict(path, dtype="fp32") -> dict
    zckpt.load_into_module(module, path, strict=True)
    zckpt.reshard(path, out, world_size=..., stage=None, ...)
    zckpt.estimate(...)

Every function that reads or writes a URL (``s3://``, ``hf://``...) takes ``storage_options={...}`` (fsspec
options: endpoint, credentials...) for that call only; nothing is kept process-wide.
"""

from __future__ import annotations

from zckpt.lazy import lazy_exports

__version__ = "0.1.0"

_LAZY = {
    "open_checkpoint": "zckpt.deepspeed.layout",
    "Checkpoint": "zckpt.deepspeed.layout",
    "verify": "zckpt.ops.verify",
    "merge": "zckpt.ops.merge",
    "iter_tensors": "zckpt.ops.merge",
    "load_state_dict": "zckpt.ops.merge",
    "load_into_module": "zckpt.ops.merge",
    "reshard": "zckpt.ops.reshard",
    "estimate": "zckpt.ops.estimate",
    "push": "zckpt.ops.push",
    "Pusher": "zckpt.ops.push",
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


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
