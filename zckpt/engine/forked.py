"""The files a job only copies, written by a forked process while this one imports numpy for the files it casts.

A job that casts (``convert --to deepspeed``: the bf16 weights cast from the fp32 masters) imports numpy and
ml_dtypes before its threads start: about 0.05 s of the lent 16-core host's time, and 0.1 s of the 2-core box's,
during which nothing is written. Beside the copying threads the import is no better: both need the GIL, and the
import took 2.1-2.7x as long while the copies ran at a third of their rate (docs/benchmarks.md, issue 49). So the
output files are split in two:

    copies   the files none of whose jobs needs numpy (a DeepSpeed optimizer file: masters and moments as they are)
             -> written by a child forked now, with its own threads: it starts writing at once (no import, no new
                interpreter: the plan is already in its memory), its headers written by the same ``done``
    casts    the files with a cast -> written here, after the import, while the child copies, with a third of
             the threads, one more at a time while they would end after the child's (:class:`_Balance`, up to
             half); once the child is done, with as many as it had (:class:`_Pool`): on the lent host
             (2026-12-06, twelfth session) the cast file went on 0.14-0.23 s after the child's last copy at 4
             threads, 0.11-0.15 s with them grown

and joined: the child sends its progress, then its files' CRC-32s, the input spans it read (checked here with the
rest before anything is published, :class:`zckpt.engine.checked.InputCheck`) and its counters; an error in it is
raised here as it was raised there (one line, the same exit status); a child that dies is an error naming its
signal. Ctrl-C reaches both (one process group); the child ignores it, and this process, unwinding, kills it and
waits for it before the scratch folder is removed. Without ``os.fork`` (not Linux), with a thread already running
(a fork then may deadlock), numpy or torch already imported (nothing to hide), remote sources, tees, maps, a read
meter or a launcher's share: one process, as before. ``ZCKPT_FORK_COPIES=0`` turns it off.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import struct
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from zckpt.errors import StorageError, ZckptError

log = logging.getLogger(__name__)

FORK_COPIES = os.environ.get("ZCKPT_FORK_COPIES", "1") != "0"
_PROGRESS_EVERY = 0.05  # seconds between the child's progress messages
BALANCE = True  # this process's threads grow while its files would end after the child's (:class:`_Balance`)
BALANCE_MOST = 1 / 2  # ... up to this share of the threads
_HEAD = struct.Struct("<Q")


def may_fork() -> bool:
    """Whether this process may fork a writer now: ``ZCKPT_FORK_COPIES`` not 0, Linux, no thread running (a fork
    then may deadlock), numpy and torch not imported (nothing to hide), no tees, maps or read meter."""
    from zckpt.engine import mapped, tees
    from zckpt.io import meters
    return (FORK_COPIES and hasattr(os, "fork") and sys.platform.startswith("linux") and "numpy" not in sys.modules
            and "torch" not in sys.modules and threading.active_count() == 1 and not tees.SHARE_READS
            and not mapped.MAP_WRITES and not meters._METERS)


def split(targets: list, worker, remote: bool) -> tuple[list, list] | None:
    """``(copies, casts)``: the targets to write in a forked child and here, or None to write them all here."""
    if remote or not may_fork() or not hasattr(worker, "cast_needs"):  # (no cast_needs: a test's stand-in)
        return None
    copies, casts = [], []
    for t in targets:
        if t.tee_in or t.writers != 1:
            return None
        needs = worker.cast_needs((parts, dtype) for _, _, parts, dtype in t.jobs)[0] if t.jobs else None
        (casts if needs else copies).append(t)
    if not casts or not any(t.jobs for t in copies):
        return None
    return copies, casts


def cast_workers(workers: int) -> int:
    """This process's threads while the child copies with ``workers``: a third of them, at least 2 (1 where the
    user asked for 1). The files it casts are few (a DeepSpeed model-states file: one), each written at one inode's
    rate whatever the threads; on the lent host 4 threads beside the child's 12 gave convert --to deepspeed
    0.99-1.09 s against 1.01-1.17 s with 12, and 6 (the child then slower by as much) no better than 4
    (docs/benchmarks.md). Once the child is done, the threads grow to ``workers``."""
    return min(workers, max(2, workers // 3))


def write_apart(copies: list, casts: list, write: Callable, workers: int, worker, check,
                progress: Callable[[int], None] | None, closed: Callable | None,
                after_job: Callable[[], None] | None) -> dict:
    """``copies`` written by a forked child with ``workers`` threads, ``casts`` here with :func:`cast_workers`, each by
    ``write(targets, pool, progress, closed, after_job)`` (:func:`zckpt.engine.lanes.write_files` on one process's
    targets); returns both's CRC-32s."""
    for stream in (sys.stdout, sys.stderr):  # (buffered text is not written twice)
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    parent = os.getpid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(r)
        _child(w, parent, copies, write, workers, worker, check)
    os.close(w)
    log.debug("  %d file(s) only copied written by a forked process (pid %d) while %d with casts are written here",
              len(copies), pid, len(casts))
    box = _Box()
    reader = threading.Thread(target=_read, args=(r, box), name="zckpt-forked", daemon=True)
    reader.start()

    def drain() -> None:
        with box.lock:
            n, box.progress = box.progress, 0
        if n and progress:
            progress(n)

    own = _Pool(cast_workers(workers), workers)  # (the caller's pool's own threads never start)
    box.ended = lambda: own.grow(workers)
    balance = _Balance(own, _bytes(casts), _bytes(copies), max(own.threads, int(workers * BALANCE_MOST))) \
        if BALANCE else None
    wrote = [0]

    def mine_progress(n: int) -> None:
        wrote[0] += n
        if progress:
            progress(n)

    def mine() -> None:  # after each of this process's jobs: the child's progress; its error stops this side too
        drain()
        if box.error is not None:
            raise box.error
        if balance is not None and box.result is None:
            balance.step(time.monotonic(), wrote[0], box.copied, box.at)
        if after_job is not None:
            after_job()

    reaped = False
    try:
        with own:
            crcs = write(casts, own, mine_progress, closed, mine)
        if check is not None and reader.is_alive():  # while the child copies: what the input check reads first
            check.prepare(_sources(copies + casts))
        while reader.is_alive():
            reader.join(0.05)
            drain()
        drain()
        status = _wait(pid)
        reaped = True
    finally:
        if not reaped:  # this side failed or was interrupted: the child stops before the scratch folder goes
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait(pid)
            reader.join()
    if box.error is not None:
        raise box.error
    if box.result is None:
        raise StorageError(f"the process writing {_names(copies)} ended without a result ({_status(status)})",
                           hint="run again; if it recurs, set ZCKPT_FORK_COPIES=0 and report it")
    got, spans, counters = box.result
    if check is not None:
        check.absorb(spans)
    _add_counters(worker, counters)
    for t in copies:
        t.crcs = {slot: v for (key, slot), v in got.items() if key == t.key}
        if closed is not None:
            closed(t)
    return {**got, **crcs}


