#!/usr/bin/env python
"""Where merge's fixed costs go, on one timeline per run, beside 16-thread copies of its output (issue 49 item 3).

``python benchmarks/timeline_merge.py run CK OUT [merge options]``: one ``zckpt merge CK -o OUT`` in this process,
as the CLI runs it (``zckpt.cli`` imported first), with timers around its steps (no change to zckpt): opening the
checkpoint, the plan, the input check, the output checks, the worker, the publisher, the works, each file's
creation, the writing (its first job's start and last job's end, each file's close), the pool's shutdown, the
index, the input check's end, the commit. Prints one JSON line: zckpt's own ``seconds`` and the marks (ms from the
start of ``merge``).

``python benchmarks/timeline_merge.py bench --ck CK --work DIR [--rounds 5] [--variants 'name:ENV=V,..|args;..']
[--copies pcopy,pcopy4,pcopy12] [-- merge options]``: each round runs every variant (a fresh process each: ``run``
above, with its environment and extra arguments), each run after a ``sync`` and followed by the copies of its output
(``bench_copybar.parallel_copy``: pcopy, 16 threads of 64 MiB ranges; pcopy4, 16 threads of 4 MiB ranges; pcopy12,
12 threads of 64 MiB); the order of the variants turns by one each round. Prints each run's timeline in a line and,
at the end, per variant: best and median seconds, the fixed costs (before the first job, after the last), the
writing, and each copy's best.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run_one(ck: str, out: str, extra: list[str]) -> int:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import threading
    import zckpt.cli  # noqa: F401  (what the program has imported before a command starts)
    from zckpt.cli import merge as merge_cli  # noqa: F401
    from zckpt.ops import merge as M
    from zckpt.engine import run as R, lanes as L, executor as E, checked as C
    from zckpt.io import publish as P
    marks: list = []
    lock = threading.Lock()
    first_last = [None, None, 0]

    def wrap(owner, name, label=None):
        fn = getattr(owner, name)

        def w(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                marks.append((label or name, t, time.perf_counter()))
        setattr(owner, name, w)

    for owner, name in ((M, "open_checkpoint"), (M, "plan_merge"), (M, "trainer_files"),
                        (M.checksums, "input_check"), (R.publish, "check_output"), (R.casting, "torch_pays"),
                        (R.works_, "merge_works"), (R._lanes, "create"), (R._lanes, "write_files"),
                        (L, "_close"), (C.InputCheck, "finish"), (C.InputCheck, "close"), (P.Publisher, "commit"),
                        (P.Publisher, "__enter__"), (P.Publisher, "__exit__"), (P.Publisher, "write_bytes"),
                        (E.Worker, "__init__"), (E.Worker, "close")):
        wrap(owner, name, f"{getattr(owner, '__name__', '')}.{name}")
    job = E.Worker.write

    def timed_write(self, *a, **k):
        t = time.perf_counter()
        try:
            return job(self, *a, **k)
        finally:
            e = time.perf_counter()
            with lock:
                first_last[0] = t if first_last[0] is None else min(first_last[0], t)
                first_last[1] = e if first_last[1] is None else max(first_last[1], e)
                first_last[2] += 1
    E.Worker.write = timed_write
    args = {"max_shard_size": "5GB", "dtype": "fp32", "workers": None}
    it = iter(extra)
    for a in it:
        if a == "--max-shard-size":
            args["max_shard_size"] = next(it)
        elif a == "--dtype":
            args["dtype"] = next(it)
        elif a in ("--workers", "-j"):
            args["workers"] = int(next(it))
        else:
            raise SystemExit(f"unknown option {a}")
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    r = M.merge(ck, out, **args)
    t1 = time.perf_counter()
    ms = lambda t: round(1000 * (t - t0), 2)  # noqa: E731
    doc = {"seconds": round(r.seconds, 4), "wall_ms": ms(t1), "write_seconds": r.stats.get("write_seconds"),
           "plan_seconds": r.stats.get("plan_seconds"), "jobs": first_last[2],
           "first_job_ms": ms(first_last[0]) if first_last[0] else None,
           "last_job_ms": ms(first_last[1]) if first_last[1] else None,
           "marks": [(n, ms(a), ms(b)) for n, a, b in marks]}
    print(json.dumps(doc))
    return 0


def bench(argv: list[str]) -> int:
    import argparse
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_copybar import parallel_copy, RANGE  # noqa: F401
    import bench_copybar
    ap = argparse.ArgumentParser()
    ap.add_argument("--ck", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="base:")
    ap.add_argument("--copies", default="pcopy,pcopy4,pcopy12")
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    variants = []
    for v in a.variants.split(";"):
        name, _, rest = v.partition(":")
        envs, _, args = rest.partition("|")
        env = dict(kv.split("=", 1) for kv in envs.split(",") if kv)
        variants.append((name, env, args.split()))
    out, copy = work / "tl-out", work / "tl-copy"
    res: dict = {name: [] for name, _, _ in variants}
    copies: dict = {c: [] for c in a.copies.split(",") if c}

    def do_copies():
        for c in copies:
            shutil.rmtree(copy, ignore_errors=True)
            os.sync()
            if c == "pcopy":
                s = parallel_copy(out, copy, 16)
            elif c == "pcopy12":
                s = parallel_copy(out, copy, 12)
            elif c == "pcopy4":
                old, inter = bench_copybar.RANGE, bench_copybar.interleaved
                bench_copybar.RANGE = 4 << 20
                bench_copybar.interleaved = lambda sizes, rng=4 << 20: inter(sizes, rng)
                try:
                    s = parallel_copy(out, copy, 16)
                finally:
                    bench_copybar.RANGE, bench_copybar.interleaved = old, inter
            else:
                raise SystemExit(f"unknown copy {c}")
            copies[c].append(s)
        shutil.rmtree(copy, ignore_errors=True)

    for r in range(a.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for name, env, args in order:
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            p = subprocess.run([sys.executable, __file__, "run", a.ck, str(out), *a.extra, *args],
                               env={**os.environ, **env}, capture_output=True, text=True)
            if p.returncode:
                print(f"{name}: failed\n{p.stderr[-2000:]}", flush=True)
                continue
            doc = json.loads(p.stdout.strip().splitlines()[-1])
            res[name].append(doc)
            marks = {}
            for n, s, e in doc["marks"]:
                marks.setdefault(n, []).append((s, e))
            brief = " ".join(f"{n.split('.')[-1]}={e - s:.1f}" for n, ((s, e), *_) in marks.items()
                             if n.split(".")[-1] in ("open_checkpoint", "plan_merge", "input_check", "__init__",
                                                     "__enter__", "merge_works", "finish", "commit", "__exit__"))
            creates = sum(e - s for n, v in marks.items() if n.endswith(".create") for s, e in v)
            print(f"round {r} {name}: seconds {doc['seconds']:.4f} plan {doc['plan_seconds']} write "
                  f"{doc['write_seconds']} first job {doc['first_job_ms']} ms last job {doc['last_job_ms']} ms "
                  f"end {doc['wall_ms']} ms jobs {doc['jobs']} | creates {creates:.1f} | {brief}", flush=True)
            print("  marks " + json.dumps(doc["marks"]), flush=True)
            do_copies()
            print("  copies " + " ".join(f"{c} {v[-1]:.4f}" for c, v in copies.items()), flush=True)
        shutil.rmtree(out, ignore_errors=True)
    print("\n| variant | runs | best s | median s | before the first job, ms (median) | writing, ms (median) | "
          "after the last job, ms (median) |")
    print("|---|---|---|---|---|---|---|")
    for name, docs in res.items():
        if not docs:
            continue
        secs = [d["seconds"] for d in docs]
        pre = [d["first_job_ms"] for d in docs]
        wr = [d["last_job_ms"] - d["first_job_ms"] for d in docs]
        post = [1000 * d["seconds"] - d["last_job_ms"] for d in docs]
        print(f"| {name} | {len(docs)} | {min(secs):.4f} | {statistics.median(secs):.4f} | "
              f"{statistics.median(pre):.1f} | {statistics.median(wr):.1f} | {statistics.median(post):.1f} |")
    for c, v in copies.items():
        if v:
            print(f"{c}: best {min(v):.4f} median {statistics.median(v):.4f} ({', '.join(f'{x:.4f}' for x in v)})")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        sys.exit(run_one(sys.argv[2], sys.argv[3], sys.argv[4:]))
    sys.exit(bench(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]))
