#!/usr/bin/env python
"""Where the copy limit is on this host: pread + (CRC) + pwrite throughput by processes x threads x files x chunk.

Copies a source file (in the page cache) into fresh output files, the way zckpt's engine does (positioned reads
into a per-thread buffer, the CRC-32 of the buffer, one positioned write), for every configuration in
``CONFIGS``: ``procs`` processes, ``threads`` threads each, the output spread over ``files`` files (each process
writes its own contiguous share; ``files < procs`` makes processes share a file; ``order="spread"`` deals its jobs
round-robin over the files of its share, so its threads write different files at once), ``chunk`` bytes a job. Reports
GB/s of output per configuration (best of ``--repeat``) as lines of JSON. No torch, no zckpt.

    python benchmarks/probe_io.py --dir /tmp/probe --gb 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import get_context

try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover
    from zlib import crc32

CONFIGS = [
    # procs, threads, files, chunk MiB, crc (True, False or "cfr": copy_file_range), prealloc
    (1, 1, 1, 4, True, "truncate"),
    (1, 4, 1, 4, True, "truncate"),
    (1, 8, 1, 4, True, "truncate"),
    (1, 8, 1, 4, False, "truncate"),
    (1, 8, 1, 1, True, "truncate"),
    (1, 8, 1, 16, True, "truncate"),
    (1, 8, 1, 4, True, "fallocate"),
    (1, 8, 2, 4, True, "truncate"),
    (1, 8, 4, 4, True, "truncate"),
    (1, 8, 8, 4, True, "truncate"),
    (1, 16, 8, 4, True, "truncate"),
    (1, 8, 4, 1, True, "truncate"),
    (2, 4, 1, 4, True, "truncate"),
    (2, 4, 2, 4, True, "truncate"),
    (2, 8, 2, 4, True, "truncate"),
    (4, 4, 1, 4, True, "truncate"),
    (4, 4, 1, 4, True, "fallocate"),
    (4, 4, 4, 4, True, "truncate"),
    (4, 2, 4, 4, True, "truncate"),
    (4, 4, 4, 1, True, "truncate"),
    (4, 4, 8, 4, True, "truncate"),
    (8, 2, 1, 4, True, "truncate"),
    (8, 2, 8, 4, True, "truncate"),
    (8, 1, 8, 4, True, "truncate"),
    (16, 1, 16, 4, True, "truncate"),
    (1, 16, 16, 4, True, "truncate"),
    (2, 8, 8, 4, True, "truncate"),
    (4, 4, 16, 4, True, "truncate"),
    (8, 2, 16, 4, True, "truncate"),
    (1, 8, 8, 1, True, "truncate"),
    (1, 8, 8, 16, True, "truncate"),
    # where the one-process ceiling comes from: without the CRC, and with copy_file_range (no user-space copy,
    # no GIL between the bytes), threads of one process against processes
    (1, 8, 8, 4, False, "truncate"),
    (8, 1, 8, 4, False, "truncate"),
    (1, 1, 1, 4, "cfr", "truncate"),
    (1, 8, 8, 4, "cfr", "truncate"),
    (1, 16, 16, 4, "cfr", "truncate"),
    (4, 1, 4, 4, "cfr", "truncate"),
    (4, 4, 16, 4, "cfr", "truncate"),
    (8, 1, 8, 4, "cfr", "truncate"),
    (16, 1, 16, 4, "cfr", "truncate"),
]


def _proc(args) -> float:
    src, paths, lo, hi, threads, chunk, do_crc, order = args
    # this process's span [lo, hi) of the concatenated output, files of equal size
    fsize = _proc.fsize
    fds = {}
    lock = threading.Lock()

    def fd_of(i):
        with lock:
            if i not in fds:
                fds[i] = os.open(paths[i], os.O_WRONLY)
            return fds[i]

    sfd = os.open(src, os.O_RDONLY)
    ssize = os.fstat(sfd).st_size
    local = threading.local()

    def job(pos):
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(chunk)
        n = min(chunk, hi - pos)
        i, off = divmod(pos, fsize)
        m = min(n, fsize - off)
        if do_crc == "cfr":  # in-kernel copy: no user-space buffer, no CRC, the GIL released throughout
            s0 = pos % (ssize - chunk)
            for fi, at, k in ((i, off, m), (i + 1, 0, n - m)):
                while k > 0:
                    got = os.copy_file_range(sfd, fd_of(fi), k, s0, at)
                    assert got > 0
                    s0, at, k = s0 + got, at + got, k - got
            return n
        mv = memoryview(buf)[:n]
        got = os.preadv(sfd, [mv], pos % (ssize - chunk))
        assert got == n
        if do_crc:
            crc32(mv)
        os.pwrite(fd_of(i), mv[:m], off)
        if m < n:
            os.pwrite(fd_of(i + 1), mv[m:], 0)
        return n

    positions = list(range(lo, hi, chunk))
    if order == "spread":  # round-robin over this process's files: concurrent jobs go to different files
        byfile: dict[int, list[int]] = {}
        for pos in positions:
            byfile.setdefault(pos // fsize, []).append(pos)
        lanes = list(byfile.values())
        positions = [lane[k] for k in range(max(map(len, lanes))) for lane in lanes if k < len(lane)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(job, positions))
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    os.close(sfd)
    return dt


def run_config(src, out_dir, total, procs, threads, files, chunk_mib, do_crc, prealloc, order="seq") -> dict:
    chunk = chunk_mib << 20
    fsize = -(-total // files)
    paths = [os.path.join(out_dir, f"out{i}") for i in range(files)]
    for p in paths:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        if prealloc == "fallocate":
            os.posix_fallocate(fd, 0, fsize)
        else:
            os.ftruncate(fd, fsize)
        os.close(fd)
    _proc.fsize = fsize
    share = -(-total // procs)
    share -= share % chunk
    spans = [(r * share, total if r == procs - 1 else (r + 1) * share) for r in range(procs)]
    t0 = time.perf_counter()
    if procs == 1:
        inner = [_proc((src, paths, *spans[0], threads, chunk, do_crc, order))]
    else:
        ctx = get_context("fork")
        with ctx.Pool(procs) as pool:
            inner = pool.map(_proc, [(src, paths, lo, hi, threads, chunk, do_crc, order) for lo, hi in spans])
    wall = time.perf_counter() - t0
    for p in paths:
        os.remove(p)
    return {"procs": procs, "threads": threads, "files": files, "chunk_mib": chunk_mib, "crc": do_crc,
            "prealloc": prealloc, "order": order, "seconds": round(wall, 3), "slowest_proc_s": round(max(inner), 3),
            "gb_per_s": round(total / wall / 1e9, 2),
            # without the pool's start (forking the processes): the slowest process's own copy
            "gb_per_s_inner": round(total / max(inner) / 1e9, 2)}


def _parse_config(text: str) -> tuple:
    f = text.split(":")
    crcs = {"1": True, "0": False, "cfr": "cfr"}
    if not (3 <= len(f) <= 7 and all(x.isdigit() for x in f[:4]) and (len(f) < 5 or f[4] in crcs)
            and (len(f) < 6 or f[5] in ("truncate", "fallocate")) and (len(f) < 7 or f[6] in ("seq", "spread"))):
        raise SystemExit(f"--configs: {text!r} is not PROCS:THREADS:FILES[:CHUNK_MIB[:CRC[:PREALLOC[:ORDER]]]] "
                         "(CRC 1, 0 or cfr; PREALLOC truncate or fallocate; ORDER seq or spread)")
    crc = crcs[f[4]] if len(f) > 4 else True
    return (int(f[0]), int(f[1]), int(f[2]), int(f[3]) if len(f) > 3 else 4, crc,
            f[5] if len(f) > 5 else "fallocate", f[6] if len(f) > 6 else "seq")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/probe")
    ap.add_argument("--gb", type=float, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated indices into CONFIGS (default: all)")
    ap.add_argument("--configs", default="",
                    help="configurations instead of CONFIGS: PROCS:THREADS:FILES[:CHUNK_MIB[:CRC[:PREALLOC[:ORDER]]]],... "
                         "(CRC 1, 0 or cfr; PREALLOC truncate or fallocate; ORDER seq: each process's jobs in "
                         "file order, spread: round-robin over its files; defaults 4, 1, fallocate, seq)")
    ap.add_argument("--all-runs", action="store_true", help="one line per run, not only the best of --repeat")
    a = ap.parse_args(argv)
    if a.configs:
        picked = [_parse_config(c) for c in a.configs.split(",")]
    else:
        picked = [CONFIGS[int(i)] for i in a.only.split(",")] if a.only else CONFIGS
    os.makedirs(a.dir, exist_ok=True)
    total = int(a.gb * 1e9)
    total -= total % (16 << 20)
    src = os.path.join(a.dir, "src")
    if not os.path.exists(src) or os.path.getsize(src) < total:
        block = os.urandom(64 << 20)
        with open(src, "wb") as f:
            for _ in range(-(-total // len(block))):
                f.write(block)
    with open(src, "rb") as f:  # warm
        while f.read(64 << 20):
            pass
    out_dir = os.path.join(a.dir, "out")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    os.system(f"cp {src} {out_dir}/cp")
    print(json.dumps({"cp_seconds": round(time.perf_counter() - t0, 3),
                      "cp_gb_per_s": round(os.path.getsize(src) / (time.perf_counter() - t0) / 1e9, 2)}), flush=True)
    os.remove(f"{out_dir}/cp")
    for cfg in picked:
        best = None
        for k in range(a.repeat):
            os.sync()
            r = run_config(src, out_dir, total, *cfg)
            if a.all_runs:
                print(json.dumps({**r, "run": k}), flush=True)
            best = r if best is None or r["seconds"] < best["seconds"] else best
        if not a.all_runs:
            print(json.dumps(best), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
