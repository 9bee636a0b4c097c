"""A process forked as convert --to deepspeed starts, importing numpy while this one reads the checkpoint and
plans, then writing the files with casts while this one writes the files it only copies.

A job that casts (the bf16 weights cast from the fp32 masters) imports numpy and ml_dtypes before its first cast:
0.06-0.09 s on the lent 16-core host, about as long as reading a DCP's metadata and planning (0.08 s, issue 49's
1.05B checkpoint). :mod:`zckpt.engine.forked` hides the import behind the copies by forking after the plan; the
casts then start that much later, and the cast file (one inode, written at its own rate) ended 0.11-0.23 s after
the copies (docs/benchmarks.md, twelfth session). Forked before the plan, the import runs beside the planning
instead, and the casts start with the copies. Expected on that host: the cast file's 0.06-0.09 s of import off
its path, so that it ends about when the copies do (0.05-0.1 s off the command); not yet measured there, so opt-in
(``CASTS_AHEAD``)::

    casts_ahead()        the fork, when the command starts (ZCKPT_CASTS_AHEAD=1; Linux, no thread running, numpy
                         and torch not imported, ZCKPT_FORK_COPIES not 0): the caster imports numpy (and ml_dtypes
                         where it is quick to import), then waits for its jobs
    write_beside()       lanes.write_files, where :func:`zckpt.engine.forked.split` splits the plan's files: the
                         files with casts sent to the caster (their jobs pickled, on a side thread: a message larger
                         than the pipe waits for its import), written there with a third of the threads, all of them
                         once this process has written the files it only copies; their headers written here from
                         the CRC-32s it sends back with its input spans (checked here with the rest before anything
                         is published) and its counters
    dismiss() / the end  no split (no cast after all, a plan kept in one process): stopped at once; at the end of the
                         command in any case (an error, Ctrl-C): killed and reaped before the scratch folder goes

Its failure is raised here as it was raised there (one line, the same exit status); Ctrl-C reaches both (one
process group), the caster ignores it and this process, unwinding, kills it. The protocol and the pools are
:mod:`zckpt.engine.forked`'s. The caster gets its writer (:func:`zckpt.engine.lanes.write_casts`) from the caller,
as ``casts_ahead(write=...)``: lanes imports this module.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Callable

from zckpt.engine import forked
from zckpt.errors import StorageError

log = logging.getLogger(__name__)

# ZCKPT_CASTS_AHEAD=1: a process forked before the plan imports numpy and writes the casts (:func:`casts_ahead`).
# Off by default until it is measured on the lent 16-core host (no device time was left in the session that built
# it, 2026-12-06 thirteenth; benchmarks/results/2026-12-06n-balance-host/call3.sh is the measurement to run); the
# default is the fork after the plan (:func:`zckpt.engine.forked.write_apart`), measured
CASTS_AHEAD = os.environ.get("ZCKPT_CASTS_AHEAD", "0") == "1"


class _Caster:
    """A process forked before the checkpoint is read, importing numpy while this one plans; :func:`write_beside`
    hands it the files with casts. ``to``: the pipe this process writes to it; ``back``: the one it answers on."""

    def __init__(self, pid: int, to: int, back: int):
        self.pid, self.to, self.back = pid, to, back
        self.ended = False
        self.sending = threading.Lock()  # (one message at a time on the pipe)
        self.sender: threading.Thread | None = None

    def send(self, kind: str, value) -> None:
        with self.sending:
            self._send(kind, value)

    def _send(self, kind: str, value) -> None:
        try:
            forked._sender(self.to)(kind, value)
        except OSError:  # it has ended: its status (or its error, already sent) says how
            pass

    def send_beside(self, kind: str, value) -> threading.Thread:
        """``send`` on a side thread: a message larger than the pipe holds waits for the caster to read it (while
        it still imports), and this process goes on meanwhile; a later ``send`` waits for it."""
        self.sending.acquire()

        def run() -> None:
            try:
                self._send(kind, value)
            finally:
                self.sending.release()
        t = self.sender = threading.Thread(target=run, name="zckpt-send", daemon=True)
        t.start()
        return t

    def end(self, kill: bool = True) -> int:
        """Stop it (unless ``kill`` is False: it is ending by itself) and reap it; its exit status."""
        if self.ended:
            return 0
        self.ended = True
        if kill:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        status = forked._wait(self.pid)
        if self.sender is not None:  # (its write ends once the reader is gone; only then is the pipe closed, so
            self.sender.join()  # that it never writes into a file opened since under the same number)
        for fd in (self.to, self.back):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.to = self.back = -1
        return status


_CASTER: _Caster | None = None


@contextlib.contextmanager
def casts_ahead(write: Callable, wanted: bool = True):
    """Around a command whose output will have casts (convert --to deepspeed of bf16 or fp16 weights): a process
    forked now imports numpy (0.06-0.09 s on the lent 16-core host) while this one reads the checkpoint and plans
    (about as long), and then writes the files with casts (:func:`write_beside`), this process the files it only
    copies. Unused (no cast after all, or a plan :func:`zckpt.engine.forked.split` keeps in one process), it is
    stopped as soon as that is known, and at the end in any case (an error, Ctrl-C). Nothing where a fork is not
    taken (``split``'s conditions) or ``CASTS_AHEAD`` is off. ``write(spec, cfg, pool, worker, step, after_job)``:
    what the caster runs on the jobs it is sent (:func:`zckpt.engine.lanes.write_casts`)."""
    global _CASTER
    if not (wanted and CASTS_AHEAD and _CASTER is None and forked.may_fork()):
        yield
        return
    for stream in (sys.stdout, sys.stderr):  # (buffered text is not written twice)
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    to_r, to_w = os.pipe()
    back_r, back_w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the caster: never returns
        os.close(to_w)
        os.close(back_r)
        _caster(to_r, back_w, parent, write)
    os.close(to_r)
    os.close(back_w)
    caster = _CASTER = _Caster(pid, to_w, back_r)
    log.debug("  a process forked (pid %d) to import numpy for the casts while the checkpoint is read", pid)
    try:
        yield
    finally:
        _CASTER = None
        caster.end()


def dismiss() -> None:
    """The warm caster is not needed (this plan keeps its casts here, or has none): stopped now."""
    global _CASTER
    if _CASTER is not None:
        _CASTER.end()


def caster() -> _Caster | None:
    return _CASTER if _CASTER is not None and not _CASTER.ended else None


def write_beside(caster_: _Caster, copies: list, casts: list, write: Callable, pool, worker, check,
                 progress: Callable[[int], None] | None, closed: Callable | None,
                 after_job: Callable[[], None] | None, done: Callable | None, durable: bool,
                 lanes: int | None) -> dict:
    """``casts`` written by the caster forked before the plan (:func:`casts_ahead`), with ``cast_workers`` of
    ``pool``'s threads growing to all of them once this process is done; ``copies`` here on ``pool`` (by
    ``write``, :func:`zckpt.engine.lanes.write_files` on one process's targets). The casts' files are finished
    here from the CRC-32s it sends: ``done`` (their headers), fsync when ``durable``, ``closed``. Returns both's
    CRC-32s."""
    workers = getattr(pool, "_max_workers", 1)
    spec = [(t.key, t.path, t.jobs, t.size) for t in casts]
    cfg = {"workers": workers, "first": forked.cast_workers(workers), "lanes": lanes, "check": check is not None,
           "pure_upcast": getattr(worker, "pure_upcast", False),
           "storage_options": getattr(worker, "storage_options", None)}
    box = forked._Box()
    reader = threading.Thread(target=forked._read, args=(caster_.back, box), name="zckpt-forked", daemon=True)
    caster_.back = -1  # (the reader's now: it closes it at the end)
    caster_.send_beside("jobs", (spec, cfg))
    reader.start()
    log.debug("  %d file(s) with casts written by a forked process (pid %d, forked before the plan) while %d only "
              "copied are written here", len(casts), caster_.pid, len(copies))

    def drain() -> None:
        with box.lock:
            n, box.progress = box.progress, 0
        if n and progress:
            progress(n)

    def mine() -> None:  # after each of this process's jobs: the caster's progress; its error stops this side too
        drain()
        if box.error is not None:
            raise box.error
        if after_job is not None:
            after_job()

    reaped, status = False, 0
    try:
        crcs = write(copies, pool, progress, closed, mine)
        caster_.send("grow", None)  # this side is done: the caster takes all the threads
        if check is not None and reader.is_alive():  # while the caster casts: what the input check reads first
            check.prepare(forked._sources(copies + casts))
        while reader.is_alive():
            reader.join(0.05)
            drain()
        drain()
        status = caster_.end(kill=False)
        reaped = True
    finally:
        if not reaped:  # this side failed or was interrupted: the caster stops before the scratch folder goes
            caster_.end()
            reader.join()
    if box.error is not None:
        raise box.error
    if box.result is None:
        raise StorageError(f"the process writing {forked._names(casts)} ended without a result "
                           f"({forked._status(status)})", hint="run again; if it recurs, set ZCKPT_FORK_COPIES=0 and report it")
    got, spans, counters = box.result
    if check is not None:
        check.absorb(spans)
    forked._add_counters(worker, counters)
    for t in casts:  # its files' headers, from its CRC-32s
        t.crcs = {slot: v for (key, slot), v in got.items() if key == t.key}
        fd = os.open(t.path, os.O_WRONLY)
        try:
            wrote = done(t, fd) if done is not None else None
            if wrote and progress:
                progress(wrote)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if closed is not None:
            closed(t)
    return {**got, **crcs}


def _caster(fd: int, back: int, parent: int, write: Callable) -> None:
    """The caster's life: numpy imported, then the jobs awaited; none (the pipe closed): it ends."""
    code = 1
    side = forked._Side(forked._sender(back), parent)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent stops this process
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        from zckpt.encoding import casting
        casting.warm()
        f = os.fdopen(fd, "rb")
        got = forked._receive(f)
        if got is None or got[0] != "jobs":
            code = 0
            return
        spec, cfg = got[1]
        from zckpt.engine import executor
        from zckpt.engine.checked import InputCheck
        check = InputCheck() if cfg["check"] else None
        worker = executor.Worker(pure_upcast=cfg["pure_upcast"], storage_options=cfg["storage_options"],
                                 check=check)
        pool = forked._Pool(cfg["first"], cfg["workers"])

        def listen() -> None:  # the parent's "grow" (its side is done); the pipe's end: nothing more
            while (msg := forked._receive(f)) is not None:
                if msg[0] == "grow":
                    pool.grow(cfg["workers"])
        threading.Thread(target=listen, name="zckpt-listen", daemon=True).start()
        with pool:
            crcs = write(spec, cfg, pool, worker, side.step, side.after_job)
        side.ok(crcs, worker, check)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent, which reports it
        side.failed(exc)
    finally:
        os._exit(code)
