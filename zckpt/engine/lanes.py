"""Several output files written at once: the jobs of up to ``lanes`` files dealt in turn to the pool's threads.

Buffered writes into one file serialize on its inode's lock (ext4, xfs): on the lent 16-core host one file takes
about 3.5-5 GB/s whatever the number of writers, while one process whose 8 threads write 16 files at once copies
16.9-17.7 GB/s (pread + CRC-32 + pwrite, ``benchmarks/probe_io.py --configs 1:8:16:4:1:fallocate:spread``;
docs/benchmarks.md, "2026-12-04, second visit"). So every job list of the engine (one process's, or one rank's
share under a launcher) goes through :func:`write_files`::

    targets   [Target(key, path, jobs)]  in plan order; jobs (slot, offset, parts, dtype) in file order
    deal      up to ``lanes`` files open at a time (most jobs first), each dealt its jobs in proportion to their
              number, so that files open together finish together; a finished file's lane takes the next
    run       at most ``ahead`` jobs in flight on the pool (memory and open files stay bounded), results taken
              in the order dealt; each (file, slot)'s CRC-32 parts combined in file order when the file is finished
    tees      a cast job that also writes its source bytes into other files (zckpt.engine.tees.share_reads, opt-in):
              each tee counts as one of that file's jobs, its CRC part one of that file's
    hints     each job's local input ranges advised (WILLNEED) as it is queued (zckpt.engine.readahead): the
              kernel reads ahead of the threads when the page cache is cold; ZCKPT_READ_HINTS=0 turns it off
    maps      with ZCKPT_MAP_WRITES=1, a job is read or cast straight into a shared map of its file
              (zckpt.engine.mapped), where the file allows it; otherwise written by ``Worker.write``
    fork      where some files need numpy for their casts and it is not imported yet, the files that are only
              copied are written by a forked child meanwhile (zckpt.engine.forked), the rest here after the import
    finish    a file whose last job (and tee) is done: ``done(target, fd)`` (its headers), fsync when durable,
              closed

Remote sources keep one file at a time through :func:`zckpt.engine.executor.run_jobs`, which fetches the byte
ranges of the jobs ahead in windows (the network, not a file's lock, is their limit). No torch, no numpy.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Iterator

from zckpt.engine import executor, forked, mapped, readahead, tees
from zckpt.io import allocation
from zckpt.io.hashing import crc32_combine

# Files written at once by one process (at most): ZCKPT_FILES_AT_ONCE.
FILES_AT_ONCE = executor.env_int("ZCKPT_FILES_AT_ONCE", 16)


@dataclass
class Target:
    """One output file's jobs for this process: ``key`` (the caller's file index), ``path``, ``jobs`` ``(slot,
    offset, parts, dtype)`` (``slot`` < 0: no CRC wanted); ``size``: create the file at this size first (None: it
    exists at its size already); ``writers``: the processes writing into it (they share its write slots)."""

    key: int
    path: str
    jobs: list
    size: int | None = None
    writers: int = 1
    fd: int | None = field(default=None, repr=False)
    left: int = field(default=0, repr=False)
    slots: threading.Semaphore | None = field(default=None, repr=False)
    crcs: dict = field(default_factory=dict, repr=False)  # slot -> (crc, length) of its bytes, once finished
    users: int = field(default=0, repr=False)  # jobs writing into ``fd`` now
    tee_in: int = 0  # other files' cast jobs that also write into this one (zckpt.engine.tees)
    crc_parts: dict = field(default_factory=dict, repr=False)  # slot -> [(offset, crc, length)] written so far
    map: memoryview | None = field(default=None, repr=False)  # the file mapped for writing (zckpt.engine.mapped)


def create(path: str, size: int) -> None:
    """A new file ``path`` at its final ``size`` (allocated where the filesystem can:
    :func:`zckpt.io.allocation.allocate`)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # less the umask, as open() gives
    try:
        allocation.allocate(fd, size)
    finally:
        os.close(fd)


def _deal(targets: list[Target], lanes: int) -> Iterator[tuple[Target, tuple]]:
    """``(target, job)`` pairs, each file's jobs in order, up to ``lanes`` files open at a time (the files of most
    jobs first), paced: the next job is the open file's that is furthest behind by the share of its jobs dealt (a
    file opened later starts level with the others), so files opened together are dealt their last jobs together.
    Dealt round-robin, a file of 2 GB among files of 1.5 GB was written alone at the end, at one inode's rate."""
    waiting = deque(sorted((t for t in targets if t.jobs), key=lambda t: -len(t.jobs)))
    active: list = []  # heap of [share dealt, order opened, target, next job]
    opened = 0
    level = 0.0
    while waiting or active:
        while len(active) < lanes and waiting:
            heapq.heappush(active, [level, opened, waiting.popleft(), 0])
            opened += 1
        lane = heapq.heappop(active)
        level = lane[0]
        t, i = lane[2], lane[3]
        yield t, t.jobs[i]
        lane[0] += 1 / len(t.jobs)
        lane[3] = i + 1
        if lane[3] < len(t.jobs):
            heapq.heappush(active, lane)


