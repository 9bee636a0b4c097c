"""The sha256 of a push's local files: :func:`checked_sha256` (a torch zip's, or a ``.distcp`` file's, entries
CRC-checked over the same bytes) and :class:`HashCache`, kept in ``$ZCKPT_CACHE_DIR/push-hashes.json`` (default
``~/.cache/zckpt``) and keyed by (absolute path, size, mtime_ns), so an unchanged multi-GB shard is hashed once,
not every cycle.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading

from zckpt.io import hashing, storage
from zckpt.errors import CorruptFile
from zckpt.encoding.zipentries import LOCAL_SIG, StreamedCrcs, read_file_entries

log = logging.getLogger(__name__)

def _cache_dir() -> str:
    if os.environ.get("ZCKPT_CACHE_DIR"):
        return os.environ["ZCKPT_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "zckpt")


class HashCache:
    """sha256 of local files keyed by (absolute path, size, mtime_ns), kept in a small JSON file."""

    def __init__(self, path: str | None = None, enabled: bool = True):
        self.path = path or os.path.join(_cache_dir(), "push-hashes.json")
        self.enabled = enabled
        self._lock = threading.Lock()
        self._entries: dict[str, list] = {}
        self._dirty = False
        if enabled:
            with contextlib.suppress(OSError, ValueError):
                with open(self.path, encoding="utf-8") as f:
                    data = json.load(f)
                if isinstance(data, dict) and data.get("version") == 2 and isinstance(data.get("files"), dict):
                    self._entries = data["files"]

    def get(self, path: str, st: os.stat_result) -> str | None:
        with self._lock:
            entry = self._entries.get(path)
        if entry and entry[0] == st.st_size and entry[1] == st.st_mtime_ns:
            return entry[2]
        return None

    def put(self, path: str, st: os.stat_result, digest: str) -> None:
        with self._lock:
            self._entries[path] = [st.st_size, st.st_mtime_ns, digest]
            self._dirty = True

    def save(self) -> None:
        if not self.enabled or not self._dirty:
            return
        with self._lock:
            entries = {p: e for p, e in self._entries.items() if os.path.exists(p)}
            self._entries, self._dirty = entries, False
        try:
            storage.write_bytes_atomic(self.path, json.dumps({"version": 2, "files": entries}).encode())
        except OSError as exc:
            log.debug("cannot save hash cache %s: %s", self.path, exc)


TORCH_SUFFIXES = (".pt", ".pth", ".bin")  # torch.save zips (rank files, scheduler.pt, rng_state_N.pth, ...)
# and DCP's .distcp files: a torch zip per item, at the offsets the .metadata beside it gives


def checked_sha256(path: str, cancel: threading.Event | None = None) -> str:
    """sha256 of a local file; for a torch zip (or a ``.distcp`` file's items), the CRC-32 of every entry checked
    over the same bytes."""
    crcs = None
    if path.endswith(TORCH_SUFFIXES):
        with open(path, "rb") as f:
            if f.read(4) == LOCAL_SIG:
                crcs = StreamedCrcs(read_file_entries(path).values())
    elif path.endswith(".distcp"):  # DCP: one torch zip per item, where the .metadata beside it says
        from zckpt.dcp.entries import distcp_entries
        entries = distcp_entries(path)
        crcs = StreamedCrcs(entries) if entries is not None else None
    digest = hashing.sha256_file(path, cancel=cancel, on_chunk=crcs)
    bad = crcs.damaged() if crcs is not None else []
    if bad:
        name = bad[0].split("/", 1)[1] if "/" in bad[0] else bad[0]
        raise CorruptFile(f"zip entry {name}{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}: the bytes "
                          "do not match the CRC-32 the file records: the file is damaged, so the checkpoint is "
                          "not pushed", path=path,
                          hint="copy the file again from where it was saved, or push another checkpoint")
    return digest
