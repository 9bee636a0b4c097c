#!/usr/bin/env python
"""CRC-32 implementations on this host: Python's ``zlib.crc32``, zlib-ng's and ISA-L's bindings, 1 and N threads.

Each checksums a 256 MiB buffer of random bytes (in memory, so the figure is the CRC's alone), best of 5; with N
threads, each thread its own buffer at once (all three release the GIL). Also ``crc32_combine`` per call.

    python benchmarks/bench_crc.py --threads 1,8,16
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import zlib


def impls() -> dict:
    out = {"zlib": zlib.crc32}
    try:
        from zlib_ng import zlib_ng
        out["zlib-ng"] = zlib_ng.crc32
    except ImportError:
        pass
    try:
        from isal import isal_zlib
        out["isal"] = isal_zlib.crc32
    except ImportError:
        pass
    return out


def rate(fn, bufs: list, repeat: int = 5) -> float:
    """GB/s of ``fn`` over every buffer at once (one thread per buffer), best of ``repeat``."""
    best = float("inf")
    for _ in range(repeat):
        ts = [threading.Thread(target=fn, args=(b,)) for b in bufs]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return sum(len(b) for b in bufs) / best / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,8,16")
    ap.add_argument("--mib", type=int, default=256)
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    bufs = [os.urandom(args.mib << 20) for _ in range(max(threads))]
    found = impls()
    ref = zlib.crc32(bufs[0])
    print(f"{os.cpu_count()} CPUs, {args.mib} MiB per thread")
    print("| implementation | " + " | ".join(f"{t} thread{'s' if t > 1 else ''} GB/s" for t in threads) + " |")
    print("|---|" + "---|" * len(threads))
    for name, fn in found.items():
        assert fn(bufs[0]) == ref, name
        print(f"| {name} | " + " | ".join(f"{rate(fn, bufs[:t]):.1f}" for t in threads) + " |", flush=True)
    from zckpt.io.hashing import CRC32_IMPL, crc32_combine
    t0 = time.perf_counter()
    for _ in range(10000):
        crc32_combine(0x12345678, 0x9ABCDEF0, 4 << 20)
    print(f"\nzckpt uses {CRC32_IMPL}; crc32_combine: {(time.perf_counter() - t0) / 10000 * 1e6:.2f} us per call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
