#!/usr/bin/env python
"""A timeline of one zckpt command across both processes of a forked write (engine/forked): when each step of the
main process ran, when each output file's jobs started and ended in whichever process wrote it, and the busy
writing threads per 50 ms in each process.

    python benchmarks/timeline_forked.py [--json-out F] -- convert CK-dcp --to deepspeed -w 4 ... -o OUT

Runs the command in this process (the zckpt that ``PYTHONPATH`` names) with hooks and no change to zckpt: the steps
below are timed where they run; every ``executor.Worker.write`` (one job) and every file's close (``lanes._close``)
is timed with its process. The forked child writes its events to a file beside ``--json-out`` (or a temp file)
just before it exits (``lanes._write_files`` returning in it). Times are seconds from this script's start
(CLOCK_MONOTONIC: the same clock in both processes).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time

T0 = time.perf_counter()


def main() -> int:
    argv = sys.argv[1:]
    json_out = None
    if argv[:1] == ["--json-out"]:
        json_out, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as the zckpt program does (zckpt/__main__.py)
    spill = (json_out or os.path.join(tempfile.gettempdir(), f"zckpt-tl-{os.getpid()}")) + ".child"
    events: list = []  # (pid, kind, name, start, end)
    jobs: list = []  # (pid, thread, path, start, end, bytes)
    lock = threading.Lock()
    main_pid = os.getpid()

    import importlib
    import zckpt.cli
    events.append((main_pid, "step", "import zckpt.cli", 0.0, time.perf_counter() - T0))

    def wrap(modname: str, attr: str) -> None:
        mod = importlib.import_module(modname)
        owner = mod
        parts = attr.split(".")
        for p in parts[:-1]:
            owner = getattr(owner, p)
        fn = getattr(owner, parts[-1])

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                end = time.perf_counter()
                with lock:
                    events.append((os.getpid(), "step", f"{modname.split('.')[-1]}.{attr}", t - T0, end - T0))
                if attr == "_write_files" and os.getpid() != main_pid:  # the child: about to exit
                    with open(spill, "w") as f:
                        json.dump({"events": events, "jobs": jobs}, f)
        setattr(owner, parts[-1], wrapper)

    for modname, attr in [
            ("zckpt.ops.to_deepspeed", "plan_to_deepspeed"), ("zckpt.ops.to_deepspeed", "open_dcp"),
            ("zckpt.ops.to_deepspeed", "format_of"), ("zckpt.ops.to_deepspeed", "check_no_hidden_ties"),
            ("zckpt.state.checksums", "input_check"), ("zckpt.io.publish", "check_output"),
            ("zckpt.engine.works", "reshard_works"), ("zckpt.engine.works", "merge_works"),
            ("zckpt.engine.works", "convert_works"), ("zckpt.engine.lanes", "create"),
            ("zckpt.engine.forked", "split"), ("zckpt.engine.forked", "write_apart"), ("zckpt.engine.forked", "_wait"),
            ("zckpt.engine.lanes", "_write_files"), ("zckpt.encoding.casting", "prepare"),
            ("zckpt.engine.checked", "InputCheck.prepare"), ("zckpt.engine.checked", "InputCheck.finish"),
            ("zckpt.io.publish", "Publisher.commit"), ("zckpt.io.publish", "Publisher.__enter__"),
            ("zckpt.io.publish", "Publisher.__exit__"), ("zckpt.io.publish", "Publisher.write_bytes")]:
        try:
            wrap(modname, attr)
        except (ImportError, AttributeError) as e:
            print(f"(not timed: {modname}.{attr}: {e})", file=sys.stderr)

    from zckpt.engine import executor, lanes
    from zckpt.engine.works import job_bytes
    write = executor.Worker.write

    def timed_write(self, fd, off, parts, dtype, *a, **k):
        t = time.perf_counter()
        try:
            return write(self, fd, off, parts, dtype, *a, **k)
        finally:
            end = time.perf_counter()
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                path = str(fd)
            n = job_bytes(parts, dtype)
            with lock:
                jobs.append((os.getpid(), threading.get_ident(), os.path.basename(path), t - T0, end - T0, n))
    executor.Worker.write = timed_write
    close = lanes._close

    def timed_close(fd, sync, t, closed):
        try:
            return close(fd, sync, t, closed)
        finally:
            with lock:
                events.append((os.getpid(), "closed", os.path.basename(t.path), time.perf_counter() - T0, None))
    lanes._close = timed_close

    events.append((main_pid, "step", "hooks", 0.0, time.perf_counter() - T0))
    sys.argv = ["zckpt", *argv]
    code = 0
    try:
        zckpt.cli.main()
    except SystemExit as e:
        code = e.code or 0
    end = time.perf_counter() - T0
    events.append((main_pid, "step", "command", 0.0, end))
    if os.path.exists(spill):
        with open(spill) as f:
            child = json.load(f)
        os.unlink(spill)
        events.extend(tuple(e) for e in child["events"] if e[0] != main_pid)
        jobs.extend(tuple(j) for j in child["jobs"] if j[0] != main_pid)
    report(events, jobs, main_pid, end)
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"events": events, "jobs": jobs, "end": end}, f)
    return int(code) if isinstance(code, int) else 1


def report(events: list, jobs: list, main_pid: int, end: float) -> None:
    who = {main_pid: "main"}
    for e in events:
        who.setdefault(e[0], "child")
    print(f"# timeline (s from start; command ended at {end:.3f})")
    for pid, kind, name, s, e in sorted(events, key=lambda e: e[3]):
        if kind == "step":
            print(f"  {who[pid]:5s} {s:7.3f} -> {e:7.3f} ({e - s:6.3f})  {name}")
        else:
            print(f"  {who[pid]:5s} {s:7.3f}            closed  {name}")
    print("# files: process, jobs, GB, first job start, last job end, GB/s over that span")
    files: dict = {}
    for pid, _, path, s, e, n in jobs:
        row = files.setdefault((who.get(pid, "child"), path), [0, 0, 1e9, 0.0])
        row[0] += 1
        row[1] += n
        row[2] = min(row[2], s)
        row[3] = max(row[3], e)
    for (w, path), (k, n, s, e) in sorted(files.items(), key=lambda kv: kv[1][2]):
        print(f"  {w:5s} {path:55s} {k:5d} {n / 1e9:6.2f} {s:7.3f} {e:7.3f} {n / 1e9 / max(e - s, 1e-9):6.2f}")
    print("# busy writing threads per 50 ms (main / child) and GB/s written in it (main / child)")
    if not jobs:
        return
    first = min(j[3] for j in jobs)
    last = max(j[4] for j in jobs)
    step = 0.05
    b = first
    while b < last:
        row = []
        for side in ("main", "child"):
            busy = sum(max(0.0, min(e, b + step) - max(s, b)) for pid, _, _, s, e, _ in jobs
                       if who.get(pid, "child") == side) / step
            gb = sum(n * max(0.0, min(e, b + step) - max(s, b)) / max(e - s, 1e-9) for pid, _, _, s, e, n in jobs
                     if who.get(pid, "child") == side) / 1e9 / step
            row.append((busy, gb))
        print(f"  {b:7.3f}  busy {row[0][0]:5.1f} / {row[1][0]:5.1f}   GB/s {row[0][1]:6.1f} / {row[1][1]:6.1f}")
        b += step


if __name__ == "__main__":
    sys.exit(main())
