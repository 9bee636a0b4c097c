"""Bytes fetched while opening a checkpoint, kept for the block (:func:`keep_fetched`; part of
:mod:`zckpt.io.storage`): a ranged read that lies inside them is answered from memory."""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Iterator

_KEPT: list[dict[str, tuple[list[int], list[bytes]]]] = []  # active keep_fetched() blocks (almost always none)
_KEPT_LOCK = threading.Lock()


@contextlib.contextmanager
def keep_fetched() -> Iterator[None]:
    """While the block runs, the bytes :class:`zckpt.io.ranges.RangeFile` s fetched stay readable: a
    :func:`zckpt.io.reading.read_range` that lies inside them (a scalar a reader reads after the file's pickle) is
    answered from memory, not with a GET. Scoped to the block (opening one checkpoint), so a long-running process
    never reads stale bytes."""
    kept: dict[str, tuple[list[int], list[bytes]]] = {}
    with _KEPT_LOCK:
        _KEPT.append(kept)
    try:
        yield
    finally:
        with _KEPT_LOCK:  # by identity: two blocks' dicts may be equal (both empty)
            del _KEPT[next(i for i, k in enumerate(_KEPT) if k is kept)]


def kept_range(path: str, offset: int, length: int) -> bytes | None:
    """``length`` bytes of ``path`` from ``offset`` when a :func:`keep_fetched` block holds them all, else None."""
    if not _KEPT:
        return None
    with _KEPT_LOCK:
        for kept in _KEPT:
            starts, datas = kept.get(path, ((), ()))
            i = bisect.bisect(starts, offset) - 1
            if i >= 0 and offset + length <= starts[i] + len(datas[i]):
                return datas[i][offset - starts[i]:offset - starts[i] + length]
    return None


def keep(path: str, starts: list[int], datas: list[bytes]) -> None:
    """Hand the blocks a closing :class:`zckpt.io.ranges.RangeFile` fetched (``starts[i]`` .. ``+ len(datas[i])``,
    sorted) to the active :func:`keep_fetched` blocks (none active: nothing is kept)."""
    if not _KEPT:
        return
    with _KEPT_LOCK:
        for kept in _KEPT:
            kept[path] = (starts, datas)