def stop_pool(pool) -> None:
    """``pool.shutdown()`` with its idle threads woken at once: a ThreadPoolExecutor wakes them one after another
    (each exiting thread wakes the next), 0.3-0.4 ms a thread on the lent host, 4-5 ms for 12 threads between the
    last job and the rest of a merge (benchmarks/timeline_merge.py; docs/benchmarks.md, issue 49)."""
    pool.shutdown(wait=False)
    work, threads = getattr(pool, "_work_queue", None), getattr(pool, "_threads", ())
    if work is not None:
        for _ in range(len(threads)):  # (work still queued after a failure runs first, as before)
            work.put(None)
    pool.shutdown(wait=True)


def _remote(targets: list[Target]) -> bool:
    """Whether the sources are behind URLs (the first piece of each file's first job says: one plan reads one
    checkpoint). Only the schedule depends on it: a remote piece on the local path is still read, unprefetched."""
    for t in targets:
        if t.jobs and any(True for _ in executor.remote_ranges(t.jobs[0][2])):
            return True
    return False


def write_files(targets: list[Target], pool, worker: executor.Worker, crc_of=None, *, lanes: int | None = None,
                durable: bool = False, progress: Callable[[int], None] | None = None,
                done: Callable[[Target, int], None] | None = None, closed: Callable[[Target], None] | None = None,
                after_job: Callable[[], None] | None = None) -> dict[tuple[int, int], tuple[int, int]]:
    """Write every target's jobs with ``worker`` on ``pool``; returns ``{(key, slot): (crc, length)}`` of the
    bytes written (each slot's parts combined in file order; also ``target.crcs``). ``crc_of``: the sources' CRCs
    for kernel copies (:meth:`zckpt.engine.torchzip.SourceMaps.crc`). ``done(target, fd)``: a file's jobs are all
    written (write its headers; the bytes it returns are reported to ``progress``); then it is fsynced when
    ``durable`` (on a side thread, while the next files are written) and closed, and ``closed(target)`` is called.
    ``progress(n)``, ``after_job()``: after each job.

    Where some files need numpy for their casts and numpy is not imported yet, the files that are only copied are
    written by a forked child meanwhile (:mod:`zckpt.engine.forked`): the same jobs, headers and checks."""
    remote = _remote(targets)
    apart = forked.split(targets, worker, remote) if pool is not None else None
    if apart is not None:  # the files it only copies written by a forked child while this one imports numpy

        def write(part, part_pool, step, part_closed, part_after_job):
            return _write_files(part, part_pool, worker, crc_of, lanes, durable, step, done, part_closed,
                                part_after_job, remote)
        return forked.write_apart(*apart, write, getattr(pool, "_max_workers", 1), worker,
                                  getattr(worker, "check", None), progress, closed, after_job)
    return _write_files(targets, pool, worker, crc_of, lanes, durable, progress, done, closed, after_job, remote)


