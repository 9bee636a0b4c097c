"""zckpt's one storage layer: local paths on a fast path, S3 through one boto3 client, other URLs through fsspec.

Paths are plain ``str`` everywhere (a ``pathlib.Path`` would collapse the ``//`` of ``s3://``)::

    /data/run1/checkpoint-4          local (also file:///data/...)   builtin open / os calls
    s3://bucket/run1                 s3fs; endpoint and keys from AWS_ENDPOINT_URL(_S3), AWS_ACCESS_KEY_ID, ...
    hf://user/repo/path              huggingface_hub.HfFileSystem (hf://datasets/user/repo/... too)
    memory://scratch/x               fsspec's in-process memory store (tests)

Backend options (fsspec/s3fs keyword arguments such as ``endpoint_url``, ``key``, ``secret``; ``--storage-option
key=value`` in the CLI) are passed, never kept: every function here takes ``storage_options=`` and uses exactly
what it is given (on S3 on top of the standard AWS variables). There is no process-wide default, so two calls
with different endpoints or credentials in one process (a library inside a trainer) never see each other's.
The callers thread them: :func:`zckpt.state.open.open_checkpoint` records them on the ``Checkpoint``
(``ckpt.storage_options``) and the ops hand them on to the readers, the executor and the publisher.

On S3 every call (stat, list, ranged GET, upload) goes through one shared, thread-safe boto3 client built from the
same options (:func:`_boto3_client`; s3fs only when the options need it or ``ZCKPT_S3_UPLOADER=s3fs``): a reading
command never imports s3fs, and GETs run in parallel threads. Opening a remote torch file for its metadata is
:func:`open_ranges` (a few parallel rounds; nothing fetched twice).

Failures: missing paths raise ``FileNotFoundError``, refused access ``PermissionError`` (the builtins fsspec
backends already use); any other backend failure becomes :class:`zckpt.errors.StorageError` naming the URL.

Object-store rules kept here, in one place:

* no rename on S3: :func:`write_bytes_atomic` is a single PUT (atomic on S3), :func:`put_file` a PUT or a
  multipart upload that only becomes visible when it completes; locally both write a temp file and rename it;
* listings are not cached (a pusher running for days must see what others changed);
* "directories" on object stores are key prefixes: :func:`makedirs` is a no-op there.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from typing import IO, Any

from zckpt.errors import StorageError

log = logging.getLogger(__name__)

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_PASSTHROUGH = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError,
                InterruptedError, StorageError)

#: default block size for remote random reads: small, so a reader fetches about the ranges it asks for
REMOTE_BLOCK_SIZE = 256 * 1024
_COPY_CHUNK = 8 * 1024 * 1024


# --------------------------------------------------------------------------------------------------- paths


def protocol(path: str | os.PathLike) -> str:
    """``"s3"``, ``"hf"``, ``"memory"`` ...; ``"file"`` for local paths and ``file://`` URLs."""
    match = _SCHEME.match(os.fspath(path))
    return match.group(1).lower() if match else "file"


def is_url(path: str | os.PathLike) -> bool:
    """True for a URL with a scheme other than ``file://`` (i.e. anything not on the local disk)."""
    return protocol(path) != "file"


def local_path(path: str | os.PathLike) -> str:
    """The local filesystem path for a plain path or a ``file://`` URL."""
    path = os.fspath(path)
    path = path.removeprefix("file://")
    return path


def join(base: str | os.PathLike, *parts: str) -> str:
    """Join path parts; keeps ``s3://bucket/x`` intact (``os.path.join`` for local paths)."""
    base = os.fspath(base)
    parts = tuple(p for p in (os.fspath(p) for p in parts) if p)
    if not is_url(base):
        return os.path.join(base, *parts)
    tail = "/".join(p.strip("/") for p in parts if p.strip("/"))
    if not tail:
        return base
    if base.endswith("://"):
        return base + tail
    return base.rstrip("/") + "/" + tail


def basename(path: str | os.PathLike) -> str:
    path = os.fspath(path).rstrip("/")
    return path.rsplit("/", 1)[-1] if is_url(path) else os.path.basename(path)


