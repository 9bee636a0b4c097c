"""The one opener: each format's reader is asked, in turn, whether a path is its own; the first that says yes reads it.

A format is a package with a ``reader`` module that answers three things (:data:`READERS` lists them, by module
name, so that opening a checkpoint imports only the readers it asks, and no format package imports another)::

    FORMAT = "dcp"                                   the name readers put in Checkpoint.format
    claims(path, storage_options) -> bool            from a listing or a small file, never tensor bytes
    read(path, tag, storage_options) -> Checkpoint   metadata only (the format's readers, checked by check_records)
    CRC_ENTRIES = "zckpt.dcp.entries"                optional: a module whose crc_entries(ckpt) -> (path -> [ZipEntry])
                                                     gives the zip entries whose CRC-32 guard ckpt's bytes, where the
                                                     metadata read at open does not hold them (DCP's items)
    MERGE_VIEW = "zckpt.megatron.hf_names"           optional: a module whose merge_view(ckpt, dtype) -> (ckpt,
                                                     files, notes) gives merge Hugging Face names and a config.json
    STATE_VIEW = "zckpt.megatron.state"              optional: a module whose training_state(ckpt, groups,
                                                     native_names) places what the reader could not (Megatron's
                                                     param groups, stated by the user) for convert's writers, and
                                                     side_state(ckpt) gives the counters beside it

DeepSpeed comes last and claims whatever the others leave: its discovery (``zckpt.deepspeed.discover.locate``)
is what explains, in one line, why a folder is no checkpoint at all.
"""

from __future__ import annotations

import importlib

from zckpt.state.model import Checkpoint

# Megatron's torch_dist is a DCP folder too (it has .metadata): asked before DCP; a Hugging Face folder (weights
# only; never a folder that also holds a training checkpoint) before DeepSpeed, which claims whatever is left
READERS = ("zckpt.megatron.reader", "zckpt.dcp.reader", "zckpt.hf.reader", "zckpt.deepspeed.reader")
FORMATS = {"megatron": "zckpt.megatron.reader", "dcp": "zckpt.dcp.reader", "hf": "zckpt.hf.reader",
           "deepspeed": "zckpt.deepspeed.reader"}


def reader_of(fmt: str):
    """The reader module of the format named ``fmt`` (``Checkpoint.format``)."""
    return importlib.import_module(FORMATS[fmt])


def format_of(path: str, storage_options: dict | None = None) -> str:
    """The format whose reader claims ``path`` first (DeepSpeed, the last, claims whatever is left)."""
    for name in READERS:
        reader = importlib.import_module(name)
        if name == READERS[-1] or reader.claims(path, storage_options):
            return reader.FORMAT
    raise AssertionError("unreachable: the last reader claims every path")


def open_checkpoint(path: str, tag: str | None = None, storage_options: dict | None = None) -> Checkpoint:
    """Describe the checkpoint at ``path``: a DeepSpeed save folder, tag folder or Trainer ``checkpoint-N``, a DCP
    folder (FSDP2's ``dcp.save``, a Trainer FSDP ``checkpoint-N``), a Megatron-Core ``torch_dist`` save or
    ``iter_NNNNNNN`` folder, local or a URL; metadata only.

    ``tag`` picks a DeepSpeed tag or a Megatron iteration (a DCP folder holds one checkpoint, and refuses it). ``storage_options``: fsspec
    options for a URL ``path`` (e.g. ``{"endpoint_url": ..., "key": ..., "secret": ...}`` for S3); every read
    uses them, and the result keeps them as ``ckpt.storage_options`` for whatever reads its bytes later. Nothing is
    kept process-wide: two checkpoints opened with different options stay apart."""
    for name in READERS:
        reader = importlib.import_module(name)
        if name == READERS[-1] or reader.claims(path, storage_options):
            return reader.read(path, tag, storage_options)
    raise AssertionError("unreachable: the last reader claims every path")
