#!/usr/bin/env python
"""Does the way the source's pages came into the page cache change a warm job's time, and its copies' (issue 49)?

The masters' files of a DeepSpeed checkpoint are in the page cache as DeepSpeed wrote them, or as the last job that
read them cold filled it; on the 2-core box a file filled by many threads' reads or by ``POSIX_FADV_WILLNEED`` reads
back at half the rate of one filled by one thread reading in order (``benchmarks/probe_pagecache.py --loads``). This
probe brings the source files of each job back by one FILL at a time, then runs each job warm beside a copy of its
output (``pcopy``) and a copy that reads what it reads (``rwcopy``, merges only), as ``bench_copybar.py`` does. On
the lent 16-core host the fills changed neither the files' read rate nor the merges (docs/benchmarks.md, issue 49,
twentieth session).

FILLs, in the order given (``written`` must come first: nothing is dropped before it):

* ``written``: nothing dropped: the files as the cache holds them now (as DeepSpeed wrote them, on a fresh host);
* ``seq1``: the source files' pages dropped, then each file read by one thread, 4 MiB reads in order (``cat``);
* ``pread16``: dropped, then read by ``--threads`` threads, 64 MiB ranges round robin over the files (the cold bar's
  read in ``bench_copybar.py``);
* ``zcold``: dropped, then the first job of ``--jobs`` run cold (its seconds and disk bytes are a cold figure);
* ``zcold-nohints``: the same with ``ZCKPT_READ_HINTS=0``. (``zcold-ahead``, with the twentieth session's
  ``ZCKPT_READ_HINTS=read``, side threads reading each job's uncached inputs ahead in order, went with it: no gain
  on the lent host, docs/benchmarks.md.)

``--cold-ab 1,0 --cold-rounds 3``: first (after ``written``), rounds of each job of ``--jobs`` run cold with each
``ZCKPT_READ_HINTS`` value in turn (the source dropped before each), each run's seconds and the masters' read rate
after it (one thread); then, with or without them, a ``--threads`` read of the whole source, cold (the disk's rate).

Pages are dropped with ``POSIX_FADV_DONTNEED`` on each source file after ``sync`` (clean pages: no root needed, the
interpreter's files stay cached); ``fincore`` (util-linux), where installed, prints how much stayed resident.
After each fill: one thread's read rate of the first optimizer file's masters (4 MiB reads), then ``--repeat`` rounds
of each job, ``pcopy`` and ``rwcopy`` (it reads the masters' storages, as ``bench_copybar.py``'s does); the table
gives medians. After ``zcold``, the pages the job did not read are read in order by one thread (resident pages stay
as the job left them), so that every fill leaves the whole source resident.

    python benchmarks/probe_fill.py --ckpt CK --jobs merge-fp32-1GB,merge-bf16 --fills written,seq1,zcold --repeat 3
    python benchmarks/probe_fill.py --ckpt CK --jobs merge-fp32-1GB,merge-bf16 --fills '' --cold-ab 1,0   # cold only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_copybar import (JOBS, READ_FACTOR, ROOT, env_for, masters_regions,  # noqa: E402
                                      parallel_copy, parallel_read, rm, run_job, source_files)
from benchmarks.probe_pagecache import drop_pages, fill as fill_pages, read_rate  # noqa: E402

FILLS = ("written", "seq1", "pread16", "zcold", "zcold-nohints")
HINTS = {"zcold": {}, "zcold-nohints": {"ZCKPT_READ_HINTS": "0"}}


def drop(files: list[Path]) -> None:
    os.sync()
    for p in files:
        drop_pages(p)


def resident(files: list[Path]) -> str:
    if not shutil.which("fincore"):
        return "fincore not installed"
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES,SIZE", *map(str, files)], capture_output=True, text=True)
    if out.returncode != 0:
        return f"fincore failed: {out.stderr.strip()[:200]}"
    res = size = 0
    for line in out.stdout.split("\n"):
        if line.split():
            r, s = line.split()
            res, size = res + int(r), size + int(s)
    return f"{res / max(size, 1):.1%} of {size / 1e9:.2f} GB resident"


def seq1(files: list[Path]) -> None:
    for p in files:
        fill_pages(p, "pread1", 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--jobs", default="merge-fp32-1GB")
    ap.add_argument("--fills", default="written,seq1,zcold")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--cold-ab", default="", help="ZCKPT_READ_HINTS values run cold in turn (after 'written')")
    ap.add_argument("--cold-rounds", type=int, default=None, help="rounds of --cold-ab (default 3)")
    ap.add_argument("--workdir", default=None, help="where outputs and copies go (default: beside --ckpt)")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    ck = Path(a.ckpt).resolve()
    jobs, fills = a.jobs.split(","), [f for f in a.fills.split(",") if f]
    bad = [j for j in jobs if j not in JOBS or j == "convert-ds"] + [f for f in fills if f not in FILLS]
    if bad:
        ap.error(f"unknown or unsupported: {', '.join(bad)} (jobs: {', '.join(j for j in JOBS if j != 'convert-ds')};"
                 f" fills: {', '.join(FILLS)})")
    if a.repeat < 1:
        ap.error("--repeat: at least 1 (the table gives medians of the runs)")
    if a.cold_rounds is not None and (not a.cold_ab or a.cold_rounds < 1):
        ap.error("--cold-rounds is the number (at least 1) of rounds of --cold-ab: give the ZCKPT_READ_HINTS values too")
    a.cold_rounds = 3 if a.cold_rounds is None else a.cold_rounds
    if "written" in fills[1:]:
        ap.error("'written' can only be the first fill: every other one drops the files first")
    if not (ck / "latest").is_file():
        ap.error(f"{ck}: no 'latest' file (a DeepSpeed checkpoint folder is expected)")
    work = Path(a.workdir).resolve() if a.workdir else ck.parent
    out, copy = work / "pf-out", work / "pf-copy"
    srcs = sorted({p for j in jobs for p in source_files(j, ck, ck)})
    optim = [p for p in srcs if "optim_states" in p.name]
    masters = masters_regions(optim)
    env = env_for(ROOT)
    res: dict = {"checkpoint": str(ck), "threads": a.threads, "fills": {}}
    save = (lambda: Path(a.json_out).write_text(json.dumps(res, indent=1))) if a.json_out else (lambda: None)

    def masters_rate() -> float:
        """One thread's GB/s over every master region (0 where there are none)."""
        if not masters:
            return 0.0
        return sum(m[2] for m in masters) / sum(m[2] / read_rate(m[0], start=m[1], nbytes=m[2]) for m in masters)

    cold_ab = [v for v in a.cold_ab.split(",") if v]
    res["cold_ab"] = []

    def run_cold_ab() -> None:
        for rnd in range(a.cold_rounds if cold_ab else 0):
            for job in jobs:
                order = cold_ab[rnd % len(cold_ab):] + cold_ab[:rnd % len(cold_ab)]
                for v in order:
                    rm(out)
                    drop(srcs)
                    r = run_job([str(x) for x in JOBS[job](ck, ck)] + ["-o", str(out)],
                                env_for(ROOT, {"ZCKPT_READ_HINTS": v}))
                    after = masters_rate()
                    res["cold_ab"].append({"round": rnd, "job": job, "hints": v, "zckpt_s": r["zckpt_s"],
                                           "disk_read_bytes": r["disk_read_bytes"], "masters_after_gbs": after})
                    print(f"cold {job} ZCKPT_READ_HINTS={v}: zckpt {r['zckpt_s']:.3f} s, read from disk "
                          f"{r['disk_read_bytes'] / 1e9:.2f} GB; then one thread reads the masters at {after:.1f} "
                          f"GB/s", flush=True)
            save()
        rm(out)
        drop(srcs)
        rs, rb = parallel_read(srcs, a.threads)
        res["cold_read"] = {"s": rs, "bytes": rb}
        print(f"cold {a.threads}-thread read of the source: {rb / 1e9:.2f} GB in {rs:.2f} s "
              f"({rb / rs / 1e9:.2f} GB/s)", flush=True)

    if fills[:1] != ["written"]:  # the cold runs first; otherwise after the files are measured as they were
        run_cold_ab()
    for fill in fills:
        rec: dict = {"jobs": {}}
        if fill != "written":
            drop(srcs)
            rec["after_drop"] = resident(srcs)
            t = time.perf_counter()
            if fill == "seq1":
                seq1(srcs)
            elif fill == "pread16":
                parallel_read(srcs, a.threads)
            else:
                rm(out)
                r = run_job([str(x) for x in JOBS[jobs[0]](ck, ck)] + ["-o", str(out)], env_for(ROOT, HINTS[fill]))
                rec["cold_job"] = {k: r[k] for k in ("zckpt_s", "wall_s", "disk_read_bytes")}
                rm(out)
                seq1(srcs)  # what the job did not read back (resident pages stay as the job left them)
            rec["fill_s"] = time.perf_counter() - t
        rec["resident"] = resident(srcs)
        m0 = masters[0] if masters else None
        rec["optim0_read_gbs"] = [read_rate(m0[0], start=m0[1], nbytes=m0[2]) for _ in range(3)] if m0 else []
        print(f"== fill {fill}: {rec.get('fill_s', 0):.2f} s; {rec['resident']} (after the drop: "
              f"{rec.get('after_drop', '-')}); cold job {rec.get('cold_job', '-')}; one thread reads "
              f"the masters of {optim[0].name if optim else '-'} at "
              f"{' '.join(f'{v:.1f}' for v in rec['optim0_read_gbs'])} GB/s",
              flush=True)
        for job in jobs:
            cmd = [str(x) for x in JOBS[job](ck, ck)] + ["-o", str(out)]
            runs = []
            for rep in range(a.repeat):
                rm(out)
                os.sync()
                r = run_job(cmd, env)
                os.sync()
                c = {}
                rm(copy)
                os.sync()
                c["pcopy"] = parallel_copy(out, copy, a.threads)
                if job in READ_FACTOR and masters:  # (none: not a ZeRO-1/2 checkpoint, no rwcopy)
                    rm(copy)
                    os.sync()
                    c["rwcopy"] = parallel_copy(out, copy, a.threads, read_from=masters, read_factor=READ_FACTOR[job])
                rm(copy)
                runs.append({"zckpt_s": r["zckpt_s"], "write_s": r["write_s"], **c})
                print(f"  {job} run {rep}: zckpt {r['zckpt_s']:.3f} s (write {r['write_s']}) "
                      + " ".join(f"{k} {v:.3f} s" for k, v in c.items()), flush=True)
            rec["jobs"][job] = runs
        res["fills"][fill] = rec
        save()
        if fill == "written":
            run_cold_ab()
    rm(out)
    print()
    for job in jobs:
        for v in cold_ab:
            got = [c for c in res["cold_ab"] if c["job"] == job and c["hints"] == v]
            if got:
                runs = ", ".join("%.3f" % c["zckpt_s"] for c in got)
                print(f"cold {job} ZCKPT_READ_HINTS={v}: median {statistics.median(c['zckpt_s'] for c in got):.3f} s"
                      f" ({runs}), masters after {statistics.median(c['masters_after_gbs'] for c in got):.1f} GB/s")
    print("| fill | fill s | cold job s | masters of one file, one thread GB/s | job | zckpt median | pcopy median | "
          "rwcopy median | zckpt / pcopy | zckpt / rwcopy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for fill, rec in res["fills"].items():
        for job, runs in rec["jobs"].items():
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "write_s"}
            rw = med.get("rwcopy")
            cj = rec.get("cold_job", {}).get("zckpt_s")
            ratio = f"{med['zckpt_s'] / rw:.2f}" if rw else "-"
            print(f"| {fill} | {rec.get('fill_s', 0):.2f} | {f'{cj:.2f}' if cj else '-'} | "
                  f"{statistics.median(rec['optim0_read_gbs']) if rec['optim0_read_gbs'] else 0:.1f} | {job} | "
                  f"{med['zckpt_s']:.3f} | {med['pcopy']:.3f} | {f'{rw:.3f}' if rw else '-'} | "
                  f"{med['zckpt_s'] / med['pcopy']:.2f} | {ratio} |")
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
