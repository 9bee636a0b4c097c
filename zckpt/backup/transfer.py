"""What a push moves between SRC and DEST, shared by every destination: :class:`FileTask` (a local file to send),
:class:`RemoteFile` (what DEST holds under that name), :func:`check_unchanged` (a file that changed while being
sent raises :class:`FileChanged`) and :func:`wait_all` (the push pool's futures, the first failure cancelling the
rest).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os

# ``ctx`` arguments are the running push's :class:`zckpt.backup.context.PushContext` (pool, cancel flag, retries,
# hashes); the annotation is a name only: this module sits below the push and never imports it


@dataclasses.dataclass
class FileTask:
    rel: str
    local: str
    size: int
    mtime_ns: int
    sha256: str | None = None
    send: bool = True


@dataclasses.dataclass
class RemoteFile:
    size: int
    sha256: str | None = None
    blob_id: str | None = None


def check_unchanged(task: FileTask) -> None:
    st = os.stat(task.local)
    if st.st_size != task.size or st.st_mtime_ns != task.mtime_ns:
        raise FileChanged(task.rel)


class FileChanged(Exception):
    """A local file changed while it was being pushed."""


def wait_all(futures: list[cf.Future], ctx: PushContext) -> None:
    """Wait for every future; on the first failure cancel the rest and raise it."""
    try:
        pending = set(futures)
        while pending:
            done, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_EXCEPTION)
            for fut in done:
                if fut.exception() is not None:
                    for p in pending:
                        p.cancel()
                    cf.wait(pending)
                    raise fut.exception()
    except BaseException:
        for f in futures:
            f.cancel()
        raise
