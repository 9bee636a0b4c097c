"""Input bytes read once for every output that needs them: a cast job also writes its source bytes where a plain
copy of the same bytes was planned.

``convert --to deepspeed`` writes each fp32 master twice: copied into its rank's optimizer file, and cast to bf16
into the model states. Planned apart, both jobs read it (3.8 GB of the 15 GB a 1B-parameter convert reads, and their
CRC-32s). :func:`share_reads` finds, among one process's :class:`zckpt.engine.lanes.Target` jobs, every cast job
(one :class:`Cast` of local pieces) whose source bytes some plain copy also reads, and makes the cast job write
them there too::

    cast job   [Cast(pieces)]         -> [SharedCast(pieces cut where the copies start and end, tees)]
    copy job   [Piece, Piece, ...]    -> the same job less the bytes a tee writes (cut into the runs left)
    Tee        (target, slot, offset, first, count, start, nbytes): pieces first..first+count of the cast's
               source bytes (bytes start..start+nbytes of its read buffer) written at ``offset`` of ``target``

:func:`write_shared` carries out a SharedCast job: each piece read once (its CRC-32 reported to the input check,
and reused as the copy's CRC: the bytes are the same), cast and written, then every tee written from the same
buffer under its file's write slots. :mod:`zckpt.engine.lanes` counts a target's tees among its jobs (a file is
finished when both are done) and combines each slot's CRC-32 parts in file order, wherever they were written.

Off by default (``ZCKPT_SHARE_READS=1`` turns it on). On the lent 16-core host it first made convert --to deepspeed
37% slower (0.85 -> 1.16 s, best of 3; docs/benchmarks.md, issue 49, sixth session): the pwrites' thread time
doubled. In plan order each tee goes to the optimizer file of the rank whose masters the cast jobs are at, so the
threads of every cast in flight piled onto one file's inode lock beside that file's own copies. Since then a cast
target's jobs are dealt in turn by the file their tees write into (:func:`_interleaved`), and the tees no longer
lose (eighth session): the writing took 0.876-0.886 s against 0.924-0.964 s in three profiled runs each (run second
in each round, a place that lent merge bf16 about 4% in an A/A control), the threads' time 10.3 s against 10.8-11.2;
whole jobs, best of 5, 0.887 s against 0.871 (medians 0.927 and 0.921). That is within the host's spread, so
sharing stays opt-in.

Only one process's targets share (a launcher's ranks split each file by byte ranges and combine their CRCs so);
pieces behind URLs never do (their bytes are fetched ahead in windows). Output bytes are the same either way.
"""

from __future__ import annotations

import bisect
import os
import threading
from typing import Callable

from zckpt.encoding.safeload import DTYPE_SIZES
from zckpt.engine.executor import dealt_in_turn, pwrite_all
from zckpt.engine.segments import Cast, Fill, Piece
from zckpt.io import storage
from zckpt.io.hashing import crc32, crc32_combine

SHARE_READS = os.environ.get("ZCKPT_SHARE_READS", "0") == "1"


class Tee:
    """Bytes ``start``..``start + nbytes`` of a cast job's source (its pieces ``first``..``first + count``),
    written at ``offset`` of ``target`` (a :class:`zckpt.engine.lanes.Target`) into CRC ``slot`` (< 0: none).
    (Plain classes here, not dataclasses: every command imports this module, and each dataclass costs its import
    half a millisecond or more.)"""

    __slots__ = ("target", "slot", "offset", "first", "count", "start", "nbytes")

    def __init__(self, target, slot: int, offset: int, first: int, count: int, start: int, nbytes: int):
        self.target, self.slot, self.offset = target, slot, offset
        self.first, self.count, self.start, self.nbytes = first, count, start, nbytes

    def __repr__(self) -> str:
        return f"Tee({getattr(self.target, 'path', self.target)!r}, slot {self.slot}, at {self.offset}, " \
               f"{self.nbytes} bytes)"


class SharedCast(Cast):
    """A :class:`Cast` whose source bytes are also written, as they are, by its ``tees``."""

    def __init__(self, pieces: list, src_dtype: str, tees: list):
        super().__init__(pieces, src_dtype)
        self.tees = tees


class _Copy:
    """A plain copy's piece: its source bytes [lo, hi) of ``path`` land at ``out`` of job ``j`` of ``target``;
    ``taken``: the source ranges [lo, hi) a tee writes."""

    __slots__ = ("lo", "hi", "target", "j", "out", "dtype", "taken")

    def __init__(self, lo: int, hi: int, target, j: int, out: int, dtype: str):
        self.lo, self.hi, self.target, self.j, self.out, self.dtype, self.taken = lo, hi, target, j, out, dtype, []


