#!/usr/bin/env python
"""Where a ``zckpt merge`` run spends its time, next to a plain ``cp`` of its output (the instrument behind the
numbers in docs/benchmarks.md; run it before and after performance work).

Alternating rounds, medians, warm page cache, ``sync`` (untimed) before each command so no run pays for the
previous one's dirty pages. Each command is its own process:

* ``python -c pass``                     interpreter start-up
* ``zckpt merge --dry-run``              start-up + imports + checkpoint metadata + plan (no bytes)
* ``zckpt merge`` with variants          the whole job (``--workers N``; ``streams=N``: concurrent writes
                                         into one output file, ``zckpt.engine.executor.WRITE_STREAMS``)
* ``cp OUT/model.safetensors COPY``      the disk's speed for the same bytes

    python benchmarks/probe_merge.py CKPT [--dtype fp32] [--rounds 5] [--variants default,w1,w2,streams8]
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

ROOT = Path(__file__).resolve().parent.parent

DRIVER = ("import sys; import zckpt.engine.executor as m; "
          "m.WRITE_STREAMS = int(sys.argv.pop(1)); from zckpt.cli import main; sys.argv[0] = 'zckpt'; main()")


def timed(cmd: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    return dt, usage.ru_maxrss * 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="default,w1,w2,streams8",
                    help="comma list of: default, wN (--workers N), streamsN (WRITE_STREAMS=N)")
    ap.add_argument("--workdir", default=None, help="where outputs go (default: next to the checkpoint)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    work = Path(args.workdir or Path(args.checkpoint).resolve().parent) / "probe"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out, copy = work / "out", work / "copy.bin"
    py = sys.executable
    base = [args.checkpoint, "--dtype", args.dtype, "-o", str(out), "--quiet", "--overwrite"]

    def merge_cmd(variant: str) -> list[str]:
        if variant.startswith("streams"):
            return [py, "-c", DRIVER, variant[len("streams"):], "merge", *base]
        extra = ["--workers", variant[1:]] if variant.startswith("w") else []
        return [py, "-m", "zckpt", "merge", *base, *extra]

    commands = {"python -c pass": [py, "-c", "pass"],
                "merge --dry-run": [py, "-m", "zckpt", "merge", *base, "--dry-run"]}
    for v in args.variants.split(","):
        commands[f"merge {v}"] = merge_cmd(v)
    timed(commands[f"merge {args.variants.split(',')[0]}"])  # warm-up: page cache, .pyc files
    rows: dict[str, list] = {k: [] for k in [*commands, "cp"]}
    for _ in range(args.rounds):
        for name, cmd in commands.items():
            if name != "merge --dry-run" and name != "python -c pass":
                shutil.rmtree(out, ignore_errors=True)
            os.sync()
            rows[name].append(timed(cmd))
        src = next(iter(sorted(out.glob("*.safetensors"))))
        copy.unlink(missing_ok=True)
        os.sync()
        rows["cp"].append(timed(["cp", str(src), str(copy)]))
        copy.unlink()
    cp_med = statistics.median(t for t, _ in rows["cp"])
    result = {"checkpoint": args.checkpoint, "dtype": args.dtype, "cpus": os.cpu_count(), "rounds": args.rounds,
              "output_bytes": sum(f.stat().st_size for f in out.iterdir()), "rows": {}}
    print(f"{'command':<24} {'median s':>9} {'x cp':>6} {'peak RSS MiB':>13}   runs")
    for name, vals in rows.items():
        med = statistics.median(t for t, _ in vals)
        rss = max(r for _, r in vals) / 2**20
        result["rows"][name] = {"median_s": med, "x_cp": med / cp_med, "peak_rss_mib": rss,
                                "runs": [round(t, 3) for t, _ in vals]}
        print(f"{name:<24} {med:9.3f} {med / cp_med:6.2f} {rss:13.0f}   {' '.join(f'{t:.2f}' for t, _ in vals)}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
