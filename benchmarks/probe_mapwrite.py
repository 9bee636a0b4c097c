#!/usr/bin/env python
"""Issue 49 item 3, a probe: can writing through a shared map of the output beat a pread/pwrite copy?

A buffered pwrite into one file holds that file's inode lock (ext4: one writer at a time, about 4 GB/s on the lent
host), and a pread/pwrite copy moves every byte twice (page cache -> buffer -> page cache). ``preadv`` of the source
straight into a writable shared map of the (fallocated) output moves it once, and threads fill one file side by
side (page faults, no inode lock). Each mode copies the same SRC bytes (whole files, 4 MiB jobs dealt to THREADS
threads) into fresh output files, best of REPEAT:

  pcopy     pread into a thread buffer, pwrite (the bar's copy, 4 MiB jobs)
  pcrc      pcopy with a CRC-32 of each job (isal), what zckpt does for a checked copy
  mapread   preadv straight into a shared map of the fallocated output, then the CRC-32 over the map
  mappop    mapread with MADV_POPULATE_WRITE of each job's range first

``--one-file``: all sources into one output file (the bf16 merge's and convert --to deepspeed's model states);
otherwise one output per source.  python benchmarks/probe_mapwrite.py [--threads 16] [--one-file] SRC...
"""
from __future__ import annotations

import argparse
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from isal import isal_zlib

JOB = 4 << 20
POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def run(mode: str, srcs: list[str], threads: int, one_file: bool, outdir: str) -> float:
    sizes = [os.path.getsize(s) for s in srcs]
    fds = [os.open(s, os.O_RDONLY) for s in srcs]
    if one_file:
        outs = [os.path.join(outdir, "out-0")]
        places = [(0, sum(sizes[:i])) for i in range(len(srcs))]
        out_sizes = [sum(sizes)]
    else:
        outs = [os.path.join(outdir, f"out-{i}") for i in range(len(srcs))]
        places = [(i, 0) for i in range(len(srcs))]
        out_sizes = sizes
    for o in outs:
        if os.path.exists(o):
            os.unlink(o)
    jobs = []  # (src index, src offset, n, out index, out offset)
    for i, size in enumerate(sizes):
        for off in range(0, size, JOB):
            jobs.append((i, off, min(JOB, size - off), places[i][0], places[i][1] + off))
    jobs.sort(key=lambda j: (j[1], j[0]))  # interleaved over the files, as a deal would
    local = threading.local()
    t0 = time.perf_counter()
    ofds = [os.open(o, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644) for o in outs]
    for fd, n in zip(ofds, out_sizes):
        os.posix_fallocate(fd, 0, n)
    maps = []
    if mode.startswith("map"):
        maps = [memoryview(mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE))
                for fd, n in zip(ofds, out_sizes)]

    def job(j):
        i, off, n, o, at = j
        if mode in ("pcopy", "pcrc"):
            b = getattr(local, "b", None)
            if b is None:
                b = local.b = memoryview(bytearray(JOB))
            got = os.preadv(fds[i], [b[:n]], off)
            assert got == n
            c = isal_zlib.crc32(b[:n]) if mode == "pcrc" else 0
            done = 0
            while done < n:
                done += os.pwrite(ofds[o], b[done:n], at + done)
            return c
        v = maps[o][at:at + n]
        if mode == "mappop":
            mm = v.obj
            start = at - at % mmap.PAGESIZE
            mm.madvise(POPULATE_WRITE, start, at + n - start)
        got = os.preadv(fds[i], [v], off)
        assert got == n
        c = isal_zlib.crc32(v)
        v.release()
        return c

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(job, jobs))
    for m in maps:
        obj = m.obj
        m.release()
        obj.close()
    for fd in ofds:
        os.close(fd)
    t = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    return t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("srcs", nargs="+")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--one-file", action="store_true")
    ap.add_argument("--modes", default="pcopy,pcrc,mapread")
    ap.add_argument("--outdir", default="/tmp/probe_mapwrite")
    a = ap.parse_args()
    os.makedirs(a.outdir, exist_ok=True)
    total = sum(os.path.getsize(s) for s in a.srcs)
    modes = a.modes.split(",")
    times = {m: [] for m in modes}
    for _ in range(a.repeat):
        for m in modes:  # alternated, each after a sync with the last one's output removed (no writeback behind it)
            for f in os.listdir(a.outdir):
                os.unlink(os.path.join(a.outdir, f))
            os.sync()
            times[m].append(run(m, a.srcs, a.threads, a.one_file, a.outdir))
    for m in modes:
        best = min(times[m])
        print(f"{m:8s} {'one file' if a.one_file else f'{len(a.srcs)} files'} {a.threads:2d} threads "
              f"{total / 1e9:.2f} GB: best {best:.3f} s ({total / best / 1e9:.1f} GB/s) all "
              + " ".join(f"{t:.3f}" for t in times[m]), flush=True)
    for f in os.listdir(a.outdir):
        os.unlink(os.path.join(a.outdir, f))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
