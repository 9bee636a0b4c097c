"""Read-ahead hints for local sources: as each job is handed to the pool, the kernel is told to start reading its
input ranges (``posix_fadvise(POSIX_FADV_WILLNEED)``), so that with the page cache cold the disk is kept busy by
the jobs queued behind the ones being read, not only by the threads reading.

The pool's threads read their jobs' bytes with ``pread`` into their buffers, each waiting for its own read; the
jobs in flight (``lanes``: up to four per thread) are known well ahead. A hint is only a hint: pages already in
the page cache cost a lookup (about 50 us per 4 MiB on the 2-core box, in the thread that deals the jobs), a
failure to open or advise is ignored (the job's own read reports it), and nothing read this way skips the job's
CRC check (the bytes are still read, and checked, by the job). Remote pieces are fetched ahead by
:func:`zckpt.engine.executor.run_jobs` instead.

On the lent 16-core host (docs/benchmarks.md, issue 49, sixteenth session), cold, median of five runs each: merge
bf16 1.85 s against 2.02 without, merge fp32 1.80 against 1.84, convert --to dcp 5.18 against 5.33 (its best run
was without: 4.84 against 5.17); warm, every job within its runs' spread. ``ZCKPT_READ_HINTS=0`` turns them off.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Iterator

from zckpt.engine.executor import input_pieces
from zckpt.io import storage

_ADVISE = getattr(os, "posix_fadvise", None)
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)


def enabled() -> bool:
    """Whether hints are given here: the platform has ``posix_fadvise`` and ``ZCKPT_READ_HINTS`` is not ``0``."""
    return _ADVISE is not None and _WILLNEED is not None and os.environ.get("ZCKPT_READ_HINTS", "1") != "0"


class _Cachestat:
    """``cachestat(2)`` (Linux 6.5+): how many pages of a file's range are in the page cache, without reading them."""

    def __init__(self):
        import ctypes
        self.ct = ctypes
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.rng = (ctypes.c_uint64 * 2)()
        self.out = (ctypes.c_uint64 * 5)()

    def cached(self, fd: int, off: int, n: int) -> int:
        self.rng[0], self.rng[1] = off, n
        if self.libc.syscall(451, fd, self.rng, self.out, 0) != 0:
            raise OSError(self.ct.get_errno(), "cachestat")
        return self.out[0] * 4096


class _ReadAhead:
    """ZCKPT_READ_HINTS=read (an experiment, issue 49): each job's local input ranges not yet in the page cache are
    read ahead by side threads, each (source file, output file) through its own descriptor and in the order dealt, so
    that the kernel sees sequential readers (large folios, its own read-ahead) rather than the pool's interleaved
    reads; the jobs read (and check) their bytes as before."""

    def __init__(self, threads: int = 8, block: int = 4 << 20):
        import threading
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor
        self.stat = _Cachestat()
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="zckpt-ahead")
        self.lock = threading.Lock()
        self.queues: dict = {}
        self.busy: set = set()
        self.fds: dict = {}
        self.block = block
        self.local = threading.local()
        self.deque = deque
        self.stopped = False

    def add(self, key, path: str, off: int, n: int) -> None:
        with self.lock:
            q = self.queues.setdefault(key, self.deque())
            q.append((path, off, n))
            if key in self.busy:
                return
            self.busy.add(key)
        self.pool.submit(self._drain, key)

    def _drain(self, key) -> None:
        buf = getattr(self.local, "buf", None)
        if buf is None:
            buf = self.local.buf = memoryview(bytearray(self.block))
        while True:
            with self.lock:
                q = self.queues[key]
                if not q or self.stopped:
                    self.busy.discard(key)
                    return
                path, off, n = q.popleft()
            try:
                fd = self.fds.get(key)
                if fd is None:
                    fd = self.fds[key] = os.open(path, os.O_RDONLY)
                st = self.stat.cached(fd, off, n)
                if st >= n - 4096:
                    continue
                end = off + n
                while off < end:
                    got = os.preadv(fd, [buf[:min(self.block, end - off)]], off)
                    if got <= 0:
                        break
                    off += got
            except OSError:  # the job's own read reports it
                continue

    def close(self) -> None:
        with self.lock:
            self.stopped = True
        self.pool.shutdown(wait=True)
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass


def local_ranges(parts: list) -> list[tuple[str, int, int]]:
    """(path, offset, nbytes) of a job's local input ranges (inside casts too), ranges of one file that touch or
    overlap merged, in the order first read."""
    out: list[list] = []
    last: dict[str, list] = {}
    for p in input_pieces(parts):
        if storage.is_url(p.path):
            continue
        r = last.get(p.path)
        if r is not None and r[1] <= p.offset <= r[1] + r[2]:
            r[2] = max(r[2], p.offset + p.nbytes - r[1])
        else:
            r = [p.path, p.offset, p.nbytes]
            last[p.path] = r
            out.append(r)
    return [tuple(r) for r in out]


def hinted(items: Iterable, parts_of: Callable, fd_of: Callable[[str], int]) -> Iterator:
    """``items`` as they are, each one's local input ranges (``parts_of(item)``) advised before it is yielded;
    ``fd_of(path)``: a read-only descriptor of the file (the worker's reader keeps them open)."""
    if not enabled():
        yield from items
        return
    if os.environ.get("ZCKPT_READ_HINTS") == "read":
        try:
            ahead = _ReadAhead()
        except (OSError, AttributeError):
            ahead = None
        if ahead is not None:
            try:
                for item in items:
                    for path, off, n in local_ranges(parts_of(item)):
                        if n > 0:
                            ahead.add((path, id(item[0]) if isinstance(item, tuple) else 0), path, off, n)
                    yield item
            finally:
                ahead.close()
            return
    failed: set[str] = set()
    for item in items:
        for path, off, n in local_ranges(parts_of(item)):
            if n <= 0 or path in failed:
                continue
            try:
                _ADVISE(fd_of(path), off, n, _WILLNEED)
            except OSError:  # a file that cannot be opened: the job's own read says so
                failed.add(path)
        yield item
