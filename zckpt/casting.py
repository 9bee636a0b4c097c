"""dtype conversion of raw chunks, bit-identical to torch's ``Tensor.to`` on CPU.

Up-casts (bf16/fp16 -> fp32) are exact bit operations; down-casts round to nearest even (bf16:
``(u + 0x7FFF + lsb) >> 16``; fp16: IEEE rounding). numpy (imported on first use) does this without importing
torch (a 1.5 s start-up); small bf16 -> fp32 jobs need not even numpy (:func:`upcast_bf16_pure`);
for large jobs torch's single-pass kernel is faster, so callers pass ``use_torch=True`` past a size threshold.
NaN payloads are the one thing torch's kernels treat in their own ways, so a chunk holding any NaN is handed
to torch itself. ``tests/test_casting.py`` checks every fp16/bf16 bit pattern and random fp32 ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


def upcast_bf16_pure(raw) -> memoryview:
    """bf16 -> fp32 without numpy: each value's two bytes become the high half of a zero-filled float32 (exact,
    NaN payloads included, like torch). ~8 ns per element, for small jobs where importing numpy (50-150 ms) would
    cost more than the work. Byte order does not matter: the file data is little-endian and is moved as is."""
    src = memoryview(raw).cast("B").cast("H")
    out = bytearray(len(src) * 4)
    memoryview(out).cast("H")[1::2] = src
    return memoryview(out)


def _bf16_from_f32(a: np.ndarray) -> np.ndarray:
    import numpy as np
    u = a.view(np.uint32)
    r = (u >> 16) & 1
    r += 0x7FFF
    r += u
    r >>= 16
    return r.astype(np.uint16)


def _has_nan(raw: np.ndarray, dtype: str) -> bool:
    import numpy as np
    if dtype == "float32":
        return bool(np.isnan(raw.view(np.float32)).any())
    if dtype == "float16":
        return bool(((raw.view(np.uint16) & 0x7FFF) > 0x7C00).any())
    if dtype == "bfloat16":
        return bool(((raw.view(np.uint16) & 0x7FFF) > 0x7F80).any())
    return False


def cast(raw, src: str, dst: str, use_torch: bool = False) -> np.ndarray:
    """Convert ``raw`` (bytes of ``src`` elements: a uint8 array or any buffer) to ``dst``; returns a uint8 array."""
    import numpy as np
    if not isinstance(raw, np.ndarray):
        raw = np.frombuffer(raw, dtype=np.uint8)
    if src == dst:
        return raw
    if use_torch or _has_nan(raw, src) or not ({src, dst} <= {"float32", "bfloat16", "float16"}):
        import torch
        t = torch.from_numpy(raw).view(getattr(torch, src)).to(getattr(torch, dst))
        return t.view(torch.uint8).numpy()
    if src == "bfloat16" and dst == "float32":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.uint8)
    if src == "float16" and dst == "float32":
        return raw.view(np.float16).astype(np.float32).view(np.uint8)
    if src == "float32" and dst == "bfloat16":
        return _bf16_from_f32(raw.view(np.float32)).view(np.uint8)
    if src == "float32" and dst == "float16":
        with np.errstate(over="ignore"):
            return raw.view(np.float32).astype(np.float16).view(np.uint8)
    return cast(cast(raw, src, "float32"), "float32", dst)  # bf16 <-> fp16: exact via fp32, as torch does
