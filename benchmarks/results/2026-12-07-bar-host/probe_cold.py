"""Sixteenth session, call 4: is the cold merges' gap the read's size and depth? With the page cache dropped before
each: a read of the rank optimizer files (all their bytes) by T threads in R-byte ranges dealt round robin over the
files, for (T, R) in (16, 64 MiB) (the bar's read), (12, 4 MiB) (zckpt's default: 12 writers, 4 MiB jobs),
(16, 4 MiB), (24, 4 MiB), (32, 4 MiB); then the cold jobs at --workers 12 (the default), 16, 24, 32. ROUNDS rounds,
each in its own order. Run from the repo root on the host after device_copybar.sh made the checkpoint:
  PYTHONPATH=/tmp/site:. python3 benchmarks/results/2026-12-07-bar-host/probe_cold.py CK OUT.json"""
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.bench_copybar import JOBS, drop_caches, env_for, files_of, interleaved, rm, run_job  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def read(files, threads, rng):
    jobs = interleaved([p.stat().st_size for p in files], rng)
    bufs = [bytearray(rng) for _ in range(threads)]
    fds = [os.open(p, os.O_RDONLY) for p in files]
    t0 = time.perf_counter()

    def worker(k):
        view = memoryview(bufs[k])
        return sum(os.preadv(fds[i], [view[:n]], off) for i, off, n in jobs[k::threads])

    with ThreadPoolExecutor(threads) as pool:
        got = sum(pool.map(worker, range(threads)))
    dt = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    return dt, got


def main():
    ck, out_json = Path(sys.argv[1]), Path(sys.argv[2])
    rounds = int(os.environ.get("ROUNDS", "2"))
    tag = (ck / "latest").read_text().strip()
    optim = sorted(p for p in files_of(ck / tag) if "optim_states" in p.name)
    out = ck.parent / "probe-out"
    env = env_for(ROOT)
    res = {"optim_files": [str(p) for p in optim], "reads": [], "jobs": []}
    reads = [(16, 64 << 20), (12, 4 << 20), (16, 4 << 20), (24, 4 << 20), (32, 4 << 20)]
    for r in range(rounds):
        for t, rng in reads[r % len(reads):] + reads[:r % len(reads)]:
            drop_caches()
            dt, got = read(optim, t, rng)
            res["reads"].append({"round": r, "threads": t, "range": rng, "s": dt, "bytes": got})
            print(f"round {r} read {t} threads x {rng >> 20} MiB: {got / 1e9:.2f} GB in {dt:.2f} s "
                  f"({got / dt / 1e9:.2f} GB/s)", flush=True)
            out_json.write_text(json.dumps(res, indent=1))
    for r in range(rounds):
        for job in os.environ.get("JOBS", "merge-bf16,merge-fp32-1GB,convert-dcp").split(","):
            ws = [12, 16, 24, 32]
            for w in ws[r % 4:] + ws[:r % 4]:
                rm(out)
                drop_caches()
                subprocess.run([sys.executable, "-c", "import zckpt.cli, zckpt.ops.merge, zckpt.ops.convert, numpy, "
                                "isal.isal_zlib, ml_dtypes"], env=env, check=True)
                x = run_job([str(a) for a in JOBS[job](ck, None)] + ["-o", str(out), "--workers", str(w)], env)
                x.update(round=r, job=job, workers=w)
                res["jobs"].append(x)
                print(f"round {r} {job} --workers {w}: zckpt {x['zckpt_s']:.2f} s, read "
                      f"{x['disk_read_bytes'] / 1e9:.2f} GB ({x['disk_read_bytes'] / x['write_s'] / 1e9:.2f} GB/s "
                      f"over its writing)", flush=True)
                out_json.write_text(json.dumps(res, indent=1))
    rm(out)


if __name__ == "__main__":
    main()
