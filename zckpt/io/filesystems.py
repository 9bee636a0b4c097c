"""Which fsspec filesystem a URL goes to and with which options, and backend failures said as ours (part of
:mod:`zckpt.io.storage`).

Options are passed, never kept: :func:`get_fs` uses exactly what it is given (on S3 on top of the standard AWS
variables, :func:`s3_options`). Missing paths stay ``FileNotFoundError``, refused access ``PermissionError``; any
other backend failure becomes :class:`zckpt.errors.StorageError` naming the URL (:func:`backend_errors`)."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from zckpt.errors import StorageError
from zckpt.io.paths import local_path, protocol

#: raised through :func:`backend_errors` (and the boto3 calls) as they are
PASSTHROUGH = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError,
               InterruptedError, StorageError)


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


def s3_options(options: dict[str, Any]) -> dict[str, Any]:
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
        options = s3_options(options)
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
def backend_errors(url: str, op: str):
    """Map a backend failure to a builtin or StorageError that names the URL."""
    try:
        yield
    except PASSTHROUGH:
        raise
    except OSError as exc:  # the backend translated the server's answer (s3fs: 400 -> EINVAL ...)
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise StorageError(f"{op} failed: {text}", path=url, hint="") from exc
    except Exception as exc:
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise StorageError(f"{op} failed: {type(exc).__name__}: {text}", path=url,
                           hint="check the URL, the credentials and that the server is reachable") from exc
