"""zckpt: a toolkit for DeepSpeed ZeRO checkpoints.

Public API (imported lazily, so ``import zckpt`` is cheap); one function per command, its parameters the
command's options (``--fsync`` -> ``fsync=``, ``--latest`` -> ``latest=``, ``--tie`` -> ``ties=``; docs/guide.md)::

    zckpt.open_checkpoint(path, tag=None) -> Checkpoint   # metadata only, no tensor bytes
    zckpt.info(path, tag=None, *, latest=False) -> dict   # the fields of info --json
    zckpt.verify(path, tag=None, deep=False, *, latest=False) -> VerifyReport
    zckpt.merge(path, out, fmt="safetensors", dtype="fp32", ...)
    zckpt.iter_tensors(path, dtype="fp32") -> iterator of (name, tensor)
    zckpt.load_state_dict(path, dtype="fp32") -> dict
    zckpt.load_into_module(module, path, strict=True)
    zckpt.reshard(path, out, world_size=..., stage=None, ...)
    zckpt.convert(path, out, to="dcp" | "deepspeed" | ...)  # between formats, whole training state
    zckpt.diff(a, b, ...) / zckpt.push(src, dest, ...) / zckpt.estimate(...)
    every result: .to_dict(), the fields --json prints
    zckpt.diff(a, b, only=None, atol=None, ...) -> DiffResult   # two checkpoints of any formats, tensor by tensor
    from zckpt.integrations import fsdp2                    # DCP -> FSDP2 in one call, groups from the checkpoint
    fsdp2.load(model, optimizer, path, scheduler=None); fsdp2.param_groups(model, path)

Every function that reads or writes a URL (``s3://``, ``hf://``...) takes ``storage_options={...}`` (fsspec
options: endpoint, credentials...) for that call only; nothing is kept process-wide.
"""

from __future__ import annotations

import sys as _sys


def _run_as_program() -> bool:
    """Whether this interpreter runs zckpt itself (``python -m zckpt``, the ``zckpt`` script), not a program that
    imports zckpt: only then is Ctrl-C during start-up zckpt's to answer."""
    argv = list(getattr(_sys, "orig_argv", []))[1:]
    while argv and argv[0].startswith("-") and argv[0] not in ("-m", "-c", "-"):
        argv = argv[2:] if argv[0] in ("-X", "-W", "-Q") else argv[1:]  # interpreter options (-S, -X importtime)
    if argv[:1] == ["-m"]:
        return argv[1:2] == ["zckpt"]
    return bool(argv) and argv[0].replace("\\", "/").rsplit("/", 1)[-1] in ("zckpt", "zckpt.exe", "zckpt-script.py")


if _run_as_program():  # a Ctrl-C before the CLI is loaded: one line, exit 130 (zckpt.cli._interrupts from then on)
    import os as _os
    import signal as _signal

    def _interrupted_while_starting(signum, frame):
        _os.write(2, b"zckpt: interrupted\n")
        args = _sys.argv[1:]
        if "--json" in (args[:args.index("--")] if "--" in args else args):  # errors are JSON too
            command = next((a for a in args if not a.startswith("-")), None)
            _os.write(1, ('{"ok": false, "command": %s, "error": {"type": "KeyboardInterrupt", "message": '
                          '"interrupted", "path": null, "hint": null, "exit_code": 130}}\n'
                          % ('"%s"' % command if command and command.isalnum() else "null")).encode())
        _os._exit(130)

    _signal.signal(_signal.SIGINT, _interrupted_while_starting)
    _signal.signal(_signal.SIGTERM, _interrupted_while_starting)

from zckpt.lazy import lazy_exports  # noqa: E402

__version__ = "0.1.0"

_LAZY = {
    "open_checkpoint": "zckpt.state.open",
    "Checkpoint": "zckpt.state.model",
    "info": "zckpt.api",
    "verify": "zckpt.api",
    "merge": "zckpt.api",
    "iter_tensors": "zckpt.ops.merge",
    "load_state_dict": "zckpt.ops.merge",
    "load_into_module": "zckpt.ops.merge",
    "reshard": "zckpt.api",
    "convert": "zckpt.api",
    "estimate": "zckpt.api",
    "diff": "zckpt.api",
    "push": "zckpt.api",
    "Pusher": "zckpt.backup.schedule",
}

from zckpt.errors import (  # noqa: E402, F401  (re-exported)
    CheckpointNotFound,
    CorruptFile,
    IncompleteCheckpoint,
    InvalidArgument,
    MissingDependency,
    OutputExists,
    StorageError,
    UnsafePickle,
    UnsupportedLayout,
    ZckptError,
)


__all__ = sorted(list(_LAZY) + [
    "CheckpointNotFound", "CorruptFile", "IncompleteCheckpoint", "InvalidArgument", "MissingDependency", "OutputExists",
    "StorageError", "UnsafePickle", "UnsupportedLayout", "ZckptError", "__version__",
])


__getattr__, _ = lazy_exports(__name__, _LAZY)


def __dir__() -> list[str]:
    """The public names only (no ``annotations``, no subpackages): what ``__all__`` lists."""
    return list(__all__)
