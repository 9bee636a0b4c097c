#!/usr/bin/env python
"""How fast one thread reads files from the page cache, against copies of them written with 64 MiB writes (issue 49:
merge reads the masters out of DeepSpeed's files as the page cache holds them; the 16-thread copy of the baseline
reads files zckpt has just written with 4 MiB writes).

    python benchmarks/probe_pagecache.py FILE [FILE ...] --work DIR [--rounds 4]   # those files and their copies
    python benchmarks/probe_pagecache.py --torch-save --work DIR                    # a file torch.save wrote (512 MiB)
    python benchmarks/probe_pagecache.py FILE --loads [--threads 12] [--rounds 2]   # how the page cache was filled

``--loads``: FILE's pages dropped (``POSIX_FADV_DONTNEED``: clean pages, no root needed), then brought back by one
method, then FILE read three times by one thread, per method and round: ``pread1`` (one thread, 4 MiB reads in
order), ``preadN`` (N threads, 4 MiB ranges dealt in turn, one shared descriptor: how zckpt's jobs read),
``ownN`` (the same ranges, each thread its own descriptor), ``runN`` (each thread its own descriptor and a
contiguous Nth of the file, in order), ``willneed`` (``POSIX_FADV_WILLNEED`` of each 4 MiB range, then read: zckpt's
read hints), ``mapN`` and ``hugeN`` (N threads populating 4 MiB ranges of a read-only map, ``MADV_POPULATE_READ``;
``huge``: the map advised ``MADV_HUGEPAGE`` first). As we read Linux's ``mm/readahead.c``, the kernel fills the cache
in 4 KiB pages for reads it finds random and for WILLNEED, in large folios for a sequential reader; a copy out of
small pages is slower. (On the lent 16-core host the fills differed by a few percent only: docs/benchmarks.md, issue
49, twentieth session.)

Otherwise each FILE (or the ``torch.save`` file) is first copied into ``--work`` with 64 MiB writes, then each round
reads every file and its copy in 4 MiB ``preadv`` calls, warm, and prints GB/s per file as ``file/copy``. The copies
are removed at the end.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def read_rate(path: Path, rng: int = 4 << 20, start: int = 0, nbytes: int | None = None) -> float:
    """GB/s of one thread reading ``path`` (or ``nbytes`` of it from ``start``) in ``rng`` reads."""
    fd = os.open(path, os.O_RDONLY)
    try:
        end = os.fstat(fd).st_size if nbytes is None else start + nbytes
        buf = memoryview(bytearray(rng))
        t = time.perf_counter()
        for off in range(start, end, rng):
            os.preadv(fd, [buf[:min(rng, end - off)]], off)
        return (end - start) / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)


def copy_big(src: Path, dst: Path, block: int = 64 << 20) -> None:
    fi, fo = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        n = os.fstat(fi).st_size
        for off in range(0, n, block):
            os.pwrite(fo, os.pread(fi, block, off), off)
    finally:
        os.close(fi)
        os.close(fo)


def drop_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fill(path: Path, method: str, threads: int, rng: int = 4 << 20) -> float:
    """Seconds to bring ``path``'s pages into the page cache by ``method`` (see ``--loads``)."""
    import mmap
    fd = os.open(path, os.O_RDONLY)
    n = os.fstat(fd).st_size
    offs = list(range(0, n, rng))
    mm = None
    if method.startswith(("map", "huge")):
        mm = mmap.mmap(fd, n, prot=mmap.PROT_READ)
        if method.startswith("huge"):
            mm.madvise(mmap.MADV_HUGEPAGE)
    populate = getattr(mmap, "MADV_POPULATE_READ", 22)

    def work(k: int) -> None:
        buf = memoryview(bytearray(rng))
        if method.startswith(("own", "run")):  # each thread its own descriptor (its own read-ahead state)
            per = -(-len(offs) // threads)
            mine = offs[k * per:(k + 1) * per] if method.startswith("run") else offs[k::threads]
            tfd = os.open(path, os.O_RDONLY)
            try:
                for off in mine:
                    os.preadv(tfd, [buf], off)
            finally:
                os.close(tfd)
            return
        for j in range(k, len(offs), threads):
            if mm is not None:
                mm.madvise(populate, offs[j], min(rng, n - offs[j]))
            elif method == "willneed":
                os.posix_fadvise(fd, offs[j], rng, os.POSIX_FADV_WILLNEED)
                os.preadv(fd, [buf], offs[j])
            else:
                os.preadv(fd, [buf], offs[j])

    t = time.perf_counter()
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, range(threads)))
        return time.perf_counter() - t
    finally:
        if mm is not None:
            mm.close()
        os.close(fd)


def loads(path: Path, threads: int, rounds: int) -> None:
    methods = ["pread1", f"pread{threads}", f"own{threads}", f"run{threads}", "willneed", f"map{threads}",
               f"huge{threads}"]
    for r in range(rounds):
        for m in methods:
            drop_pages(path)
            k = 1 if m == "pread1" else threads
            dt = fill(path, m, k)
            rates = " ".join(f"{read_rate(path):.1f}" for _ in range(3))
            print(f"round {r} {m}: filled at {path.stat().st_size / dt / 1e9:.2f} GB/s; then read at {rates} GB/s",
                  flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*")
    ap.add_argument("--work", default=None, help="where the copies go (not with --loads)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--torch-save", action="store_true", help="a file of 8 x 64 MiB tensors written by torch.save")
    ap.add_argument("--loads", action="store_true", help="how the way the page cache is filled changes later reads")
    ap.add_argument("--threads", type=int, default=12)
    a = ap.parse_args()
    if a.loads:
        if not a.files or a.torch_save or a.work:
            ap.error("--loads takes FILE ... only (no --torch-save, no --work)")
        for f in a.files:
            loads(Path(f), a.threads, a.rounds)
        return 0
    if a.work is None or not (a.files or a.torch_save):
        ap.error("FILE ... or --torch-save, and --work (the copies go there)")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    files = [Path(f) for f in a.files]
    made = []
    if a.torch_save:
        import torch
        p = work / "torch_save.pt"
        torch.save({f"t{i}": torch.randn(16 << 20) for i in range(8)}, p)
        files.append(p)
        made.append(p)
    copies = []
    for k, f in enumerate(files):
        c = work / f"copy{k}_{f.name}"
        copy_big(f, c)
        copies.append(c)
    try:
        for r in range(a.rounds):
            print(f"round {r}: " + "  ".join(f"{f.name} {read_rate(f):.1f}/{read_rate(c):.1f} GB/s"
                                             for f, c in zip(files, copies)), flush=True)
    finally:
        for p in copies + made:
            p.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
