#!/usr/bin/env python
"""convert --to deepspeed's planning steps before its writing, timed on their own: the jobs of every output file
(``works.reshard_works``) and the bytes no job writes (each file's headers), three times each, then a profile of
the jobs by their own time.

    python benchmarks/profile_plan.py DCP [--chunk BYTES] [--world-size 4]

``--chunk``: the engine's job size (default: its CHUNK_BYTES, 4 MiB); a small checkpoint cut into smaller jobs
has the job count of a larger one (the 89M DCP in 341 KiB jobs: 3899, the lent host's 1.05B in 4 MiB: 3839).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dcp")
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--world-size", type=int, default=4)
    args = ap.parse_args()
    import zckpt.engine.executor as ex
    if args.chunk:
        ex.CHUNK_BYTES = args.chunk
    from zckpt.dcp.reader import open_dcp
    from zckpt.deepspeed.from_state import load_config
    from zckpt.engine import torchzip, works
    from zckpt.ops import to_deepspeed
    ckpt = open_dcp(args.dcp)
    cfg, known = load_config(None, "bf16")
    plan = to_deepspeed.plan_to_deepspeed(ckpt, args.world_size, 2, cfg, ["scale", "idx"], known, None)
    for _ in range(3):
        t = time.perf_counter()
        ws = works.reshard_works(plan, torchzip.SourceMaps(), ex.CHUNK_BYTES)
        t_works = time.perf_counter() - t
        t = time.perf_counter()
        headers = sum(w.size - sum(works.job_bytes(parts, dtype) for _, _, parts, dtype in w.jobs) for w in ws)
        t_headers = time.perf_counter() - t
        print(f"reshard_works {t_works * 1e3:.1f} ms ({sum(len(w.jobs) for w in ws)} jobs), "
              f"header bytes {t_headers * 1e3:.1f} ms ({headers} bytes)")
    prof = cProfile.Profile()
    prof.enable()
    works.reshard_works(plan, torchzip.SourceMaps(), ex.CHUNK_BYTES)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
