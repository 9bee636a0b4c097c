#!/usr/bin/env python
"""zckpt's fp32 -> fp16 kernel against numpy's own cast (``astype``) without torch, for another numpy version's
interpreter: one thread, 8 MiB fp32 chunks of 128 MiB of N(0, 0.02) values, CPU seconds per GB, best of 5.

    /path/to/venv/bin/python benchmarks/bench_fp16_numpy.py
"""

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zckpt.encoding import casting  # noqa: E402

rng = np.random.default_rng(0)
d = (rng.standard_normal(32 << 20) * 0.02).astype(np.float32)
out = np.empty(2 << 20, np.uint16)


def run(k) -> float:
    best = 9.0
    for _ in range(5):
        c = time.process_time()
        for off in range(0, d.size, 2 << 20):
            k(d[off:off + (2 << 20)])
        best = min(best, time.process_time() - c)
    return best / (d.nbytes / 1e9)


def astype(f) -> None:
    with np.errstate(over="ignore"):
        np.copyto(out.view(np.float16), f, casting="unsafe")


print(f"{sys.version.split()[0]} numpy {np.__version__}: astype {run(astype):.3f}, zckpt's kernel "
      f"{run(lambda f: casting._fp16_from_f32(f, out)):.3f} CPU s per GB")
