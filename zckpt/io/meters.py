"""Counting the bytes read from files under a folder or URL prefix (:func:`read_meter`; part of
:mod:`zckpt.io.storage`)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from zckpt.io.paths import is_url, local_path


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
