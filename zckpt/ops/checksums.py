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
    if ckpt.format != "dcp":  # what the metadata read at open already holds (InputCheck reads a file's directory
        known = stored_entries(ckpt)  # itself where a span falls outside these)
        return lambda path: known.get(path, [])
    from zckpt.dcp import reader as dcp_reader
    by_file = dcp_reader.items(ckpt)
    return lambda path: item_entries(path, [(off, n) for off, n, _ in by_file.get(path, ())], opts)


def stored_entries(ckpt: Checkpoint) -> dict[str, list[ZipEntry]]:
    """Every storage entry the checkpoint's metadata (read at open, through the allow-list) names, with the CRC-32
    its zip directory gave: per file, so nothing is read again (resume's reads stay each source byte once)."""
    from zckpt.formats.safeload import Inert, LazyTensor
    out: dict[str, dict[int, ZipEntry]] = {}
    seen: set[int] = set()
    todo = [ckpt.model_state, ckpt.model_states, ckpt.optim_states]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, LazyTensor):
            s = obj.storage
            if s.crc is not None and s.offset >= 0:
                out.setdefault(s.path, {})[s.offset] = ZipEntry(f"archive/data/{s.key}", -1, s.offset, s.nbytes,
                                                                s.crc)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif isinstance(obj, Inert):
            todo.extend(vars(obj).values())
    return {path: list(entries.values()) for path, entries in out.items()}


def item_entries(path: str, items: list[tuple[int, int]], storage_options: dict | None = None) -> list[ZipEntry]:
    """The entries of the torch zips at ``(offset, length)`` ``items`` of a DCP data file, at their offsets in it."""
    from zckpt.dcp.reader import Window
    from zckpt.formats.zipentries import read_entries
    out = []
    opener = storage.open_ranges if storage.is_url(path) else storage.open_input
    with opener(path, storage_options) as f:
        for offset, length in items:
            for e in read_entries(Window(f, offset, length), length, path).values():
                out.append(ZipEntry(e.name, offset + e.header_offset, offset + e.data_offset, e.size, e.crc))
    return out


def distcp_entries(path: str) -> list[ZipEntry] | None:
    """The entries of a local ``.distcp`` file's items, from the ``.metadata`` beside it (None without one)."""
    import os
    from zckpt.formats import dcpmeta
    meta = os.path.join(os.path.dirname(path), ".metadata")
    if not os.path.isfile(meta):
        return None
    with open(meta, "rb") as f:
        md = dcpmeta.read_metadata(f.read(), meta)
    name = os.path.basename(path)
    items = [(c.offset, c.length) for te in md.tensors.values() for c in te.chunks if c.file == name]
    items += [(v.offset, v.length) for v in md.values.values() if v.file == name]
    return item_entries(path, sorted(items))


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