def _copies(targets: list) -> dict[str, tuple[list[int], list[_Copy], list[int]]]:
    """Every plain copy's local pieces by source path: (sorted starts, copies, the furthest end up to each)."""
    by_path: dict[str, list[_Copy]] = {}
    for t in targets:
        for j, (_, off, parts, dtype) in enumerate(t.jobs):
            if not all(isinstance(p, (bytes, bytearray, Fill)) or type(p) is Piece for p in parts):
                continue  # a job that casts is no plain copy
            pos = off
            for p in parts:
                n = len(p) if isinstance(p, (bytes, bytearray)) else p.nbytes
                if type(p) is Piece and p.dtype == dtype and n and not storage.is_url(p.path):
                    by_path.setdefault(p.path, []).append(_Copy(p.offset, p.offset + n, t, j, pos, dtype))
                pos += n
    out = {}
    for path, cs in by_path.items():
        cs.sort(key=lambda c: c.lo)
        ends, furthest = [], 0
        for c in cs:
            furthest = max(furthest, c.hi)
            ends.append(furthest)
        out[path] = ([c.lo for c in cs], cs, ends)
    return out


def _overlaps(index, lo: int, hi: int) -> list[_Copy]:
    """The copies whose source bytes meet [lo, hi)."""
    starts, cs, ends = index
    i = bisect.bisect_left(starts, hi)
    found = []
    while i > 0 and ends[i - 1] > lo:  # (no copy at or before i - 1 ends after lo otherwise)
        i -= 1
        if cs[i].hi > lo:
            found.append(cs[i])
    return found


def _free(c: _Copy, lo: int, hi: int) -> bool:
    return all(hi <= a or b <= lo for a, b in c.taken)


