#!/usr/bin/env python
"""DeepSpeed -> DCP benchmark: ``zckpt convert --to dcp`` vs a plain copy of its output vs the naive route, in one run.

Uses the ZeRO-2 bf16 checkpoint ``bench_merge.py`` generates (cached under the work dir; default ~234M params at
4 ranks) and runs, alternately and ``--repeat`` times each, with a warm page cache:

* ``zckpt convert CKPT --to dcp -o OUT``        the whole training state: fp32 masters, both Adam moments, steps,
                                                 groups, frozen weights, buffers (streamed, .metadata last)
* ``cp -r OUT COPY``                             a plain copy of that output: the disk's speed for those bytes
* naive: ``get_fp32_state_dict_from_zero_checkpoint(CKPT)`` + ``dcp.save({"model": sd})``
                                                 DeepSpeed's converter into RAM, then torch's DCP writer: the
                                                 model only (no optimizer state: FSDP2 cannot resume from it)

Each command runs in its own process; peak RSS is the largest process (``wait4``) and the process tree's peak
(psutil, sampled every 50 ms). Output sizes are listed so the bytes each route writes can be compared.

    python benchmarks/bench_convert.py [--layers 21] [--repeat 2] [--json-out convert.json]
    python benchmarks/bench_convert.py --layers 2 --hidden 256 --vocab 2000 --ffn 512 --world-size 2   # small
"""

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
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

NAIVE = """
import sys
import torch.distributed.checkpoint as dcp
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
sd = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1])
dcp.save({"model": sd}, checkpoint_id=sys.argv[2], no_dist=True)
"""


def main(argv=None) -> int:
    from bench_merge import count_params, du, ensure_checkpoint, model_dims
    from bench_reshard import run_measured

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=str(ROOT / ".bench"))
    ap.add_argument("--layers", type=int, default=21)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--world-size", type=int, default=4, help="world size of the source checkpoint")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--workers", type=int, default=None, help="zckpt --workers")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    dims = model_dims(args.layers, args.hidden, args.vocab, args.ffn)
    ckpt = ensure_checkpoint(work, dims, args.world_size)
    tag = (ckpt / "latest").read_text().strip()
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(PYTHONSAFEPATH="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "zckpt")], check=True,
                   stdout=subprocess.DEVNULL)
    py = sys.executable
    out, copy, naive = work / "convert-out", work / "convert-copy", work / "convert-naive"
    zk = [py, "-m", "zckpt", "convert", str(ckpt), "--to", "dcp", "-o", str(out), "--quiet", "--overwrite"]
    if args.workers:
        zk += ["--workers", str(args.workers)]
    cases = {
        "zckpt convert --to dcp": (lambda: zk, out),
        "cp -r (zckpt's output)": (lambda: ["cp", "-r", str(out), str(copy)], copy),
        "naive: get_fp32_state_dict_from_zero_checkpoint + dcp.save (model only)":
            (lambda: [py, "-c", NAIVE, str(ckpt), str(naive)], naive),
    }
    subprocess.run(["cat"] + [str(p) for p in (ckpt / tag).iterdir()], stdout=subprocess.DEVNULL, check=True)
    results: dict[str, list] = {k: [] for k in cases}
    for i in range(args.repeat):
        for name, (make, dst) in cases.items():
            if dst is not out:
                shutil.rmtree(dst, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            dt, rss, tree = run_measured(make(), env)
            results[name].append((dt, rss, tree, du(dst)))
            print(f"[{i + 1}/{args.repeat}] {name:<40} {dt:7.2f}s  peak RSS {rss / 2**20:7.0f} MiB  "
                  f"tree {tree / 2**20:7.0f} MiB  out {du(dst) / 1e9:.3f} GB", flush=True)
    base = statistics.median(r[0] for r in results["cp -r (zckpt's output)"])
    rows = []
    for name, rs in results.items():
        t = statistics.median(r[0] for r in rs)
        rows.append({"command": name, "seconds": round(t, 2), "x_copy": round(t / base, 2),
                     "peak_rss_mib": round(max(r[1] for r in rs) / 2**20),
                     "tree_rss_mib": round(max(r[2] for r in rs) / 2**20),
                     "output_gb": round(rs[-1][3] / 1e9, 3)})
    for d in (out, copy, naive):
        shutil.rmtree(d, ignore_errors=True)
    summary = {"checkpoint": ckpt.name, "params": count_params(dims), "bytes": du(ckpt),
               "world_size": args.world_size, "repeat": args.repeat, "cpus": os.cpu_count(), "rows": rows}
    print(f"\ncheckpoint {ckpt.name}: {count_params(dims) / 1e6:.0f}M params, {du(ckpt) / 1e9:.2f} GB, ZeRO-2 bf16 "
          f"at {args.world_size} ranks, median of {args.repeat}, warm page cache, {os.cpu_count()} CPUs")
    print("| command | seconds | x copy of the output | peak RSS (MiB) | tree RSS (MiB) | output (GB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['command']} | {r['seconds']} | {r['x_copy']} | {r['peak_rss_mib']} | {r['tree_rss_mib']} | "
              f"{r['output_gb']} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
