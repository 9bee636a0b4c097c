#!/usr/bin/env python
"""Scaling benchmark: one ``zckpt merge`` / ``reshard`` split over P = 1, 2, 4, 8 processes on one host.

P = 1 is the plain command (no launcher); P > 1 is ``torchrun --standalone --nproc-per-node P -m zckpt ...``: every
process writes its share of the bytes into the shared scratch folder, rank 0 publishes (zckpt.engine.distributed).
Beside each, the same data movement without zckpt: P processes (forked, one thread each) copying exactly the
source byte ranges of the same P shares into the same output offsets with ``copy_file_range`` (what P parallel
``cat``s of those ranges would do): the storage's speed for these bytes at that P.

Reported per case and P (medians of ``--repeat`` runs): wall seconds of the command (interpreter start, torch import
under torchrun, planning, writing, publishing), zckpt's own seconds (``--json``: open to publish), the copy's
seconds, speed-up and efficiency vs P = 1 (T1 / (P * TP)) and the copy's time over zckpt's. ``--cold`` also runs
each case with the page cache dropped first (``/proc/sys/vm/drop_caches``; where that is refused, every source
file is ``posix_fadvise(DONTNEED)``-ed after a sync; the JSON says which worked).

    python benchmarks/bench_scale.py --layers 26 --hidden 2048 --ffn 8192 --procs 1,2,4,8 --json-out r.json
    python benchmarks/bench_scale.py --ckpt fixtures/z3_fp32_ws3 --procs 1,2 --repeat 1     # a smoke test

``--zckpt-root DIR`` runs the zckpt of another tree (e.g. a checkout of the version before a change) on the same
checkpoint, for a before / after in one run. Each run's ``--json`` ``stats`` (plan seconds, and under torchrun
rank 0's seconds per step: ``phases``) are kept in the raw JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drop_caches(ckpt: Path) -> str:
    """Empty the page cache of the checkpoint's files; returns the method that worked."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for p in ckpt.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def zckpt_cmd(procs: int, args: list[str]) -> list[str]:
    if procs == 1:
        return [sys.executable, "-m", "zckpt", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(procs),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "zckpt", *args]


