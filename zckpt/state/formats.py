"""The format registry: each format package declares, in one object, what it reads and what it writes.

A format package has a ``format`` module whose ``FORMAT`` is a :class:`Format`: a small protocol, as DCP's
``StorageReader`` / ``StorageWriter`` are. Its methods import the package's own modules when first called, so that
asking a format whether a path is its own imports that format's reader and nothing else (opening a ZeRO-2
checkpoint imports the DeepSpeed reader and ``zero12`` only). An ability a format does not have is ``None``::

    name                                      the name readers put in Checkpoint.format
    claims(path, storage_options) -> bool     None: the format is written, never read
    read(path, tag, storage_options)          -> Checkpoint (metadata only; every record passes check_records)
    crc_entries(ckpt)                         (path -> [ZipEntry]): the zip entries guarding ckpt's bytes where the
                                              metadata read at open does not hold them (DCP's items)
    merge_view(ckpt, dtype)                   (ckpt, files, notes): merge's records under Hugging Face names
    training_state(ckpt, groups, native)      ckpt with what the reader could not place (Megatron's param groups,
                                              stated by the user), for convert's writers
    side_state(ckpt)                          what a training state holds beside model and optimizer (counters,
                                              scheduler; what is left out and why)
    side_files(ckpt)                          [CheckpointFile]: the files beside the state that a writer carries
                                              over as they are (a Trainer checkpoint's own files)
    plan_convert(ckpt, out, options)          the format's convert writer: ``options`` (a dict of the target's
                                              options) -> a plan the engine executes (``plan.engine``)
    convert_options                           the option names ``plan_convert`` takes (the rest are refused)
    preload()                                 import the reader now (resume, at a trainer's start-up)

:data:`REGISTRY` lists the format modules in the order the opener asks them; a new format is a package with its
``format`` module and one line here (docs/architecture.md). Operations ask :func:`named` for a format's abilities;
nothing else looks a format up by module name.
"""

from __future__ import annotations

import importlib
from typing import Callable

# claim order: Megatron's torch_dist is a DCP folder too (it has .metadata): asked before DCP; DeepSpeed comes last
# among the readers and claims whatever the others leave (its discovery says why a folder is no checkpoint at all);
# a Hugging Face folder (weights only, never a folder holding a training checkpoint) is asked before it
REGISTRY = ("zckpt.megatron.format", "zckpt.dcp.format", "zckpt.hf.format", "zckpt.deepspeed.format")


class Format:
    """What one format package reads and writes (see the module docstring); subclassed once per package."""

    name: str = ""
    claims: Callable | None = None
    read: Callable | None = None
    crc_entries: Callable | None = None
    merge_view: Callable | None = None
    training_state: Callable | None = None
    side_state: Callable | None = None
    side_files: Callable | None = None
    plan_convert: Callable | None = None
    convert_options: tuple = ()

    def preload(self) -> None:
        """Import the format's reader now (a trainer's start-up, rather than its first load)."""

    def __repr__(self) -> str:
        can = [a for a in ("read", "crc_entries", "merge_view", "training_state", "side_state", "side_files",
                           "plan_convert") if getattr(self, a) is not None]
        return f"<Format {self.name!r}: {', '.join(can)}>"


_LOADED: dict[str, Format] = {}


def _load(module: str) -> Format:
    fmt = _LOADED.get(module)
    if fmt is None:
        fmt = importlib.import_module(module).FORMAT
        _LOADED[module] = fmt
    return fmt


def readers():
    """The formats that read, in claim order (each module imported when reached)."""
    for module in REGISTRY:
        fmt = _load(module)
        if fmt.claims is not None:
            yield fmt


def named(name: str) -> Format:
    """The format called ``name`` (``Checkpoint.format``, or convert's ``--to``); KeyError when none is."""
    for module in REGISTRY:
        if _load(module).name == name:
            return _load(module)
    raise KeyError(name)


def names(ability: str | None = None) -> list[str]:
    """The registered formats' names, in registry order; with ``ability``: those that have it."""
    return [f.name for f in map(_load, REGISTRY) if ability is None or getattr(f, ability) is not None]
