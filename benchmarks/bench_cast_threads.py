#!/usr/bin/env python
"""The fp32 -> bf16 / fp16 cast alone, in T threads at once (as the engine's workers run it): aggregate GB/s of fp32
read, for zckpt's numpy kernels (this tree, and ``--before DIR``'s) and torch's, on 4 MiB chunks of distinct memory
(``--mib`` per thread, so the input comes from memory, not the cache).

    python benchmarks/bench_cast_threads.py --threads 1,8,16 --before .bench/before
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def load_casting(root: Path):
    spec = importlib.util.spec_from_file_location(f"casting_{abs(hash(str(root)))}",
                                                  root / "zckpt" / "encoding" / "casting.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,8,16")
    ap.add_argument("--mib", type=int, default=256, help="fp32 input per thread")
    ap.add_argument("--chunk-mib", type=int, default=4)
    ap.add_argument("--before", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    kernels = {"numpy (this tree)": (load_casting(ROOT), False)}
    if args.before:
        kernels["numpy (before)"] = (load_casting(Path(args.before).resolve()), False)
    try:
        import torch  # noqa: F401
        kernels["torch"] = (kernels["numpy (this tree)"][0], True)
    except ImportError:
        pass
    chunk = args.chunk_mib << 20
    for threads in [int(x) for x in args.threads.split(",")]:
        rng = np.random.default_rng(0)
        data = [(rng.standard_normal((args.mib << 20) // 4) * 0.02).astype(np.float32).view(np.uint8)
                for _ in range(threads)]
        for dst in ("bfloat16", "float16"):
            for name, (mod, use_torch) in kernels.items():
                def work(k: int) -> None:
                    d = data[k]
                    for off in range(0, d.size, chunk):
                        mod.cast(d[off:off + chunk], "float32", dst, use_torch)
                best = 1e9
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(work, range(threads)))  # warm: scratch buffers made
                    for _ in range(args.repeat):
                        t0 = time.perf_counter()
                        list(pool.map(work, range(threads)))
                        best = min(best, time.perf_counter() - t0)
                gb = threads * (args.mib << 20) / 1e9
                print(f"threads {threads:3} {dst:9} {name:18} {gb / best:7.2f} GB/s fp32 read ({best:.3f} s)",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
