#!/usr/bin/env python
"""Candidate fp32 -> bf16 kernels side by side, in T threads casting 4 MiB chunks of distinct memory at once (as the
engine's workers do): aggregate GB/s of fp32 read and CPU seconds per GB (process time: the figure that holds on a shared
machine), best of ``--repeat``. Every kernel's bits are checked against
the integer formula ``(u + 0x7FFF + lsb) >> 16`` first (NaN-free input, as the numpy path gets it).

* ``six-calls``: the kernel before (shift, and, add, add, shift, copy to uint16; 4 MiB scratch);
* ``six-calls-blocks``: the same over ``--block`` elements at a time (scratch stays in L1/L2; 6 calls per block);
* ``two-calls``: a kernel tried and not kept: ``rint(u / 2**16)`` as the float32 nearest ``i + 2**39 + 2**32``
  (``i``: the bits as int32, summed in float64 inside one buffered numpy call), whose low 16 bits are the bf16;
* ``two-calls-blocks``: the same over blocks;
* ``ml_dtypes``: its compiled cast alone (``np.copyto`` into a ``ml_dtypes.bfloat16`` view), when installed;
* ``zckpt cast()``: zckpt's whole path (the NaN scan included; ml_dtypes' cast where installed);
  ``fp16 astype``: zckpt's fp16 path, numpy's fp32 -> fp16 cast;
* ``torch``: ``Tensor.copy_`` into a per-thread buffer (when torch is installed).

    python benchmarks/bench_cast_kernels.py --threads 1,8,16 --repeat 5
"""

from __future__ import annotations

import argparse
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


def six(u, out, r) -> None:
    np.right_shift(u, 16, out=r)
    np.bitwise_and(r, 1, out=r)
    np.add(r, u, out=r)
    np.add(r, 0x7FFF, out=r)
    np.right_shift(r, 16, out=r)
    np.copyto(out, r, casting="unsafe")


def two(u, out, f) -> None:
    np.add(u.view(np.int32), 2.0 ** 39 + 2.0 ** 32, out=f.view(np.float32), dtype=np.float64, casting="unsafe")
    np.copyto(out, f, casting="unsafe")


def ml_cast(u, out, _r) -> None:
    import ml_dtypes
    np.copyto(out.view(ml_dtypes.bfloat16), u.view(np.float32), casting="unsafe")


def whole(kernel):
    def run(a):
        u = a.view(np.uint32)
        out = _buf("out", u.size, np.uint16)
        kernel(u, out, _buf("r", u.size, np.uint32))
        return out
    return run


def blocks(kernel, block: int):
    def run(a):
        u = a.view(np.uint32)
        out = _buf("out", u.size, np.uint16)
        r = _buf("rb", block, np.uint32)
        for lo in range(0, u.size, block):
            k = min(block, u.size - lo)
            kernel(u[lo:lo + k], out[lo:lo + k], r[:k])
        return out
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,8,16")
    ap.add_argument("--mib", type=int, default=256, help="fp32 input per thread")
    ap.add_argument("--chunk-mib", type=int, default=4)
    ap.add_argument("--block", type=int, default=1 << 16, help="elements per block")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", default=None, help="comma-separated kernel names")
    args = ap.parse_args(argv)
    kernels = {"six-calls": whole(six), "six-calls-blocks": blocks(six, args.block), "two-calls": whole(two),
               "two-calls-blocks": blocks(two, args.block),
               "ml_dtypes": whole(ml_cast),
               "zckpt cast()": lambda a: casting.cast(a.view(np.uint8), "float32", "bfloat16"),
               "fp16 astype": lambda a: casting.cast(a.view(np.uint8), "float32", "float16")}
    try:
        import torch  # noqa: F401
        kernels["torch bf16"] = lambda a: casting.cast(a.view(np.uint8), "float32", "bfloat16", True)
        kernels["torch fp16"] = lambda a: casting.cast(a.view(np.uint8), "float32", "float16", True)
    except ImportError:
        pass
    if not casting.fast_bf16(1 << 62):  # (ml_dtypes whatever its import costs)
        del kernels["ml_dtypes"]
    if args.only:
        kernels = {k: v for k, v in kernels.items() if k in args.only.split(",")}
    rng = np.random.default_rng(0)
    probe = np.concatenate([rng.integers(0, 2 ** 32, 1 << 20, dtype=np.uint64).astype(np.uint32),
                            (np.arange(1 << 16, dtype=np.uint32) << 16) | 0x8000])
    probe = probe[~np.isnan(probe.view(np.float32))]
    want = ((probe.astype(np.uint64) + 0x7FFF + ((probe >> 16) & 1)) >> 16).astype(np.uint16)
    for name, k in kernels.items():
        if "fp16" not in name:
            assert np.array_equal(k(probe.view(np.float32)).view(np.uint16), want), name
    chunk = (args.chunk_mib << 20) // 4
    print(f"{sys.version.split()[0]} numpy {np.__version__}, {len(__import__('os').sched_getaffinity(0))} CPUs, "
          f"{args.mib} MiB per thread, {args.chunk_mib} MiB chunks, blocks of {args.block} elements, "
          f"best of {args.repeat}", flush=True)
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
            print(f"threads {threads:3} {name:17} {gb / min(times):7.2f} GB/s fp32 read, CPU {min(cpus) / gb:.3f} s "
                  f"per GB (best of wall {' '.join(f'{t:.3f}' for t in times)}; CPU "
                  f"{' '.join(f'{t:.3f}' for t in cpus)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