def _add_counters(worker, counters: dict) -> None:
    stats = getattr(worker, "stats", None)
    if stats is not None:
        for name, value in counters.items():  # (seconds ran side by side: the longer; counts add)
            have = getattr(stats, name)
            setattr(stats, name, max(have, value) if name.endswith("_seconds") else have + value)


class _Box:
    """What the reader thread took from the child: progress not yet reported, its result or its error;
    ``ended()`` is called once the child has sent its last message."""

    def __init__(self):
        self.lock = threading.Lock()
        self.progress = 0
        self.copied = 0  # the child's bytes written so far, as of its last message
        self.at = 0.0  # when that message came (time.monotonic)
        self.result = None
        self.error: BaseException | None = None
        self.ended: Callable[[], None] = lambda: None


class _Pool:
    """The threads writing this process's files: ``first`` of them while the child copies, ``grow(n)`` adds more
    once it is done (the jobs not yet started go to whichever thread is free). ``_max_workers`` is the most it may
    grow to, which is what :func:`zckpt.engine.lanes.write_files` sizes its jobs in flight by. (A
    ThreadPoolExecutor cannot grow but through its private fields.) On the lent host the growth took 0.05 s off
    convert --to deepspeed's writing: 0.930-1.010 s from the fork to the end against 0.986-1.056 without it, five
    alternated runs each (docs/benchmarks.md, 2026-12-06 twelfth session)."""

    def __init__(self, first: int, most: int):
        self._max_workers = max(first, most)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self.grow(first)

    @property
    def threads(self) -> int:
        return len(self._threads)

    def grow(self, n: int) -> None:
        with self._lock:
            while not self._closed and len(self._threads) < min(n, self._max_workers):
                t = threading.Thread(target=self._work, name=f"zckpt-cast_{len(self._threads)}", daemon=True)
                t.start()
                self._threads.append(t)

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - the caller takes it from the future
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def __enter__(self) -> "_Pool":
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        for t in threads:
            t.join()