def _write_files(targets: list[Target], pool, worker, crc_of, lanes: int | None, durable: bool, progress, done,
                 closed, after_job, remote: bool) -> dict[tuple[int, int], tuple[int, int]]:
    workers = getattr(pool, "_max_workers", 1) if pool is not None else 1
    lanes = max(1, lanes or FILES_AT_ONCE)
    opening = threading.Lock()  # guards every target's fd, users and the abort flag
    aborted = [False]
    syncing: list = []
    importing = time.perf_counter()
    worker.prepare((parts, dtype) for t in targets for _, _, parts, dtype in t.jobs)  # the casts' imports, first
    began = time.perf_counter()
    for t in targets:
        t.left, t.crcs, t.crc_parts, t.users = len(t.jobs) + t.tee_in, {}, {}, 0
        t.slots = threading.BoundedSemaphore(max(1, executor.WRITE_STREAMS // max(1, t.writers)))

    mode = os.O_RDWR if mapped.MAP_WRITES else os.O_WRONLY  # (a writable shared map needs the file readable)

    def fd_of(t: Target) -> int:  # (holding ``opening``)
        if t.fd is None:
            if t.size is not None:
                executor.test_delay()
                fd = os.open(t.path, mode | os.O_CREAT | os.O_TRUNC, 0o666)  # less the umask
                try:
                    allocation.allocate(fd, t.size)
                except BaseException:
                    os.close(fd)
                    raise
                t.fd = fd
            else:
                t.fd = os.open(t.path, mode)
            if t.jobs:
                t.map = mapped.open_map(t.fd)
        return t.fd

    def use(t: Target) -> int:
        with opening:
            if aborted[0]:  # a job that started after a failure: it writes nothing
                raise InterruptedError("writing stopped")
            fd = fd_of(t)
            t.users += 1
        return fd

    def release(t: Target) -> None:
        with opening:
            t.users -= 1
            if aborted[0] and not t.users and t.fd is not None:  # the last writer of a failed run closes it
                os.close(t.fd)
                t.fd = None
                view, t.map = t.map, None
                mapped.close_map(view)

    def run(item):
        t, (slot, off, parts, dtype) = item
        fd = use(t)
        try:
            if len(parts) == 1 and isinstance(parts[0], tees.SharedCast):
                return tees.write_shared(worker, fd, off, parts[0], dtype, slot >= 0, t.slots, use, release)
            if t.map is not None:
                got = mapped.write(worker, t.map, off, parts, dtype, slot >= 0)
                if got is not None:
                    return got, ()
            return worker.write(fd, off, parts, dtype, crc_of=crc_of, want_crc=slot >= 0, slots=t.slots), ()
        finally:
            release(t)

    def finish(t: Target) -> None:  # every job of ``t`` has been taken: no writer left
        for slot, got in t.crc_parts.items():  # each slot's CRC-32 parts in file order
            crc, length = 0, 0
            for _, c, n in sorted(got, key=lambda g: g[0]):
                crc, length = (crc32_combine(crc, c, n) if length else c), length + n
            t.crcs[slot] = (crc, length)
        with opening:
            fd = fd_of(t)
            t.fd = None
            view, t.map = t.map, None
        mapped.close_map(view)  # (its pages are the file's: the headers below and fsync see them)
        try:
            wrote = done(t, fd) if done is not None else None
            if wrote and progress:
                progress(wrote)
        except BaseException:
            os.close(fd)
            raise
        if durable:  # flushed on a side thread while the next files are written
            syncing.append(syncer.submit(_close, fd, True, t, closed))
        else:
            _close(fd, False, t, closed)

    def took(item, result) -> None:
        t, job = item
        (crc, n), teed = result
        if job[0] >= 0:
            t.crc_parts.setdefault(job[0], []).append((job[1], crc, n))
        for tee, c in teed:
            if tee.slot >= 0:
                tee.target.crc_parts.setdefault(tee.slot, []).append((tee.offset, c, tee.nbytes))
            n += tee.nbytes
        if progress:
            progress(n)
        if after_job:
            after_job()
        for u in (t, *(tee.target for tee, _ in teed)):
            u.left -= 1
            if u.left == 0:
                finish(u)

    syncer = ThreadPoolExecutor(1, thread_name_prefix="zckpt-fsync") if durable else None
    try:
        for t in targets:  # files without a job of this process's: created (or opened) and finished first
            if not t.left:
                finish(t)
        if pool is not None and not remote:
            fd_of_source = getattr(getattr(worker, "reader", None), "fd", None)
            dealt = _deal(targets, lanes)
            if fd_of_source is not None:  # the kernel reads each job's inputs as it is queued (page cache cold)
                dealt = readahead.hinted(dealt, lambda it: it[1][2], fd_of_source)
            _run_ordered(pool, run, dealt, took, ahead=4 * workers)
        else:  # one file at a time; remote ranges fetched ahead (run_jobs' windows)
            for t in targets:
                if t.jobs:
                    items = [(t, job) for job in t.jobs]
                    with contextlib.closing(executor.run_jobs(pool, run, items, worker,
                                                              parts_of=lambda it: it[1][2])) as results:
                        for item, result in zip(items, results):
                            took(item, result)
        for fut in syncing:  # every file on disk (when durable) before the caller publishes
            fut.result()
        stats = getattr(worker, "stats", None)  # (a test's stand-in worker may keep none)
        if stats is not None:
            stats.imports_seconds += began - importing
            stats.write_seconds += time.perf_counter() - began
    finally:
        if syncer is not None:
            syncer.shutdown(wait=True)
        with opening:  # a failure: the files still open are closed now, or by their last writer
            aborted[0] = True
            for t in targets:
                if t.fd is not None and not t.users:
                    with contextlib.suppress(OSError):
                        os.close(t.fd)
                    t.fd = None
                if not t.users:
                    view, t.map = t.map, None
                    mapped.close_map(view)
    return {(t.key, slot): v for t in targets for slot, v in t.crcs.items()}


def _close(fd: int, sync: bool, t: Target, closed) -> None:
    try:
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    if closed is not None:
        closed(t)


def _run_ordered(pool, fn, items, took, ahead: int) -> None:
    """``took(item, fn(item))`` for every item, in order, with at most ``ahead`` items submitted to ``pool`` and
    not yet taken. On a failure, every job still in flight is waited for."""
    pending: deque = deque()
    try:
        for item in items:
            pending.append((item, pool.submit(fn, item)))
            while len(pending) >= ahead or (pending and pending[0][1].done()):
                it, fut = pending.popleft()
                took(it, fut.result())
        while pending:
            it, fut = pending.popleft()
            took(it, fut.result())
    finally:
        for _, fut in pending:
            fut.cancel()
        wait([fut for _, fut in pending])
