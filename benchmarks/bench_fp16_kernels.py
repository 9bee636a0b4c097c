#!/usr/bin/env python
"""Candidate fp32 -> fp16 kernels side by side, in T threads casting chunks of distinct memory at once (as the
engine's workers do; ``--chunk-mib`` of fp32 per chunk, 8 = a 4 MiB fp16 output job): CPU seconds per GB of fp32
read (process time: the figure that holds on a shared machine) and wall GB/s, best of ``--repeat``. Every kernel's
bits are checked against torch's ``.to(torch.float16)`` first (random fp32 patterns and every rounding edge, NaN
left out as zckpt hands NaN chunks to torch).

* ``astype``: numpy's own cast (``np.copyto`` into a float16 array; zckpt's kernel before);
* ``int passes, blocks N``: zckpt's kernel now (``casting._fp16_from_f32``: fifteen numpy calls, integer rounding)
  over blocks of N elements (``casting.F16_BLOCK``, 262144; ``whole chunk``: one block);
* ``ml_dtypes round``: the same but rounded by ml_dtypes' compiled bf16 cast of the placed bits (eleven calls),
  over the whole chunk or over blocks of ``F16_BLOCK``;
* ``zckpt cast()``: zckpt's whole path (the NaN scan included);
* ``torch``: ``Tensor.copy_`` into a per-thread buffer (when torch is installed).

    python benchmarks/bench_fp16_kernels.py --threads 1,2 --mib 128 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zckpt.encoding import casting  # noqa: E402

_tls = threading.local()


def _buf(name: str, n: int, dtype) -> np.ndarray:
    arr = getattr(_tls, name, None)
    if arr is None or arr.size < n:
        arr = np.empty(n, dtype)
        setattr(_tls, name, arr)
    return arr[:n]


def astype(f: np.ndarray) -> np.ndarray:
    out = _buf("out", f.size, np.uint16)
    with np.errstate(over="ignore"):
        np.copyto(out.view(np.float16), f, casting="unsafe")
    return out


def int_passes(block: int):
    """zckpt's kernel with ``casting.F16_BLOCK`` = ``block`` (1 << 30: the whole chunk at once)."""
    def run(f: np.ndarray) -> np.ndarray:
        casting.F16_BLOCK = block
        return casting._fp16_from_f32(f, _buf("out", f.size, np.uint16))
    return run


def ml_blocks(block: int):
    def run(f: np.ndarray) -> np.ndarray:
        out = _buf("out16", f.size, np.uint16)
        for lo in range(0, f.size, block):
            ml_round(f[lo:lo + block], out[lo:lo + block])
        return out
    return run


def ml_round(f: np.ndarray, into: np.ndarray | None = None) -> np.ndarray:
    """The placed bits (as zckpt's kernel) rounded by ml_dtypes' compiled fp32 -> bf16 cast (its rounding at bit 16
    is the one wanted; no NaN pattern reaches it): four integer calls fewer, one compiled pass more."""
    import ml_dtypes
    n = f.size
    out = _buf("out", n, np.uint16) if into is None else into
    c, x, r, small = (_buf("c", n, np.float32), _buf("x", n, np.uint32),
                           _buf("r", n, np.uint32), _buf("s", n, np.bool_))
    np.clip(f, -65536.0, 65536.0, out=c)
    cb = c.view(np.uint32)
    np.left_shift(cb, 3, out=x)
    np.add(x, 0x40000000, out=x)
    np.bitwise_and(cb, 0x7FFFFFFF, out=cb)
    np.less(c, 2.0 ** -13, out=small)
    np.add(c, 0.5, out=c)
    np.left_shift(cb, 16, out=cb)
    np.copyto(x, cb, where=small)
    np.bitwise_and(f.view(np.uint32), 0x80000000, out=r)
    np.bitwise_or(x, r, out=x)
    np.copyto(out.view(ml_dtypes.bfloat16), x.view(np.float32), casting="unsafe")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--mib", type=int, default=128, help="fp32 input per thread")
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", default=None, help="comma-separated kernel names")
    args = ap.parse_args(argv)
    block = casting.F16_BLOCK
    kernels = {"astype": astype, "int passes, whole chunk": int_passes(1 << 30),
               "int passes, blocks 16384": int_passes(1 << 14), "int passes, blocks 65536": int_passes(1 << 16),
               "int passes, blocks 262144": int_passes(1 << 18), "int passes, blocks 1048576": int_passes(1 << 20),
               "ml_dtypes round, whole": ml_round, "ml_dtypes round, blocks": ml_blocks(block),
               "zckpt cast()": lambda f: (setattr(casting, "F16_BLOCK", block),
                                          casting.cast(f.view(np.uint8), "float32", "float16"))[1]}
    import torch
    kernels["torch"] = lambda f: casting.cast(f.view(np.uint8), "float32", "float16", True)
    if args.only:
        kernels = {k: v for k, v in kernels.items() if k in args.only.split(",")}
    rng = np.random.default_rng(0)
    edges = ((np.arange(1 << 16, dtype=np.uint32) << 16)[:, None]
             | np.array([0, 1, 0xFFF, 0x1000, 0x1001, 0x2FFF, 0x3000, 0x7FFF, 0x8000, 0xFFFF], np.uint32)).ravel()
    probe = np.concatenate([rng.integers(0, 2 ** 32, 1 << 20, dtype=np.uint64).astype(np.uint32), edges])
    probe = probe[~np.isnan(probe.view(np.float32))].view(np.float32)
    want = torch.from_numpy(probe.copy()).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    for name, k in kernels.items():
        assert np.array_equal(k(probe).view(np.uint16), want), name
    chunk = (args.chunk_mib << 20) // 4
    print(f"{sys.version.split()[0]} numpy {np.__version__}, torch {torch.__version__}, "
          f"{len(os.sched_getaffinity(0))} CPUs, load {os.getloadavg()[0]:.1f}, {args.mib} MiB per thread, "
          f"{args.chunk_mib} MiB chunks, best of {args.repeat}", flush=True)
    for threads in [int(x) for x in args.threads.split(",")]:
        data = [(rng.standard_normal((args.mib << 20) // 4) * 0.02).astype(np.float32) for _ in range(threads)]
        for name, kernel in kernels.items():
            def work(t: int) -> None:
                d = data[t]
                for off in range(0, d.size, chunk):
                    kernel(d[off:off + chunk])
            times, cpus = [], []
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(work, range(threads)))  # warm: scratch buffers made
                for _ in range(args.repeat):
                    t0, c0 = time.perf_counter(), time.process_time()
                    list(pool.map(work, range(threads)))
                    times.append(time.perf_counter() - t0)
                    cpus.append(time.process_time() - c0)
            gb = threads * (args.mib << 20) / 1e9
            print(f"threads {threads} {name:26} CPU {min(cpus) / gb:.3f} s per GB, {gb / min(times):6.2f} GB/s wall "
                  f"(wall {' '.join(f'{t:.3f}' for t in times)}; CPU {' '.join(f'{t:.3f}' for t in cpus)})",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