class _Balance:
    """While the child copies: this process's threads grow by one, up to ``most``, when its files would end more
    than ``SLACK`` seconds after the child's at the rates of the last ``SETTLE`` seconds (each side's bytes written
    against its total; the child's as of its messages). The split at the fork is a guess: on the lent host the
    cast file ended 0.11-0.15 s after the child's copies at 4 threads of 16, and 0.14-0.17 s before them at 6
    (the child then slower by as much; docs/benchmarks.md, 2026-12-06 twelfth session); this finds the count in
    between for the machine and the checkpoint at hand. It only grows (a thread started is not stopped): one at a
    time, a window apart, so a growth's effect on both sides is seen before the next. On the lent host (H200 kind,
    thirteenth session; six alternated runs each) the fork to the end took 0.875 s on average against 0.902
    without it; a thread more here costs the child more than it gives this side (at 6 threads here the child
    copied 12-13 GB/s against 17-18 at 4), so the gain is the tail it removes, not a faster machine."""

    SETTLE = 0.1
    SLACK = 0.02

    def __init__(self, pool: "_Pool", own_total: int, child_total: int, most: int):
        self.pool, self.own_total, self.child_total, self.most = pool, own_total, child_total, most
        self.mark: tuple[float, int, int, float] | None = None  # (time, own bytes, child bytes, its message's time)

    def step(self, now: float, own: int, child: int, child_at: float) -> bool:
        """This process's bytes ``own`` now, the child's ``child`` as of its message at ``child_at``; True: grown."""
        if self.own_total <= 0 or self.child_total <= 0:
            return False
        if self.mark is None:
            self.mark = (now, own, child, child_at)
            return False
        t0, own0, child0, at0 = self.mark
        if now - t0 < self.SETTLE or child_at <= at0:
            return False
        self.mark = (now, own, child, child_at)
        own_rate, child_rate = (own - own0) / (now - t0), (child - child0) / (child_at - at0)
        if own_rate <= 0 or child_rate <= 0 or child >= self.child_total or self.pool.threads >= self.most:
            return False
        own_end = now + max(0, self.own_total - own) / own_rate
        child_end = child_at + (self.child_total - child) / child_rate
        if own_end <= child_end + self.SLACK:
            return False
        self.pool.grow(self.pool.threads + 1)
        log.debug("  %d thread(s) here: this side would end %.3f s after the forked copy", self.pool.threads,
                  own_end - child_end)
        return True


def _bytes(targets: list) -> int:
    """The bytes of ``targets``' files (created at their size before the fork; 0 where one cannot be read)."""
    try:
        return sum(os.path.getsize(t.path) for t in targets)
    except (OSError, TypeError, ValueError):
        return 0


def _read(fd: int, box: _Box) -> None:
    with os.fdopen(fd, "rb") as f:
        while True:
            got = _receive(f)
            if got is None:
                return
            kind, value = got
            if kind == "p":
                with box.lock:
                    box.progress += value
                    box.copied += value
                    box.at = time.monotonic()
            elif kind == "ok":
                box.result = value
                box.ended()
            else:
                box.error = _rebuilt(value)


def _sender(fd: int) -> Callable[[str, object], None]:
    """``send(kind, value)``: one message on the pipe ``fd`` (its length, then the pickled pair)."""

    def send(kind: str, value) -> None:
        body = pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL)
        data = memoryview(_HEAD.pack(len(body)) + body)
        while data:
            data = data[os.write(fd, data):]
    return send


def _receive(f) -> tuple | None:
    """The next message on the pipe file ``f`` (from this program's other process), or None at its end."""
    head = f.read(_HEAD.size)
    if len(head) < _HEAD.size:
        return None
    body = f.read(_HEAD.unpack(head)[0])
    try:
        return pickle.loads(body)  # (this program's own other process: not a file from anyone)
    except Exception:  # noqa: BLE001 - a message cut short (the sender was killed mid-write)
        return None


