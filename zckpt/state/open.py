"""The one opener: each format that reads is asked, in the registry's order (:mod:`zckpt.state.formats`), whether a
path is its own; the first that says yes reads it.

A format declares ``claims(path, storage_options) -> bool`` (from a listing or a small file, never tensor bytes)
and ``read(path, tag, storage_options) -> Checkpoint`` (metadata only; its records pass check_records), with its
optional abilities beside them (the zip entries guarding its bytes, merge's view, the training state for another
format's writer, its side files): :class:`zckpt.state.formats.Format`. Asking a format imports its reader only, so
opening a ZeRO-2 checkpoint imports the DeepSpeed reader and ``zero12``, nothing else.

DeepSpeed comes last and claims whatever the others leave: its discovery (``zckpt.deepspeed.discover.locate``)
is what explains, in one line, why a folder is no checkpoint at all.
"""

from __future__ import annotations

from zckpt.errors import StorageError
from zckpt.io import storage
from zckpt.state import formats
from zckpt.state.formats import Format
from zckpt.state.model import Checkpoint


def format_named(name: str) -> Format:
    """The format called ``name`` (``Checkpoint.format``)."""
    return formats.named(name)


def format_of(path: str, storage_options: dict | None = None) -> Format:
    """The format that claims ``path`` first (DeepSpeed, the last reader, claims whatever is left). A URL whose
    scheme has no backend installed is refused naming the URL given, not the first file a reader looked for."""
    try:
        for fmt in formats.readers():
            if fmt.claims(path, storage_options):
                return fmt
    except StorageError as exc:
        if isinstance(exc.__cause__, ImportError) and exc.path != str(path):
            raise StorageError(exc.message, path=str(path), hint=exc.hint) from exc.__cause__
        raise
    raise AssertionError("unreachable: the last reader claims every path")


def open_checkpoint(path: str, tag: str | None = None, storage_options: dict | None = None) -> Checkpoint:
    """Describe the checkpoint at ``path``: a DeepSpeed save folder, tag folder or Trainer ``checkpoint-N``, a DCP
    folder (FSDP2's ``dcp.save``, a Trainer FSDP ``checkpoint-N``), a Megatron-Core ``torch_dist`` save or
    ``iter_NNNNNNN`` folder, local or a URL; metadata only.

    ``tag`` picks a DeepSpeed tag or a Megatron iteration (a DCP folder holds one checkpoint, and refuses it). ``storage_options``: fsspec
    options for a URL ``path`` (e.g. ``{"endpoint_url": ..., "key": ..., "secret": ...}`` for S3); every read
    uses them, and the result keeps them as ``ckpt.storage_options`` for whatever reads its bytes later. Nothing is
    kept process-wide: two checkpoints opened with different options stay apart."""
    with storage.listings_kept():  # each format's claims and then its read ask the same folders: listed once
        return format_of(path, storage_options).read(path, tag, storage_options)