def share_reads(targets: list) -> int:
    """Make the cast jobs of ``targets`` write the bytes plain copies would read again (above); returns the
    bytes now read once instead of twice. Jobs are rewritten in place; ``target.tee_in`` counts the tees that
    write into each target."""
    for t in targets:
        t.tee_in = 0
    casts = [(t, j) for t in targets for j, (_, _, parts, dtype) in enumerate(t.jobs)
             if len(parts) == 1 and type(parts[0]) is Cast and parts[0].src_dtype != dtype]
    index = _copies(targets) if casts else None
    if not index:
        return 0
    shared = 0
    for t, j in casts:
        slot, off, parts, dtype = t.jobs[j]
        cast = parts[0]
        pieces, tees, raw = [], [], 0
        for q in cast.pieces:
            size = DTYPE_SIZES[q.dtype]
            cuts = []
            if q.path in index and not storage.is_url(q.path):
                for c in sorted(_overlaps(index[q.path], q.offset, q.offset + q.nbytes), key=lambda c: c.lo):
                    lo, hi = max(c.lo, q.offset), min(c.hi, q.offset + q.nbytes)
                    if c.dtype == q.dtype and (lo - q.offset) % size == 0 and (lo - c.lo) % size == 0 \
                            and (hi - lo) % size == 0 \
                            and _free(c, lo, hi) and (not cuts or cuts[-1][1] <= lo):
                        c.taken.append((lo, hi))  # (a copy of bytes another copy also reads: one of them)
                        cuts.append((lo, hi, c))
            pos = q.offset
            for lo, hi, c in cuts + [(q.offset + q.nbytes, None, None)]:
                if lo > pos:  # read for the cast alone
                    pieces.append(Piece(q.path, pos, (lo - pos) // size, q.dtype))
                    raw += lo - pos
                if c is None:
                    break
                tee_slot = c.target.jobs[c.j][0]
                last = tees[-1] if tees else None
                if last is not None and last.target is c.target and last.slot == tee_slot \
                        and last.offset + last.nbytes == c.out + lo - c.lo and last.first + last.count == len(pieces):
                    last.count += 1
                    last.nbytes += hi - lo
                else:
                    tees.append(Tee(c.target, tee_slot, c.out + lo - c.lo, len(pieces), 1, raw, hi - lo))
                pieces.append(Piece(q.path, lo, (hi - lo) // size, q.dtype))
                raw += hi - lo
                shared += hi - lo
                pos = hi
        if tees:
            t.jobs[j] = (slot, off, [SharedCast(pieces, cast.src_dtype, tees)], dtype)
            for tee in tees:
                tee.target.tee_in += 1
    if shared:
        _cut_copies(index)
        for t in {id(t): t for t, _ in casts}.values():
            t.jobs = _interleaved(t.jobs)
    return shared


def _interleaved(jobs: list) -> list:
    """A cast target's jobs dealt in turn by the file their first tee writes into (each file's in their order):
    in plan order the casts in flight would all tee into the optimizer file of one rank, queueing on its inode
    lock. (The order of one target's jobs is free: lanes combines each slot's CRC-32 parts by offset.)"""
    def tee_file(job):
        parts = job[2]
        return id(parts[0].tees[0].target) if len(parts) == 1 and isinstance(parts[0], SharedCast) else None
    return dealt_in_turn(jobs, tee_file)


def _cut_copies(index) -> None:
    """The copy jobs less the bytes their tees write: each job cut into the runs of bytes left (in file order)."""
    taken: dict[int, tuple] = {}
    for _, cs, _ in index.values():
        for c in cs:
            if c.taken:
                taken.setdefault(id(c.target), (c.target, {}))[1].setdefault(c.j, []).extend(
                    (c.out + a - c.lo, c.out + b - c.lo) for a, b in c.taken)
    for t, by_job in taken.values():
        jobs = []
        for j, job in enumerate(t.jobs):
            jobs.extend(_cut_job(job, sorted(by_job[j])) if j in by_job else [job])
        t.jobs = jobs


def _cut_job(job: tuple, holes: list[tuple[int, int]]) -> list[tuple]:
    """``job`` without the output byte ranges ``holes`` (sorted, within its plain pieces): the jobs left."""
    slot, off, parts, dtype = job
    out, run, run_at, pos = [], [], off, off
    h = 0
    for p in parts:
        n = len(p) if isinstance(p, (bytes, bytearray)) else p.nbytes
        end, cur = pos + n, pos
        while h < len(holes) and holes[h][0] < end:
            a, b = holes[h]
            if a > cur:  # the bytes before the hole: kept
                run.append(_part(p, cur - pos, a - cur, dtype))
            if run:
                out.append((slot, run_at, run, dtype))
            run, cur, run_at = [], b, b
            h += 1
        if cur < end:
            if not run:
                run_at = cur
            run.append(p if cur == pos else _part(p, cur - pos, end - cur, dtype))
        pos = end
    if run:
        out.append((slot, run_at, run, dtype))
    return out


def _part(p, start: int, n: int, dtype: str):
    """Bytes ``start``..``start + n`` of a plain part (holes only ever fall in pieces)."""
    if isinstance(p, Piece):
        return Piece(p.path, p.offset + start, n // DTYPE_SIZES[p.dtype], p.dtype)
    if isinstance(p, Fill):
        return Fill(n // DTYPE_SIZES[p.dtype], p.dtype)
    return p[start:start + n]


def write_shared(worker, fd: int, offset: int, part: SharedCast, dtype: str, want_crc: bool,
                 slots: threading.Semaphore, open_target: Callable[[object], int],
                 release: Callable[[object], None]) -> tuple[tuple[int, int], list[tuple[Tee, int]]]:
    """Write a SharedCast job: its pieces read once into the worker's buffer (each CRC-32 reported to the input
    check), cast and written at ``offset`` of ``fd``, then each tee written from the same bytes (``open_target``
    gives a tee's file descriptor, ``release`` gives it back). Returns ((CRC-32 or 0, bytes) of the cast job,
    [(tee, CRC-32 of its bytes)])."""
    src = DTYPE_SIZES[part.src_dtype]
    raw = worker.buffer(part.numel * src)
    crcs, pos = [], 0
    check = worker.check
    for p in part.pieces:
        n = p.nbytes
        c = worker.reader.read_crc(p, raw[pos:pos + n])
        if check is not None:
            check.add_crc(p.path, p.offset, n, c)
        crcs.append(c)
        pos += n
    data = memoryview(worker.cast_raw(raw, part.src_dtype, dtype)).cast("B")  # (raw left as it is, for the tees)
    with slots:
        pwrite_all(fd, data, offset)
    main = (crc32(data) if want_crc else 0, data.nbytes)
    done = []
    for tee in part.tees:
        t = tee.target
        tfd = open_target(t)
        try:
            with t.slots:
                pwrite_all(tfd, raw[tee.start:tee.start + tee.nbytes], tee.offset)
        finally:
            release(t)
        crc = 0
        if tee.slot >= 0:
            for i in range(tee.first, tee.first + tee.count):
                crc = crc32_combine(crc, crcs[i], part.pieces[i].nbytes) if i > tee.first else crcs[i]
        done.append((tee, crc))
    return main, done
