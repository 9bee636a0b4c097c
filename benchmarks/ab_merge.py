"""A/B of two zckpt trees on one checkpoint, in alternating order (ABBA...), so neither tree always runs first.

    python benchmarks/ab_merge.py CKPT BEFORE_DIR [--reps 10] [--cmd merge|reshard|convert] [--json-out F]

Each run is ``python -m zckpt <cmd> CKPT -o OUT --overwrite --json`` with PYTHONPATH set to the tree; the figure
is the command's own ``seconds`` (open, plan, write, CRC check, publish), the output removed between runs."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARGS = {"merge": ["merge", "--to", "safetensors", "--dtype", "fp32"], "reshard": ["reshard", "--world-size", "8"],
        "convert": ["convert", "--to", "dcp", "--layout", "dcp"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("before")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cmd", default="merge", choices=sorted(ARGS))
    ap.add_argument("--json-out")
    a = ap.parse_args()
    trees = {"after": str(ROOT), "before": str(Path(a.before).resolve())}
    extra = os.environ.get("PYTHONPATH", "")
    out = Path(os.environ.get("AB_OUT", "/tmp/ab-out"))
    times: dict[str, list[float]] = {k: [] for k in trees}
    for i in range(a.reps):
        order = ["after", "before"] if i % 2 == 0 else ["before", "after"]
        for k in order:
            shutil.rmtree(out, ignore_errors=True)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [trees[k], extra] if p)}
            r = subprocess.run([sys.executable, "-m", "zckpt", ARGS[a.cmd][0], a.ckpt, *ARGS[a.cmd][1:], "-o",
                                str(out), "--json", "-q"], env=env, capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"{k}: {r.stderr}")
            times[k].append(json.loads(r.stdout)["seconds"])
    shutil.rmtree(out, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"cmd": a.cmd, "ckpt": a.ckpt, "reps": a.reps, "raw": times, "median": med,
           "after_over_before": round(med["after"] / med["before"], 3)}
    print(json.dumps(res))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
