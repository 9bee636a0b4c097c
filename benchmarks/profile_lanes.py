#!/usr/bin/env python
"""Where a single-process job's time goes: a timeline of its writing threads and files, and cProfile of its main
thread.

Runs one zckpt command (the zckpt that ``PYTHONPATH`` names) in this process (``python benchmarks/profile_lanes.py [--json-out F] [--phases] -- merge CK -o OUT``)
with two hooks, no change to zckpt: every ``executor.Worker.write`` (one job: read, CRC, cast, pwrite; or
``tees.write_shared``, a cast job that also writes its source bytes elsewhere) is timed
on its thread, with the file it writes and its bytes; every output file's close (``lanes._close``) is timed. From
them:

* per file: bytes, the first job's start and the last job's end (s from the first job);
* busy threads over time (10 ms buckets) and GB/s written per 100 ms;
* the tail: from the moment fewer than half the threads are busy for good, to the last job's end: its seconds,
  bytes and the files still being written then;
* the main thread's cProfile, top 25 by cumulative time (the plan; the writing shows as waits);
* or, with ``--phases``, no cProfile (every thread at its own speed) and the writing threads' seconds per phase
  summed over the threads: reads (``read_raw``, ``read_into``), ``crc32``, casts, ``render``, ``pwrite``, the input
  check's bookkeeping.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import threading
import time
from pathlib import Path


def main() -> int:
    argv = sys.argv[1:]
    json_out, phases = None, False
    while argv[:1] in (["--json-out"], ["--phases"]):
        if argv[0] == "--phases":
            phases, argv = True, argv[1:]
        else:
            json_out, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as the zckpt program does (zckpt/__main__.py)
    from zckpt.engine import executor, lanes
    spent: dict = {}  # --phases: seconds and calls per phase, summed over the threads

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                d = time.perf_counter() - t
                with lock:
                    row = spent.setdefault(name, [0.0, 0])
                    row[0] += d
                    row[1] += 1
        return wrapper

    events: list = []  # (thread, start, end, bytes, path)
    closes: dict = {}
    paths: dict = {}
    lock = threading.Lock()
    orig_write, orig_close = executor.Worker.write, lanes._close

    def path_of(fd: int) -> str:
        p = paths.get(fd)
        if p is None:
            try:
                p = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                p = str(fd)
            paths[fd] = p
        return p

    def write(self, fd, *a, **k):
        t0 = time.perf_counter()
        r = orig_write(self, fd, *a, **k)
        t1 = time.perf_counter()
        with lock:
            events.append((threading.get_ident(), t0, t1, r[1], path_of(fd)))
        return r

    try:
        from zckpt.engine import tees
        orig_shared = tees.write_shared
    except ImportError:  # a tree without it: every job goes through Worker.write
        tees = orig_shared = None

    def write_shared(worker, fd, *a, **k):  # a cast job that also writes its source bytes into other files
        t0 = time.perf_counter()
        r = orig_shared(worker, fd, *a, **k)
        t1 = time.perf_counter()
        with lock:
            events.append((threading.get_ident(), t0, t1, r[0][1], path_of(fd)))
            for tee, _ in r[1]:  # each file its bytes (at the job's end: the thread's time counted once)
                events.append((threading.get_ident(), t1, t1, tee.nbytes, tee.target.path))
        return r

    def close(fd, sync, t, closed):
        paths.pop(fd, None)
        orig_close(fd, sync, t, closed)
        closes[t.path] = time.perf_counter()

    executor.Worker.write = write
    if orig_shared is not None:
        tees.write_shared = write_shared
    lanes._close = close
    imports: list = []  # (start, end) of each casting.prepare: the casts' imports, before the first job
    from zckpt.encoding import casting as _casting
    orig_prepare = _casting.prepare

    def prepare(*a, **k):
        t = time.perf_counter()
        try:
            return orig_prepare(*a, **k)
        finally:
            imports.append((t, time.perf_counter()))

    _casting.prepare = prepare
    if phases:  # where the writing threads' time goes (no cProfile: the main thread runs at its own speed)
        from zckpt.encoding import casting, tensors
        executor.pwrite_all = timed("pwrite", executor.pwrite_all)
        executor.crc32 = timed("crc32", executor.crc32)
        if orig_shared is not None:
            tees.pwrite_all, tees.crc32 = executor.pwrite_all, executor.crc32
        tensors.Reader.read_raw = timed("read_raw", tensors.Reader.read_raw)
        tensors.Reader.read_into = timed("read_into", tensors.Reader.read_into)
        if hasattr(tensors.Reader, "read_crc"):  # (reads with their CRC-32s)
            tensors.Reader.read_crc = timed("read_crc", tensors.Reader.read_crc)
        casting.cast = timed("cast", casting.cast)
        executor.Worker.render = timed("render", executor.Worker.render)
        executor.InputCheck.add_crc = timed("check.add_crc", executor.InputCheck.add_crc)
    from zckpt.cli import main as cli

    prof = cProfile.Profile()
    t_start = time.perf_counter()
    if not phases:
        prof.enable()
    try:
        cli.main(args=argv, prog_name="zckpt", standalone_mode=False)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    prof.disable()
    t_end = time.perf_counter()
    if not events:
        print("no jobs written")
        return 1
    t0 = min(e[1] for e in events)
    t1 = max(e[2] for e in events)
    threads = sorted({e[0] for e in events})
    files: dict = {}
    for _, a, b, n, p in events:
        f = files.setdefault(os.path.basename(p.replace(" (deleted)", "")), {"bytes": 0, "first": a, "last": b,
                                                                              "jobs": 0})
        f["bytes"] += n
        f["jobs"] += 1
        f["first"], f["last"] = min(f["first"], a), max(f["last"], b)
    step = 0.01
    nb = int((t1 - t0) / step) + 1
    busy = [0.0] * nb
    for _, a, b, n, _ in events:
        i = int((a - t0) / step)
        while i < nb and t0 + i * step < b:
            lo, hi = max(a, t0 + i * step), min(b, t0 + (i + 1) * step)
            busy[i] += max(0.0, hi - lo) / step
            i += 1
    half = len(threads) / 2
    tail_from = nb
    while tail_from > 0 and busy[tail_from - 1] < half:
        tail_from -= 1
    tail_t = t0 + tail_from * step
    tail_bytes = sum(n * max(0.0, min(1.0, (b - max(a, tail_t)) / max(b - a, 1e-9))) for _, a, b, n, _ in events)
    tail_files = sorted({os.path.basename(p) for _, a, b, n, p in events if b > tail_t})
    total = sum(e[3] for e in events)
    per100 = []
    for k in range(int((t1 - t0) / 0.1) + 1):
        lo, hi = t0 + k * 0.1, t0 + (k + 1) * 0.1
        per100.append(round(sum(n * max(0.0, min(b, hi) - max(a, lo)) / max(b - a, 1e-9)
                                for _, a, b, n, _ in events) / 0.1 / 1e9, 2))
    s = io.StringIO()
    if phases:
        jobs_s = sum(b - a for _, a, b, _, _ in events)
        s.write(f"phases (thread seconds; jobs {jobs_s:.3f} s in all, {len(threads)} threads x writing "
                f"{t1 - t0:.3f} s = {len(threads) * (t1 - t0):.3f}):\n")
        for name, (sec, calls) in sorted(spent.items(), key=lambda kv: -kv[1][0]):
            s.write(f"  {name:14s} {sec:8.3f} s  {calls:7d} calls  {sec / max(jobs_s, 1e-9) * 100:5.1f}% of the jobs\n")
    else:
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
    doc = {"argv": argv, "command_s": t_end - t_start, "before_first_job_s": t0 - t_start,
           "writing_s": t1 - t0, "after_last_job_s": t_end - t1, "threads": len(threads), "bytes": total,
           "gb_per_s": total / (t1 - t0) / 1e9, "busy_mean": sum(busy) / nb,
           "tail_s": t1 - tail_t, "tail_bytes": tail_bytes, "tail_files": tail_files,
           "files": {k: {"bytes": v["bytes"], "jobs": v["jobs"], "first_s": round(v["first"] - t0, 4),
                         "last_s": round(v["last"] - t0, 4)} for k, v in sorted(files.items(), key=lambda kv: kv[1]["last"])},
           "busy_10ms": [round(b, 1) for b in busy], "gb_per_s_100ms": per100,
           "job_s_mean": sum(b - a for _, a, b, _, _ in events) / len(events), "jobs": len(events),
           "main_profile": s.getvalue()}
    print(f"{' '.join(argv[:1])}: command {doc['command_s']:.3f}s = before the first job {doc['before_first_job_s']:.3f}"
          f" + writing {doc['writing_s']:.3f} ({doc['gb_per_s']:.2f} GB/s, {len(threads)} threads, mean busy "
          f"{doc['busy_mean']:.1f}) + after {doc['after_last_job_s']:.3f}; tail (< {half:g} busy) {doc['tail_s']:.3f}s "
          f"{tail_bytes / 1e9:.2f} GB in {len(tail_files)} files {tail_files[:6]}")
    for a, b in imports:
        print(f"  the casts' imports (casting.prepare): {a - t0:+.3f} -> {b - t0:+.3f} s from the first job "
              f"({b - a:.3f} s)")
    doc["imports_s"] = [(round(a - t0, 4), round(b - t0, 4)) for a, b in imports]
    for k, v in doc["files"].items():
        print(f"    {k}: {v['bytes'] / 1e9:.3f} GB, {v['jobs']} jobs, {v['first_s']:.3f} -> {v['last_s']:.3f} s")
    print("  GB/s per 100 ms:", doc["gb_per_s_100ms"])
    print("\n".join(doc["main_profile"].splitlines()[:45]))
    if json_out:
        Path(json_out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
