"""The one byte-moving engine: output byte ranges described by segments, written by one worker.

Every file zckpt writes (a safetensors shard, a torch ``.bin``, a DeepSpeed rank file) is planned as byte ranges
of the output, each a list of segments::

    Piece(path, offset, numel, dtype)   bytes of an input file (a slice of a rank file's tensor)
    Fill(numel, dtype)                  zeros (partition padding)
    Cast(pieces, src_dtype)             input bytes converted to the output dtype (torch's rounding)
    bytes                               literal bytes (headers, pickles)

and carried out the same way::

    segments --chunks()--> (byte offset, parts) jobs of <= CHUNK_BYTES --Worker.write()-->
        same-dtype local pieces and zero fill: copy_file_range, in the kernel (no bytes through Python)
        anything else (casts, URLs, no copy_file_range): read into the thread's buffer, convert, pwrite

Memory is bounded: a few CHUNK_BYTES buffers per worker thread, whatever the model size. Writes into one file take
one of its ``WRITE_STREAMS`` slots, the jobs of several files dealt in turn (:mod:`zckpt.engine.lanes`); reads and
casts stay parallel. No torch or numpy import here (casts import numpy on first use: :mod:`zckpt.encoding.casting`).
"""

from __future__ import annotations

import bisect
import heapq
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator

from zckpt.io import storage
from zckpt.engine.checked import InputCheck
from zckpt.engine.segments import Cast, Fill, Piece, seg_numel, slice_segments
from zckpt.encoding.safeload import DTYPE_SIZES
from zckpt.io.hashing import crc32, crc32_combine


def env_int(name: str, default: int) -> int:
    """A positive integer from the environment; anything else (unset, empty, not a number) is ``default``."""
    try:
        return max(1, int(os.environ.get(name, "")))
    except ValueError:
        return default


CHUNK_BYTES = env_int("ZCKPT_CHUNK_KIB", 4096) << 10  # per job (4 MiB); memory: ~3 buffers of it per thread
# Writes into one output file (in-kernel copies and pwrites of cast chunks) take one of WRITE_STREAMS slots: the
# most threads, of all processes together, writing into one file at a time. On the lent 16-core host's ext4 (Linux
# 6.18) one file takes about 3.5-4 GB/s whatever the number of writers, but 8 of them beat 1 (single-process
# merge of a 3.8 GB file: 0.93 s against 1.12 s) and 16 lose to 4 (four ranks into that file: 1.30 s against
# 0.90 s); docs/benchmarks.md, "At the copy limit". A launcher's rank divides them by the ranks sharing the file
# (``zckpt.engine.lanes.Target.writers``). Reads and casts, which need the CPU, use the whole pool; and since one
# file is the limit, several files are written at once (zckpt.engine.lanes).
WRITE_STREAMS = env_int("ZCKPT_WRITE_STREAMS", 8)
_ZEROS = bytes(1 << 20)
# Remote sources (s3://, ...): the byte ranges of the next PREFETCH_BYTES of jobs are fetched ahead, coalesced into
# ranged GETs of at most MAX_REQUEST_BYTES, REQUESTS_IN_FLIGHT at a time (PREFETCH_BYTES in memory at most).
PREFETCH_BYTES = 256 << 20
FIRST_WINDOW_BYTES = 8 << 20  # the first window is small (writing starts soon), later ones double
WINDOWS_AHEAD = 4  # windows of at most PREFETCH_BYTES / WINDOWS_AHEAD
MAX_REQUEST_BYTES = 16 << 20
MIN_REQUEST_BYTES = 1 << 20
REQUEST_GAP_BYTES = 256 << 10  # ranges of one file closer than this are read in one request (the gap is read too)
REQUESTS_IN_FLIGHT = 16


