"""What a user asks zckpt for, one module each: merge, reshard (and its universal layout), verify, info,
estimate, push (with scan: which local checkpoints are complete, and destinations: where they go).

Each plans as plain data and executes with :mod:`zckpt.engine.executor`, publishing through :mod:`zckpt.io.publish`. The
public functions are re-exported lazily by :mod:`zckpt` (``zckpt.merge(...)`` is the function; this package holds
the modules), and the CLI (:mod:`zckpt.cli`) is a thin layer over them (docs/architecture.md).
"""
