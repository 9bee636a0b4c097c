#!/usr/bin/env python
"""``zckpt diff`` benchmark: a DeepSpeed checkpoint against its own reshard and its DCP conversion, beside reading
both sides' files and beside the script users write today (both loaded with torch, compared).

Uses a ZeRO-2 bf16 checkpoint made by DeepSpeed (``bench_merge.ensure_checkpoint``, cached under the work dir),
reshards it to ``--to-world-size`` ranks and converts it to DCP with zckpt, then runs, alternately and ``--repeat``
times each, with a warm page cache, each in its own process (peak RSS from ``wait4``, the tree's from psutil):

* ``zckpt diff CKPT OTHER``         masters, both Adam moments, frozen weights, buffers, groups, counters; every
                                    byte read CRC-checked
* read both                         every file of both sides read once (``cat`` to /dev/null): the disk's and page
                                    cache's speed for the same bytes
* torch script                      what users write today: DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``
                                    of CKPT, the other side loaded with torch (the reshard the same way; the DCP
                                    with ``dcp_to_torch_save`` + ``torch.load``), ``torch.equal`` per master (the
                                    weights only: the moments are not compared)

    python benchmarks/bench_diff.py [--layers 2 --hidden 1024 --vocab 16000 --ffn 4096] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SCRIPT = """
import sys, os, warnings, torch
warnings.simplefilter("ignore")
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
a = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1])
if os.path.exists(os.path.join(sys.argv[2], ".metadata")):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(sys.argv[2], sys.argv[3])
    b = torch.load(sys.argv[3], weights_only=False)["model"]
    os.remove(sys.argv[3])
else:
    b = get_fp32_state_dict_from_zero_checkpoint(sys.argv[2])
bad = [k for k in a if k not in b or not torch.equal(a[k].float(), b[k].float())]
print(len(a), "tensors", len(bad), "differ")
sys.exit(1 if bad else 0)
"""


def main(argv=None) -> int:
    from bench_merge import count_params, du, ensure_checkpoint, model_dims
    from bench_reshard import run_measured

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=str(ROOT / ".bench"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--world-size", type=int, default=2, help="world size of the source checkpoint")
    ap.add_argument("--to-world-size", type=int, default=3, help="world size of its reshard")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    dims = model_dims(args.layers, args.hidden, args.vocab, args.ffn)
    ckpt = ensure_checkpoint(workdir, dims, args.world_size)
    env = dict(os.environ, DS_ACCELERATOR="cpu", ZCKPT_DISABLE_PROGRESS_BARS="1")
    zckpt = [sys.executable, "-m", "zckpt"]
    others = {"reshard": workdir / f"{ckpt.name}-diff-ws{args.to_world_size}",
              "dcp": workdir / f"{ckpt.name}-diff-dcp"}
    for kind, out in others.items():
        if not out.exists():
            cmd = ["reshard", str(ckpt), "-w", str(args.to_world_size)] if kind == "reshard" else \
                ["convert", str(ckpt), "--to", "dcp"]
            subprocess.run(zckpt + cmd + ["-o", str(out), "-q"], check=True, env=env)
    for f in [*ckpt.rglob("*"), *[p for o in others.values() for p in o.rglob("*")]]:  # warm the page cache
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass
    tmp = workdir / "bench-diff-tmp.pt"
    routes = {}
    for kind, other in others.items():
        files = [str(p) for p in [*ckpt.rglob("*"), *other.rglob("*")] if p.is_file()]
        routes[f"zckpt diff ({kind})"] = zckpt + ["diff", str(ckpt), str(other), "-q"]
        routes[f"read both ({kind})"] = ["sh", "-c", 'cat "$@" > /dev/null', "sh", *files]
        routes[f"torch script ({kind})"] = [sys.executable, "-c", SCRIPT, str(ckpt), str(other), str(tmp)]
    results = {name: [] for name in routes}
    for _ in range(args.repeat):
        for name, cmd in routes.items():
            results[name].append(run_measured(cmd, env))
            print(f"{name:28s} {results[name][-1][0]:7.2f} s  peak RSS {results[name][-1][1] / 2**20:7.0f} MiB",
                  flush=True)
    summary = {"params": count_params(dims), "checkpoint_bytes": du(ckpt), "cpus": os.cpu_count(),
               **{f"{kind}_bytes": du(o) for kind, o in others.items()}, "routes": {}}
    print(f"\n{count_params(dims) / 1e6:.0f}M params, checkpoint {du(ckpt) / 1e9:.2f} GB "
          f"({args.world_size} ranks), reshard {du(others['reshard']) / 1e9:.2f} GB, "
          f"DCP {du(others['dcp']) / 1e9:.2f} GB")
    for name, runs in results.items():
        med = statistics.median(r[0] for r in runs)
        rss = max(r[1] for r in runs)
        tree = max(r[2] for r in runs)
        summary["routes"][name] = {"seconds": [round(r[0], 3) for r in runs], "median_seconds": round(med, 3),
                                   "peak_rss_bytes": rss, "peak_tree_rss_bytes": tree}
        print(f"| {name} | {med:.2f} | {rss / 2**20:.0f} MiB |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2) + "\n")
    tmp.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