def dealt_in_turn(items: list, key: Callable) -> list:
    """``items`` grouped by ``key(item)`` and dealt from the groups in turn, in proportion to their sizes, each
    group's items in their order (``items`` itself when all share one key): long runs of one key come out mixed."""
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    if len(groups) < 2:
        return items
    heap = [(0.0, k, q, 0) for k, q in enumerate(groups.values())]  # (share dealt, order, items, next)
    out = []
    while heap:
        _, k, q, i = heapq.heappop(heap)
        out.append(q[i])
        if i + 1 < len(q):
            heapq.heappush(heap, ((i + 1) / len(q), k, q, i + 1))
    return out


def zeros_crc(n: int, crc: int = 0) -> int:
    """CRC-32 of ``n`` zero bytes following ``crc``."""
    while n:
        k = min(n, len(_ZEROS))
        crc = crc32(memoryview(_ZEROS)[:k], crc)
        n -= k
    return crc


# ---------------------------------------------------------------------------------------------- chunker

def chunks(segments: list, dtype: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, list]]:
    """Split one output tensor's segments into jobs of at most ``chunk_bytes``: (byte offset in the tensor, parts)."""
    size = DTYPE_SIZES[dtype]
    per = max(1, chunk_bytes // max(size, 4))
    pos = 0
    cur, cur_n, cur_start = [], 0, 0
    for seg in segments:
        if isinstance(seg, (bytes, bytearray)):
            parts = [seg]
        else:
            n = seg_numel(seg, dtype)
            if 0 < n <= per and isinstance(seg, Piece):  # a whole (immutable) piece: nothing to slice
                parts = [seg]
            elif type(seg) is Piece:  # (the common long piece: its slices by arithmetic, slice_segments' result)
                at = DTYPE_SIZES[seg.dtype]
                parts = [Piece(seg.path, seg.offset + s * at, min(per, n - s), seg.dtype) for s in range(0, n, per)]
            elif type(seg) is Cast and len(seg.pieces) == 1 and type(seg.pieces[0]) is Piece:  # (one long cast)
                p0 = seg.pieces[0]
                at = DTYPE_SIZES[p0.dtype]
                parts = [Cast([Piece(p0.path, p0.offset + s * at, min(per, n - s), p0.dtype)], seg.src_dtype)
                         for s in range(0, n, per)]
            else:
                parts = [p for s in range(0, n, per) for p in slice_segments([seg], s, min(per, n - s))] if n else []
        for part in parts:
            pn = seg_numel(part, dtype)
            if cur and cur_n + pn > per:
                yield cur_start, cur
                cur, cur_n, cur_start = [], 0, pos
            cur.append(part)
            cur_n += pn
            pos += pn * size
    if cur:
        yield cur_start, cur


# ---------------------------------------------------------------------------------------------- worker

def pwrite_all(fd: int, data, offset: int) -> None:
    data = memoryview(data)
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def pwrite_pieces(fd: int, pieces: Iterable[tuple[int, bytes]], base: int = 0) -> None:
    """Write ``(offset, bytes)`` pieces at ``base + offset``, each run of pieces that follow one another as one
    pwrite (the small records of a file of many torch zips: a DCP file of 651 is 13 pieces each, 2 runs)."""
    run: list = []
    start = end = 0
    for off, data in sorted(pieces, key=lambda p: p[0]):
        if run and off == end:
            run.append(data)
        else:
            if run:
                pwrite_all(fd, b"".join(run), base + start)
            run, start, end = [data], off, off
        end += len(data)
    if run:
        pwrite_all(fd, b"".join(run), base + start)


def test_delay() -> None:
    """Fault-injection hook for the crash tests: ZCKPT_TEST_SLOW_WRITE=seconds pauses before each file."""
    delay = os.environ.get("ZCKPT_TEST_SLOW_WRITE")
    if delay:
        time.sleep(float(delay))


class _NoKernelCopy(Exception):
    """copy_file_range cannot do this chunk (unsupported here, or EOF of a truncated input): render it instead."""


class Worker:
    """Writes jobs with one reusable buffer per thread; casts via :mod:`zckpt.encoding.casting` (no torch needed).

    Plain copies need neither numpy nor torch, and neither do small bf16 -> fp32 casts (``pure_upcast``: frozen
    weights and buffers of a bf16 run merged to fp32); other casts import numpy (50-150 ms), before the threads start
    (:meth:`prepare`)."""

    def __init__(self, pure_upcast: bool = False, reader=None, storage_options: dict | None = None,
                 check: InputCheck | None = None):
        from zckpt.encoding.tensors import Reader
        # pieces whose path is a URL are read with ``storage_options`` (the checkpoint's: ``ckpt.storage_options``)
        self.reader = reader or Reader(storage_options)
        # every input byte read is reported to ``check`` (its zip entry's CRC-32 checked before publishing)
        self.check = check
        self.reader.check = check
        self.storage_options = storage_options if storage_options is not None else \
            getattr(self.reader, "storage_options", None)
        self.stats = FetchStats()
        self._fetcher: ThreadPoolExecutor | None = None
        self.local = threading.local()
        self.use_cfr = hasattr(os, "copy_file_range")
        self.use_torch = "torch" in sys.modules  # a trainer process: torch's kernels are already loaded
        self.write_slots = threading.BoundedSemaphore(WRITE_STREAMS)
        self.pure_upcast = pure_upcast

    def buffer(self, nbytes: int, slot: str = "buf") -> memoryview:
        buf = getattr(self.local, slot, None)
        if buf is None or len(buf) < nbytes:
            buf = bytearray(max(nbytes, 1 << 20))
            setattr(self.local, slot, buf)
        return memoryview(buf)[:nbytes]

    def render_cast(self, pieces: list[Piece], src_dtype: str, dtype: str, numel: int, out=None):
        """The bytes of ``pieces`` converted to ``dtype`` (a buffer-protocol object with ``nbytes``); ``out``: the
        place in a job's output buffer they go (numpy's and torch's casts write there, no copy after)."""
        raw = self.buffer(numel * DTYPE_SIZES[src_dtype])
        self.reader.read_pieces(pieces, raw)
        return self.cast_raw(raw, src_dtype, dtype, out)

    def cast_raw(self, raw, src_dtype: str, dtype: str, out=None):
        """:meth:`render_cast` of bytes already read (``raw``, this thread's buffer; left as it is)."""
        from zckpt.encoding import casting  # (imports no numpy itself: a cast does, on first use)
        if src_dtype == dtype:
            data = raw
        elif self.pure_upcast and src_dtype == "bfloat16" and dtype == "float32":
            data = casting.upcast_bf16_pure(raw)
        else:
            return casting.cast(raw, src_dtype, dtype, self.use_torch, out=out)  # (in ``out`` when given)
        if out is not None:
            out[:] = memoryview(data).cast("B")
            return out
        return data

    def render(self, parts: list, dtype: str):
        """The output bytes of a job's parts, in this thread's buffers."""
        if len(parts) == 1 and isinstance(parts[0], Cast):  # the common cast job: no extra copy
            p = parts[0]
            return memoryview(self.render_cast(p.pieces, p.src_dtype, dtype, p.numel)).cast("B")
        total = sum(seg_numel(p, dtype) for p in parts) * DTYPE_SIZES[dtype]
        view = self.buffer(total, "out")
        pos = 0
        for p in parts:
            if isinstance(p, (bytes, bytearray)):
                view[pos:pos + len(p)] = p
                pos += len(p)
            elif isinstance(p, Fill):
                view[pos:pos + p.nbytes] = bytes(p.nbytes)
                pos += p.nbytes
            elif isinstance(p, Piece):
                if p.dtype != dtype:
                    raise ValueError(f"piece of {p.dtype} in a {dtype} tensor")
                self.reader.read_into(p, view[pos:pos + p.nbytes])
                pos += p.nbytes
            else:  # Cast: into its place in the job's buffer
                n = p.numel * DTYPE_SIZES[dtype]
                self.render_cast(p.pieces, p.src_dtype, dtype, p.numel, view[pos:pos + n])
                pos += n
        return view[:pos]

    def cast_needs(self, jobs: Iterable[tuple[list, str]]) -> tuple[set, int]:
        """The imports the casts among ``jobs`` ((parts, dtype) pairs) need: their (src, dst) dtype pairs and the
        fp32 bytes of their fp32 -> bf16 down-casts; nothing when there are none, or only the small pure upcasts, or
        torch casts (imported already)."""
        pairs, bf16 = set(), 0
        for parts, dtype in jobs:
            for p in parts:
                if isinstance(p, Cast):
                    pairs.add((p.src_dtype, dtype))
                    if (p.src_dtype, dtype) == ("float32", "bfloat16"):
                        bf16 += p.numel * 4
        if self.use_torch or (self.pure_upcast and pairs <= {("bfloat16", "float32")}):
            return set(), 0
        return pairs, bf16

    def prepare(self, jobs: Iterable[tuple[list, str]]) -> None:
        """Before the threads start: import what the casts among ``jobs`` ((parts, dtype) pairs) need, and decide
        whether their fp32 -> bf16 down-casts use ml_dtypes by their bytes (:func:`zckpt.encoding.casting.prepare`);
        nothing when there are none, or only the small pure upcasts."""
        pairs, bf16 = self.cast_needs(jobs)
        if pairs:
            from zckpt.encoding import casting
            casting.prepare(pairs, bf16)

    def kernel_copyable(self, parts: list, dtype: str) -> bool:
        return self.use_cfr and all(
            isinstance(p, Fill) or (isinstance(p, Piece) and p.dtype == dtype and not storage.is_url(p.path))
            for p in parts)

    def write(self, fd: int, offset: int, parts: list, dtype: str,
              crc_of: Callable[[str, int, int, int], int] | None = None, want_crc: bool = False,
              slots: threading.Semaphore | None = None) -> tuple[int, int]:
        """Write one job at ``offset`` of ``fd``; returns (CRC-32 of the bytes or 0, bytes written).

        ``want_crc``: compute the CRC; for kernel copies it comes from ``crc_of(path, offset, n, crc)`` (the
        caller's read-only maps of the sources), otherwise from the rendered bytes. With an input check, the CRC
        of every source byte is reported to it (kernel copies: from a read-only map, which is then the output's
        CRC too). ``slots``: the write slots of ``fd``'s file (default: this worker's, for one file at a time)."""
        slots = self.write_slots if slots is None else slots
        if self.check is not None and self.kernel_copyable(parts, dtype):
            return self._checked_copy(fd, offset, parts, dtype, want_crc, slots)
        if self.kernel_copyable(parts, dtype) and (crc_of is not None or not want_crc):
            try:
                return self._kernel_copy(fd, offset, parts, crc_of if want_crc else None, slots)
            except _NoKernelCopy:
                pass
        views = self._fetched_views(parts, dtype)
        if views is not None:  # remote bytes fetched ahead: written from the fetched blocks, not copied first
            pos = offset
            with slots:
                for v in views:
                    pwrite_all(fd, v, pos)
                    pos += len(v)
            if self.check is not None:
                self._check_views(parts, views)
            crc = 0
            if want_crc:
                for v in views:
                    crc = crc32(v, crc)
            return crc, pos - offset
        data = self.render(parts, dtype)
        with slots:
            pwrite_all(fd, data, offset)
        return (crc32(data) if want_crc else 0), data.nbytes

    def _checked_copy(self, fd: int, offset: int, parts: list, dtype: str, want_crc: bool,
                      slots: threading.Semaphore) -> tuple[int, int]:
        """Same-dtype local pieces with an input check: read into this thread's buffer, each piece's CRC reported
        to the check (and combined into the output's), written with one pwrite. (In-kernel copies would need a
        second read of the source for its CRC; on the lent host a read-only map of it made the check cost 28% of
        a merge.)"""
        total = sum(p.nbytes for p in parts)
        view = self.buffer(total, "out")
        pos, crc = 0, 0
        for p in parts:
            n = p.nbytes
            if isinstance(p, Fill):
                view[pos:pos + n] = bytes(n) if n > len(_ZEROS) else memoryview(_ZEROS)[:n]
                c = zeros_crc(n) if want_crc else 0
            else:
                c = self.reader.read_crc(p, view[pos:pos + n])
                self.check.add_crc(p.path, p.offset, n, c)
            crc = crc32_combine(crc, c, n) if want_crc else 0
            pos += n
        with slots:
            pwrite_all(fd, view[:total], offset)
        return crc, total

    def _check_views(self, parts: list, views: list[memoryview]) -> None:
        """Report the fetched views of a job's remote pieces (in order) to the input check."""
        it = iter(views)
        for p in parts:
            left, crc = p.nbytes, 0
            while left:
                v = next(it)
                if isinstance(p, Piece):
                    crc = crc32(v, crc)
                left -= len(v)
            if isinstance(p, Piece):
                self.check.add_crc(p.path, p.offset, p.nbytes, crc)

    def _fetched_views(self, parts: list, dtype: str) -> list[memoryview] | None:
        """The job's bytes as views of the blocks fetched ahead (``reader.cache``), when every part is a same-dtype
        remote piece they hold (or zeros); None otherwise (rendered into a buffer instead)."""
        cache = getattr(self.reader, "cache", None)
        if cache is None:
            return None
        views = []
        for p in parts:
            if isinstance(p, Piece) and p.dtype == dtype and storage.is_url(p.path):
                vs = cache.views(p.path, p.offset, p.nbytes)
                if vs is None:
                    return None
                views.extend(vs)
            elif isinstance(p, Fill) and p.nbytes <= len(_ZEROS):
                views.append(memoryview(_ZEROS)[:p.nbytes])
            else:
                return None
        return views

    def _kernel_copy(self, fd_out: int, offset: int, parts: list, crc_of, slots) -> tuple[int, int]:
        pos = offset
        with slots:  # only the copies take a write slot: the CRCs below run in parallel
            for p in parts:
                n = p.nbytes
                if isinstance(p, Fill):
                    left = n
                    while left:
                        k = min(left, len(_ZEROS))
                        pwrite_all(fd_out, memoryview(_ZEROS)[:k], pos + n - left)
                        left -= k
                else:
                    fd_in = self.reader.fd(p.path)
                    src, dst, left = p.offset, pos, n
                    while left:
                        try:
                            got = os.copy_file_range(fd_in, fd_out, left, src, dst)
                        except OSError:
                            self.use_cfr = False  # not supported between these files: user space from now on
                            raise _NoKernelCopy() from None
                        if got <= 0:  # EOF: a truncated input; the read path reports it with the file's name
                            raise _NoKernelCopy()
                        src, dst, left = src + got, dst + got, left - got
                pos += n
        crc = 0
        if crc_of is not None:  # of the sources' bytes (read-only maps), which are what was copied
            for p in parts:
                crc = zeros_crc(p.nbytes, crc) if isinstance(p, Fill) else crc_of(p.path, p.offset, p.nbytes, crc)
        return crc, pos - offset

    def fetcher(self) -> ThreadPoolExecutor:
        """The threads that run this worker's ranged GETs (made on first remote read)."""
        if self._fetcher is None:
            self._fetcher = ThreadPoolExecutor(REQUESTS_IN_FLIGHT, thread_name_prefix="zckpt-get")
        return self._fetcher

    def close(self):
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=True)
            self._fetcher = None
        self.reader.close()


