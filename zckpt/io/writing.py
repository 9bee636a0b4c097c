"""Writing: crash-safe local writes (a temp file renamed into place), uploads (one PUT, or a multipart upload
that appears whole), deletes (part of :mod:`zckpt.io.storage`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from typing import IO, Any

from zckpt.io.filesystems import backend_errors, get_fs
from zckpt.io.paths import is_url, local_path, protocol
from zckpt.io.s3 import boto3_client, boto3_put

_COPY_CHUNK = 8 * 1024 * 1024


def _fs_callback(callback):
    """An fsspec Callback from ``callback(nbytes)`` (called with each increment), or pass one through."""
    from fsspec.callbacks import Callback, NoOpCallback

    if callback is None:
        return NoOpCallback()
    if isinstance(callback, Callback):
        return callback

    class _Increments(Callback):
        def relative_update(self, inc=1):
            self.value += inc
            callback(inc)

        def absolute_update(self, value):
            inc, self.value = value - self.value, value
            if inc:
                callback(inc)

    return _Increments()


def makedirs(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> None:
    """Create a local folder (and parents); a no-op on object stores, where folders are key prefixes."""
    path = os.fspath(path)
    if not is_url(path):
        os.makedirs(local_path(path), exist_ok=True)


def fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_umask_lock = threading.Lock()


def umask() -> int:
    """This process's umask, read without changing it (``/proc/self/status``; elsewhere set and restored under a
    lock, which other threads creating files at that instant could see)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def _create_temp(folder: str, name: str, mode: int) -> tuple[int, str]:
    """A new file ``.<name>.<random>.tmp`` in ``folder`` created with ``mode`` (the umask applies, as for ``cp``:
    ``tempfile.mkstemp`` would make it 0600, unreadable to the rest of a team sharing the disk)."""
    import secrets

    for _ in range(100):
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name next to {name}", os.path.join(folder, name))


@contextlib.contextmanager
def _local_atomic(target: str, mode: int = 0o666) -> Iterator[IO[bytes]]:
    """Write ``target`` through a temp file in the same folder, fsync, rename; nothing is left on failure.
    The file gets ``mode`` less the umask (what ``open()`` or ``cp`` would give)."""
    folder = os.path.dirname(os.path.abspath(target)) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = _create_temp(folder, os.path.basename(target), mode)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def _copy_mode(fd: int) -> int:
    """The mode a copy gets (before the umask): the source's permission bits, as ``cp`` without ``-p``."""
    import stat

    return stat.S_IMODE(os.fstat(fd).st_mode) & 0o777


def put_file(local_path_: str | os.PathLike, url: str | os.PathLike, callback: Callable[[int], Any] | None = None,
             storage_options: dict[str, Any] | None = None, *, metadata: dict[str, str] | None = None,
             chunksize: int | None = None, max_concurrency: int | None = None) -> None:
    """Upload (or copy) one local file to ``url``; the object appears whole or not at all.

    ``callback(nbytes)`` is called with each increment of bytes sent; raising from it abandons the transfer.
    S3: a single PUT below ``2*chunksize``, else a multipart upload (parts of ``chunksize``, default 50 MiB;
    ``max_concurrency`` parts in flight) that S3 publishes only on completion, through boto3's transfer
    manager when the options allow (else s3fs); ``metadata`` becomes ``x-amz-meta-*``. Local: a temp file
    renamed into place. Other URLs: the fsspec backend's ``put_file``.
    """
    src = local_path(os.fspath(local_path_))
    url = os.fspath(url)
    if not is_url(url):
        cb = callback or (lambda n: None)
        with open(src, "rb") as fin, _local_atomic(local_path(url), _copy_mode(fin.fileno())) as fout:
            while True:
                chunk = fin.read(_COPY_CHUNK)
                if not chunk:
                    break
                fout.write(chunk)
                cb(len(chunk))
        return
    if protocol(url) in ("s3", "s3a"):
        opts = dict(storage_options or {})
        boto = boto3_client(opts)
        if boto is not None:
            client, extra = boto
            boto3_put(client, extra, src, url, callback, metadata, chunksize,
                       max_concurrency or opts.get("max_concurrency"))
            return
    fs, inner = get_fs(url, storage_options)
    kwargs: dict[str, Any] = {}
    if protocol(url) in ("s3", "s3a"):
        if metadata:
            kwargs["Metadata"] = dict(metadata)
        if chunksize:
            kwargs["chunksize"] = int(chunksize)
        if max_concurrency:
            kwargs["max_concurrency"] = int(max_concurrency)
    with backend_errors(url, "upload"):
        fs.put_file(src, inner, callback=_fs_callback(callback), **kwargs)


def write_bytes_atomic(url: str | os.PathLike, data: bytes, storage_options: dict[str, Any] | None = None) -> None:
    """Write a small file whole or not at all (local: temp + fsync + rename; S3: one PUT)."""
    url = os.fspath(url)
    if not is_url(url):
        with _local_atomic(local_path(url)) as f:
            f.write(data)
        return
    fs, inner = get_fs(url, storage_options)
    with backend_errors(url, "write"):
        fs.pipe_file(inner, bytes(data))


def remove(url: str | os.PathLike, recursive: bool = False, storage_options: dict[str, Any] | None = None, *,
           missing_ok: bool = False) -> None:
    """Delete a file (or, with ``recursive``, a folder / every key under a prefix)."""
    url = os.fspath(url)
    if not is_url(url):
        path = local_path(url)
        try:
            if recursive and os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        except FileNotFoundError:
            if not missing_ok:
                raise
        return
    fs, inner = get_fs(url, storage_options)
    try:
        with backend_errors(url, "delete"):
            if not missing_ok and not fs.exists(inner):  # S3 DELETE of a missing key succeeds silently
                raise FileNotFoundError(2, "No such file or directory", url)
            fs.rm(inner, recursive=recursive)
    except FileNotFoundError:
        if not missing_ok:
            raise
