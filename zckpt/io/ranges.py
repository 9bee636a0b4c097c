"""Opening a remote torch file for its metadata in a few parallel rounds, nothing fetched twice
(:func:`open_ranges`, :class:`RangeFile`; part of :mod:`zckpt.io.storage`)."""

from __future__ import annotations

import bisect
import os
import threading
from typing import Any

from zckpt.errors import StorageError
from zckpt.io import fetched
from zckpt.io.filesystems import PASSTHROUGH
from zckpt.io.meters import count_read
from zckpt.io.reading import REMOTE_BLOCK_SIZE, read_range, size
from zckpt.io.s3 import S3Object, is_boto_error, raise_boto

# Opening a remote torch file for its metadata (:func:`open_ranges`): the first GET asks for the last TAIL_BYTES
# (the zip directory; a file this small comes whole) and, at the same time, the first HEAD_BYTES (the headers and
# the pickle); the readers then :meth:`RangeFile.prefetch` everything else they will read in one parallel round.
TAIL_BYTES = 1 << 20
HEAD_BYTES = 1 << 20
WHOLE_BYTES = 4 << 20  # a file of known size up to this is fetched whole, in one GET
PREFETCH_GAP = 256 << 10  # wanted ranges closer than this are fetched in one GET (the gap is read too)
_META_THREADS = 16
_meta_pool = None
_meta_pool_lock = threading.Lock()


def _pool():
    global _meta_pool
    with _meta_pool_lock:
        if _meta_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _meta_pool = ThreadPoolExecutor(_META_THREADS, thread_name_prefix="zckpt-meta")
        return _meta_pool