def parent(path: str | os.PathLike) -> str:
    """The folder holding ``path`` (local paths made absolute; a URL's bucket root is its own parent)."""
    path = os.fspath(path).rstrip("/")
    if is_url(path):
        head = path.rsplit("/", 1)[0]
        return head if "://" in head and not head.endswith(":/") else path
    return os.path.dirname(os.path.abspath(path))


# ------------------------------------------------------------------------------------------------ options


def parse_storage_options(pairs) -> dict[str, Any]:
    """Turn CLI ``key=value`` strings into fsspec options; values are JSON when they parse as JSON.

    ``anon=true`` -> ``{"anon": True}``, ``client_kwargs={"region_name": "eu-west-1"}`` -> a dict,
    ``endpoint_url=http://127.0.0.1:8333`` -> the string.
    """
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"storage option {pair!r} is not KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _s3_options(options: dict[str, Any]) -> dict[str, Any]:
    """s3fs options from the standard AWS variables, overridden by explicit options."""
    env = os.environ
    out: dict[str, Any] = {}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        out["endpoint_url"] = endpoint
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        out["key"] = env["AWS_ACCESS_KEY_ID"]
        out["secret"] = env["AWS_SECRET_ACCESS_KEY"]
        if env.get("AWS_SESSION_TOKEN"):
            out["token"] = env["AWS_SESSION_TOKEN"]
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        out["client_kwargs"] = {"region_name": region}
    # a pusher runs for days and others change the bucket: never answer from a stale listing
    out["use_listings_cache"] = False
    for key, value in options.items():
        if key == "client_kwargs" and isinstance(value, dict):
            out["client_kwargs"] = {**out.get("client_kwargs", {}), **value}
        else:
            out[key] = value
    return out


def get_fs(path: str | os.PathLike, storage_options: dict[str, Any] | None = None):
    """``(filesystem, path_inside_it)`` for a local path or URL.

    ``storage_options``: the backend's keyword arguments, exactly as given (nothing process-wide is added; on
    S3 they override what the AWS variables say). Ignored for local paths.
    """
    import fsspec

    path = os.fspath(path)
    proto = protocol(path)
    if proto == "file":
        from fsspec.implementations.local import LocalFileSystem

        return LocalFileSystem(), os.path.abspath(local_path(path))
    options = dict(storage_options or {})
    if proto in ("s3", "s3a"):
        options = _s3_options(options)
    try:
        fs = fsspec.filesystem(proto, **options)
    except ImportError as exc:
        extra = {"s3": "s3", "s3a": "s3", "hf": "hub"}.get(proto)
        if extra:
            raise StorageError(f"no backend for {proto}:// is installed", path=path,
                               hint=f"pip install 'zckpt[{extra}]'") from exc
        raise StorageError(f"no backend for {proto}:// ({exc})", path=path,
                           hint=f"install the fsspec backend for {proto}://") from exc
    except ValueError as exc:
        raise StorageError(f"cannot use {proto}:// ({exc})", path=path) from exc
    return fs, fs._strip_protocol(path)


@contextlib.contextmanager
def _errors(url: str, op: str):
    """Map a backend failure to a builtin or StorageError that names the URL."""
    try:
        yield
    except _PASSTHROUGH:
        raise
    except OSError as exc:  # the backend translated the server's answer (s3fs: 400 -> EINVAL ...)
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise StorageError(f"{op} failed: {text}", path=url, hint="") from exc
    except Exception as exc:
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise StorageError(f"{op} failed: {type(exc).__name__}: {text}", path=url,
                           hint="check the URL, the credentials and that the server is reachable") from exc


# ------------------------------------------------------------------------------------------------ reading


class ReadMeter:
    """The bytes read from files under ``root`` while it is active (:func:`read_meter`): everything this module
    reads (:func:`open_input` files, :func:`read_range`, :func:`read_bytes`), and what other readers report with
    :func:`count_read` (``os.preadv`` of tensor pieces)."""

    def __init__(self, root: str | os.PathLike):
        self.root = _meter_key(root).rstrip("/") + "/"
        self.bytes = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes += n


_METERS: list[ReadMeter] = []  # active meters (almost always none: then nothing is counted or wrapped)
_METERS_LOCK = threading.Lock()


