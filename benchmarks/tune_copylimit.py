#!/usr/bin/env python
"""The engine's knobs on one checkpoint: each case at P = 1 and P > 1 under several settings, one line of JSON each.

Settings are environment variables the engine reads (``ZCKPT_WRITE_STREAMS``: pwrites in flight per process;
``ZCKPT_FALLOCATE=0``: files only truncated to size) and ``--workers`` (threads per process). Every run starts
from an empty output and a ``sync``; the page cache holds the checkpoint (one warm-up run per case first).
What :mod:`benchmarks.bench_copylimit` then measures with the settings chosen.

    python benchmarks/tune_copylimit.py --layers 26 --hidden 2048 --ffn 8192 --out tune.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_copylimit import CASES, run  # noqa: E402

# (procs, workers or None, env): each knob against its default (the 2026-12-03 visit ran this with the defaults of
# then, 1 writer per file: its "8 writers" rows are today's default)
VARIANTS = [
    (1, None, {}),
    (1, None, {"ZCKPT_FALLOCATE": "0"}),
    (1, None, {"ZCKPT_WRITE_STREAMS": "1"}),
    (1, 4, {}),
    (4, None, {}),
    (4, 2, {}),
    (4, None, {"ZCKPT_WRITE_STREAMS": "1"}),
    (4, None, {"ZCKPT_FALLOCATE": "0"}),
    (8, None, {}),
    (8, 1, {}),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=str(ROOT / ".bench"))
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--cases", default="reshard-ws8,convert-dcp,merge-fp32,merge-fp32-1GB")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--ckpt", default=None, help="an existing checkpoint instead of the generated one")
    ap.add_argument("--max-procs", type=int, default=8)
    ap.add_argument("--variants", default=None,
                    help="instead of the built-in list: P[:WORKERS[:VAR=VALUE]],... e.g. 1,1:16,4,4:8,8,8:4")
    a = ap.parse_args(argv)
    if a.variants:
        a.variant_list = []
        for v in a.variants.split(","):
            procs, workers, *env = v.split(":") + [""]
            a.variant_list.append((int(procs), int(workers) if workers else None,
                                   dict(e.split("=", 1) for e in env if e)))
    else:
        a.variant_list = VARIANTS
    import compileall  # the tree's bytecode written first, as `pip install` does for the wheel
    compileall.compile_dir(str(ROOT / "zckpt"), quiet=1)
    from benchmarks.bench_merge import ensure_checkpoint, model_dims
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = Path(a.ckpt).resolve() if a.ckpt else ensure_checkpoint(work, model_dims(a.layers, a.hidden, a.vocab,
                                                                                       a.ffn), a.world_size)
    base = dict(os.environ, DS_ACCELERATOR="cpu", ZCKPT_DISABLE_PROGRESS_BARS="1", PYTHONSAFEPATH="1",
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = work / "tune-out"
    with open(a.out or os.devnull, "a") as sink:
        for case in a.cases.split(","):
            tune_case(case, ckpt, out, base, a, sink)
    return 0


def tune_case(case: str, ckpt: Path, out: Path, base: dict, a, sink) -> None:
    """Every variant of one case, a JSON line each (printed and written to ``sink``)."""
    args = [str(x) for x in CASES[case](ckpt, out)]
    run(1, args + ["--overwrite"], base)  # warm
    for procs, workers, env in [v for v in a.variant_list if v[0] <= a.max_procs]:
        for _ in range(a.repeat):
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            extra = ["--workers", str(workers)] if workers else []
            wall, secs, doc, _ = run(procs, args + extra, dict(base, **env))
            nbytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
            files = sum(1 for f in out.rglob("*") if f.is_file())
            stats = doc.get("stats", {})
            row = {"case": case, "procs": procs, "workers": workers, "env": env, "zckpt_s": secs,
                   "wall_s": round(wall, 3), "bytes": nbytes, "files": files,
                   "gb_per_s": round(nbytes / secs / 1e9, 2), "plan_s": stats.get("plan_seconds"),
                   "phases": stats.get("phases")}
            print(json.dumps(row), flush=True)
            sink.write(json.dumps(row) + "\n")
            sink.flush()
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
