"""dtype conversion of raw chunks, bit-identical to torch's ``Tensor.to`` on CPU.

Up-casts (bf16/fp16 -> fp32) are exact bit operations; down-casts round to nearest even (bf16:
``(u + 0x7FFF + lsb) >> 16``; fp16: IEEE rounding). numpy (imported on first use) does this without importing
torch (a 1.5 s start-up and ~400 MiB), in per-thread scratch arrays; small bf16 -> fp32 jobs need not even numpy
(:func:`upcast_bf16_pure`). ``use_torch=True`` (callers that already imported torch, or jobs whose down-casts
are large enough that importing it pays: :func:`torch_pays`) uses torch's kernels.
NaN payloads are the one thing torch's kernels treat in their own ways, so a chunk holding any NaN is handed
to torch itself. ``tests/test_casting.py`` checks every fp16/bf16 bit pattern and random fp32 ones.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from zckpt.errors import require_torch
from zckpt.encoding.lazytensor import DTYPE_SIZES

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


_tls = threading.local()


def _scratch(slot: str, n: int, dtype) -> np.ndarray:
    """A per-thread array of at least ``n`` elements, reused across chunks: no allocation (and no page faults
    on fresh memory) per chunk. A result stays valid until the same thread's next cast."""
    import numpy as np
    arr = getattr(_tls, slot, None)
    if arr is None or arr.size < n:
        arr = np.empty(max(n, 1 << 18), dtype=dtype)
        setattr(_tls, slot, arr)
    return arr[:n]


def _bf16_from_f32(a: np.ndarray) -> np.ndarray:
    """fp32 -> bf16, round to nearest even: ``(u + 0x7FFF + lsb) >> 16`` (no NaN here), over the whole chunk in six
    numpy calls, all but the first in place. Few calls matter more than fewer passes: the engine's worker threads
    cast at once, and each call takes the GIL again (cut into cache-sized blocks, 16 threads cast at half the rate,
    docs/benchmarks.md)."""
    import numpy as np
    u = a.view(np.uint32)
    r = _scratch("u32", u.size, np.uint32)
    np.right_shift(u, 16, out=r)
    np.bitwise_and(r, 1, out=r)
    np.add(r, u, out=r)
    np.add(r, 0x7FFF, out=r)
    np.right_shift(r, 16, out=r)
    out = _scratch("out16", u.size, np.uint16)
    np.copyto(out, r, casting="unsafe")  # (every value < 2**16: nothing is cut)
    return out


#: fp32 bytes a job's down-casts (fp32 -> bf16 / fp16) must read before importing torch for its one-pass kernel
#: pays: the import costs about 1.5 s of CPU and 400 MiB; numpy's casts take 5-6 passes (bf16) or numpy's slow
#: fp16 loop, torch's one. Lent 16-core host, 8 threads (docs/benchmarks.md, issue 49): a 4.28 GB merge to bf16 into
#: 5 files took 1.03 s with numpy's cast, 0.46 s with torch's (0.13 s per GB read), so the import pays from about
#: 11 GB; on fewer cores each GB saves more (one thread: numpy 1.85 GB/s, torch 25)
TORCH_CAST_FROM = 8 << 30


def torch_pays(downcast_bytes: int) -> bool:
    """Whether a job whose down-casts read ``downcast_bytes`` of fp32 should cast with torch's kernel: torch imported
    already (a trainer process), or installed and the job at least :data:`TORCH_CAST_FROM` (then it is imported
    here, once). torch stays optional: without it numpy casts every byte, bit for bit the same."""
    import sys
    if "torch" in sys.modules:
        return True
    if downcast_bytes < TORCH_CAST_FROM:
        return False
    try:
        import torch  # noqa: F401 - its kernels, for cast(use_torch=True)
    except ImportError:
        return False
    return True


#: torch's integer and bool dtype names (numpy's are the same)
_INTEGERS = ("int64", "int32", "int16", "int8", "uint8", "bool")


def _has_nan(raw: np.ndarray, dtype: str) -> bool:
    import numpy as np
    if dtype == "float32":
        f = raw.view(np.float32)
        return bool(f.size) and bool(np.isnan(np.max(f)))  # one read pass: a NaN anywhere makes the max NaN
    if dtype == "float16":
        return bool(((raw.view(np.uint16) & 0x7FFF) > 0x7C00).any())
    if dtype == "bfloat16":
        return bool(((raw.view(np.uint16) & 0x7FFF) > 0x7F80).any())
    return False


def cast(raw, src: str, dst: str, use_torch: bool = False) -> np.ndarray:
    """Convert ``raw`` (bytes of ``src`` elements: a uint8 array or any buffer) to ``dst``; returns a uint8 array
    (a per-thread buffer, valid until this thread's next call)."""
    import numpy as np
    if not isinstance(raw, np.ndarray):
        raw = np.frombuffer(raw, dtype=np.uint8)
    if src == dst:
        return raw
    if not use_torch and src in _INTEGERS and dst in ("float32", "float64"):
        # integers (a step count, an index buffer) to fp32/fp64: C's conversion, round to nearest even, as torch's
        # static_cast; no NaN can arise. (Not to bf16/fp16: torch goes through float there, rounding twice.)
        ints = raw.view(np.dtype(src))
        out = _scratch(f"int-{dst}", ints.size, np.dtype(dst))
        np.copyto(out, ints, casting="unsafe")
        return out.view(np.uint8)
    if use_torch or _has_nan(raw, src) or not ({src, dst} <= {"float32", "bfloat16", "float16"}):
        what = "a chunk holding NaN" if not use_torch and {src, dst} <= {"float32", "bfloat16", "float16"} else "it"
        torch = require_torch(f"casting {src} to {dst} ({what}: torch's own kernels decide those bits)")
        t = torch.from_numpy(raw).view(getattr(torch, src))
        out = getattr(_tls, "torch_out", None)
        size = t.numel() * DTYPE_SIZES[dst]
        if out is None or out.numel() < size:
            out = _tls.torch_out = torch.empty(max(size, 1 << 20), dtype=torch.uint8)
        out = out[:size].view(getattr(torch, dst))
        out.copy_(t)  # torch's kernel into this thread's buffer: no fresh pages per chunk
        return out.view(torch.uint8).numpy()
    if src == "bfloat16" and dst == "float32":
        x = raw.view(np.uint16)
        out = _scratch("out32", x.size, np.uint32)
        np.left_shift(x, 16, out=out, dtype=np.uint32)
        return out.view(np.uint8)
    if src == "float16" and dst == "float32":
        x = raw.view(np.float16)
        out = _scratch("out32", x.size, np.uint32).view(np.float32)
        np.copyto(out, x)
        return out.view(np.uint8)
    if src == "float32" and dst == "bfloat16":
        return _bf16_from_f32(raw.view(np.float32)).view(np.uint8)
    if src == "float32" and dst == "float16":  # numpy's cast (IEEE round to nearest even, as torch): one call
        x = raw.view(np.float32)
        out = _scratch("out16", x.size, np.uint16).view(np.float16)
        with np.errstate(over="ignore"):
            np.copyto(out, x, casting="unsafe")
        return out.view(np.uint8)
    return cast(cast(raw, src, "float32"), "float32", dst)  # bf16 <-> fp16: exact via fp32, as torch does