# ---------------------------------------------------------------------------------------------- remote reads

class FetchStats:
    """A worker's remote reads (bytes, ranged GETs, seconds waited), input bytes read once for two outputs, and the
    seconds of its casts' imports and of its writing (what a command's ``seconds`` spend beside planning and
    publishing)."""

    def __init__(self):
        self.bytes = 0
        self.requests = 0
        self.wait_seconds = 0.0
        self.read_once = 0
        self.imports_seconds = 0.0  # the casts' imports (numpy, ml_dtypes), before the writing threads start
        self.write_seconds = 0.0  # from the first job dealt to the last file finished (zckpt.engine.lanes)
        self.lock = threading.Lock()

    def to_json(self) -> dict:
        return {"remote_bytes": self.bytes, "remote_requests": self.requests,
                "remote_wait_seconds": round(self.wait_seconds, 3), "read_once_bytes": self.read_once,
                "imports_seconds": round(self.imports_seconds, 3), "write_seconds": round(self.write_seconds, 3)}


class RangeCache:
    """Fetched byte ranges of remote files, served to the worker's reader (``Reader.cache``) instead of a GET."""

    def __init__(self):
        self.blocks: dict[str, tuple[list[int], list[bytes]]] = {}

    def add(self, path: str, start: int, data: bytes) -> None:
        starts, datas = self.blocks.setdefault(path, ([], []))
        i = bisect.bisect(starts, start)
        starts.insert(i, start)
        datas.insert(i, data)

    def views(self, path: str, offset: int, n: int) -> list[memoryview] | None:
        """The ``n`` bytes at ``offset`` of ``path`` as views of the fetched blocks holding them, or None."""
        have = self.blocks.get(path)
        if not have:
            return None
        starts, datas = have
        i = bisect.bisect(starts, offset) - 1
        out, pos, end = [], offset, offset + n
        while pos < end:
            if i < 0 or i >= len(starts) or not starts[i] <= pos < starts[i] + len(datas[i]):
                return None
            lo = pos - starts[i]
            k = min(end - pos, len(datas[i]) - lo)
            out.append(memoryview(datas[i])[lo:lo + k])
            pos += k
            i += 1
        return out

    def read_into(self, path: str, offset: int, buf: memoryview) -> bool:
        """Fill ``buf`` with the bytes at ``offset`` of ``path`` if they were fetched (from one or more blocks)."""
        have = self.blocks.get(path)
        if not have:
            return False
        starts, datas = have
        i = bisect.bisect(starts, offset) - 1
        pos, n = 0, len(buf)
        while pos < n:
            if i < 0 or i >= len(starts):
                return False
            lo = offset + pos - starts[i]
            if not 0 <= lo < len(datas[i]):
                return False
            k = min(n - pos, len(datas[i]) - lo)
            buf[pos:pos + k] = memoryview(datas[i])[lo:lo + k]
            pos += k
            i += 1
        return True


