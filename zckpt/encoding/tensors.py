"""Reading the bytes that :class:`~zckpt.state.model.Piece` lists point to.

Local files are read with ``os.pread`` on descriptors kept open per thread-safe :class:`Reader`; URLs go through
the storage layer, one ranged read per piece. Bytes land directly in a caller's buffer: nothing is read twice.
"""

from __future__ import annotations

import os
import threading

from zckpt.io import storage
from zckpt.io.hashing import crc32
from zckpt.errors import CorruptFile


def torch_dtype(name: str):
    import torch
    return getattr(torch, name)


class Reader:
    """Reads pieces into buffers; caches one file descriptor per local file.

    ``storage_options``: fsspec options for pieces whose path is a URL (the checkpoint's, ``ckpt.storage_options``);
    given here, never taken from anywhere process-wide. ``cache``: byte ranges fetched ahead (the engine's
    ``RangeCache``, set while a window of jobs runs); URL pieces found there are not read again."""

    cache = None
    check = None  # an InputCheck (zckpt.engine.checked): every piece read is reported to it

    def __init__(self, storage_options: dict | None = None):
        self.storage_options = storage_options
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: str) -> int:
        """The cached read-only descriptor of a local file (for in-kernel copies)."""
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    fd = os.open(path, os.O_RDONLY)
                    self._fds[path] = fd
        return fd

    def read_into(self, piece, buf: memoryview) -> None:
        """Fill ``buf`` (exactly ``piece.nbytes`` long) with the piece's bytes (reported to ``check``)."""
        if self.check is None:
            self.read_raw(piece, buf)
        else:
            self.check.add_crc(piece.path, piece.offset, piece.nbytes, self.read_crc(piece, buf))

    def read_crc(self, piece, buf: memoryview) -> int:
        """:meth:`read_raw`, returning the CRC-32 of the bytes read: one read, then one CRC pass over them. (Read in
        512 KiB blocks, each block's CRC right after its read while in the core's cache, every job of reshard,
        convert and merge took 10-50% longer on the lent 16-core host: eight times the calls, each taking the GIL
        again among a dozen threads; docs/benchmarks.md, issue 49.)"""
        self.read_raw(piece, buf)
        return crc32(buf[:piece.nbytes])

    def read_raw(self, piece, buf: memoryview) -> None:
        """:meth:`read_into` without reporting to ``check`` (the caller does, with the CRC it computes)."""
        n = piece.nbytes
        if storage.is_url(piece.path):
            cache = self.cache
            if cache is None or not cache.read_into(piece.path, piece.offset, buf[:n]):
                data = storage.read_range(piece.path, piece.offset, n, self.storage_options)
                if len(data) != n:
                    raise CorruptFile(f"short read at byte {piece.offset} (file truncated?)", path=piece.path)
                buf[:n] = data
            return
        fd = self.fd(piece.path)
        done = 0
        while done < n:
            got = os.preadv(fd, [buf[done:n]], piece.offset + done)
            if got <= 0:
                raise CorruptFile(f"short read at byte {piece.offset + done} (file truncated?)", path=piece.path)
            done += got
        storage.count_read(piece.path, n)

    def read_pieces(self, pieces, buf: memoryview) -> int:
        pos = 0
        for p in pieces:
            self.read_into(p, buf[pos:pos + p.nbytes])
            pos += p.nbytes
        return pos

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load_pieces(pieces, dtype: str, shape, reader: Reader | None = None, storage_options: dict | None = None):
    """A new torch tensor of ``shape`` holding the concatenated pieces (all of ``dtype``).

    Without a ``reader``, one is made for this call with ``storage_options`` (for pieces behind URLs)."""
    import math
    import torch
    numel = math.prod(shape)
    wrong = {p.dtype for p in pieces} - {dtype}
    if wrong:  # bytes are never relabelled: a caller that assumes a dtype the files do not hold is a bug
        raise ValueError(f"pieces of {', '.join(sorted(wrong))} read as {dtype}")
    have = sum(p.numel for p in pieces)
    if have != numel:
        raise CorruptFile(f"pieces hold {have} elements, shape {list(shape)} needs {numel}",
                          path=pieces[0].path if pieces else None)
    out = torch.empty(numel, dtype=torch_dtype(dtype))
    if numel:
        own = reader is None
        reader = reader or Reader(storage_options)
        try:
            reader.read_pieces(pieces, memoryview(out.view(torch.uint8).numpy()))
        finally:
            if own:
                reader.close()
    return out.view(shape) if shape else out.reshape(())
