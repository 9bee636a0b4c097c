#!/usr/bin/env python
"""Issue 49 item 3: every job beside a 16-thread copy of the bytes it writes (page cache warm) and beside the time
to read what it reads (page cache cold).

One ZeRO-2 checkpoint made by real DeepSpeed (``bench_merge.ensure_checkpoint``, or ``--ckpt``) and its DCP
conversion (made once by zckpt, the source of ``convert-ds``). The jobs, each the plain command (P = 1):

    merge-fp32-1GB  zckpt merge CK --dtype fp32 --max-shard-size 1GB
    merge-bf16      zckpt merge CK --dtype bf16                    (one file)
    reshard-ws8     zckpt reshard CK -w 8
    convert-dcp     zckpt convert CK --to dcp
    convert-ds      zckpt convert DCP --to deepspeed -w 4 --stage 2 --dtype bf16 --buffers scale,idx

**Warm** (``--repeat`` runs, best and all reported): the job (zckpt's own seconds from ``--json``, the wall
seconds, peak RSS and CPU seconds from ``wait4``), then ``sync`` (its output flushed, so that every timed step
below starts with nothing dirty, as the job did), then three copies of its output, each into a fresh folder:

* ``pcopy``: ``--threads`` threads, ``pread`` / ``pwrite`` of 64 MiB ranges of every output file, dealt round robin
  over the files (file 0's range 0, file 1's range 0, ...), the files created at their size first (fallocate, as
  zckpt creates its own) -- the baseline of issue 49;
* ``cfr``: the same ranges through ``copy_file_range`` (in the kernel, no user-space buffer);
* ``cp -r``.

For the merges also ``rwcopy``: the same threads read the bytes the job reads (64 MiB ranges of the fp32 masters'
storages in the source's optimizer files, found by zckpt's reader: twice the output's bytes for merge-bf16, the
output's bytes for merge-fp32-1GB; until the twentieth session the first such bytes of the whole files, the first
moments) and write the output's bytes (the last 64 MiB of each range's reads written as the range): a copy
that reads what the job reads, from the files it reads them from, and writes what it writes. (A copy of the output
reads files zckpt has just written; the masters' files are in the page cache as DeepSpeed left them, which on the
2-core box read a third slower, and on the lent host as fast: benchmarks/probe_pagecache.py, docs/benchmarks.md,
issue 49, nineteenth and twentieth sessions.)

**Cold** (``--cold``: after ``sync`` and ``echo 3 > /proc/sys/vm/drop_caches``, refused and said so when that is
not allowed; then the interpreter, zckpt and what its jobs import (numpy, ml_dtypes, isal) imported once, so that
they are read back): the job once (its bytes read from the disk: ``ru_inblock`` x 512), then, caches dropped again, a
``--threads``-thread ``pread`` of every source file (64 MiB ranges, round robin): the disk's read rate for these
files. The time to read what the job reads = its disk bytes / that rate (for reshard and both converts the job
reads every source file, so this is the whole read's own time). ``--cold-rounds N``: every cold job N times, in
rounds, each run against the read after it; the table gives each ratio and their median.

``--variants 'name:ENV=V,ENV2=V|--extra args;...'``: the job again with other settings (warm, zckpt only, the
last tree of ``--trees``).
``--before DIR``: another tree's zckpt (``git archive OLD zckpt | tar -x -C DIR``), run alternately with this one
(each round starting one tree further on, so that no tree always runs in the same place).

    python benchmarks/bench_copybar.py --layers 26 --hidden 2048 --ffn 8192 --repeat 3 --cold --json-out r.json
    python benchmarks/bench_copybar.py --layers 2 --hidden 256 --ffn 512 --repeat 1 --threads 4   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RANGE = 64 << 20
JOBS = {
    "merge-fp32-1GB": lambda ck, dcp: ["merge", ck, "--dtype", "fp32", "--max-shard-size", "1GB"],
    "merge-bf16": lambda ck, dcp: ["merge", ck, "--dtype", "bf16"],
    "reshard-ws8": lambda ck, dcp: ["reshard", ck, "-w", "8"],
    "convert-dcp": lambda ck, dcp: ["convert", ck, "--to", "dcp"],
    "convert-ds": lambda ck, dcp: ["convert", dcp, "--to", "deepspeed", "-w", "4", "--stage", "2", "--dtype", "bf16",
                                   "--buffers", "scale,idx"],
}
# rwcopy: the output bytes read per output byte, for the jobs that read the fp32 masters
READ_FACTOR = {"merge-bf16": 2, "merge-fp32-1GB": 1}


def files_of(folder: Path) -> list[Path]:
    return [p for p in sorted(folder.rglob("*")) if p.is_file()]


def sync() -> float:
    t0 = time.perf_counter()
    os.sync()
    return time.perf_counter() - t0


def rm(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def interleaved(sizes: list[int], rng: int = RANGE) -> list[tuple[int, int, int]]:
    """(file index, offset, length) of every ``rng`` range of every file, dealt round robin over the files."""
    per = [[(i, off, min(rng, n - off)) for off in range(0, n, rng)] for i, n in enumerate(sizes)]
    return [lst[k] for k in range(max(map(len, per), default=0)) for lst in per if k < len(lst)]


def masters_regions(optim: list[Path]) -> list[tuple[Path, int, int]]:
    """(file, offset, bytes) of the fp32 masters' storages in DeepSpeed ZeRO-1/2 optimizer files (what a merge reads),
    found by zckpt's own reader of .pt files (no code executed); none where a file has no such masters."""
    from zckpt.encoding import safeload
    out = []
    for p in optim:
        groups = safeload.load(str(p)).get("optimizer_state_dict", {}).get("single_partition_of_fp32_groups")
        if not groups:  # not a ZeRO-1/2 file: no rwcopy (rather than a copy of other bytes under its name)
            return []
        out += [(p, t.storage.offset, t.storage.nbytes) for t in groups]
    return out


