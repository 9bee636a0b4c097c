#!/usr/bin/env python
"""Side-by-side reshard benchmark: zckpt vs DeepSpeed's ds_to_universal vs a plain ``cp -r``, in one run.

Uses the ZeRO-2 bf16 checkpoint at 4 ranks that ``bench_merge.py`` generates (cached under .bench/, ~234M
params, ~2.9 GB) and runs, alternately and ``--repeat`` times each, with a warm page cache:

* ``cp -r CKPT COPY``                                                    (the disk's speed: the target)
* ``cp -r CKPT COPY && sync``                                            (the same, on disk: zckpt fsyncs its output)
* ``zckpt reshard CKPT --world-size 2 -o OUT``                           (native ZeRO-2 files for 2 ranks)
* ``zckpt reshard CKPT --world-size 2 --format universal -o OUT``        (universal layout)
* ``python -m deepspeed.checkpoint.ds_to_universal --input_folder CKPT/<tag> --output_folder OUT/<tag>_universal
  --inject_missing_state``                                               (DeepSpeed 0.19.8's way to change size)

Each command runs in its own process group; peak RSS is both the largest single process (``wait4``) and the
peak sum over the process tree (sampled every 50 ms with psutil: ds_to_universal runs worker processes).

    python benchmarks/bench_reshard.py [--repeat 2] [--json-out reshard.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def imported_from(env) -> str:
    """The zckpt package a command run with ``env`` imports (checked, so a before/after run cannot compare a tree with
    itself)."""
    return subprocess.run([sys.executable, "-c", "import zckpt; print(zckpt.__file__)"], env=env, check=True,
                          capture_output=True, text=True).stdout.strip()


def run_measured(cmd: list[str], env=None) -> tuple[float, int, int]:
    """(seconds, peak RSS of the largest process, peak RSS summed over the process tree) of one command."""
    import psutil
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    peak = [0]
    done = threading.Event()

    def sample():
        try:
            root = psutil.Process(proc.pid)
        except psutil.Error:
            return
        while not done.is_set():
            total = 0
            try:
                for p in [root] + root.children(recursive=True):
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
            except psutil.Error:
                break
            peak[0] = max(peak[0], total)
            done.wait(0.05)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t0
    done.set()
    th.join()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err.decode(errors='replace')[-3000:]}")
    return dt, usage.ru_maxrss * 1024, max(peak[0], usage.ru_maxrss * 1024)


def main(argv=None) -> int:
    from bench_merge import du, ensure_checkpoint, model_dims

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=str(ROOT / ".bench"))
    ap.add_argument("--layers", type=int, default=21)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--world-size", type=int, default=4, help="world size of the source checkpoint")
    ap.add_argument("--to", type=int, default=2, help="target world size")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--workers", type=int, default=None, help="zckpt --workers")
    ap.add_argument("--skip-ds", action="store_true", help="leave out ds_to_universal")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="a folder holding another zckpt package: run its reshard too (before/after in one run)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = ensure_checkpoint(work, model_dims(args.layers, args.hidden, args.vocab, args.ffn), args.world_size)
    tag = (ckpt / "latest").read_text().strip()
    size = du(ckpt)
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    # `python -m` puts the working directory ahead of PYTHONPATH on sys.path: with PYTHONSAFEPATH every run imports
    # exactly the tree its PYTHONPATH names (this one, or --baseline's) wherever it starts (before/after runs until
    # 2026-12-01 morning both imported this tree when started from the repo root)
    env.update(PYTHONSAFEPATH="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    py = sys.executable
    zk = [py, "-m", "zckpt", "reshard", str(ckpt), "--world-size", str(args.to), "--quiet"]
    if args.workers:
        zk += ["--workers", str(args.workers)]
    out = work / "reshard-out"

    def clean():
        shutil.rmtree(out, ignore_errors=True)

    cases = {
        "cp -r": lambda: ["cp", "-r", str(ckpt), str(out)],
        "cp -r && sync": lambda: ["sh", "-c", f"cp -r '{ckpt}' '{out}' && sync"],
        "zckpt reshard (native)": lambda: zk + ["-o", str(out)],
        "zckpt reshard --format universal": lambda: zk + ["--format", "universal", "-o", str(out)],
    }
    if args.baseline:  # another zckpt package (an older commit), same command, for before/after in one run
        benv = dict(env, PYTHONPATH=os.pathsep.join([str(Path(args.baseline).resolve()), env.get("PYTHONPATH", "")]))
        trees = imported_from(env), imported_from(benv)
        print(f"after: {trees[0]}\nbefore: {trees[1]}", flush=True)
        assert trees[0] != trees[1], trees
        cases["baseline zckpt reshard (native)"] = lambda: ["env", f"PYTHONPATH={benv['PYTHONPATH']}"] + zk + [
            "-o", str(out)]
        cases["baseline zckpt reshard --format universal"] = lambda: [
            "env", f"PYTHONPATH={benv['PYTHONPATH']}"] + zk + ["--format", "universal", "-o", str(out)]
    if not args.skip_ds:
        cases["ds_to_universal"] = lambda: [py, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                                            str(ckpt / tag), "--output_folder", str(out / f"{tag}_universal"),
                                            "--inject_missing_state"]
    subprocess.run(["cat"] + [str(p) for p in (ckpt / tag).iterdir()], stdout=subprocess.DEVNULL, check=True)
    results: dict[str, list] = {k: [] for k in cases}
    for i in range(args.repeat):
        for name, make in cases.items():
            clean()
            out.mkdir(parents=True) if name == "ds_to_universal" else None
            subprocess.run(["sync"], check=True)  # start every run with no dirty pages from the previous one
            dt, rss, tree = run_measured(make(), env)
            results[name].append((dt, rss, tree, du(out)))
            print(f"[{i + 1}/{args.repeat}] {name:<34} {dt:7.2f}s  peak RSS {rss / 2**20:7.0f} MiB  "
                  f"tree {tree / 2**20:7.0f} MiB  out {du(out) / 1e9:.2f} GB", flush=True)
    clean()

    base = statistics.median(r[0] for r in results["cp -r"])
    rows = []
    for name, rs in results.items():
        t = statistics.median(r[0] for r in rs)
        rows.append({"command": name, "seconds": round(t, 2), "x_cp": round(t / base, 2),
                     "peak_rss_mib": round(max(r[1] for r in rs) / 2**20),
                     "tree_rss_mib": round(max(r[2] for r in rs) / 2**20),
                     "output_gb": round(rs[-1][3] / 1e9, 2)})
    summary = {"checkpoint": ckpt.name, "bytes": size, "from_ws": args.world_size, "to_ws": args.to,
               "repeat": args.repeat, "cpus": os.cpu_count(), "rows": rows}
    print(f"\ncheckpoint {ckpt.name}: {size / 1e9:.2f} GB, ZeRO-2 bf16, {args.world_size} -> {args.to} ranks, "
          f"median of {args.repeat}, warm page cache")
    print("| command | seconds | x cp -r | peak RSS (MiB) | tree RSS (MiB) | output (GB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['command']} | {r['seconds']} | {r['x_cp']} | {r['peak_rss_mib']} | {r['tree_rss_mib']} | "
              f"{r['output_gb']} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
