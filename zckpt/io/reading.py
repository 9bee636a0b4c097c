"""Reading: random-access opens, listings, stat calls and whole or ranged reads, locally, on S3 (boto3) and
through fsspec (part of :mod:`zckpt.io.storage`)."""

from __future__ import annotations

import contextlib
import os
from contextvars import ContextVar
from typing import IO, Any

from zckpt.io import fetched
from zckpt.io.filesystems import backend_errors, get_fs
from zckpt.io.meters import count_read, metered
from zckpt.io.paths import is_url, local_path, protocol
from zckpt.io.s3 import S3Object, boto3_client, boto3_get

#: default block size for remote random reads: small, so a reader fetches about the ranges it asks for
REMOTE_BLOCK_SIZE = 256 * 1024


def open_input(path: str | os.PathLike, storage_options: dict[str, Any] | None = None, *,
               block_size: int = REMOTE_BLOCK_SIZE) -> IO[bytes]:
    """A binary file for random reads (seek/tell/read).

    Local: builtin ``open(path, "rb")``. Remote: a small read-ahead window (``block_size``) so that reading a
    zip directory and a few tensors fetches about those byte ranges, not the whole object.
    """
    path = os.fspath(path)
    if not is_url(path):
        return metered(open(local_path(path), "rb"), path)
    fs, inner = get_fs(path, storage_options)
    with backend_errors(path, "open"):
        return metered(fs.open(inner, "rb", block_size=block_size, cache_type="readahead"), path)


#: a URL folder's listing, kept within :func:`listings_kept` (one open: each format's ``claims`` asks the same folder)
_LISTINGS: ContextVar[dict | None] = ContextVar("zckpt_listings", default=None)


@contextlib.contextmanager
def listings_kept():
    """Within the block, a URL folder is listed once (a request per listing on an object store); local folders are
    always listed afresh."""
    token = _LISTINGS.set({} if _LISTINGS.get() is None else _LISTINGS.get())
    try:
        yield
    finally:
        _LISTINGS.reset(token)