def parallel_copy(src: Path, dst: Path, threads: int, kernel: bool = False,
                  read_from: list | None = None, read_factor: int = 1) -> float:
    """Seconds to copy every file of ``src`` into ``dst`` (sub-folders too) with ``threads`` threads: 64 MiB ranges
    dealt round robin over the files, the files created at their size first (fallocate). ``kernel``: through
    copy_file_range. ``read_from`` / ``read_factor``: read ``read_factor`` x each range's bytes from these files, or
    from these (file, offset, bytes) regions (their 64 MiB ranges round robin), instead of the source file, and
    write the range (a down-cast's reads and writes)."""
    files = files_of(src)
    sizes = [p.stat().st_size for p in files]
    bufs = [bytearray(RANGE * read_factor) for _ in range(threads)]  # allocated and touched before the clock
    reads = []
    if read_from:
        regions = [r if isinstance(r, tuple) else (r, 0, r.stat().st_size) for r in read_from]
        read_from = sorted({r[0] for r in regions})
        index = {p: i for i, p in enumerate(read_from)}
        reads = [(index[regions[fi][0]], regions[fi][1] + off, n)
                 for fi, off, n in interleaved([r[2] for r in regions])]
    t0 = time.perf_counter()
    rfds = [os.open(p, os.O_RDONLY) for p in files]
    wfds = []
    for p, n in zip(files, sizes):
        d = dst / p.relative_to(src)
        d.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(d, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        if n:
            os.posix_fallocate(fd, 0, n)
        wfds.append(fd)
    xfds = [os.open(p, os.O_RDONLY) for p in (read_from or [])]
    jobs = interleaved(sizes)

    def worker(k: int) -> int:
        view = memoryview(bufs[k])
        moved = 0
        for j in range(k, len(jobs), threads):
            i, off, n = jobs[j]
            if kernel:
                done = 0
                while done < n:
                    got = os.copy_file_range(rfds[i], wfds[i], n - done, off + done, off + done)
                    if got <= 0:
                        break
                    done += got
                moved += done
                continue
            if read_from:
                for r in range(read_factor):
                    fi, roff, rn = reads[(j * read_factor + r) % len(reads)]
                    os.preadv(xfds[fi], [view[r * RANGE:r * RANGE + min(rn, RANGE)]], roff)
                data = view[(read_factor - 1) * RANGE:(read_factor - 1) * RANGE + n]
            else:
                got = os.preadv(rfds[i], [view[:n]], off)
                data = view[:got]
            moved += os.pwrite(wfds[i], data, off)
        return moved

    with ThreadPoolExecutor(threads) as pool:
        moved = sum(pool.map(worker, range(threads)))
    for fd in rfds + wfds + xfds:
        os.close(fd)
    dt = time.perf_counter() - t0
    if moved != sum(sizes):
        raise RuntimeError(f"copied {moved} of {sum(sizes)} bytes")
    return dt


def parallel_read(files: list[Path], threads: int) -> tuple[float, int]:
    """(seconds, bytes) of reading every file with ``threads`` threads, 64 MiB ranges round robin over the files."""
    sizes = [p.stat().st_size for p in files]
    jobs = interleaved(sizes)
    bufs = [bytearray(RANGE) for _ in range(threads)]
    t0 = time.perf_counter()
    fds = [os.open(p, os.O_RDONLY) for p in files]

    def worker(k: int) -> int:
        view = memoryview(bufs[k])
        return sum(os.preadv(fds[i], [view[:n]], off) for i, off, n in jobs[k::threads])

    with ThreadPoolExecutor(threads) as pool:
        got = sum(pool.map(worker, range(threads)))
    for fd in fds:
        os.close(fd)
    return time.perf_counter() - t0, got


def cp_r(src: Path, dst: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    return time.perf_counter() - t0


def run_job(args: list[str], env: dict) -> dict:
    """The zckpt command in its own process: its --json, wall seconds, and through ``/usr/bin/time`` (a small
    process of its own, so that this one's memory, carried over fork and exec, is not counted) its peak RSS, CPU
    seconds and file system inputs (512-byte blocks read from the disk)."""
    cmd = [sys.executable, "-m", "zckpt", *args, "--json"]
    timed = ["/usr/bin/time", "-f", "ZCKPT_TIME %M %U %S %I"] if os.path.exists("/usr/bin/time") else []
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(timed + cmd, env=env, stdout=out, stderr=err)
        _, status, ru = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        text, etext = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{text[-2000:]}\n{etext[-2000:]}")
    doc = json.loads([ln for ln in text.splitlines() if ln.startswith("{")][-1])
    got = [ln.split()[1:] for ln in etext.splitlines() if ln.startswith("ZCKPT_TIME ")]
    rss_kib, user, sys_, inblock = (float(v) for v in got[-1]) if got else \
        (ru.ru_maxrss, ru.ru_utime, ru.ru_stime, ru.ru_inblock)
    return {"zckpt_s": doc["seconds"], "wall_s": wall, "rss_mib": rss_kib / 1024, "user_s": user, "sys_s": sys_,
            "disk_read_bytes": int(inblock) * 512, "stats": doc.get("stats", {}),
            "plan_s": doc.get("stats", {}).get("plan_seconds"), "imports_s": doc.get("stats", {}).get("imports_seconds"),
            "write_s": doc.get("stats", {}).get("write_seconds")}


def source_files(job: str, ck: Path, dcp: Path) -> list[Path]:
    if job == "convert-ds":
        return files_of(dcp)
    tag = (ck / "latest").read_text().strip()
    return files_of(ck / tag)


def env_for(tree: Path, extra: dict | None = None) -> dict:
    return dict(os.environ, DS_ACCELERATOR="cpu", ZCKPT_DISABLE_PROGRESS_BARS="1", PYTHONSAFEPATH="1",
                PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]), **(extra or {}))


