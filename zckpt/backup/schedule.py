"""Pushes on a schedule: :func:`push_every` (a loop, ``zckpt push --every``) and :class:`Pusher` (a background
thread, pushing on :meth:`Pusher.trigger` and every ``every`` seconds; what the Trainer callback uses). Runs never
overlap, and each is a fresh :func:`zckpt.backup.push.push`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from zckpt.errors import InvalidArgument, PushInterrupted, ZckptError
from zckpt.backup.context import UNREACHABLE_AFTER, Reachability
from zckpt.backup.push import push
from zckpt.backup.results import PushResult

log = logging.getLogger(__name__)

def push_every(src: str, dest, interval: float, *, cancel: threading.Event | None = None,
               on_result: Callable[[PushResult], Any] | None = None,
               on_error: Callable[[BaseException], Any] | None = None, **kwargs) -> None:
    """Push, then again every ``interval`` seconds until ``cancel`` is set (or KeyboardInterrupt).

    Runs never overlap: when a push outlasts the interval the next starts right after it, and being a fresh
    scan it takes the newest complete checkpoint. Failures go to ``on_error`` and the loop goes on.
    Ctrl-C while waiting between runs ends the loop normally; during a push it abandons the push and raises.
    """
    if interval <= 0:
        raise InvalidArgument(f"must be more than zero, not {interval}", param="every")
    cancel = cancel or threading.Event()
    kwargs.setdefault("reachability", Reachability(kwargs.pop("unreachable_after", UNREACHABLE_AFTER)))
    while not cancel.is_set():
        began = time.monotonic()
        try:
            res = push(src, dest, cancel=cancel, **kwargs)
            if on_result is not None:
                on_result(res)
        except PushInterrupted:
            if cancel.is_set():
                break
        except (ZckptError, OSError) as exc:
            if on_error is None or _missing_package(exc):  # no later run can succeed: said once, the loop ends
                raise
            on_error(exc)
        try:
            cancel.wait(max(0.0, began + interval - time.monotonic()))
        except KeyboardInterrupt:
            return  # stopped between runs: nothing was abandoned


def _missing_package(exc: BaseException) -> bool:
    """Whether ``exc`` is a package that is not installed (a DEST backend: s3fs, huggingface_hub)."""
    return isinstance(exc, ImportError) or isinstance(exc.__cause__, ImportError)


class Pusher:
    """Pushes in a background thread: on :meth:`trigger`, and every ``every`` seconds if given.

    ``flush()`` waits until everything triggered so far is pushed, ``stop()`` flushes (or, with
    ``abandon=True``, abandons the current upload cleanly) and ends the thread. Errors are logged when they
    happen, kept in ``errors``, and raised by the next ``flush()`` / ``stop()``: never lost.
    Keyword arguments go to :func:`push`.
    """

    def __init__(self, src: str, dest, *, every: float | None = None, **push_kwargs):
        if every is not None and every <= 0:
            raise InvalidArgument(f"must be more than zero, not {every}", param="every")
        self.src, self.dest, self.every = src, dest, every
        push_kwargs.setdefault("reachability", Reachability(push_kwargs.pop("unreachable_after",
                                                                            UNREACHABLE_AFTER)))
        self.push_kwargs = push_kwargs
        self.errors: list[BaseException] = []
        self.results: list[PushResult] = []
        self._unraised: list[BaseException] = []
        self._cond = threading.Condition()
        self._requested = 0
        self._finished = 0
        self._names: set[str] | None = set()
        self._stopping = False
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def last_result(self) -> PushResult | None:
        return self.results[-1] if self.results else None

    def start(self) -> Pusher:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="zckpt-pusher", daemon=True)
            self._thread.start()
        return self

    def trigger(self, checkpoint: str | None = None) -> int:
        """Ask for a push soon (coalesced with others); ``checkpoint``: only that one (name relative to src)."""
        with self._cond:
            if checkpoint is None:
                self._names = None
            elif self._names is not None:
                self._names.add(checkpoint)
            self._requested += 1
            self._cond.notify_all()
            return self._requested

    def flush(self, timeout: float | None = None, *, push_now: bool = True) -> None:
        """Wait until everything triggered so far is pushed; raise any error not yet raised.

        ``push_now``: also push everything under src now (a full scan) and wait for that too.
        """
        if self._thread is None:
            self.start()
        with self._cond:
            gen = self._requested
        if push_now:
            gen = self.trigger()
        self._wait_for(gen, timeout)
        self._raise_errors()

    def _wait_for(self, gen: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._finished < gen and self._thread is not None and self._thread.is_alive():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"push to {self.dest} still running after {timeout}s")
                self._cond.wait(remaining if remaining is not None else 1.0)

    def stop(self, timeout: float | None = None, *, abandon: bool = False, push_now: bool = False) -> None:
        """End the thread: finish pending pushes first (``push_now``: and a last full one), or abandon the
        current one (no manifest written)."""
        if abandon:
            self._cancel.set()
        elif self._thread is not None and self._thread.is_alive():
            with self._cond:
                gen = self._requested
            if push_now:
                gen = self.trigger()
            self._wait_for(gen, timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._raise_errors()

    def _raise_errors(self) -> None:
        with self._cond:
            errors, self._unraised = self._unraised, []
        if errors:
            if len(errors) > 1:
                log.error("%d push errors; raising the first, all are in Pusher.errors", len(errors))
            raise errors[0]

    def __enter__(self) -> Pusher:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(abandon=exc_type is not None)

    def _run(self) -> None:
        next_timed = time.monotonic() + self.every if self.every else None
        while True:
            with self._cond:
                while not self._stopping and self._requested == self._finished:
                    wait = None if next_timed is None else next_timed - time.monotonic()
                    if wait is not None and wait <= 0:
                        self._requested += 1
                        self._names = None
                        break
                    self._cond.wait(wait)
                if self._stopping and (self._requested == self._finished or self._cancel.is_set()):
                    return
                gen, names = self._requested, self._names
                self._names = set()
            if next_timed is not None:
                next_timed = time.monotonic() + self.every
            try:
                res = push(self.src, self.dest, cancel=self._cancel, only=sorted(names) if names else None,
                           **self.push_kwargs)
                self.results.append(res)
            except BaseException as exc:  # noqa: BLE001 - surfaced by flush()/stop()
                if isinstance(exc, PushInterrupted) and self._cancel.is_set():
                    pass
                else:
                    log.error("push %s -> %s failed: %s", self.src, self.dest, exc)
                    with self._cond:
                        self.errors.append(exc)
                        self._unraised.append(exc)
            with self._cond:
                self._finished = gen
                self._cond.notify_all()
