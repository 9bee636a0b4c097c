"""The zip entries that guard a Megatron ``torch_dist`` checkpoint's bytes: its ``.distcp`` items are DCP items
(:mod:`zckpt.encoding.distcp`), each a torch zip whose directory holds the CRC-32 of its entries.

- :func:`crc_entries`: the opener's hook (:mod:`zckpt.state.checksums`) for a ``Checkpoint`` this package read;
- :func:`items`: every item by data file (what ``verify --deep`` reads).
"""

from __future__ import annotations

from zckpt.encoding import distcp
from zckpt.state.model import Checkpoint


def crc_entries(ckpt: Checkpoint):
    """``entries(path)``: the entries of the items of each of ``ckpt``'s ``.distcp`` files."""
    return distcp.crc_entries_of(ckpt.extra["metadata"], ckpt.location.tag_dir, ckpt.storage_options)


def items(ckpt: Checkpoint) -> dict[str, list[tuple[int, int, str]]]:
    """Every item of the checkpoint by data file path: (offset, length, key), sorted."""
    return distcp.items_by_file(ckpt.extra["metadata"], ckpt.location.tag_dir)
