"""The Python API: one function per command, its parameters the command's options under one vocabulary.

Each function is the operation it names (:mod:`zckpt.ops` ...), called with the options the command line has and
named as the flags are (``--fsync`` -> ``fsync=``, ``--latest`` -> ``latest=``, ``--tie`` / ``--no-tie`` ->
``ties=``, ``--follow-links`` -> ``follow_links=``, ``-o`` -> ``out``, the second positional parameter of merge,
reshard and convert alike); every result has ``.to_dict()``, the fields ``--json`` prints.
``tests/test_api.py`` compares each command's options with its function's parameters, so they cannot drift.
"""

from __future__ import annotations

import contextlib
import inspect
import os

def operation(name: str):
    """The operation the public function ``name`` calls."""
    if name == "merge":
        from zckpt.ops.merge import merge as op
    elif name == "reshard":
        from zckpt.ops.reshard import reshard as op
    elif name == "convert":
        from zckpt.ops.convert import convert as op
    elif name == "verify":
        from zckpt.ops.verify import verify as op
    elif name == "info":
        from zckpt.ops.info import info as op
    elif name == "diff":
        from zckpt.ops.diff import diff as op
    elif name == "push":
        from zckpt.backup.push import push as op
    elif name == "estimate":
        from zckpt.ops.estimate import estimate_memory as op
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return op


OPERATIONS = ("merge", "reshard", "convert", "verify", "info", "diff", "push", "estimate")
#: convert's target formats: a second positional argument naming one is the old order (path, to), refused
TARGETS = ("dcp", "deepspeed", "megatron")
#: an operation's parameter -> the name the API gives it (as the command line's flag says it)
RENAMED = {"durable": "fsync"}
#: parameters each function adds to its operation's: what the command line applies around the call
ADDED = {
    "latest": ("merge", "reshard", "convert", "verify", "info"),
    "ties": ("merge", "reshard", "convert", "verify", "info", "diff"),
    "follow_links": ("merge", "reshard", "convert", "verify", "info", "push", "estimate"),
}
#: parameters that come first, in this order (merge, reshard and convert: the checkpoint, then the output)
LEADING = ("path", "out")


def _signature(op, name: str) -> inspect.Signature:
    params = list(inspect.signature(op).parameters.values())
    lead = [p for n in LEADING for p in params if p.name == n]
    out = [p.replace(name=RENAMED.get(p.name, p.name)) for p in lead + [p for p in params if p not in lead]]
    added = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None if k == "ties" else False)
             for k, users in ADDED.items() if name in users]
    var_kw = [p for p in out if p.kind is p.VAR_KEYWORD]
    return inspect.Signature([p for p in out if p not in var_kw] + added + var_kw,
                             return_annotation=inspect.signature(op).return_annotation)


class Info(dict):
    """What ``zckpt.info`` returns: the fields ``info --json`` prints (a dict; dtypes as torch names them)."""

    def to_dict(self) -> dict:
        return dict(self)


@contextlib.contextmanager
def _around(ties, follow_links: bool):
    """What the command line sets for one command: the ties declared (``--tie``/``--no-tie``), links followed."""
    from zckpt.deepspeed.model import declared_ties
    from zckpt.io import links

    saved = os.environ.get(links.ENV)
    if follow_links:
        os.environ[links.ENV] = "1"
    try:
        # ties=None keeps what the caller declared around the call (``with declared_ties(...)``)
        with declared_ties(ties) if ties is not None else contextlib.nullcontext():
            yield
    finally:
        if follow_links:
            if saved is None:
                os.environ.pop(links.ENV, None)
            else:
                os.environ[links.ENV] = saved


def _make(name: str):
    op = operation(name)
    sig = _signature(op, name)
    back = {v: k for k, v in RENAMED.items()}

    def call(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        kw = {back.get(k, k): v for k, v in bound.arguments.items()}
        latest, ties, follow = kw.pop("latest", False), kw.pop("ties", None), kw.pop("follow_links", False)
        if name == "convert" and "to" not in bound.arguments and str(kw.get("out")) in TARGETS:
            from zckpt.errors import InvalidArgument  # the old order, convert(path, "deepspeed"): never guessed
            raise InvalidArgument(f"the second argument of convert is the output folder (as merge's and reshard's), "
                                  f"and {kw['out']!r} is a target format", param="out",
                                  hint=f"pass to={kw['out']!r} (and the output as the second argument), or "
                                       f"out='./{kw['out']}' for a folder of that name")
        with _around(ties, follow):
            if latest:
                from zckpt.backup.latest import newest_complete
                from zckpt.errors import InvalidArgument
                if kw.get("tag") is not None:
                    raise InvalidArgument("`latest` and `tag` do not go together (`latest` picks a checkpoint, "
                                          "`tag` a tag inside one)",
                                          hint="pass the checkpoint with `tag`, or `latest` alone")
                kw["path"] = newest_complete(os.fspath(kw["path"])).path
            result = op(**kw)
        return Info({**result, "tag": result.get("tag")}) if name == "info" else result

    call.__signature__ = sig
    call.__name__ = call.__qualname__ = name
    call.__doc__ = (op.__doc__ or "").replace("``durable``", "``fsync``").replace("durable=True", "fsync=True")
    call.__module__ = __name__
    return call


def __getattr__(name: str):
    if name in OPERATIONS:
        fn = _make(name)
        globals()[name] = fn
        return fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
