"""Paths and URLs as plain ``str`` (a ``pathlib.Path`` would collapse the ``//`` of ``s3://``): which scheme a
path has, and joining / splitting that keeps ``s3://bucket/x`` intact. Part of :mod:`zckpt.io.storage`."""

from __future__ import annotations

import os
import re

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


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
    """The last name of ``path``; of a local ``.`` / ``..`` / ``ckpt/..`` (trailing slashes or not), the name of the
    folder it resolves to (``checkpoint-4`` inside it, never ``.``)."""
    path = os.fspath(path).rstrip("/")
    if is_url(path):
        return path.rsplit("/", 1)[-1]
    name = os.path.basename(path)
    return os.path.basename(os.path.abspath(path)) if name in (".", "..") else name


def parent(path: str | os.PathLike) -> str:
    """The folder holding ``path`` (local paths made absolute; a URL's bucket root is its own parent)."""
    path = os.fspath(path).rstrip("/")
    if is_url(path):
        head = path.rsplit("/", 1)[0]
        return head if "://" in head and not head.endswith(":/") else path
    return os.path.dirname(os.path.abspath(path))