def parse_variants(text: str) -> list[tuple[str, dict, list[str]]]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, _, rest = item.partition(":")
        envs, _, extra = rest.partition("|")
        env = dict(kv.split("=", 1) for kv in envs.replace(",", " ").split())
        out.append((name, env, extra.split()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=str(ROOT / ".bench"))
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--cold-tree", default=None, help="the tree run cold (default: the last of --trees)")
    ap.add_argument("--cold-jobs", default=None, help="the jobs run cold (default: --jobs)")
    ap.add_argument("--cold-rounds", type=int, default=None,
                    help="rounds of the cold jobs, each run with its own read (default 1; with --cold)")
    ap.add_argument("--no-copies", action="store_true", help="zckpt only (no pcopy / cfr / cp -r)")
    ap.add_argument("--copies", default="pcopy,cfr,cp", help="which copies run beside zckpt (pcopy, cfr, cp)")
    ap.add_argument("--variants", default="")
    ap.add_argument("--before", default=None)
    ap.add_argument("--trees", default=None, help="name=DIR,...: the trees whose zckpt runs (default: this one)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.cold_rounds is not None and (not args.cold or args.cold_rounds < 1):
        ap.error("--cold-rounds: at least 1, and only with --cold")
    args.cold_rounds = args.cold_rounds or 1
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.ckpt:
        ck = Path(args.ckpt).resolve()
    else:
        from benchmarks.bench_merge import ensure_checkpoint, model_dims
        t0 = time.time()
        ck = ensure_checkpoint(work, model_dims(args.layers, args.hidden, args.vocab, args.ffn), args.world_size)
        print(f"checkpoint ready in {time.time() - t0:.0f} s", flush=True)
    trees = {"after": ROOT} | ({"before": Path(args.before).resolve()} if args.before else {})
    if args.trees:  # name=DIR,...: these trees instead (the first one's runs get the copies)
        trees = {k: Path(v).resolve() for k, v in (item.split("=", 1) for item in args.trees.split(","))}
    first, last = next(iter(trees)), list(trees)[-1]
    import compileall
    for t in trees.values():
        compileall.compile_dir(str(t / "zckpt"), quiet=1)
    jobs = args.jobs.split(",")
    dcp = work / (ck.name + "-dcp")
    if "convert-ds" in jobs and not (dcp / ".metadata").exists():
        rm(dcp)
        run_job(["convert", str(ck), "--to", "dcp", "-o", str(dcp)], env_for(trees[first]))
    ck_bytes = sum(p.stat().st_size for p in files_of(ck))
    res = {"checkpoint": str(ck), "checkpoint_bytes": ck_bytes, "cpus": os.cpu_count(), "threads": args.threads,
           "repeat": args.repeat, "warm": {}, "cold": {}, "variants": {}}
    print(f"checkpoint {ck} ({ck_bytes / 1e9:.2f} GB), {os.cpu_count()} CPUs", flush=True)
    out, copy = work / "cb-out", work / "cb-copy"
    save = (lambda: Path(args.json_out).write_text(json.dumps(res, indent=1))) if args.json_out else (lambda: None)
    for job in jobs:
        cmd = [str(a) for a in JOBS[job](ck, dcp)] + ["-o", str(out)]
        srcs = source_files(job, ck, dcp)
        for p in srcs:  # the page cache warm
            with open(p, "rb") as f:
                while f.read(RANGE):
                    pass
        rec: dict = {"cmd": "zckpt " + " ".join(cmd), "runs": {}}
        masters = masters_regions([p for p in srcs if "optim_states" in p.name]) if job in READ_FACTOR else []
        for rep in range(args.repeat):
            # each round starts one tree further on: an A/A control (one tree twice) ran merge bf16 ~4% faster in
            # the second place of every round (docs/benchmarks.md, issue 49, eighth session)
            order = list(trees.items())
            for tree, root in order[rep % len(order):] + order[:rep % len(order)]:
                rm(out)
                sync()
                r = run_job(cmd, env_for(root))
                if tree == first and not args.no_copies:  # the copies start with nothing dirty, as the job did
                    r["flush_s"] = sync()
                rec["runs"].setdefault(tree, []).append(r)
                line = f"  {job} {tree} run {rep}: zckpt {r['zckpt_s']:.3f}s wall {r['wall_s']:.2f}s " \
                       f"(plan {r['plan_s']} imports {r['imports_s']} write {r['write_s']}) " \
                       f"rss {r['rss_mib']:.0f} MiB cpu {r['user_s'] + r['sys_s']:.1f}s"
                if tree == first and not args.no_copies:
                    rec["bytes"] = sum(p.stat().st_size for p in files_of(out))
                    rec["files"] = len(files_of(out))
                    c = {}
                    for name, fn in (("pcopy", lambda: parallel_copy(out, copy, args.threads)),
                                     ("cfr", lambda: parallel_copy(out, copy, args.threads, kernel=True)),
                                     ("cp", lambda: cp_r(out, copy))):
                        if name not in args.copies.split(","):
                            continue
                        rm(copy)
                        sync()
                        c[name] = fn()
                    factor = READ_FACTOR.get(job)
                    if factor and not masters:
                        print(f"  {job}: no ZeRO-1/2 fp32 masters found in the optimizer files: no rwcopy", flush=True)
                    if factor and masters:
                        rm(copy)
                        sync()
                        c["rwcopy"] = parallel_copy(out, copy, args.threads, read_from=masters, read_factor=factor)
                    rm(copy)
                    sync()
                    r["copies"] = c
                    line += " | " + " ".join(f"{k} {v:.3f}s" for k, v in c.items())
                print(line, flush=True)
        for name, env, extra in parse_variants(args.variants):
            vr = []
            for _ in range(args.repeat):
                rm(out)
                sync()
                vr.append(run_job(cmd + extra, env_for(trees[last], env)))
            rec.setdefault("variants", {})[name] = {"env": env, "args": extra, "runs": vr}
            print(f"  {job} variant {name}: zckpt " + ", ".join(f"{v['zckpt_s']:.3f}" for v in vr), flush=True)
        res["warm"][job] = rec
        save()
    rm(out)
    rm(copy)
    sync()
    cold_tree = args.cold_tree or list(trees)[-1]
    cold_plan = [job for _ in range(args.cold_rounds) for job in (args.cold_jobs or args.jobs).split(",")]
    if args.cold:
        for job in cold_plan:
            cmd = [str(a) for a in JOBS[job](ck, dcp)] + ["-o", str(out)]
            srcs = source_files(job, ck, dcp)
            rm(out)
            if not drop_caches():
                res["cold"]["refused"] = "writing /proc/sys/vm/drop_caches was refused"
                print("  drop_caches refused: no cold figures", flush=True)
                break
            # the interpreter, zckpt and what its jobs import (numpy, ml_dtypes for the bf16 casts, isal) read back
            # into the cache: the job's disk reads are the checkpoint's (before 2026-12-06, eighth session, ml_dtypes
            # was left out: a cold merge --dtype bf16 read it from the disk too)
            subprocess.run([sys.executable, "-c", "import zckpt.cli, zckpt.ops.merge, zckpt.ops.convert, "
                            "zckpt.ops.to_deepspeed, zckpt.ops.reshard, numpy, isal.isal_zlib\n"
                            "try:\n    import ml_dtypes\nexcept ImportError:\n    pass"],
                           env=env_for(trees[cold_tree]), check=True)
            r = run_job(cmd, env_for(trees[cold_tree]))
            r["tree"] = cold_tree
            rm(out)
            drop_caches()
            read_s, read_b = parallel_read(srcs, args.threads)
            rate = read_b / read_s
            r.update(read_all_s=read_s, read_all_bytes=read_b, read_rate=rate,
                     read_what_it_reads_s=r["disk_read_bytes"] / rate)
            res["cold"][job] = r
            res.setdefault("cold_runs", {}).setdefault(job, []).append(r)
            print(f"  {job} cold: zckpt {r['zckpt_s']:.2f}s wall {r['wall_s']:.2f}s read from disk "
                  f"{r['disk_read_bytes'] / 1e9:.2f} GB; {args.threads}-thread read of the source "
                  f"{read_b / 1e9:.2f} GB in {read_s:.2f}s ({rate / 1e9:.2f} GB/s): what it reads "
                  f"{r['read_what_it_reads_s']:.2f}s -> {r['zckpt_s'] / r['read_what_it_reads_s']:.2f}x", flush=True)
            save()
    print()
    print(f"| job | GB written | files | zckpt s best (all) | wall best | {args.threads}-thread pcopy best | cfr best "
          f"| cp -r best | zckpt / pcopy | zckpt / min(pcopy, cfr) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for job, rec in res["warm"].items():
        for tree, runs in rec["runs"].items():
            z = [r["zckpt_s"] for r in runs]
            row = f"| {job} ({tree}) | {rec.get('bytes', 0) / 1e9:.2f} | {rec.get('files', '-')} | {min(z):.3f} " \
                  f"({', '.join(f'{v:.3f}' for v in z)}) | {min(r['wall_s'] for r in runs):.2f} |"
            cs = [r["copies"] for r in rec["runs"][first] if "copies" in r]
            if cs:
                best = {k: min(c[k] for c in cs) for k in cs[0]}
                nan = float("nan")
                row += f" {best['pcopy']:.3f} | {best.get('cfr', nan):.3f} | {best.get('cp', nan):.2f} | " \
                       f"{min(z) / best['pcopy']:.2f} | {min(z) / min(best['pcopy'], best.get('cfr', nan)):.2f} |"
                if "rwcopy" in best:
                    row += f" rwcopy {best['rwcopy']:.3f} ({min(z) / best['rwcopy']:.2f}x)"
                ws = [r["write_s"] for r in runs if r.get("write_s")]
                if ws:  # the job less its fixed costs (plan, imports, input check, publishing) against the copy
                    fixed = sorted(r["zckpt_s"] - r["write_s"] for r in runs if r.get("write_s"))
                    row += f" write {min(ws):.3f} ({min(ws) / best['pcopy']:.2f}x pcopy), the rest " \
                           f"{fixed[0]:.3f}-{fixed[-1]:.3f}"
            print(row)
        for name, v in rec.get("variants", {}).items():
            print(f"| {job} ({name}) | | | {min(r['zckpt_s'] for r in v['runs']):.3f} | | | | | | |")
    for job, runs in res.get("cold_runs", {}).items():  # each run against the read that followed it
        ratios = [r["zckpt_s"] / r["read_what_it_reads_s"] for r in runs]
        r = runs[-1]
        row = f"| {job} cold | zckpt {r['zckpt_s']:.2f}s | read what it reads {r['read_what_it_reads_s']:.2f}s | " \
              f"{ratios[-1]:.2f}x |"
        if len(runs) > 1:
            each = ", ".join(f"{v:.2f}" for v in ratios)
            row += f" {len(runs)} runs: median {statistics.median(ratios):.2f}x ({each})"
        print(row)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
