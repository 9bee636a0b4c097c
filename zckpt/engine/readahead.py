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
