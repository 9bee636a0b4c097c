"""Where ``zckpt push`` sends checkpoints: a local folder, S3 or any fsspec URL (:class:`FsDestination`,
:mod:`zckpt.backup.objectstore`) or a Hugging Face Hub repository (:class:`HubDestination`,
:mod:`zckpt.backup.hub`); :func:`make_destination` picks one for a DEST.

A destination lists what is already there (size, sha256 or git blob id), sends the files that differ in
parallel through the push's pool, and writes ``zckpt-manifest.json`` last: a checkpoint at DEST without its
manifest is not complete (the manifest is the commit marker of :mod:`zckpt.io.publish`'s object-store rule, withdrawn
before a changed checkpoint's files are replaced). On the Hub files and manifest go in one commit.
"""

from __future__ import annotations

import os

from zckpt.errors import StorageError
from zckpt.io import storage
from zckpt.backup.hub import HubDestination
from zckpt.backup.objectstore import FsDestination


def make_destination(dest, storage_options: dict | None = None, *, hub_api=None, part_size: int | None = None):
    """A destination object for a local path / URL (``hf://`` -> :class:`HubDestination`)."""
    if isinstance(dest, (FsDestination, HubDestination)):
        return dest
    dest = os.fspath(dest)
    if storage.protocol(dest) == "hf":
        try:
            return HubDestination(dest, api=hub_api)
        except ImportError as exc:  # said about DEST, as every other missing backend is about the URL given
            raise StorageError("no backend for hf:// is installed", path=dest,
                               hint="pip install 'zckpt[hub]'") from exc
    return FsDestination(dest, storage_options, part_size=part_size)
