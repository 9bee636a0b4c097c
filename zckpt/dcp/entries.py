"""The zip entries that guard a DCP checkpoint's bytes: each ``.distcp`` item is a torch.save zip at an offset of its
data file (:mod:`zckpt.dcp.reader` draws the files), and each zip's directory holds the CRC-32 of its entries.

- :func:`items`: every item of a checkpoint this package read, by data file (what ``verify --deep`` reads);
- :func:`crc_entries`: the opener's hook (:mod:`zckpt.state.checksums`) for a ``Checkpoint`` this package read;
- :func:`distcp_entries`: the same for one local ``.distcp`` file, from the ``.metadata`` beside it (what the
  backup's push checks a DCP file it uploads against).
"""

from __future__ import annotations

import os

from zckpt.encoding import dcpmeta, distcp
from zckpt.encoding.zipentries import ZipEntry
from zckpt.state.model import Checkpoint


def crc_entries(ckpt: Checkpoint):
    """``entries(path)``: the entries of the items of each of ``ckpt``'s data files (their directories are read on
    first use of a file)."""
    return distcp.crc_entries_of(ckpt.extra["metadata"], ckpt.location.tag_dir, ckpt.storage_options)


item_entries = distcp.item_entries  # (zckpt.encoding.distcp: the entries of items at spans of a data file)


def distcp_entries(path: str) -> list[ZipEntry] | None:
    """The entries of a local ``.distcp`` file's items, from the ``.metadata`` beside it (None without one)."""
    meta = os.path.join(os.path.dirname(path), ".metadata")
    if not os.path.isfile(meta):
        return None
    with open(meta, "rb") as f:
        md = dcpmeta.read_metadata(f.read(), meta)
    name = os.path.basename(path)
    spans = [(c.offset, c.length) for te in md.tensors.values() for c in te.chunks if c.file == name]
    spans += [(v.offset, v.length) for v in md.values.values() if v.file == name]
    return item_entries(path, sorted(spans))


def items(ckpt: Checkpoint) -> dict[str, list[tuple[int, int, str]]]:
    """Every item of a DCP checkpoint by data file path: (offset, length, key), sorted (what ``verify --deep``
    reads)."""
    return distcp.items_by_file(ckpt.extra["metadata"], ckpt.location.tag_dir)
