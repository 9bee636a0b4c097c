#!/usr/bin/env python
"""zckpt's fp32 -> bf16 kernel against ``(u + 0x7FFF + lsb) >> 16`` (torch's rounding) on all 2**32 fp32 bit
patterns but NaN (those chunks go to torch), 2**24 at a time; ``--numpy``: numpy's passes (as without ml_dtypes).
About 2-3 minutes on one core.

    python benchmarks/check_bf16_all_patterns.py [--numpy]
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zckpt.encoding import casting  # noqa: E402


def main() -> int:
    if "--numpy" in sys.argv:
        casting._ML_BF16 = None
    casting.choose_bf16(1 << 62)  # ml_dtypes where installed, whatever its import costs
    t0, n, bad = time.time(), 1 << 24, 0
    warnings.simplefilter("ignore", RuntimeWarning)  # (the NaN patterns, computed and left out)
    for k in range(1 << 8):
        u = np.arange(k * n, (k + 1) * n, dtype=np.uint64).astype(np.uint32)
        keep = ~np.isnan(u.view(np.float32))
        want = ((u.astype(np.uint64) + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        got = casting._bf16_from_f32(u.view(np.float32))
        bad += int(np.count_nonzero((got != want) & keep))
    print(f"kernel: {'ml_dtypes' if casting._USE_ML else 'numpy'}; mismatches over all 2**32 non-NaN patterns: "
          f"{bad} ({time.time() - t0:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