def listdir(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Sorted names (not paths) of the entries in a folder / under a prefix."""
    path = os.fspath(path)
    if not is_url(path):
        return sorted(os.listdir(local_path(path)))
    kept = _LISTINGS.get()
    if kept is None:
        return _listdir_url(path, storage_options)
    key = (path.rstrip("/"), repr(sorted((storage_options or {}).items())))
    if key not in kept:
        kept[key] = _listdir_url(path, storage_options)
    return list(kept[key])


def _listdir_url(path: str, storage_options: dict[str, Any] | None) -> list[str]:
    s3 = S3Object.of(path, storage_options)
    if s3 is not None:
        return s3.listdir()
    fs, inner = get_fs(path, storage_options)
    with backend_errors(path, "list"):
        entries = fs.ls(inner, detail=False)
    names = {e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != inner.rstrip("/")}
    return sorted(n for n in names if n)


def file_sizes(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> dict[str, int]:
    """``{name: size}`` of the regular files directly in a folder (links followed, as :func:`isfile` does), from
    one listing: on an object store one LIST (a page per 1000 keys), not a HEAD per file."""
    path = os.fspath(path)
    if not is_url(path):
        out = {}
        with os.scandir(local_path(path)) as it:
            for e in it:
                if e.is_file():
                    out[e.name] = e.stat().st_size
        return out
    s3 = S3Object.of(path, storage_options)
    if s3 is not None:
        return s3.file_sizes()
    fs, inner = get_fs(path, storage_options)
    with backend_errors(path, "list"):
        entries = fs.ls(inner, detail=True)
    out = {}
    for e in entries:
        name = str(e.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
        if name and e.get("type", "file") == "file" and str(e.get("name", "")).rstrip("/") != inner.rstrip("/"):
            out[name] = int(e.get("size") or 0)
    return out


def list_files(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> dict[str, int]:
    """Every file below ``path``, recursively: ``{relative/posix/path: size}`` (empty if nothing is there)."""
    path = os.fspath(path)
    out: dict[str, int] = {}
    if not is_url(path):
        root = local_path(path)
        if not os.path.isdir(root):
            return out
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                full = os.path.join(dirpath, name)
                out[os.path.relpath(full, root).replace(os.sep, "/")] = os.path.getsize(full)
        return out
    fs, inner = get_fs(path, storage_options)
    prefix = inner.rstrip("/") + "/"
    with backend_errors(path, "list"):
        try:
            found = fs.find(inner, detail=True)
        except FileNotFoundError:
            return out
    for name, info in found.items():
        if info.get("type", "file") != "file" or not name.startswith(prefix):
            continue
        out[name[len(prefix):]] = int(info.get("size") or 0)
    return out


def _stat(path: str | os.PathLike, storage_options: dict[str, Any] | None, local, remote: str):
    """``local(path)`` for a local path; on S3 one HEAD or LIST through boto3 (:class:`zckpt.io.s3.S3Object`); the
    filesystem's ``remote`` method for other URLs (errors said as ours)."""
    path = os.fspath(path)
    if not is_url(path):
        return local(local_path(path))
    s3 = S3Object.of(path, storage_options)
    if s3 is not None:
        return getattr(s3, remote)()
    fs, inner = get_fs(path, storage_options)
    with backend_errors(path, "stat"):
        return getattr(fs, remote)(inner)


def exists(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> bool:
    return _stat(path, storage_options, os.path.exists, "exists")


def isdir(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> bool:
    return _stat(path, storage_options, os.path.isdir, "isdir")


def isfile(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> bool:
    return _stat(path, storage_options, os.path.isfile, "isfile")


def size(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> int:
    return int(_stat(path, storage_options, os.path.getsize, "size"))


def read_bytes(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> bytes:
    path = os.fspath(path)
    s3 = S3Object.of(path, storage_options)
    if not is_url(path):
        with open(local_path(path), "rb") as f:
            data = f.read()
    elif s3 is not None:
        data = s3.get()[0]
    else:
        fs, inner = get_fs(path, storage_options)
        with backend_errors(path, "read"):
            data = fs.cat_file(inner)
    count_read(path, len(data))
    return data


def read_range(path: str | os.PathLike, offset: int, length: int,
               storage_options: dict[str, Any] | None = None, *, count: bool = True) -> bytes:
    """``length`` bytes from ``offset`` (one ranged GET on object stores). ``count=False``: not added to the read
    meters (a caller that counts what it keeps)."""
    path = os.fspath(path)
    boto = boto3_client(dict(storage_options or {})) if is_url(path) and protocol(path) in ("s3", "s3a") else None
    if not is_url(path):
        with open(local_path(path), "rb", buffering=0) as f:  # unbuffered: exactly this range is read
            f.seek(offset)
            data = f.read(length)
    elif (kept := fetched.kept_range(path, offset, length)) is not None:
        return kept  # fetched already while opening (keep_fetched)
    elif boto is not None:  # thread-safe and parallel (s3fs runs every GET on one event-loop thread)
        data = boto3_get(boto[0], path, offset, length)
    else:
        fs, inner = get_fs(path, storage_options)
        with backend_errors(path, "read"):
            data = fs.cat_file(inner, start=offset, end=offset + length)
    if count:
        count_read(path, len(data))
    return data


def read_text(path: str | os.PathLike, storage_options: dict[str, Any] | None = None,
              encoding: str = "utf-8") -> str:
    return read_bytes(path, storage_options).decode(encoding)


def metadata(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> dict[str, str]:
    """User metadata stored with an object (S3 ``x-amz-meta-*``); ``{}`` where the backend has none."""
    path = os.fspath(path)
    if not is_url(path):
        return {}
    fs, inner = get_fs(path, storage_options)
    if not hasattr(fs, "metadata"):
        return {}
    with backend_errors(path, "stat"):
        return {str(k).lower(): str(v) for k, v in (fs.metadata(inner) or {}).items()}
