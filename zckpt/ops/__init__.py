"""What a user asks zckpt for, one module each: merge, reshard (and its universal layout), verify, info,
estimate. Push is the package :mod:`zckpt.backup` (``ops.push`` and ``ops.scan`` are deprecated aliases of it).

Each plans as plain data and executes with :mod:`zckpt.engine.executor`, publishing through :mod:`zckpt.io.publish`. The
public functions are re-exported lazily by :mod:`zckpt` (``zckpt.merge(...)`` is the function; this package holds
the modules), and the CLI (:mod:`zckpt.cli`) is a thin layer over them (docs/architecture.md).
"""
