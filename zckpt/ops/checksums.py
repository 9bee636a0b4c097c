"""The input check of one checkpoint: which zip entries hold its bytes, and which tensors each entry holds.

:class:`zckpt.engine.checked.InputCheck` checks the CRC-32 of every input zip entry the engine reads; what it needs
to know about the checkpoint comes from here:

- ``entries_of(path)``: the entries of a DeepSpeed rank file (its zip directory), or of a DCP ``.distcp`` file (the
  torch zip of each item, at its offset in the file, from ``.metadata``);
- ``describe(path, lo, hi)``: the tensors whose bytes lie in that entry ("the fp32 master of 'lm_head.weight' and
  3 more"), for the one-line error.

Every offline command (merge, reshard, convert both ways) and ``iter_tensors`` / ``load_state_dict`` check every
entry they read; :mod:`zckpt.ops.resume` checks the entries a rank reads whole (``max_fill``).
"""

from __future__ import annotations

from zckpt.engine.checked import InputCheck, zip_entries
from zckpt.formats.zipentries import ZipEntry
from zckpt.io import storage
from zckpt.state.model import Checkpoint

_WHAT = {"value": "", "exp_avg": "exp_avg of ", "exp_avg_sq": "exp_avg_sq of "}


def input_check(ckpt: Checkpoint, max_fill: float | None = None) -> InputCheck:
    """The :class:`InputCheck` of ``ckpt``'s files (see the module docstring)."""
    return InputCheck(entries_of(ckpt), describer(ckpt), ckpt.storage_options, max_fill)


def entries_of(ckpt: Checkpoint):
    opts = ckpt.storage_options
    if ckpt.format != "dcp":
        return lambda path: zip_entries(path, opts)
    from zckpt.dcp import reader as dcp_reader
    from zckpt.formats.zipentries import read_entries
    by_file = dcp_reader.items(ckpt)

    def dcp_entries(path: str) -> list[ZipEntry]:
        out = []
        opener = storage.open_ranges if storage.is_url(path) else storage.open_input
        with opener(path, opts) as f:
            for offset, length, _key in by_file.get(path, ()):
                for e in read_entries(dcp_reader.Window(f, offset, length), length, path).values():
                    out.append(ZipEntry(e.name, offset + e.header_offset, offset + e.data_offset, e.size, e.crc))
        return out

    return dcp_entries


def describer(ckpt: Checkpoint):
    """``describe(path, lo, hi)``: the tensors with bytes in [lo, hi) of ``path``, in words (built on first use)."""
    index: dict[str, list[tuple[int, int, str]]] = {}

    def build() -> None:
        for r in ckpt.records:
            master = "the fp32 master of " if r.kind == "trainable" and r.lp_dtype not in (None, r.dtype) else ""
            for field, what in _WHAT.items():
                for p in getattr(r, field):
                    label = f"{what or master}'{r.name}'" if what or master else f"'{r.name}'"
                    index.setdefault(p.path, []).append((p.offset, p.offset + p.nbytes, label))

    def describe(path: str, lo: int, hi: int) -> str:
        if not index:
            build()
        names = list(dict.fromkeys(label for a, b, label in index.get(path, ()) if a < hi and b > lo))
        if not names:
            return ""
        return names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")

    return describe
