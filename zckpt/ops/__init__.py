"""What a user asks zckpt for, one module each: merge, reshard, convert (and to_deepspeed), verify, info, estimate,
resume. Each pairs a format's reader with a format's writer (docs/architecture.md) plus the options that are its
own, executes the plan with :mod:`zckpt.engine` and publishes through :mod:`zckpt.io.publish`. Push is the package
:mod:`zckpt.backup`.

The public functions are re-exported lazily by :mod:`zckpt` (``zckpt.merge(...)`` is the function; this package holds
the modules), and the CLI (:mod:`zckpt.cli`) is a thin layer over them.
"""
