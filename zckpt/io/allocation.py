"""New output files at their final size (:func:`allocate`), and the filesystem a file lies on (:func:`fs_type`).

Output files are allocated at their final size before a byte is written (fallocate): on the lent 16-core host's
ext4, 4 GB written by 8 threads into a file allocated so took 0.82 s, into one only truncated to size 1.04 s
(benchmarks/probe_io.py, docs/benchmarks.md); a full disk is also found before anything is written. Filesystems
without fallocate, and tmpfs (where it would fill the pages with zeros first), get ftruncate. ``ZCKPT_FALLOCATE=0``:
ftruncate everywhere (and no filesystem is named: :func:`fs_type` is None).
"""

from __future__ import annotations

import errno
import os
import sys

NO_FALLOCATE_FS = {0x01021994, 0x858458F6}  # tmpfs, ramfs (statfs f_type)
_libc = None


def _fallocate_fn():
    """(ctypes, libc's fallocate, libc's fstatfs), or False (not Linux, ZCKPT_FALLOCATE=0, no such functions)."""
    global _libc
    if _libc is None:  # (set once, whole: never False while another thread is still looking)
        found = False
        if sys.platform.startswith("linux") and os.environ.get("ZCKPT_FALLOCATE", "1") != "0":
            try:
                import ctypes
                lib = ctypes.CDLL(None, use_errno=True)
                fn, fstatfs = lib.fallocate, lib.fstatfs
                fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
                fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
                found = (ctypes, fn, fstatfs)
            except (OSError, AttributeError):
                found = False
        _libc = found
    return _libc


def fs_type(fd: int) -> int | None:
    """statfs's ``f_type`` of the filesystem that file ``fd`` lies on (ext4 0xEF53, xfs 0x58465342, ...), or None
    where it cannot be asked (see :func:`_fallocate_fn`) or the call fails."""
    lib = _fallocate_fn()
    if not lib:
        return None
    ctypes, _, fstatfs = lib
    buf = ctypes.create_string_buffer(512)  # struct statfs: f_type is its first field (a long)
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF if fstatfs(fd, buf) == 0 else None


def allocate(fd: int, size: int) -> None:
    """Give the new file ``fd`` its final ``size``: its blocks allocated (fallocate) where the filesystem can, else
    ftruncate (a sparse file). Raises OSError(ENOSPC) when the disk cannot hold it."""
    lib = _fallocate_fn() if size > 0 else False
    if lib:
        kind = fs_type(fd)
        if kind is not None and kind not in NO_FALLOCATE_FS:
            ctypes, fn, _ = lib
            if fn(fd, 0, 0, size) == 0:
                return
            err = ctypes.get_errno()
            if err in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise OSError(err, os.strerror(err))
            # EOPNOTSUPP, ENOSYS, EINVAL...: this filesystem cannot; a plain truncate below
    os.ftruncate(fd, size)
