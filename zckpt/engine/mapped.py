"""Output files written through a shared, writable map of them (``ZCKPT_MAP_WRITES=1``; off by default).

A buffered ``pwrite`` holds its file's inode lock (ext4, xfs): one file takes one writer at a time, about 4-6 GB/s
on the lent 16-core host whatever the number of threads, and a read-then-write moves every byte twice (page cache
-> the thread's buffer -> page cache). Through a map of the output, a job's source bytes are read straight into
their place (``preadv`` into the map: one copy, no inode lock), its CRC-32 taken over them there, and a cast
writes its result there (numpy's kernels, with their ``out``). On the lent host a 16-thread copy of two 2.8 GB
files so took 0.32 s against 0.48 for pread + pwrite, and into one file 0.39 against 0.89
(``benchmarks/probe_mapwrite.py``; docs/benchmarks.md, issue 49, sixth session). Whole jobs there were slower
through maps (reshard, both converts and merge fp32: 25-87% with the maps held, 2-38% with them dropped; merge bf16
swung both ways), which is why it stays off by default (seventh session).

Only files whose blocks are all allocated are mapped (``fallocate`` succeeded: :func:`zckpt.io.allocation.allocate`):
a page of a sparse file that finds the disk full would end the process with SIGBUS, not an error. And only on the
local filesystems whose maps of such files are measured or well known (ext4, xfs, btrfs): tmpfs, network and
cluster filesystems, and ``ZCKPT_FALLOCATE=0`` write with ``pwrite`` as before. ``ZCKPT_MAP_DROP=1``:
each job's pages are unmapped after it (the process's RSS stays at its buffers; the written pages stay in the page
cache, dirty, as after a ``pwrite``).

:func:`write` returns None for a job it does not take (bytes behind a URL, literal bytes, several casts in one
job): the caller writes those with :meth:`zckpt.engine.executor.Worker.write`.
"""

from __future__ import annotations

import mmap
import os

from zckpt.encoding.safeload import DTYPE_SIZES
from zckpt.engine.segments import Cast, Fill, Piece
from zckpt.io import allocation, storage
from zckpt.io.hashing import crc32, crc32_combine

MAP_WRITES = os.environ.get("ZCKPT_MAP_WRITES", "0") == "1"
MAP_DROP = os.environ.get("ZCKPT_MAP_DROP", "0") == "1"
_MAP_FS = {0xEF53, 0x58465342, 0x9123683E}  # statfs f_type: ext4 (and ext2/3), xfs, btrfs


def _local_fs(fd: int) -> bool:
    return allocation.fs_type(fd) in _MAP_FS


def open_map(fd: int) -> memoryview | None:
    """A writable shared map of the whole file ``fd`` (opened read-write), or None: not on, an empty file, one
    whose blocks are not all allocated, or one on another filesystem than ext4, xfs and btrfs."""
    if not MAP_WRITES:
        return None
    st = os.fstat(fd)
    if st.st_size <= 0 or st.st_blocks * 512 < st.st_size or not _local_fs(fd):
        return None
    try:
        mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):
        return None
    return memoryview(mm)


def close_map(view: memoryview | None) -> None:
    """Unmap; a view some job still holds (an interrupt unwinding) leaves the map to close with its last slice."""
    if view is None:
        return
    mm = view.obj
    try:
        view.release()
        mm.close()
    except BufferError:
        pass


def _local(p) -> bool:
    return not storage.is_url(p.path)


def write(worker, view: memoryview, offset: int, parts: list, dtype: str, want_crc: bool) -> tuple[int, int] | None:
    """Write one job at ``offset`` of the mapped file ``view``: (CRC-32 of its bytes or 0, bytes), or None when
    this job is not one to write so. Every piece read is reported to ``worker.check`` as :meth:`Worker.write`
    does."""
    if all(isinstance(p, Fill) or (isinstance(p, Piece) and p.dtype == dtype and _local(p)) for p in parts):
        return _copy(worker, view, offset, parts, want_crc)
    if len(parts) == 1 and isinstance(parts[0], Cast) and all(_local(p) for p in parts[0].pieces):
        c = parts[0]
        n = c.numel * DTYPE_SIZES[dtype]
        out = view[offset:offset + n]
        try:
            worker.render_cast(c.pieces, c.src_dtype, dtype, c.numel, out)
            crc = crc32(out) if want_crc else 0
        finally:
            out.release()
        _drop(view, offset, n)
        return crc, n
    return None


def _copy(worker, view: memoryview, offset: int, parts: list, want_crc: bool) -> tuple[int, int]:
    total = sum(p.nbytes for p in parts)
    out = view[offset:offset + total]
    reader, check = worker.reader, worker.check
    pos, crc = 0, 0
    try:
        for p in parts:
            n = p.nbytes
            at = out[pos:pos + n]
            try:
                if isinstance(p, Fill):
                    at[:] = bytes(n)  # (a new file reads as zeros already; written anyway, as pwrite would)
                    c = crc32(at) if want_crc else 0
                elif check is not None:
                    c = reader.read_crc(p, at)
                    check.add_crc(p.path, p.offset, n, c)
                else:
                    reader.read_raw(p, at)
                    c = crc32(at) if want_crc else 0
            finally:
                at.release()
            crc = (crc32_combine(crc, c, n) if pos else c) if want_crc else 0
            pos += n
    finally:
        out.release()
    _drop(view, offset, total)
    return crc, total


def _drop(view: memoryview, offset: int, n: int) -> None:
    if MAP_DROP and n:
        start = offset - offset % mmap.PAGESIZE
        view.obj.madvise(mmap.MADV_DONTNEED, start, offset + n - start)