def run_zckpt(procs: int, args: list[str], env: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    res = subprocess.run(zckpt_cmd(procs, args + ["--json"]), env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{args} x{procs} failed:\n{res.stderr[-3000:]}")
    doc = json.loads([ln for ln in res.stdout.splitlines() if ln.startswith("{")][-1])
    return wall, doc


# ------------------------------------------------------------------------------------------------ the copy

def plan_works(case: str, ckpt: str, procs: int, shard: str):
    """The FileWorks zckpt would write for ``case`` (planned in this process) and the P shares."""
    from zckpt.state.open import open_checkpoint
    from zckpt.engine import torchzip
    from zckpt.engine import distributed as D
    c = open_checkpoint(ckpt)
    maps = torchzip.SourceMaps()
    if case.startswith("merge"):
        from zckpt.ops.merge import plan_merge
        plan = plan_merge(c, "safetensors", case.split("-")[1], shard)
        chunk = D.chunk_size(sum(s.size for s in plan.shards), procs)
        works = [D.safetensors_work(s, chunk) for s in plan.shards]
    else:
        from zckpt.ops.reshard import plan_reshard
        plan = plan_reshard(c, int(case.split("ws")[1]))
        chunk = D.chunk_size(sum(f.nbytes for f in plan.files), procs)
        works = [D.archive_work(f.relpath, f.archive, maps, chunk) if f.kind == "torch" else
                 D.FileWork(f.relpath, f.nbytes, src=f.src) for f in plan.files]
    return works, D.split_ranges(works, procs)


def _copy_share(works, share, out: str) -> int:
    from zckpt.engine.segments import Cast, Fill, Piece
    from zckpt.encoding.safeload import DTYPE_SIZES
    fds_in, fds_out, done = {}, {}, 0
    zeros = bytes(1 << 20)
    try:
        for fi, ji in share:
            w = works[fi]
            dst = os.path.join(out, w.relpath)
            if fi not in fds_out:
                fds_out[fi] = os.open(dst, os.O_WRONLY)
            fd = fds_out[fi]
            if ji < 0:
                src = os.open(w.src, os.O_RDONLY)
                n, pos = os.path.getsize(w.src), 0
                while pos < n:
                    pos += os.copy_file_range(src, fd, n - pos, pos, pos)
                os.close(src)
                done += n
                continue
            _, off, parts, dtype = w.jobs[ji]
            for p in parts:
                if isinstance(p, Piece):
                    fin = fds_in.get(p.path)
                    if fin is None:
                        fin = fds_in[p.path] = os.open(p.path, os.O_RDONLY)
                    left, s, d = p.nbytes, p.offset, off
                    while left:
                        got = os.copy_file_range(fin, fd, left, s, d)
                        left, s, d = left - got, s + got, d + got
                    off += p.nbytes
                elif isinstance(p, Fill):
                    left = p.nbytes
                    while left:
                        k = min(left, len(zeros))
                        os.pwrite(fd, zeros[:k], off)
                        off, left = off + k, left - k
                elif isinstance(p, Cast):  # (frozen bf16 weights in an fp32 merge): their source bytes, uncast
                    for q in p.pieces:
                        fin = fds_in.get(q.path)
                        if fin is None:
                            fin = fds_in[q.path] = os.open(q.path, os.O_RDONLY)
                        left, s, d = q.nbytes, q.offset, off
                        while left:
                            got = os.copy_file_range(fin, fd, left, s, d)
                            left, s, d = left - got, s + got, d + got
                        off += q.nbytes
                    off += p.numel * DTYPE_SIZES[dtype] - sum(q.nbytes for q in p.pieces)
                else:
                    os.pwrite(fd, p, off)
                    off += len(p)
            done += off
    finally:
        for fd in (*fds_in.values(), *fds_out.values()):
            os.close(fd)
    return done


def parallel_copy(works, shares, out: Path) -> float:
    """Seconds for len(shares) forked processes to copy their shares' source ranges into ``out``."""
    shutil.rmtree(out, ignore_errors=True)
    for w in works:
        (out / w.relpath).parent.mkdir(parents=True, exist_ok=True)
        with open(out / w.relpath, "wb") as f:
            f.truncate(w.size)
    os.sync()
    t0 = time.perf_counter()
    pids = []
    for share in shares:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _copy_share(works, share, str(out))
            except BaseException as exc:  # noqa: BLE001
                print(f"copy failed: {exc!r}", file=sys.stderr)
                code = 1
            os._exit(code)
        pids.append(pid)
    bad = [pid for pid in pids if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0]
    dt = time.perf_counter() - t0
    if bad:
        raise RuntimeError("the copy baseline failed")
    shutil.rmtree(out, ignore_errors=True)
    return dt


# ------------------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=str(ROOT / ".bench"))
    ap.add_argument("--ckpt", default=None, help="an existing checkpoint instead of generating one")
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--procs", default="1,2,4,8")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cases", default="merge-fp32,merge-bf16,reshard-ws8",
                    help="merge-<dtype> (safetensors) and reshard-ws<M>")
    ap.add_argument("--max-shard-size", default="1GB", help="merge shards (more files: less inode-lock contention)")
    ap.add_argument("--cold", action="store_true", help="also run every case with the page cache dropped")
    ap.add_argument("--cold-only", action="store_true", help="only with the page cache dropped")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--zckpt-root", default=str(ROOT), help="the tree whose zckpt runs (default: this one)")
    args = ap.parse_args(argv)
    zroot = Path(args.zckpt_root).resolve()

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if args.ckpt:
        ckpt = Path(args.ckpt).resolve()
        params = None
    else:
        from benchmarks.bench_merge import count_params, ensure_checkpoint, model_dims
        dims = model_dims(args.layers, args.hidden, args.vocab, args.ffn)
        params = count_params(dims)
        ckpt = ensure_checkpoint(workdir, dims, args.world_size)
    env = dict(os.environ, DS_ACCELERATOR="cpu", ZCKPT_DISABLE_PROGRESS_BARS="1", PYTHONSAFEPATH="1",
               PYTHONPATH=os.pathsep.join([str(zroot), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(zroot / "zckpt")], check=True,
                   stdout=subprocess.DEVNULL)
    procs = [int(p) for p in args.procs.split(",")]
    tag = (ckpt / "latest").read_text().strip()
    src_bytes = sum(p.stat().st_size for p in (ckpt / tag).rglob("*") if p.is_file())
    results = {"checkpoint": str(ckpt), "zckpt_root": str(zroot), "params": params, "checkpoint_bytes": src_bytes, "cpus": os.cpu_count(),
               "procs": procs, "repeat": args.repeat, "max_shard_size": args.max_shard_size, "cases": {}}
    print(f"checkpoint {ckpt} ({(params or 0) / 1e9:.2f}B params, {src_bytes / 2**30:.2f} GiB), "
          f"{os.cpu_count()} CPUs", flush=True)
    out = workdir / "scale-out"
    copy_out = workdir / "scale-copy"
    for case in args.cases.split(","):
        if case.startswith("merge"):
            cargs = ["merge", str(ckpt), "--dtype", case.split("-")[1], "--max-shard-size", args.max_shard_size]
        else:
            cargs = ["reshard", str(ckpt), "-w", case.split("ws")[1]]
        for cache in (["cold"] if args.cold_only else ["warm", "cold"] if args.cold else ["warm"]):
            key = f"{case}/{cache}"
            rows: dict = {}
            for p in procs:
                works, shares = plan_works(case, str(ckpt), p, args.max_shard_size)
                rec = {"wall": [], "zckpt": [], "copy": [], "cache": [], "stats": []}
                if cache == "warm" and not rows:  # read the sources once: the page cache holds them
                    run_zckpt(1, cargs + ["-o", str(out), "--overwrite"], env)
                for _ in range(args.repeat):
                    shutil.rmtree(out, ignore_errors=True)
                    if cache == "cold":
                        rec["cache"].append(drop_caches(ckpt))
                    else:
                        os.sync()
                    wall, doc = run_zckpt(p, cargs + ["-o", str(out)], env)
                    rec["wall"].append(wall)
                    rec["zckpt"].append(doc["seconds"])
                    rec["stats"].append(doc.get("stats", {}))
                    rec["bytes"] = doc["total_bytes"]
                    shutil.rmtree(out, ignore_errors=True)
                    if not case.startswith("merge-bf16") and not case.startswith("merge-fp16"):
                        if cache == "cold":
                            drop_caches(ckpt)
                        rec["copy"].append(parallel_copy(works, shares, copy_out))
                med = {k: statistics.median(v) for k, v in rec.items() if k in ("wall", "zckpt", "copy") and v}
                rows[p] = {"median_s": med, "raw": rec}
                print(f"  {key} P={p}: wall {med['wall']:.2f}s zckpt {med['zckpt']:.2f}s"
                      + (f" copy {med['copy']:.2f}s" if "copy" in med else ""), flush=True)
                last = rec["stats"][-1] if rec["stats"] else {}
                print(f"    plan {last.get('plan_seconds')}s phases {last.get('phases')}", flush=True)
            base = rows[procs[0]]["median_s"]
            for p, r in rows.items():
                m = r["median_s"]
                r["speedup_wall"] = base["wall"] / m["wall"]
                r["speedup_zckpt"] = base["zckpt"] / m["zckpt"]
                r["efficiency_wall"] = r["speedup_wall"] * procs[0] / p
                r["efficiency_zckpt"] = r["speedup_zckpt"] * procs[0] / p
                if "copy" in m:
                    r["copy_over_zckpt"] = m["copy"] / m["zckpt"]
                    r["copy_speedup"] = base["copy"] / m["copy"]
            results["cases"][key] = rows
            if args.json_out:  # after every case: a run cut short keeps what it measured
                Path(args.json_out).write_text(json.dumps(results, indent=2))

    print()
    print("| case | P | wall s | zckpt s | copy s | speed-up (zckpt s) | efficiency | copy / zckpt |")
    print("|---|---|---|---|---|---|---|---|")
    for key, rows in results["cases"].items():
        for p, r in rows.items():
            m = r["median_s"]
            print(f"| {key} | {p} | {m['wall']:.2f} | {m['zckpt']:.2f} | "
                  f"{m['copy']:.2f} | " if "copy" in m else f"| {key} | {p} | {m['wall']:.2f} | {m['zckpt']:.2f} | - | ",
                  end="")
            print(f"{r['speedup_zckpt']:.2f}x | {r['efficiency_zckpt']:.2f} | "
                  f"{r['copy_over_zckpt']:.2f} |" if "copy_over_zckpt" in r else
                  f"{r['speedup_zckpt']:.2f}x | {r['efficiency_zckpt']:.2f} | - |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
