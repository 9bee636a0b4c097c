"""The one byte-moving engine: output byte ranges described by segments, written by one worker.

Every file zckpt writes (a safetensors shard, a torch ``.bin``, a DeepSpeed rank file) is planned as byte ranges
of the output, each a list of segments::

    Piece(path, offset, numel, dtype)   bytes of an input file (a slice of a rank file's tensor)
    Fill(numel, dtype)                  zeros (partition padding)
    Cast(pieces, src_dtype)             input bytes converted to the output dtype (torch's rounding)
    bytes                               literal bytes (headers, pickles)

and carried out the same way::

    segments --chunks()--> (byte offset, parts) jobs of <= CHUNK_BYTES --Worker.write()-->
        same-dtype local pieces and zero fill: copy_file_range, in the kernel (no bytes through Python)
        anything else (casts, URLs, no copy_file_range): read into the thread's buffer, convert, pwrite

Memory is bounded by construction: a few CHUNK_BYTES buffers per worker thread, whatever the model size. Writes
into one file take one of ``WRITE_STREAMS`` slots (writes into one file serialize on its inode lock anyway);
reads and casts stay parallel. No torch or numpy import here: casts import numpy on first use
(:mod:`zckpt.formats.casting`), and a bf16 -> fp32 upcast of small work needs neither.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import zlib
from typing import Callable, Iterator

from zckpt.io import storage
from zckpt.engine.segments import Cast, Fill, Piece, seg_numel, slice_segments
from zckpt.formats.safeload import DTYPE_SIZES

CHUNK_BYTES = 4 << 20  # per job; bounds memory at about 3 buffers of this per worker thread
# Writes into one output file (in-kernel copies and pwrites of cast chunks) serialize on its inode lock, so one
# stream at a time moves them as fast as cp does; more only add contention (16-core host, 0.8 GB copy phase:
# 1 stream 0.30 s, 2 of 8 threads 0.38 s, 8 of 8 0.36 s, 16 of 16 0.41 s; cp 0.25 s). Reads and casts, which
# need the CPU, use the whole pool.
WRITE_STREAMS = 1
_ZEROS = bytes(1 << 20)


def zeros_crc(n: int, crc: int = 0) -> int:
    """CRC-32 of ``n`` zero bytes following ``crc``."""
    while n:
        k = min(n, len(_ZEROS))
        crc = zlib.crc32(memoryview(_ZEROS)[:k], crc)
        n -= k
    return crc


# ---------------------------------------------------------------------------------------------- chunker

def chunks(segments: list, dtype: str) -> Iterator[tuple[int, list]]:
    """Split one output tensor's segments into jobs of at most CHUNK_BYTES: (byte offset in the tensor, parts)."""
    size = DTYPE_SIZES[dtype]
    per = max(1, CHUNK_BYTES // max(size, 4))
    pos = 0
    cur, cur_n, cur_start = [], 0, 0
    for seg in segments:
        if isinstance(seg, (bytes, bytearray)):
            parts = [seg]
        else:
            n = seg_numel(seg, dtype)
            parts = [p for s in range(0, n, per) for p in slice_segments([seg], s, min(per, n - s))] if n else []
        for part in parts:
            pn = seg_numel(part, dtype)
            if cur and cur_n + pn > per:
                yield cur_start, cur
                cur, cur_n, cur_start = [], 0, pos
            cur.append(part)
            cur_n += pn
            pos += pn * size
    if cur:
        yield cur_start, cur


# ---------------------------------------------------------------------------------------------- worker

def pwrite_all(fd: int, data, offset: int) -> None:
    data = memoryview(data)
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def test_delay() -> None:
    """Fault-injection hook for the crash tests: ZCKPT_TEST_SLOW_WRITE=seconds pauses before each file."""
    delay = os.environ.get("ZCKPT_TEST_SLOW_WRITE")
    if delay:
        time.sleep(float(delay))


class _NoKernelCopy(Exception):
    """copy_file_range cannot do this chunk (unsupported here, or EOF of a truncated input): render it instead."""


class Worker:
    """Writes jobs with one reusable buffer per thread; casts via :mod:`zckpt.formats.casting` (no torch needed).

    Plain copies need neither numpy nor torch, and neither do small bf16 -> fp32 casts (``pure_upcast``: frozen
    weights and buffers of a bf16 run merged to fp32); other casts import numpy (50-150 ms) on first use. (An
    import on a side thread does not overlap with copies: it holds the GIL they need between calls.)"""

    def __init__(self, pure_upcast: bool = False, reader=None, storage_options: dict | None = None):
        from zckpt.formats.tensors import Reader
        # pieces whose path is a URL are read with ``storage_options`` (the checkpoint's: ``ckpt.storage_options``)
        self.reader = reader or Reader(storage_options)
        self.local = threading.local()
        self.use_cfr = hasattr(os, "copy_file_range")
        self.use_torch = "torch" in sys.modules  # a trainer process: torch's kernels are already loaded
        self.write_slots = threading.BoundedSemaphore(WRITE_STREAMS)
        self.pure_upcast = pure_upcast

    def buffer(self, nbytes: int, slot: str = "buf") -> memoryview:
        buf = getattr(self.local, slot, None)
        if buf is None or len(buf) < nbytes:
            buf = bytearray(max(nbytes, 1 << 20))
            setattr(self.local, slot, buf)
        return memoryview(buf)[:nbytes]

    def render_cast(self, pieces: list[Piece], src_dtype: str, dtype: str, numel: int):
        """The bytes of ``pieces`` converted to ``dtype`` (a buffer-protocol object with ``nbytes``)."""
        raw = self.buffer(numel * DTYPE_SIZES[src_dtype])
        self.reader.read_pieces(pieces, raw)
        if src_dtype == dtype:
            return raw
        if self.pure_upcast and src_dtype == "bfloat16" and dtype == "float32":
            from zckpt.formats.casting import upcast_bf16_pure
            return upcast_bf16_pure(raw)
        from zckpt.formats.casting import cast
        return cast(raw, src_dtype, dtype, self.use_torch)

    def render(self, parts: list, dtype: str):
        """The output bytes of a job's parts, in this thread's buffers."""
        if len(parts) == 1 and isinstance(parts[0], Cast):  # the common cast job: no extra copy
            p = parts[0]
            return memoryview(self.render_cast(p.pieces, p.src_dtype, dtype, p.numel)).cast("B")
        total = sum(seg_numel(p, dtype) for p in parts) * DTYPE_SIZES[dtype]
        view = self.buffer(total, "out")
        pos = 0
        for p in parts:
            if isinstance(p, (bytes, bytearray)):
                view[pos:pos + len(p)] = p
                pos += len(p)
            elif isinstance(p, Fill):
                view[pos:pos + p.nbytes] = bytes(p.nbytes)
                pos += p.nbytes
            elif isinstance(p, Piece):
                if p.dtype != dtype:
                    raise ValueError(f"piece of {p.dtype} in a {dtype} tensor")
                self.reader.read_into(p, view[pos:pos + p.nbytes])
                pos += p.nbytes
            else:  # Cast
                data = self.render_cast(p.pieces, p.src_dtype, dtype, p.numel)
                view[pos:pos + data.nbytes] = memoryview(data).cast("B")
                pos += data.nbytes
        return view[:pos]

    def kernel_copyable(self, parts: list, dtype: str) -> bool:
        return self.use_cfr and all(
            isinstance(p, Fill) or (isinstance(p, Piece) and p.dtype == dtype and not storage.is_url(p.path))
            for p in parts)

    def write(self, fd: int, offset: int, parts: list, dtype: str,
              crc_of: Callable[[str, int, int, int], int] | None = None, want_crc: bool = False) -> tuple[int, int]:
        """Write one job at ``offset`` of ``fd``; returns (CRC-32 of the bytes or 0, bytes written).

        ``want_crc``: compute the CRC; for kernel copies it comes from ``crc_of(path, offset, n, crc)`` (the
        caller's read-only maps of the sources), otherwise from the rendered bytes."""
        if self.kernel_copyable(parts, dtype) and (crc_of is not None or not want_crc):
            try:
                return self._kernel_copy(fd, offset, parts, crc_of if want_crc else None)
            except _NoKernelCopy:
                pass
        data = self.render(parts, dtype)
        with self.write_slots:
            pwrite_all(fd, data, offset)
        return (zlib.crc32(data) if want_crc else 0), data.nbytes

    def _kernel_copy(self, fd_out: int, offset: int, parts: list, crc_of) -> tuple[int, int]:
        pos = offset
        with self.write_slots:  # only the copies take a write slot: the CRCs below run in parallel
            for p in parts:
                n = p.nbytes
                if isinstance(p, Fill):
                    left = n
                    while left:
                        k = min(left, len(_ZEROS))
                        pwrite_all(fd_out, memoryview(_ZEROS)[:k], pos + n - left)
                        left -= k
                else:
                    fd_in = self.reader.fd(p.path)
                    src, dst, left = p.offset, pos, n
                    while left:
                        try:
                            got = os.copy_file_range(fd_in, fd_out, left, src, dst)
                        except OSError:
                            self.use_cfr = False  # not supported between these files: user space from now on
                            raise _NoKernelCopy() from None
                        if got <= 0:  # EOF: a truncated input; the read path reports it with the file's name
                            raise _NoKernelCopy()
                        src, dst, left = src + got, dst + got, left - got
                pos += n
        crc = 0
        if crc_of is not None:  # of the sources' bytes (read-only maps), which are what was copied
            for p in parts:
                crc = zeros_crc(p.nbytes, crc) if isinstance(p, Fill) else crc_of(p.path, p.offset, p.nbytes, crc)
        return crc, pos - offset

    def close(self):
        self.reader.close()
