#!/usr/bin/env python
"""Which kernel path writes a file's bytes fastest from user space, beside the 16-thread copy of issue 49.

Buffered writes into one file take its inode's lock one at a time (ext4, xfs), so a copy into few files is held to
about one writer a file, whatever the threads. This probe copies every file of ``SRC`` into a fresh folder, each
file created at its size first, with ``--threads`` threads over ``--range`` ranges dealt round robin over the
files, by several methods, alternated round by round (``sync`` before each, the source in the page cache):

    pcopy      pread into the thread's buffer, pwrite                       (issue 49's baseline, 64 MiB ranges)
    pcopy4     the same over 4 MiB ranges                                   (zckpt's job size)
    hint       pcopy4, each range's output pages first put in the page cache, outside the lock
               (posix_fadvise WILLNEED on the output: fallocated blocks read back as zeros)
    srcmap     pwrite from a read-only map of the source (no copy into a buffer), its pages mapped first
               (madvise MADV_POPULATE_READ, outside the lock), 4 MiB ranges
    nofalloc   pcopy4 into files only truncated to size (delayed allocation)
    nofhint    nofalloc + hint
    pcopyN[-tT][-crc][-u]   pread + pwrite over N MiB ranges (pcopy1, pcopy2, ...), on T threads instead of
               --threads, with the CRC-32 of each range read (isal, as zckpt checks its inputs) before its pwrite,
               with every range boundary off the page grid (-u: the ranges start after a first one of 14064 bytes,
               as a safetensors file's tensors start after its header; zckpt's jobs are cut per tensor)
    ...-pool   each range a job of its own, submitted to a pool by the main thread and its result taken there in
               order, at most 4 x threads in flight (how zckpt's lanes hand out jobs), the buffer per thread
    ...-rh     the main thread advises each range of the source (WILLNEED) before handing it out (zckpt's read
               hints, engine/readahead.py)

Every copy is compared with its source (size and sha256 of the first run of each method). Prints each run and a
table of best and median seconds per method.

    python benchmarks/probe_writepath.py SRC --work DIR [--rounds 3] [--threads 16] [--methods ...]
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import shutil
import statistics
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_copybar import files_of, interleaved  # noqa: E402  (the baseline's own file order and deal)

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


UNALIGNED = 14064  # the header of merge fp32's first shard (8 + its JSON): no tensor of it starts on a page


def spec(method: str, threads: int) -> tuple[str, int, int, bool, bool]:
    """(base method, range bytes, threads, crc, unaligned) of a method name (:func:`copy` reads ``pool`` and ``rh``
    itself); a flag that would go unused is refused."""
    base, *flags = method.split("-")
    rng = 4 << 20
    if base == "pcopy":
        rng = 64 << 20
    elif base.startswith("pcopy") and base[5:].isdigit():
        base, rng = "pcopy", int(base[5:]) << 20
    for f in flags:
        if f.startswith("t") and f[1:].isdigit():
            threads = int(f[1:])
        elif f not in ("crc", "u", "pool", "rh"):
            raise SystemExit(f"unknown method {method}")
    if "rh" in flags and "pool" not in flags or "pool" in flags and base != "pcopy":
        raise SystemExit(f"{method}: -rh goes with -pool, and -pool with pcopyN only")
    return base, rng, threads, "crc" in flags, "u" in flags


def ranges(sizes: list[int], rng: int, shift: int) -> list[tuple[int, int, int]]:
    """bench_copybar's deal of ``rng`` ranges; with ``shift``, each file's ranges start after a first one of
    ``shift`` bytes (every later boundary off the page grid), dealt round robin as well."""
    if not shift:
        return interleaved(sizes, rng)
    per = [[(i, 0, min(shift, n))] + [(i, off, min(rng, n - off)) for off in range(shift, n, rng)] if n else []
           for i, n in enumerate(sizes)]
    return [lst[k] for k in range(max(map(len, per), default=0)) for lst in per if k < len(lst)]


def copy(src: Path, dst: Path, threads: int, method: str) -> float:
    files = files_of(src)
    sizes = [p.stat().st_size for p in files]
    flags = set(method.split("-")[1:])
    method, rng, threads, want_crc, unaligned = spec(method, threads)
    if want_crc:
        from isal import isal_zlib
        crc32 = isal_zlib.crc32
    bufs = [bytearray(rng) for _ in range(threads)]
    t0 = time.perf_counter()
    rfds = [os.open(p, os.O_RDONLY) for p in files]
    maps = []
    if method == "srcmap":
        for fd, n in zip(rfds, sizes):
            mm = mmap.mmap(fd, n, prot=mmap.PROT_READ) if n else None
            maps.append((mm, memoryview(mm) if mm is not None else None))
    wfds = []
    for p, n in zip(files, sizes):
        d = dst / p.relative_to(src)
        d.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(d, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        if n:
            if method in ("nofalloc", "nofhint"):
                os.ftruncate(fd, n)
            else:
                os.posix_fallocate(fd, 0, n)
        wfds.append(fd)
    jobs = ranges(sizes, rng, UNALIGNED if unaligned else 0)
    hint = method in ("hint", "nofhint")

    def worker(k: int) -> int:
        view = memoryview(bufs[k])
        moved = 0
        for j in range(k, len(jobs), threads):
            i, off, n = jobs[j]
            if hint:
                os.posix_fadvise(wfds[i], off, n, os.POSIX_FADV_WILLNEED)
            if method == "srcmap":
                mm, mv = maps[i]
                start = off - off % mmap.PAGESIZE
                mm.madvise(MADV_POPULATE_READ, start, off + n - start)
                data = mv[off:off + n]
            else:
                got = os.preadv(rfds[i], [view[:n]], off)
                data = view[:got]
                if want_crc:
                    crc32(data)
            moved += os.pwrite(wfds[i], data, off)
            if method == "srcmap":
                data.release()
        return moved

    local = threading.local()

    def one(j: int) -> int:  # ``-pool``: one range as a job of its own
        view = getattr(local, "view", None)
        if view is None:
            view = local.view = memoryview(bytearray(rng))
        i, off, n = jobs[j]
        got = os.preadv(rfds[i], [view[:n]], off)
        if want_crc:
            crc32(view[:got])
        return os.pwrite(wfds[i], view[:got], off)

    with ThreadPoolExecutor(threads) as pool:
        if "pool" not in flags:
            moved = sum(pool.map(worker, range(threads)))
        else:
            moved, pending = 0, deque()
            for j in range(len(jobs)):
                if "rh" in flags:
                    i, off, n = jobs[j]
                    os.posix_fadvise(rfds[i], off, n, os.POSIX_FADV_WILLNEED)
                pending.append(pool.submit(one, j))
                while len(pending) >= 4 * threads or (pending and pending[0].done()):
                    moved += pending.popleft().result()
            while pending:
                moved += pending.popleft().result()
    for fd in rfds + wfds:
        os.close(fd)
    dt = time.perf_counter() - t0
    for mm, mv in maps:
        if mm is not None:
            mv.release()
            mm.close()
    if moved != sum(sizes):
        raise RuntimeError(f"{method}: copied {moved} of {sum(sizes)} bytes")
    return dt


def sha(folder: Path) -> dict:
    out = {}
    for p in files_of(folder):
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while block := f.read(16 << 20):
                h.update(block)
        out[str(p.relative_to(folder))] = h.hexdigest()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("--work", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--methods", default="pcopy,pcopy4,hint,srcmap,nofalloc,nofhint")
    a = ap.parse_args()
    src, work = Path(a.src), Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    methods = a.methods.split(",")
    for m in methods:  # every name checked before the first copy
        spec(m, a.threads)
    want = sha(src)
    total = sum(p.stat().st_size for p in files_of(src))
    got: dict = {m: [] for m in methods}
    for r in range(a.rounds):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for m in order:
            dst = work / f"wp-{m}"
            shutil.rmtree(dst, ignore_errors=True)
            os.sync()
            s = copy(src, dst, a.threads, m)
            got[m].append(s)
            ok = ""
            if r == 0:
                ok = " same bytes" if sha(dst) == want else " DIFFERENT BYTES"
            print(f"round {r} {m}: {s:.4f} s, {total / s / 1e9:.2f} GB/s{ok}", flush=True)
            shutil.rmtree(dst, ignore_errors=True)
    print(f"\n{src}: {len(files_of(src))} files, {total / 1e9:.2f} GB, {a.threads} threads")
    print("| method | best s | median s | runs |")
    print("|---|---|---|---|")
    for m in methods:
        v = got[m]
        print(f"| {m} | {min(v):.4f} | {statistics.median(v):.4f} | {', '.join(f'{x:.4f}' for x in v)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
