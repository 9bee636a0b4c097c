#!/usr/bin/env python
"""How fast one thread reads files from the page cache, against copies of them written with 64 MiB writes (issue 49:
merge reads the masters out of DeepSpeed's files as the page cache holds them; the 16-thread copy of the baseline
reads files zckpt has just written with 4 MiB writes).

    python benchmarks/probe_pagecache.py FILE [FILE ...] --work DIR [--rounds 4]   # those files and their copies
    python benchmarks/probe_pagecache.py --torch-save --work DIR                    # a file torch.save wrote (512 MiB)

Each round reads every file in 4 MiB ``preadv`` calls (warm: the files are read once before the first round only by
being written or copied) and prints GB/s per file: ``file/copy``. The copies are removed at the end.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def read_rate(path: Path, rng: int = 4 << 20) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        n = os.fstat(fd).st_size
        buf = memoryview(bytearray(rng))
        t = time.perf_counter()
        for off in range(0, n, rng):
            os.preadv(fd, [buf], off)
        return n / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)


def copy_big(src: Path, dst: Path, block: int = 64 << 20) -> None:
    fi, fo = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        n = os.fstat(fi).st_size
        for off in range(0, n, block):
            os.pwrite(fo, os.pread(fi, block, off), off)
    finally:
        os.close(fi)
        os.close(fo)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*")
    ap.add_argument("--work", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--torch-save", action="store_true", help="a file of 8 x 64 MiB tensors written by torch.save")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    files = [Path(f) for f in a.files]
    made = []
    if a.torch_save:
        import torch
        p = work / "torch_save.pt"
        torch.save({f"t{i}": torch.randn(16 << 20) for i in range(8)}, p)
        files.append(p)
        made.append(p)
    copies = []
    for k, f in enumerate(files):
        c = work / f"copy{k}_{f.name}"
        copy_big(f, c)
        copies.append(c)
    try:
        for r in range(a.rounds):
            print(f"round {r}: " + "  ".join(f"{f.name} {read_rate(f):.1f}/{read_rate(c):.1f} GB/s"
                                             for f, c in zip(files, copies)), flush=True)
    finally:
        for p in copies + made:
            p.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
