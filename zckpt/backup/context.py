"""What a running push shares with its destinations (:class:`PushContext`: pool, cancel flag, progress, retries
with back-off, hashes) and with the pushes after it (:class:`Reachability`: whether DEST answers, and for how long
it has not).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from zckpt.errors import InvalidArgument, PushInterrupted
from zckpt.backup.faults import one_line, retryable, unreachable
from zckpt.backup.hashes import checked_sha256
from zckpt.backup.results import PushEvent
from zckpt.backup.transfer import FileTask

log = logging.getLogger(__name__)

#: how long DEST may go unreachable (connection refused, host name not resolved, no route, connect timeout)
#: before a push gives up on it, counted from the start of the first request that failed so (the backend's own
#: retries inside that request included: botocore's take 0-15 s, huggingface_hub's 23 s)
UNREACHABLE_AFTER = 20.0


class Reachability:
    """Whether DEST answers, shared by every request of a push (and by the runs of
    :func:`zckpt.backup.schedule.push_every` and :class:`zckpt.backup.schedule.Pusher`): ``since`` is when the first
    failed request of the current outage began, None while DEST answers; any request that succeeds ends the outage.
    ``give_up_after``: seconds of outage after which a request that cannot connect is not retried any more. The
    retry notice is logged once per outage."""

    def __init__(self, give_up_after: float = UNREACHABLE_AFTER):
        if give_up_after < 0:
            raise InvalidArgument(f"must not be negative, not {give_up_after}", param="unreachable_after")
        self.give_up_after = give_up_after
        self.lock = threading.Lock()
        self.since: float | None = None
        self.noticed = False

    def failed(self, began: float) -> tuple[float, bool]:
        """A request that began at ``began`` could not connect: (seconds DEST has been unreachable, whether this
        is the outage's first notice)."""
        with self.lock:
            if self.since is None:
                self.since = began
            first, self.noticed = not self.noticed, True
            return time.monotonic() - self.since, first

    def answered(self) -> None:
        if self.since is None:  # (unlocked: the common case, nothing to do)
            return
        with self.lock:
            was, self.since, self.noticed = self.since, None, False
        if was is not None:
            log.info("DEST answers again after %.0fs", time.monotonic() - was)


class PushContext:
    """What a destination needs from the running push: pool, cancel flag, progress, retries, hashes."""

    def __init__(self, pool, cancel, progress, retries, hashes, workers, reach: Reachability | None = None):
        self.pool, self.cancel, self.progress, self.retries = pool, cancel, progress, retries
        self.hashes, self.workers = hashes, workers
        self.reach = reach or Reachability()
        self.gave_up = threading.Event()  # a request of this push gave up on an unreachable DEST: the others stop

    def emit(self, kind: str, **kw) -> None:
        if self.progress is not None:
            try:
                self.progress(PushEvent(kind, **kw))
            except Exception:
                log.debug("progress callback failed", exc_info=True)

    def sha256(self, task: FileTask) -> str:
        """The file's sha256; a torch zip's entries are CRC-checked over the same bytes (a damaged file raises
        :class:`CorruptFile`, and only checked files enter the hash cache)."""
        if task.sha256 is None:
            st = os.stat(task.local)
            digest = self.hashes.get(task.local, st)
            if digest is None:
                digest = checked_sha256(task.local, self.cancel)
                self.hashes.put(task.local, st, digest)
            task.sha256 = digest
        return task.sha256

    def retry(self, fn: Callable[[], Any], what: str, checkpoint: str = "") -> Any:
        """``fn()``, retried when it fails transiently: up to ``retries`` times with pauses of 1, 2, 4, 8, 16 s;
        a DEST that cannot be reached at all only while it has been so for less than ``reach.give_up_after``
        seconds (then the push gives up on DEST; see :func:`zckpt.backup.push.push`)."""
        for attempt in range(self.retries + 1):
            if self.cancel.is_set():
                raise PushInterrupted("interrupted", path=what)
            began = time.monotonic()
            try:
                out = fn()
            except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, PushInterrupted,
                    InvalidArgument):
                raise
            except OSError as exc:
                if not retryable(exc):
                    raise
                if unreachable(exc):
                    delay = self._unreachable_pause(exc, began, attempt, what, checkpoint)
                else:
                    if attempt == self.retries:
                        raise
                    delay = min(2.0 ** attempt, 30.0)
                    msg = f"{one_line(exc, what)}; retry {attempt + 1}/{self.retries} in {delay:.0f}s"
                    log.warning("%s", msg)
                    self.emit("retry", checkpoint=checkpoint, path=what, message=msg)
                self._pause(delay, exc, what)
                continue
            self.reach.answered()
            return out
        raise AssertionError("unreachable")

    def _unreachable_pause(self, exc: OSError, began: float, attempt: int, what: str, checkpoint: str) -> float:
        """The pause before retrying a request that could not connect, or ``exc`` raised when DEST has been
        unreachable too long (or the retries are used up, or another request of this push gave up)."""
        down, first = self.reach.failed(began)
        left = self.reach.give_up_after - down
        if attempt == self.retries or left <= 0 or self.gave_up.is_set():
            self.gave_up.set()
            exc.unreachable_for = down  # for push()'s one line
            raise exc
        delay = min(2.0 ** attempt, 30.0, left)
        msg = f"{one_line(exc, what)}; retrying for up to {left:.0f}s"
        if first:  # once per outage, not once per request and retry
            log.warning("%s", msg)
        self.emit("retry", checkpoint=checkpoint, path=what, message=msg)
        return delay

    def _pause(self, delay: float, exc: OSError, what: str) -> None:
        end = time.monotonic() + delay
        while (left := end - time.monotonic()) > 0:
            if self.cancel.wait(min(left, 0.25)):
                raise PushInterrupted("interrupted", path=what) from exc
            if self.gave_up.is_set() and unreachable(exc):
                raise exc