def input_pieces(parts: list) -> Iterator[Piece]:
    """Every input piece among a job's parts, inside casts too, in the order they are read."""
    for p in parts:
        if isinstance(p, Piece):
            yield p
        elif isinstance(p, Cast):
            yield from p.pieces


def remote_ranges(parts: list) -> Iterator[tuple[str, int, int]]:
    """(path, offset, nbytes) of every input range behind a URL among a job's parts (inside casts too)."""
    for p in input_pieces(parts):
        if storage.is_url(p.path):
            yield p.path, p.offset, p.nbytes


def plan_requests(ranges: Iterable[tuple[str, int, int]], max_request: int = MAX_REQUEST_BYTES,
                  gap: int = REQUEST_GAP_BYTES) -> list[tuple[str, int, int]]:
    """Coalesce byte ranges into ranged GETs: per file, sorted, neighbours closer than ``gap`` merged, none
    longer than ``max_request`` (a longer range is split into several requests)."""
    byfile: dict[str, list[tuple[int, int]]] = {}
    for path, off, n in ranges:
        if n:
            byfile.setdefault(path, []).append((off, off + n))
    out = []
    for path, spans in byfile.items():
        spans.sort()
        merged: list[list[int]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1] + gap:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        for lo, hi in merged:
            for s in range(lo, hi, max_request):
                out.append((path, s, min(max_request, hi - s)))
    return out


