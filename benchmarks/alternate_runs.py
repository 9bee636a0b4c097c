#!/usr/bin/env python
"""One zckpt command run alternately by several trees, many times (a loaded box: best, median and CPU of each).

    python benchmarks/alternate_runs.py --trees before=DIR,after=DIR --repeat 10 --out OUT \\
        -- reshard CK --ep 4 --world-size 8

Each run: OUT removed, ``sync``, ``python -m zckpt ARGS -o OUT --json`` with ``PYTHONPATH`` = the tree, under
``/usr/bin/time -v``; zckpt's own seconds (``--json``), wall, user + sys CPU and peak RSS recorded."""

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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", required=True)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--out", required=True)
    ap.add_argument("--json-out", default=None)
    args, cmd = ap.parse_args(argv[:cut]), argv[cut + 1:]
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    runs = {t: [] for t in trees}
    for rep in range(args.repeat):
        for tree, root in trees.items():
            shutil.rmtree(args.out, ignore_errors=True)
            os.sync()
            env = dict(os.environ, DS_ACCELERATOR="cpu", ZCKPT_DISABLE_PROGRESS_BARS="1", PYTHONSAFEPATH="1",
                       PYTHONPATH=os.path.abspath(root))
            with tempfile.TemporaryFile() as err:
                t0 = time.perf_counter()
                proc = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "zckpt", *cmd, "-o", args.out,
                                       "--json"], env=env, stdout=subprocess.PIPE, stderr=err)
                wall = time.perf_counter() - t0
                err.seek(0)
                etext = err.read().decode(errors="replace")
            if proc.returncode:
                raise RuntimeError(f"{tree} failed:\n{etext[-3000:]}")
            doc = json.loads([ln for ln in proc.stdout.decode().splitlines() if ln.startswith("{")][-1])
            tv = {ln.split(":", 1)[0].strip(): ln.split(":", 1)[1].strip() for ln in etext.splitlines() if ":" in ln}
            r = {"zckpt_s": doc["seconds"], "wall_s": round(wall, 3),
                 "cpu_s": float(tv["User time (seconds)"]) + float(tv["System time (seconds)"]),
                 "rss_mib": int(tv["Maximum resident set size (kbytes)"]) // 1024}
            runs[tree].append(r)
            print(f"{tree} run {rep}: zckpt {r['zckpt_s']:.3f}s wall {r['wall_s']:.2f}s cpu {r['cpu_s']:.2f}s "
                  f"rss {r['rss_mib']} MiB", flush=True)
    summary = {}
    for tree, rs in runs.items():
        z = [r["zckpt_s"] for r in rs]
        c = [r["cpu_s"] for r in rs]
        summary[tree] = {"best_s": min(z), "median_s": statistics.median(z), "cpu_median_s": statistics.median(c),
                         "cpu_best_s": min(c), "rss_mib": max(r["rss_mib"] for r in rs)}
        print(f"{tree}: best {min(z):.3f}s median {statistics.median(z):.3f}s; CPU best {min(c):.2f}s median "
              f"{statistics.median(c):.2f}s; peak RSS {summary[tree]['rss_mib']} MiB", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"cmd": cmd, "trees": trees, "runs": runs, "summary": summary}, f, indent=1)
    shutil.rmtree(args.out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
