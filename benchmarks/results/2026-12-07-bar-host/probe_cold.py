"""Sixteenth session: is the cold merges' gap the read's size and depth, and do read-ahead hints close it? With the
page cache dropped before each: a read of the rank optimizer files (all their bytes) by T threads in R-byte ranges
dealt round robin over the files, for (T, R) in READS (default (16, 64 MiB), the bar's read, and (12, 4 MiB),
zckpt's default of 12 writers and 4 MiB jobs); then each job of JOBS cold in each setting of SETTINGS
(``name=ENV=VALUE+...|--arg value``; default: ZCKPT_READ_HINTS=0 against 1). ROUNDS rounds, each starting one
setting further on. WARM=1: no reads, and the jobs with the page cache warm (each output removed and synced first). Run from the repo root on the host after device_copybar.sh made the checkpoint (and its DCP,
for convert-ds):
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
    reads = [tuple(int(x) << (20 if k else 0) for k, x in enumerate(r.split("x")))
             for r in os.environ.get("READS", "16x64,12x4").split(",") if r]
    settings = []
    for item in os.environ.get("SETTINGS", "nohints=ZCKPT_READ_HINTS=0;hints=ZCKPT_READ_HINTS=1").split(";"):
        name, _, rest = item.partition("=")
        envs, _, args = rest.partition("|")
        settings.append((name, dict(e.split("=", 1) for e in envs.split("+") if e), args.split()))
    warm = os.environ.get("WARM") == "1"  # WARM=1: no reads, the jobs with the page cache warm
    if warm:
        reads = []
        for p in files_of(ck / tag) + (files_of(ck.parent / (ck.name + "-dcp")) if (ck.parent / (ck.name + "-dcp")).exists() else []):
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass
    for r in range(rounds):
        for t, rng in reads[r % max(1, len(reads)):] + reads[:r % max(1, len(reads))]:
            drop_caches()
            dt, got = read(optim, t, rng)
            res["reads"].append({"round": r, "threads": t, "range": rng, "s": dt, "bytes": got})
            print(f"round {r} read {t} threads x {rng >> 20} MiB: {got / 1e9:.2f} GB in {dt:.2f} s "
                  f"({got / dt / 1e9:.2f} GB/s)", flush=True)
            out_json.write_text(json.dumps(res, indent=1))
    dcp = ck.parent / (ck.name + "-dcp")
    for r in range(rounds):
        for job in os.environ.get("JOBS", "merge-bf16,merge-fp32-1GB,convert-dcp").split(","):
            for name, extra_env, args in settings[r % len(settings):] + settings[:r % len(settings)]:
                rm(out)
                if warm:  # the sources stay in the page cache (read before the first round)
                    os.sync()
                else:
                    drop_caches()
                run_env = dict(env, **extra_env)
                subprocess.run([sys.executable, "-c", "import zckpt.cli, zckpt.ops.merge, zckpt.ops.convert, numpy, "
                                "isal.isal_zlib, ml_dtypes"], env=run_env, check=True)
                x = run_job([str(a) for a in JOBS[job](ck, dcp)] + ["-o", str(out), *args], run_env)
                x.update(round=r, job=job, setting=name)
                res["jobs"].append(x)
                print(f"round {r} {job} {name}: zckpt {x['zckpt_s']:.2f} s, read "
                      f"{x['disk_read_bytes'] / 1e9:.2f} GB ({x['disk_read_bytes'] / x['write_s'] / 1e9:.2f} GB/s "
                      f"over its writing)", flush=True)
                out_json.write_text(json.dumps(res, indent=1))
    by: dict = {}
    for x in res["jobs"]:
        by.setdefault((x["job"], x["setting"]), []).append(x["zckpt_s"])
    for (job, name), v in by.items():
        print(f"| {job} | {name} | {min(v):.2f} | {sorted(v)[len(v) // 2]:.2f} | {', '.join(f'{t:.2f}' for t in v)} |")
    rm(out)


if __name__ == "__main__":
    main()