class _Side:
    """What the forked child (:func:`_child`) does around its jobs: its progress sent every
    ``_PROGRESS_EVERY`` seconds, and after each job a check that the process that started it is still there (and
    the tests' faults, ``ZCKPT_TEST_FORKED``: raise, exit, hang)."""

    def __init__(self, send, parent: int):
        self.send, self.parent = send, parent
        self.pending, self.last = 0, time.monotonic()
        self.hook = os.environ.get("ZCKPT_TEST_FORKED")

    def step(self, n: int) -> None:
        self.pending += n
        if time.monotonic() - self.last >= _PROGRESS_EVERY:
            self.send("p", self.pending)
            self.pending, self.last = 0, time.monotonic()

    def after_job(self) -> None:
        if os.getppid() != self.parent:  # the parent is gone (killed): nothing will publish this
            raise StorageError("the zckpt process that started this one has ended")
        if self.hook == "raise":
            raise StorageError("injected failure in the forked copy", hint="a test asked for it")
        if self.hook == "exit":
            os._exit(17)
        while self.hook == "hang" and os.getppid() == self.parent:  # (until the parent kills it, or is gone)
            time.sleep(0.1)

    def ok(self, crcs: dict, worker, check) -> None:
        self.send("p", self.pending)
        stats = getattr(worker, "stats", None)
        counters = {k: v for k, v in vars(stats).items() if isinstance(v, (int, float))} if stats else {}
        self.send("ok", (crcs, check.export() if check is not None else [], counters))

    def failed(self, exc: BaseException) -> None:
        for value in (_portable(exc), ("other", type(exc).__name__, None, " ".join(str(exc).split())[:500])):
            try:
                self.send("error", value)
                break
            except BaseException:  # noqa: BLE001 - not picklable (the plain form then), or the parent is gone
                continue


def _child(fd: int, parent: int, targets: list, write: Callable, workers: int, worker, check) -> None:
    code = 1
    side = _Side(_sender(fd), parent)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent stops this process
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if check is not None:
            check.export()  # (the spans read before the fork are the parent's to check)
        from zckpt.engine.executor import FetchStats
        if getattr(worker, "stats", None) is not None:
            worker.stats = FetchStats()
        with ThreadPoolExecutor(workers) as pool:
            crcs = write(targets, pool, side.step, None, side.after_job)
        side.ok(crcs, worker, check)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent, which reports it
        side.failed(exc)
    finally:
        os._exit(code)


def _portable(exc: BaseException) -> tuple:
    """``exc`` as plain values (a ZckptError's path and hint survive; pickling it would keep only its message)."""
    if isinstance(exc, ZckptError):
        return "zckpt", type(exc), dict(vars(exc)), exc.message
    if isinstance(exc, OSError):
        return "os", type(exc), (exc.errno, exc.strerror, exc.filename), str(exc)
    return "other", type(exc).__name__, None, " ".join(str(exc).split())[:500]


def _rebuilt(value: tuple) -> BaseException:
    kind, cls, data, message = value
    if kind == "zckpt":
        exc = cls.__new__(cls)
        Exception.__init__(exc, message)
        vars(exc).update(data)
        return exc
    if kind == "os":
        errno, strerror, filename = data
        return cls(errno, strerror, filename) if errno is not None else cls(message)
    if cls == "KeyboardInterrupt":
        return KeyboardInterrupt()
    return StorageError(f"the forked copy failed: {cls}: {message}", hint="run again with ZCKPT_FORK_COPIES=0")


def _sources(targets: list) -> list[str]:
    """The local files the jobs of ``targets`` read."""
    from zckpt.engine.segments import Cast, Piece
    paths: dict[str, None] = {}
    for t in targets:
        for _, _, parts, _ in t.jobs:
            for p in parts:
                if isinstance(p, Piece):
                    paths[p.path] = None
                elif isinstance(p, Cast):
                    paths.update(dict.fromkeys(q.path for q in p.pieces))
    return list(paths)


def _wait(pid: int) -> int:
    """The child's exit status (0 where the host program reaps its children itself: SIGCHLD ignored)."""
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return 0


def _names(targets: list) -> str:
    names = [os.path.basename(t.path) for t in targets]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exit status {os.WEXITSTATUS(status)}"
