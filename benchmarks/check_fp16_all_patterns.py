#!/usr/bin/env python
"""zckpt's fp32 -> fp16 kernel (``casting._fp16_from_f32``, numpy passes, no torch) against torch's
``Tensor.to(torch.float16)`` on all 2**32 fp32 bit patterns but NaN (chunks holding NaN go to torch itself), 2**24
at a time; prints the mismatches (0 expected) and the first few. About 1-2 minutes on one core.
``--reference numpy``: against numpy's own cast (``astype``, IEEE round to nearest even) instead, where torch is not
installed (another numpy version's kernel, without torch).

    python benchmarks/check_fp16_all_patterns.py [--reference numpy]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zckpt.encoding import casting  # noqa: E402


def main() -> int:
    by_numpy = sys.argv[1:] == ["--reference", "numpy"]
    if by_numpy:
        name = "numpy's astype"

        def reference(f: np.ndarray) -> np.ndarray:
            with np.errstate(over="ignore"):
                return f.astype(np.float16).view(np.uint16)
    else:
        import torch
        torch.set_num_threads(1)
        name = f"torch {torch.__version__}"

        def reference(f: np.ndarray) -> np.ndarray:
            return torch.from_numpy(f).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    t0, n, bad, shown, nonnan = time.time(), 1 << 24, 0, 0, 0
    for k in range(1 << 8):
        u = np.arange(k * n, (k + 1) * n, dtype=np.uint64).astype(np.uint32)
        keep = ~np.isnan(u.view(np.float32))
        f = u.view(np.float32)[keep]
        nonnan += f.size
        want = reference(f)
        got = casting._fp16_from_f32(f)
        miss = np.nonzero(got != want)[0]
        bad += miss.size
        for i in miss[:max(0, 5 - shown)]:
            print(f"  0x{f.view(np.uint32)[i]:08x} ({f[i]!r}): zckpt 0x{got[i]:04x}, reference 0x{want[i]:04x}")
            shown += 1
    print(f"numpy {np.__version__}, against {name}: mismatches over all {nonnan} non-NaN fp32 patterns: "
          f"{bad} ({time.time() - t0:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
