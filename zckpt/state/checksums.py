"""The input check of one checkpoint: which zip entries hold its bytes, and which tensors each entry holds.

:class:`zckpt.engine.checked.InputCheck` checks the CRC-32 of every input zip entry the engine reads; what it needs
to know about the checkpoint comes from here:

- ``entries_of(path)``: the entries the metadata read at open holds (every storage a rank file's pickles name,
  with the CRC-32 of its zip directory), or what the format's reader says (``crc_entries``: a DCP ``.distcp``
  file's items, each a torch zip at an offset, from ``.metadata``);
- ``describe(path, lo, hi)``: the tensors whose bytes lie in that entry ("the fp32 master of 'lm_head.weight' and
  3 more"), for the one-line error.

Every offline command (merge, reshard, convert both ways) and ``iter_tensors`` / ``load_state_dict`` check every
entry they read; :mod:`zckpt.ops.resume` checks the entries a rank reads whole (``max_fill``).
"""

from __future__ import annotations

from zckpt.encoding.safeload import Inert, LazyTensor
from zckpt.encoding.zipentries import ZipEntry
from zckpt.engine.checked import InputCheck
from zckpt.state.model import Checkpoint
from zckpt.state.formats import named

_WHAT = {"value": "", "exp_avg": "exp_avg of ", "exp_avg_sq": "exp_avg_sq of "}


def input_check(ckpt: Checkpoint, max_fill: float | None = None) -> InputCheck:
    """The :class:`InputCheck` of ``ckpt``'s files (see the module docstring)."""
    return InputCheck(entries_of(ckpt), describer(ckpt), ckpt.storage_options, max_fill)


def entries_of(ckpt: Checkpoint):
    crc_entries = named(ckpt.format).crc_entries  # the format's own, where its metadata read at open does not say
    if crc_entries is not None:
        return crc_entries(ckpt)
    known = stored_entries(ckpt)  # (InputCheck reads a file's own directory where a span falls outside these)
    return lambda path: known.get(path, [])


def stored_entries(ckpt: Checkpoint) -> dict[str, list[ZipEntry]]:
    """Every storage entry the checkpoint's metadata (read at open, through the allow-list) names, with the CRC-32
    its zip directory gave: per file, so nothing is read again (resume's reads stay each source byte once)."""
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