def _meter_key(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    return path if is_url(path) else os.path.abspath(local_path(path))


@contextlib.contextmanager
def read_meter(root: str | os.PathLike) -> Iterator[ReadMeter]:
    """Count every byte read from files under ``root`` (a folder or URL prefix) while the block runs, in any
    thread (``zckpt.deepspeed.load_checkpoint`` reports it as ``bytes_read``)."""
    meter = ReadMeter(root)
    with _METERS_LOCK:
        _METERS.append(meter)
    try:
        yield meter
    finally:
        with _METERS_LOCK:
            _METERS.remove(meter)


def count_read(path: str | os.PathLike, n: int) -> None:
    """Add ``n`` bytes read from ``path`` to the active meters whose root holds it."""
    if not _METERS or not n:
        return
    key = _meter_key(path)
    for meter in list(_METERS):
        if key.startswith(meter.root):
            meter.add(n)


class _MeteredFile:
    """A binary file whose reads are counted by the active meters (other attributes pass through)."""

    def __init__(self, f, path: str):
        self._f, self._path = f, path

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        count_read(self._path, len(data))
        return data

    def readinto(self, buf) -> int:
        n = self._f.readinto(buf)
        count_read(self._path, n or 0)
        return n

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()
        return False


def metered(f, path: str | os.PathLike):
    """``f`` (opened from ``path``) counted by the active meters covering ``path``; ``f`` itself when none does."""
    if not _METERS:
        return f
    key = _meter_key(path)
    return _MeteredFile(f, os.fspath(path)) if any(key.startswith(m.root) for m in list(_METERS)) else f


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
    with _errors(path, "open"):
        return metered(fs.open(inner, "rb", block_size=block_size, cache_type="readahead"), path)


def listdir(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Sorted names (not paths) of the entries in a folder / under a prefix."""
    path = os.fspath(path)
    if not is_url(path):
        return sorted(os.listdir(local_path(path)))
    s3 = _S3.of(path, storage_options)
    if s3 is not None:
        return s3.listdir()
    fs, inner = get_fs(path, storage_options)
    with _errors(path, "list"):
        entries = fs.ls(inner, detail=False)
    names = {e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != inner.rstrip("/")}
    return sorted(n for n in names if n)


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
    with _errors(path, "list"):
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
    """``local(path)`` for a local path; on S3 one HEAD or LIST through boto3 (:class:`_S3`); the filesystem's
    ``remote`` method for other URLs (errors said as ours)."""
    path = os.fspath(path)
    if not is_url(path):
        return local(local_path(path))
    s3 = _S3.of(path, storage_options)
    if s3 is not None:
        return getattr(s3, remote)()
    fs, inner = get_fs(path, storage_options)
    with _errors(path, "stat"):
        return getattr(fs, remote)(inner)


def exists(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> bool:
    return _stat(path, storage_options, os.path.exists, "exists")


def isdir(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> bool:
    return _stat(path, storage_options, os.path.isdir, "isdir")


def isfile(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> bool:
    return _stat(path, storage_options, os.path.isfile, "isfile")


def size(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> int:
    return int(_stat(path, storage_options, os.path.getsize, "size"))


class _S3:
    """Metadata calls on one ``s3://`` path through the shared boto3 client (:func:`_boto3_client`): one HEAD or
    LIST each, thread-safe, and no s3fs import (0.2-0.5 s of a command's start-up). The answers are the ones s3fs
    gives: a "folder" is a key prefix (or the bucket), a file a key."""

    def __init__(self, client, url: str):
        self.client, self.url = client, url
        self.bucket, _, key = url.split("://", 1)[1].partition("/")
        self.key = key.rstrip("/")

    @classmethod
    def of(cls, path: str, storage_options: dict[str, Any] | None) -> "_S3 | None":
        if protocol(path) not in ("s3", "s3a"):
            return None
        boto = _boto3_client(dict(storage_options or {}))
        return cls(boto[0], path) if boto is not None else None

    def _call(self, op: str, fn, **kwargs):
        try:
            return fn(Bucket=self.bucket, **kwargs)
        except Exception as exc:
            if isinstance(exc, _PASSTHROUGH) or not _is_boto_error(exc):
                raise
            if _boto_missing(exc):
                raise FileNotFoundError(2, "No such file or directory", self.url) from None
            _raise_boto(exc, self.url, op)

    def head(self) -> int | None:
        """The object's size, or None when there is no object of this key."""
        if not self.key:
            return None
        try:
            return int(self._call("stat", self.client.head_object, Key=self.key)["ContentLength"])
        except FileNotFoundError:
            return None

    def pages(self, delimiter: str = "/", max_keys: int | None = None):
        prefix = self.key + "/" if self.key else ""
        kwargs: dict[str, Any] = {"Prefix": prefix, "Delimiter": delimiter}
        if max_keys:
            kwargs["MaxKeys"] = max_keys
        while True:
            page = self._call("list", self.client.list_objects_v2, **kwargs)
            yield prefix, page
            if max_keys or not page.get("IsTruncated"):
                return
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def has_children(self) -> bool:
        try:
            for _, page in self.pages(max_keys=1):
                return bool(page.get("Contents") or page.get("CommonPrefixes"))
        except FileNotFoundError:  # no such bucket
            return False
        return False

    def bucket_exists(self) -> bool:
        try:
            self._call("stat", self.client.head_bucket)
            return True
        except FileNotFoundError:
            return False

    def exists(self) -> bool:
        if not self.key:
            return self.bucket_exists()
        return self.head() is not None or self.has_children()

    def isdir(self) -> bool:
        return self.bucket_exists() if not self.key else self.has_children()

    def isfile(self) -> bool:
        return self.head() is not None

    def size(self) -> int:
        n = self.head()
        if n is not None:
            return n
        if self.isdir():
            return 0
        raise FileNotFoundError(2, "No such file or directory", self.url)

    def listdir(self) -> list[str]:
        names: set[str] = set()
        for prefix, page in self.pages():
            names.update(o["Key"][len(prefix):] for o in page.get("Contents", ()))
            names.update(p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", ()))
        names.discard("")  # a folder's own marker object
        if not names and not (self.isfile() if self.key else self.bucket_exists()):
            raise FileNotFoundError(2, "No such file or directory", self.url)
        return sorted(n for n in names if "/" not in n)

    def get(self, offset: int | None = None, length: int | None = None, suffix: int | None = None) -> tuple:
        """``(data, object size)``: the object, ``length`` bytes from ``offset``, or its last ``suffix`` bytes."""
        kwargs: dict[str, Any] = {}
        if suffix is not None:
            kwargs["Range"] = f"bytes=-{suffix}"
        elif offset is not None:
            kwargs["Range"] = f"bytes={offset}-{offset + length - 1}"
        try:
            resp = self._call("read", self.client.get_object, Key=self.key, **kwargs)
        except StorageError as exc:
            if suffix is not None and "InvalidRange" in str(exc):  # an empty object has no last bytes
                return b"", self.size()
            raise
        data = resp["Body"].read()
        total = resp.get("ContentRange", "").rpartition("/")[2]
        return data, int(total) if total.isdigit() else len(data)


def _boto_missing(exc: BaseException) -> bool:
    """A boto3 error that says the key or bucket does not exist (404 / NoSuchKey / NoSuchBucket)."""
    from botocore.exceptions import ClientError

    if not isinstance(exc, ClientError):
        return False
    err = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return err.get("Code") in ("404", "NoSuchKey", "NotFound", "NoSuchBucket") or status == 404


def read_bytes(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> bytes:
    path = os.fspath(path)
    s3 = _S3.of(path, storage_options)
    if not is_url(path):
        with open(local_path(path), "rb") as f:
            data = f.read()
    elif s3 is not None:
        data = s3.get()[0]
    else:
        fs, inner = get_fs(path, storage_options)
        with _errors(path, "read"):
            data = fs.cat_file(inner)
    count_read(path, len(data))
    return data


def read_range(path: str | os.PathLike, offset: int, length: int,
               storage_options: dict[str, Any] | None = None, *, count: bool = True) -> bytes:
    """``length`` bytes from ``offset`` (one ranged GET on object stores). ``count=False``: not added to the read
    meters (a caller that counts what it keeps)."""
    path = os.fspath(path)
    boto = _boto3_client(dict(storage_options or {})) if is_url(path) and protocol(path) in ("s3", "s3a") else None
    if not is_url(path):
        with open(local_path(path), "rb", buffering=0) as f:  # unbuffered: exactly this range is read
            f.seek(offset)
            data = f.read(length)
    elif _KEPT and (kept := _from_kept(path, offset, length)) is not None:
        return kept  # fetched already while opening (keep_fetched)
    elif boto is not None:  # thread-safe and parallel (s3fs runs every GET on one event-loop thread)
        data = _boto3_get(boto[0], path, offset, length)
    else:
        fs, inner = get_fs(path, storage_options)
        with _errors(path, "read"):
            data = fs.cat_file(inner, start=offset, end=offset + length)
    if count:
        count_read(path, len(data))
    return data


# Opening a remote torch file for its metadata (:func:`open_ranges`): the first GET asks for the last TAIL_BYTES
# (the zip directory; a file this small comes whole) and, at the same time, the first HEAD_BYTES (the headers and
# the pickle); the readers then :meth:`RangeFile.prefetch` everything else they will read in one parallel round.
TAIL_BYTES = 1 << 20
HEAD_BYTES = 1 << 20
WHOLE_BYTES = 4 << 20  # a file of known size up to this is fetched whole, in one GET
PREFETCH_GAP = 256 << 10  # wanted ranges closer than this are fetched in one GET (the gap is read too)
_META_THREADS = 16
_meta_pool = None
_meta_pool_lock = threading.Lock()


def _pool():
    global _meta_pool
    with _meta_pool_lock:
        if _meta_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _meta_pool = ThreadPoolExecutor(_META_THREADS, thread_name_prefix="zckpt-meta")
        return _meta_pool


def _coalesce(spans, gap: int) -> list[list[int]]:
    merged: list[list[int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return merged


class RangeFile:
    """A remote file opened for random reads of its metadata: every byte range fetched is kept and never fetched
    again; reads of bytes not fetched yet GET at least ``block_size`` (``REMOTE_BLOCK_SIZE``) from there.

    :meth:`prefetch` fetches a list of wanted ranges in one round, in parallel (neighbours closer than
    ``PREFETCH_GAP`` as one GET). Reads stay ordinary ``seek``/``read`` calls, so a reader checks exactly the
    same bytes whether they came ahead or on demand. Meant for headers and pickles (what it fetched is held in
    memory until it is closed), not tensor bytes."""

    def __init__(self, path: str, storage_options: dict[str, Any] | None = None, *, size_hint: int | None = None,
                 block_size: int = REMOTE_BLOCK_SIZE):
        self.path, self.storage_options, self.block_size = path, storage_options, block_size
        self.starts: list[int] = []  # sorted, non-overlapping blocks: starts[i] .. starts[i] + len(datas[i])
        self.datas: list[bytes] = []
        self.pos = 0
        self.requests = 0
        self._lock = threading.Lock()
        s3 = _S3.of(path, storage_options)
        if size_hint is not None and size_hint < 0:
            size_hint = None
        if s3 is None:
            self.size = size(path, storage_options)
            self._fetch([(max(0, self.size - TAIL_BYTES), self.size)])
        elif size_hint is not None and size_hint <= WHOLE_BYTES:  # a small file: all of it, one GET
            data, self.size = s3.get()
            self.requests += 1
            self._add(0, data)
        else:  # its size and last bytes in one GET (Content-Range); with a size known, its first bytes beside it
            head = None
            if size_hint is not None:
                head = _pool().submit(_get_range, s3, 0, min(HEAD_BYTES, max(0, size_hint - TAIL_BYTES)))
            tail, self.size = s3.get(suffix=TAIL_BYTES)
            self.requests += 1
            self._add(self.size - len(tail), tail)
            if head is not None:
                try:
                    data = head.result()
                except (FileNotFoundError, StorageError):
                    data = b""  # (changed since its size was taken): read on demand
                self.requests += 1
                self._add_missing(0, data[:self.size])

    # --------------------------------------------------------------------------- blocks

    def _add(self, start: int, data: bytes) -> None:
        if not data:
            return
        with self._lock:
            i = bisect.bisect(self.starts, start)
            self.starts.insert(i, start)
            self.datas.insert(i, bytes(data))
        count_read(self.path, len(data))

    def _add_missing(self, start: int, data: bytes) -> None:
        """Keep the parts of ``data`` (bytes at ``start``) that no block holds yet."""
        for lo, hi in self._missing(start, start + len(data)):
            self._add(lo, data[lo - start:hi - start])

    def _missing(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The parts of ``[lo, hi)`` that no block holds."""
        out, pos = [], lo
        with self._lock:
            i = max(0, bisect.bisect(self.starts, lo) - 1)
            while pos < hi and i < len(self.starts):
                s, e = self.starts[i], self.starts[i] + len(self.datas[i])
                if e <= pos:
                    i += 1
                    continue
                if s > pos:
                    out.append((pos, min(s, hi)))
                pos = max(pos, e)
                i += 1
        if pos < hi:
            out.append((pos, hi))
        return out

    def _fetch(self, spans: list[tuple[int, int]]) -> None:
        """GET every span (several in parallel)."""
        spans = [(lo, min(hi, self.size)) for lo, hi in spans if lo < min(hi, self.size)]
        if len(spans) == 1:
            lo, hi = spans[0]
            datas = [read_range(self.path, lo, hi - lo, self.storage_options, count=False)]
        else:
            futures = [_pool().submit(read_range, self.path, lo, hi - lo, self.storage_options, count=False)
                       for lo, hi in spans]
            datas = [f.result() for f in futures]
        self.requests += len(spans)
        for (lo, _), data in zip(spans, datas):
            self._add_missing(lo, data)

    def prefetch(self, ranges) -> None:
        """Fetch the bytes of ``ranges`` ((offset, end) pairs) not held yet, in one round of parallel GETs."""
        spans = [span for lo, hi in ranges for span in self._missing(max(0, lo), min(hi, self.size))]
        if spans:
            self._fetch([(lo, hi) for lo, hi in _coalesce(spans, PREFETCH_GAP)])

    # --------------------------------------------------------------------------- file protocol

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        self.pos = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence] + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        lo = self.pos
        hi = self.size if n is None or n < 0 else min(self.size, lo + n)
        if hi <= lo:
            return b""
        missing = self._missing(lo, hi)
        if missing:  # read ahead from the first missing byte, up to the next block held
            ahead = self._missing(missing[0][0], min(self.size, max(hi, missing[0][0] + self.block_size)))
            self._fetch([s for s in ahead if s[0] < hi or s is ahead[0]])
        out = bytearray()
        with self._lock:
            i = max(0, bisect.bisect(self.starts, lo) - 1)
            pos = lo
            while pos < hi and i < len(self.starts):
                s, d = self.starts[i], self.datas[i]
                if s <= pos < s + len(d):
                    k = min(hi, s + len(d)) - pos
                    out += memoryview(d)[pos - s:pos - s + k]
                    pos += k
                i += 1
        self.pos = lo + len(out)
        return bytes(out)

    def close(self) -> None:
        if _KEPT and self.starts:
            with _KEPT_LOCK:
                for kept in _KEPT:
                    kept[self.path] = (self.starts, self.datas)
        self.starts, self.datas = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


_KEPT: list[dict[str, tuple[list[int], list[bytes]]]] = []  # active keep_fetched() blocks (almost always none)
_KEPT_LOCK = threading.Lock()


@contextlib.contextmanager
def keep_fetched() -> Iterator[None]:
    """While the block runs, the bytes :class:`RangeFile` s fetched stay readable: a :func:`read_range` that lies
    inside them (a scalar a reader reads after the file's pickle) is answered from memory, not with a GET. Scoped
    to the block (opening one checkpoint), so a long-running process never reads stale bytes."""
    kept: dict[str, tuple[list[int], list[bytes]]] = {}
    with _KEPT_LOCK:
        _KEPT.append(kept)
    try:
        yield
    finally:
        with _KEPT_LOCK:  # by identity: two blocks' dicts may be equal (both empty)
            del _KEPT[next(i for i, k in enumerate(_KEPT) if k is kept)]


def _from_kept(path: str, offset: int, length: int) -> bytes | None:
    with _KEPT_LOCK:
        for kept in _KEPT:
            starts, datas = kept.get(path, ((), ()))
            i = bisect.bisect(starts, offset) - 1
            if i >= 0 and offset + length <= starts[i] + len(datas[i]):
                return datas[i][offset - starts[i]:offset - starts[i] + length]
    return None


def _get_range(s3: "_S3", offset: int, length: int) -> bytes:
    return s3.get(offset, length)[0] if length > 0 else b""


def open_ranges(path: str | os.PathLike, storage_options: dict[str, Any] | None = None,
                size_hint: int | None = None) -> RangeFile:
    """A URL opened for reading its metadata (:class:`RangeFile`), in as few round trips as its size allows:
    ``size_hint`` (the size a listing or HEAD gave) up to ``WHOLE_BYTES``: the whole file in one GET; larger: its
    last ``TAIL_BYTES`` (the zip directory) and first ``HEAD_BYTES`` side by side; unknown: the last bytes first.
    The rest is fetched as it is read or prefetched."""
    path = os.fspath(path)
    try:
        return RangeFile(path, storage_options, size_hint=size_hint)
    except Exception as exc:
        if isinstance(exc, _PASSTHROUGH) or not _is_boto_error(exc):
            raise
        _raise_boto(exc, path, "open")


def _boto3_get(client, url: str, offset: int, length: int) -> bytes:
    """One ranged GET through boto3 (``length`` bytes from ``offset``; fewer at the end of the object)."""
    if length <= 0:
        return b""
    bucket, _, key = url.split("://", 1)[1].partition("/")
    try:
        resp = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}")
        return resp["Body"].read()
    except Exception as exc:
        if isinstance(exc, _PASSTHROUGH) or not _is_boto_error(exc):
            raise
        from botocore.exceptions import ClientError

        if isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") == "InvalidRange":
            return b""  # past the end: the caller reports the short read with the file's name
        _raise_boto(exc, url, "read")


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
    with _errors(path, "stat"):
        return {str(k).lower(): str(v) for k, v in (fs.metadata(inner) or {}).items()}


# ------------------------------------------------------------------------------------------------ writing


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
        boto = _boto3_client(opts)
        if boto is not None:
            client, extra = boto
            _boto3_put(client, extra, src, url, callback, metadata, chunksize,
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
    with _errors(url, "upload"):
        fs.put_file(src, inner, callback=_fs_callback(callback), **kwargs)


# S3 uploads: boto3's transfer manager when it can honour the options (measured about 1.5x s3fs's put_file
# with several files in flight: s3fs does every stream's signing and copying on one event-loop thread).
# ZCKPT_S3_UPLOADER=s3fs forces s3fs; options only s3fs understands fall back to it automatically.
_S3FS_ONLY_HARMLESS = {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache",
                       "default_block_size", "default_fill_cache", "default_cache_type", "version_aware",
                       "cache_regions", "max_concurrency", "retries", "fixed_upto", "asynchronous"}
_boto_lock = threading.Lock()
_boto_clients: dict[str, Any] = {}


def _boto3_client(options: dict[str, Any]):
    """``(client, extra_upload_args)`` equivalent to the s3fs options, or None to use s3fs."""
    if os.environ.get("ZCKPT_S3_UPLOADER", "auto").lower() == "s3fs":
        return None
    try:
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config
    except ImportError:
        return None
    opts = _s3_options(options)
    known = {"endpoint_url", "key", "secret", "token", "client_kwargs", "config_kwargs", "anon", "profile",
             "s3_additional_kwargs", *_S3FS_ONLY_HARMLESS}
    if set(opts) - known:
        return None  # an s3fs-specific option we cannot translate: let s3fs do it
    extra = dict(opts.get("s3_additional_kwargs") or {})
    if extra:  # (s3transfer is imported only here and for uploads: 0.1-0.4 s a reading command does not need)
        from boto3.s3.transfer import S3Transfer

        if set(extra) - set(S3Transfer.ALLOWED_UPLOAD_ARGS):
            return None
    cache_key = json.dumps({k: v for k, v in opts.items() if k not in _S3FS_ONLY_HARMLESS}, sort_keys=True,
                           default=str)
    with _boto_lock:
        cached = _boto_clients.get(cache_key)
        if cached is None:
            client_kwargs = dict(opts.get("client_kwargs") or {})
            config_kwargs = dict(opts.get("config_kwargs") or {})
            if opts.get("anon"):
                config_kwargs["signature_version"] = UNSIGNED
            config_kwargs.setdefault("max_pool_connections", 64)
            if opts.get("endpoint_url"):
                client_kwargs.setdefault("endpoint_url", opts["endpoint_url"])
            if opts.get("key"):
                client_kwargs.update(aws_access_key_id=opts["key"], aws_secret_access_key=opts.get("secret"),
                                     aws_session_token=opts.get("token"))
            session = boto3.session.Session(profile_name=opts.get("profile"))
            cached = _boto_clients[cache_key] = session.client("s3", config=Config(**config_kwargs),
                                                                **client_kwargs)
    return cached, extra


def _boto3_put(client, extra, src, url, callback, metadata, chunksize, max_concurrency) -> None:
    from boto3.s3.transfer import S3Transfer, TransferConfig
    from botocore.exceptions import ClientError

    bucket, _, key = url.split("://", 1)[1].partition("/")
    part = int(chunksize or 50 * 1024 * 1024)
    size_ = os.path.getsize(src)
    part = max(part, -(-size_ // 10_000))  # S3 allows 10,000 parts
    config = TransferConfig(multipart_threshold=2 * part, multipart_chunksize=part,
                            max_concurrency=max(1, int(max_concurrency or 1)), use_threads=True)
    args = dict(extra)
    if metadata:
        args["Metadata"] = dict(metadata)
    try:
        S3Transfer(client, config).upload_file(src, bucket, key, extra_args=args, callback=callback)
    except Exception as exc:
        if isinstance(exc, _PASSTHROUGH) or not _is_boto_error(exc):
            raise
        _raise_boto(exc, url, "upload")


def _raise_boto(exc: BaseException, url: str, op: str):
    """Raise a boto3 failure as the builtin / StorageError s3fs would have raised, naming ``url``."""
    from botocore.exceptions import ClientError

    client_error = exc if isinstance(exc, ClientError) else _find_cause(exc, ClientError)
    if client_error is not None:
        from s3fs.errors import translate_boto_error

        translated = translate_boto_error(client_error)
        if isinstance(translated, (FileNotFoundError, PermissionError)):
            raise type(translated)(translated.errno, f"{translated.strerror or translated}", url) from exc
        if isinstance(translated, OSError):
            raise StorageError(f"{op} failed: {' '.join(str(translated).split())}", path=url,
                               hint="") from translated
    text = " ".join(str(exc).split()) or type(exc).__name__
    raise StorageError(f"{op} failed: {type(exc).__name__}: {text}", path=url,
                       hint="check the URL, the credentials and that the server is reachable") from exc


def _is_boto_error(exc: BaseException) -> bool:
    for e in (exc, exc.__cause__, exc.__context__):
        if e is not None and (type(e).__module__ or "").startswith(("botocore", "boto3", "s3transfer", "urllib3")):
            return True
    return False


def _find_cause(exc: BaseException, cls) -> BaseException | None:
    seen, cur = 0, exc.__cause__ or exc.__context__
    while cur is not None and seen < 8:
        if isinstance(cur, cls):
            return cur
        cur, seen = cur.__cause__ or cur.__context__, seen + 1
    return None


def write_bytes_atomic(url: str | os.PathLike, data: bytes, storage_options: dict[str, Any] | None = None) -> None:
    """Write a small file whole or not at all (local: temp + fsync + rename; S3: one PUT)."""
    url = os.fspath(url)
    if not is_url(url):
        with _local_atomic(local_path(url)) as f:
            f.write(data)
        return
    fs, inner = get_fs(url, storage_options)
    with _errors(url, "write"):
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
        with _errors(url, "delete"):
            if not missing_ok and not fs.exists(inner):  # S3 DELETE of a missing key succeeds silently
                raise FileNotFoundError(2, "No such file or directory", url)
            fs.rm(inner, recursive=recursive)
    except FileNotFoundError:
        if not missing_ok:
            raise