def _coalesce(spans, gap: int) -> list[list[int]]:
    merged: list[list[int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return merged


class RangeFile:
    """A remote file opened for random reads of its metadata: every byte range fetched is kept and never fetched
    again; reads of bytes not fetched yet GET at least ``block_size`` (``REMOTE_BLOCK_SIZE``) from there.

    :meth:`prefetch` fetches a list of wanted ranges in one round, in parallel (neighbours closer than
    ``PREFETCH_GAP`` as one GET). Reads stay ordinary ``seek``/``read`` calls, so a reader checks exactly the
    same bytes whether they came ahead or on demand. Meant for headers and pickles (what it fetched is held in
    memory until it is closed), not tensor bytes."""

    def __init__(self, path: str, storage_options: dict[str, Any] | None = None, *, size_hint: int | None = None,
                 block_size: int = REMOTE_BLOCK_SIZE):
        self.path, self.storage_options, self.block_size = path, storage_options, block_size
        self.starts: list[int] = []  # sorted, non-overlapping blocks: starts[i] .. starts[i] + len(datas[i])
        self.datas: list[bytes] = []
        self.pos = 0
        self.requests = 0
        self._lock = threading.Lock()
        s3 = S3Object.of(path, storage_options)
        if size_hint is not None and size_hint < 0:
            size_hint = None
        if s3 is None:
            self.size = size(path, storage_options)
            self._fetch([(max(0, self.size - TAIL_BYTES), self.size)])
        elif size_hint is not None and size_hint <= WHOLE_BYTES:  # a small file: all of it, one GET
            data, self.size = s3.get()
            self.requests += 1
            self._add(0, data)
        else:  # its size and last bytes in one GET (Content-Range); with a size known, its first bytes beside it
            head = None
            if size_hint is not None:
                head = _pool().submit(_get_range, s3, 0, min(HEAD_BYTES, max(0, size_hint - TAIL_BYTES)))
            tail, self.size = s3.get(suffix=TAIL_BYTES)
            self.requests += 1
            self._add(self.size - len(tail), tail)
            if head is not None:
                try:
                    data = head.result()
                except (FileNotFoundError, StorageError):
                    data = b""  # (changed since its size was taken): read on demand
                self.requests += 1
                self._add_missing(0, data[:self.size])

    # --------------------------------------------------------------------------- blocks

    def _add(self, start: int, data: bytes) -> None:
        if not data:
            return
        with self._lock:
            i = bisect.bisect(self.starts, start)
            self.starts.insert(i, start)
            self.datas.insert(i, bytes(data))
        count_read(self.path, len(data))

    def _add_missing(self, start: int, data: bytes) -> None:
        """Keep the parts of ``data`` (bytes at ``start``) that no block holds yet."""
        for lo, hi in self._missing(start, start + len(data)):
            self._add(lo, data[lo - start:hi - start])

    def _missing(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The parts of ``[lo, hi)`` that no block holds."""
        out, pos = [], lo
        with self._lock:
            i = max(0, bisect.bisect(self.starts, lo) - 1)
            while pos < hi and i < len(self.starts):
                s, e = self.starts[i], self.starts[i] + len(self.datas[i])
                if e <= pos:
                    i += 1
                    continue
                if s > pos:
                    out.append((pos, min(s, hi)))
                pos = max(pos, e)
                i += 1
        if pos < hi:
            out.append((pos, hi))
        return out

    def _fetch(self, spans: list[tuple[int, int]]) -> None:
        """GET every span (several in parallel)."""
        spans = [(lo, min(hi, self.size)) for lo, hi in spans if lo < min(hi, self.size)]
        if len(spans) == 1:
            lo, hi = spans[0]
            datas = [read_range(self.path, lo, hi - lo, self.storage_options, count=False)]
        else:
            futures = [_pool().submit(read_range, self.path, lo, hi - lo, self.storage_options, count=False)
                       for lo, hi in spans]
            datas = [f.result() for f in futures]
        self.requests += len(spans)
        for (lo, _), data in zip(spans, datas):
            self._add_missing(lo, data)

    def prefetch(self, ranges) -> None:
        """Fetch the bytes of ``ranges`` ((offset, end) pairs) not held yet, in one round of parallel GETs."""
        spans = [span for lo, hi in ranges for span in self._missing(max(0, lo), min(hi, self.size))]
        if spans:
            self._fetch([(lo, hi) for lo, hi in _coalesce(spans, PREFETCH_GAP)])

    # --------------------------------------------------------------------------- file protocol

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        self.pos = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence] + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        lo = self.pos
        hi = self.size if n is None or n < 0 else min(self.size, lo + n)
        if hi <= lo:
            return b""
        missing = self._missing(lo, hi)
        if missing:  # read ahead from the first missing byte, up to the next block held
            ahead = self._missing(missing[0][0], min(self.size, max(hi, missing[0][0] + self.block_size)))
            self._fetch([s for s in ahead if s[0] < hi or s is ahead[0]])
        out = bytearray()
        with self._lock:
            i = max(0, bisect.bisect(self.starts, lo) - 1)
            pos = lo
            while pos < hi and i < len(self.starts):
                s, d = self.starts[i], self.datas[i]
                if s <= pos < s + len(d):
                    k = min(hi, s + len(d)) - pos
                    out += memoryview(d)[pos - s:pos - s + k]
                    pos += k
                i += 1
        self.pos = lo + len(out)
        return bytes(out)

    def close(self) -> None:
        if self.starts:
            fetched.keep(self.path, self.starts, self.datas)
        self.starts, self.datas = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _get_range(s3: "S3Object", offset: int, length: int) -> bytes:
    return s3.get(offset, length)[0] if length > 0 else b""


def open_ranges(path: str | os.PathLike, storage_options: dict[str, Any] | None = None,
                size_hint: int | None = None) -> RangeFile:
    """A URL opened for reading its metadata (:class:`RangeFile`), in as few round trips as its size allows:
    ``size_hint`` (the size a listing or HEAD gave) up to ``WHOLE_BYTES``: the whole file in one GET; larger: its
    last ``TAIL_BYTES`` (the zip directory) and first ``HEAD_BYTES`` side by side; unknown: the last bytes first.
    The rest is fetched as it is read or prefetched."""
    path = os.fspath(path)
    try:
        return RangeFile(path, storage_options, size_hint=size_hint)
    except Exception as exc:
        if isinstance(exc, PASSTHROUGH) or not is_boto_error(exc):
            raise
        raise_boto(exc, path, "open")
