"""S3 through one shared, thread-safe boto3 client built from the s3fs options (part of :mod:`zckpt.io.storage`).

Every call on ``s3://`` (stat, list, ranged GET, upload) goes through :func:`boto3_client`, so a reading command
never imports s3fs and GETs run in parallel threads; s3fs only when the options need it or
``ZCKPT_S3_UPLOADER=s3fs`` (then :func:`boto3_client` answers None). Failures are raised as s3fs would raise them
(:func:`raise_boto`)."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from zckpt.errors import StorageError
from zckpt.io.filesystems import PASSTHROUGH, s3_options
from zckpt.io.paths import protocol


class S3Object:
    """Metadata calls on one ``s3://`` path through the shared boto3 client (:func:`boto3_client`): one HEAD or
    LIST each, thread-safe, and no s3fs import (0.2-0.5 s of a command's start-up). The answers are the ones s3fs
    gives: a "folder" is a key prefix (or the bucket), a file a key."""

    def __init__(self, client, url: str):
        self.client, self.url = client, url
        self.bucket, _, key = url.split("://", 1)[1].partition("/")
        self.key = key.rstrip("/")

    @classmethod
    def of(cls, path: str, storage_options: dict[str, Any] | None) -> "S3Object | None":
        if protocol(path) not in ("s3", "s3a"):
            return None
        boto = boto3_client(dict(storage_options or {}))
        return cls(boto[0], path) if boto is not None else None

    def _call(self, op: str, fn, **kwargs):
        try:
            return fn(Bucket=self.bucket, **kwargs)
        except Exception as exc:
            if isinstance(exc, PASSTHROUGH) or not is_boto_error(exc):
                raise
            if _boto_missing(exc):
                raise FileNotFoundError(2, "No such file or directory", self.url) from None
            raise_boto(exc, self.url, op)

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

    def file_sizes(self) -> dict[str, int]:
        """``{name: size}`` of the objects directly under this prefix, from the listing alone (no HEAD per object)."""
        out: dict[str, int] = {}
        for prefix, page in self.pages():
            for o in page.get("Contents", ()):
                name = o["Key"][len(prefix):]
                if name and "/" not in name:
                    out[name] = int(o.get("Size") or 0)
        if not out and not self.exists():
            raise FileNotFoundError(2, "No such file or directory", self.url)
        return out

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


# S3 uploads: boto3's transfer manager when it can honour the options (measured about 1.5x s3fs's put_file
# with several files in flight: s3fs does every stream's signing and copying on one event-loop thread).
# ZCKPT_S3_UPLOADER=s3fs forces s3fs; options only s3fs understands fall back to it automatically.
_S3FS_ONLY_HARMLESS = {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache",
                       "default_block_size", "default_fill_cache", "default_cache_type", "version_aware",
                       "cache_regions", "max_concurrency", "retries", "fixed_upto", "asynchronous"}
_boto_lock = threading.Lock()
_boto_clients: dict[str, Any] = {}


def boto3_client(options: dict[str, Any]):
    """``(client, extra_upload_args)`` equivalent to the s3fs options, or None to use s3fs."""
    if os.environ.get("ZCKPT_S3_UPLOADER", "auto").lower() == "s3fs":
        return None
    try:
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config
    except ImportError:
        return None
    opts = s3_options(options)
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


def boto3_put(client, extra, src, url, callback, metadata, chunksize, max_concurrency) -> None:
    from boto3.s3.transfer import S3Transfer, TransferConfig

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
        if isinstance(exc, PASSTHROUGH) or not is_boto_error(exc):
            raise
        raise_boto(exc, url, "upload")


def raise_boto(exc: BaseException, url: str, op: str):
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


def is_boto_error(exc: BaseException) -> bool:
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


def boto3_get(client, url: str, offset: int, length: int) -> bytes:
    """One ranged GET through boto3 (``length`` bytes from ``offset``; fewer at the end of the object)."""
    if length <= 0:
        return b""
    bucket, _, key = url.split("://", 1)[1].partition("/")
    try:
        resp = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}")
        return resp["Body"].read()
    except Exception as exc:
        if isinstance(exc, PASSTHROUGH) or not is_boto_error(exc):
            raise
        from botocore.exceptions import ClientError

        if isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") == "InvalidRange":
            return b""  # past the end: the caller reports the short read with the file's name
        raise_boto(exc, url, "read")