def _fetch(worker: Worker, requests: list[tuple[str, int, int]]):
    """Start the ranged GETs of ``requests`` on the worker's fetch threads; returns their futures."""
    def get(req):
        path, off, n = req
        data = storage.read_range(path, off, n, worker.storage_options)
        with worker.stats.lock:
            worker.stats.bytes += len(data)
            worker.stats.requests += 1
        return req, data

    pool = worker.fetcher()
    return [pool.submit(get, r) for r in requests]


def run_jobs(pool, fn: Callable, jobs: Iterable, worker: Worker | None = None,
             parts_of: Callable = lambda job: job[1], window: int = PREFETCH_BYTES) -> Iterator:
    """``fn(job)`` for every job on ``pool`` (or in this thread when None), results in job order.

    When jobs read remote pieces, they run in windows of remote bytes (the first small, then doubling up to a
    quarter of ``window``); up to ``window`` bytes of the windows ahead are being fetched (coalesced ranged GETs,
    :func:`plan_requests`, many in flight) while one is written, and the worker's reader is served from them.
    Local-only jobs run exactly as ``pool.map``."""
    jobs = list(jobs)
    ranges = [list(remote_ranges(parts_of(j))) for j in jobs] if worker is not None else []
    if not any(ranges):
        yield from (pool.map(fn, jobs) if pool is not None else map(fn, jobs))
        return
    windows, cur, size, limit = [], [], 0, min(FIRST_WINDOW_BYTES, window // WINDOWS_AHEAD)
    for i, rs in enumerate(ranges):
        cur.append(i)
        size += sum(r[2] for r in rs)
        if size >= limit:
            windows.append((cur, size))
            cur, size, limit = [], 0, min(2 * limit, window // WINDOWS_AHEAD)
    if cur:
        windows.append((cur, size))

    def start(win):
        rs = [r for i in win for r in ranges[i]]
        total = sum(r[2] for r in rs)
        # from the plan: a full window (PREFETCH_BYTES / WINDOWS_AHEAD) is WINDOWS_AHEAD GETs of MAX_REQUEST_BYTES,
        # so PREFETCH_BYTES in flight are REQUESTS_IN_FLIGHT GETs of 16 MiB (what a tuned boto3 download does);
        # the first, small windows are cut finer so that writing starts soon
        size_ = min(MAX_REQUEST_BYTES, max(MIN_REQUEST_BYTES, total // WINDOWS_AHEAD))
        return _fetch(worker, plan_requests(rs, size_))

    cache = RangeCache()
    reader = worker.reader
    pending: list = []  # futures of the windows being fetched, in order
    nxt, in_flight = 0, 0
    try:
        for k, (win, _) in enumerate(windows):
            while nxt < len(windows) and (nxt <= k or in_flight + windows[nxt][1] <= window):
                pending.append(start(windows[nxt][0]))
                in_flight += windows[nxt][1]
                nxt += 1
            t0 = time.perf_counter()
            got = [f.result() for f in pending.pop(0)]
            worker.stats.wait_seconds += time.perf_counter() - t0
            cache.blocks.clear()
            for (path, off, _), data in got:
                cache.add(path, off, data)
            reader.cache = cache
            todo = [jobs[i] for i in win]
            yield from (pool.map(fn, todo) if pool is not None else map(fn, todo))
            in_flight -= windows[k][1]
    finally:
        for futures in pending:
            for f in futures:
                f.cancel()
        reader.cache = None
