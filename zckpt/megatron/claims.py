"""Whether a path is a Megatron-Core save: the names that say so, and nothing else of the reader (the opener asks
every format before reading one; this keeps asking Megatron cheap for a checkpoint that is not its own)."""

from __future__ import annotations

import re

from zckpt.io import storage

LATEST = "latest_checkpointed_iteration.txt"
META_JSON = "metadata.json"
ITER_RE = re.compile(r"^iter_\d{7}$")


def isfile(path: str, opts) -> bool:
    """Whether ``path`` is a file (False where the folder is not there either)."""
    try:
        return storage.isfile(path, opts)
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return False


def claims(path: str, storage_options: dict | None = None) -> bool:
    """A Megatron save folder (``latest_checkpointed_iteration.txt``), or an ``iter_NNNNNNN`` folder with
    Megatron's ``metadata.json`` or legacy ``mp_rank_XX`` folders: claimed before DCP (torch_dist has ``.metadata``
    too), so that a layout zckpt does not read is refused as Megatron's."""
    path = str(path).rstrip("/") or "/"
    if isfile(storage.join(path, LATEST), storage_options):
        return True
    if not ITER_RE.match(storage.basename(path)):
        return bool(iterations(path, storage_options))  # a save folder whose latest file is missing
    if isfile(storage.join(path, META_JSON), storage_options):
        return True
    try:
        return any(n.startswith("mp_rank_") for n in storage.listdir(path, storage_options))
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return False


def iterations(path: str, opts) -> list[str]:
    """The ``iter_NNNNNNN`` folders of ``path`` that hold Megatron's ``metadata.json``, oldest first."""
    try:
        names = storage.listdir(path, opts)
    except (FileNotFoundError, NotADirectoryError, ValueError, OSError):
        return []
    return sorted(n for n in names if ITER_RE.match(n) and isfile(storage.join(path, n, META_JSON), opts))
