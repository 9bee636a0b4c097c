"""Every input byte the engine reads, checked against the CRC-32 its zip entry records, before anything is published.

``torch.save`` writes each storage as a stored zip entry whose CRC-32 is in the central directory; ``torch.load``
never checks it, so a flipped bit in a rank file loads as a wrong number. The engine reports what it read here::

    plain copies and casts            the CRC of the bytes just read into the worker's buffer (no copy_file_range
                                      while checking: it would need a second read of the source for its CRC)
    remote blocks fetched ahead       the CRC of the fetched views

as spans ``(path, offset, length, crc)``. :meth:`InputCheck.finish` then takes every zip entry a span falls in,
orders its spans, drops repeats (a tensor read twice), reads what no span covered (partition padding: a few bytes),
combines the CRCs in order (:func:`zckpt.io.hashing.crc32_combine`) and compares the result with the entry's CRC.
A mismatch raises :class:`~zckpt.errors.CorruptFile` naming the file, the entry and (through ``describe``) the
tensors it holds; the callers run it before they publish, so a damaged input never becomes an output.

Which entries exist comes from ``entries_of(path)`` (a torch zip's directory; for a DCP ``.distcp`` file, the zips of
its items at their offsets); a file without CRCs (a legacy torch file) has none, and nothing is checked there.
``max_fill``: entries whose uncovered bytes exceed this fraction of the entry are not read to complete them, and
are counted in :attr:`InputCheck.unchecked` instead (ranged reads of another rank's partition on resume).
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
from typing import Callable

from zckpt.errors import CorruptFile
from zckpt.encoding.zipentries import ZipEntry
from zckpt.io import storage
from zckpt.io.hashing import crc32, crc32_combine

_READ_BLOCK = 8 << 20


class MappedCrc:
    """CRC-32s of byte ranges of local files, computed on read-only maps of them (no copy out of the page cache);
    the pages are dropped from the mapping afterwards, so RSS stays flat."""

    def __init__(self):
        self._maps: dict[str, tuple] = {}
        self._lock = threading.Lock()

    def crc(self, path: str, offset: int, n: int, crc: int = 0) -> int:
        if n <= 0:
            return crc
        m = self._maps.get(path)
        if m is None:
            with self._lock:
                m = self._maps.get(path)
                if m is None:
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
                    finally:
                        os.close(fd)
                    m = (mm, memoryview(mm))
                    self._maps[path] = m
        if offset + n > len(m[1]):
            raise CorruptFile(f"bytes {offset}-{offset + n} lie past the end of the file (truncated?)", path=path)
        crc = crc32(m[1][offset:offset + n], crc)
        if hasattr(m[0], "madvise"):
            start = offset - offset % mmap.PAGESIZE
            m[0].madvise(mmap.MADV_DONTNEED, start, offset + n - start)
        return crc

    def close(self) -> None:
        with self._lock:
            for mm, view in self._maps.values():
                try:
                    view.release()
                    mm.close()
                except BufferError:  # a worker still reads a slice (Ctrl-C unwinds while chunks are in flight):
                    pass  # the map closes with its last slice; raising here would hide the interrupt
            self._maps.clear()


def zip_entries(path: str, storage_options: dict | None = None) -> list[ZipEntry]:
    """The entries of the torch zip at ``path`` (local or URL); [] for a file that is not a zip (legacy)."""
    from zckpt.encoding.zipentries import LOCAL_SIG, read_entries
    with storage.open_ranges(path, storage_options) if storage.is_url(path) else open(path, "rb") as f:
        if f.read(4) != LOCAL_SIG:
            return []
        return list(read_entries(f, None, path).values())


class InputCheck:
    """The spans the engine read, and the check of every zip entry they fall in (see the module docstring)."""

    def __init__(self, entries_of: Callable[[str], list[ZipEntry]] | None = None,
                 describe: Callable[[str, int, int], str] | None = None,
                 storage_options: dict | None = None, max_fill: float | None = None):
        self.storage_options = storage_options
        self._entries_of = entries_of or (lambda path: zip_entries(path, storage_options))
        self._describe = describe
        self.max_fill = max_fill
        self._spans: list[tuple[str, int, int, int]] = []  # list.append is atomic: worker threads add freely
        self._entries: dict[str, tuple[list[int], list[ZipEntry]]] = {}
        self._done: set[tuple[str, int]] = set()  # (path, data offset) of entries already checked
        self._from_directory: set[str] = set()  # files whose entries were read from their own zip directory
        self._lock = threading.Lock()
        self.checked = 0  # entries checked
        self.checked_bytes = 0
        self.unchecked = 0  # entries read only in part, left unchecked (max_fill)

    # -------------------------------------------------------------------------------- what was read
    def add(self, path: str, offset: int, data) -> None:
        """Bytes just read from ``path`` at ``offset`` (a buffer)."""
        n = memoryview(data).nbytes
        if n:
            self._spans.append((path, offset, n, crc32(data)))

    def add_crc(self, path: str, offset: int, n: int, crc: int) -> None:
        if n:
            self._spans.append((path, offset, n, crc))

    # -------------------------------------------------------------------------------- spans between ranks
    def export(self) -> list[tuple[str, int, int, int]]:
        """This process's spans (for another rank's :meth:`absorb`), neighbours joined, then forgotten here."""
        spans, self._spans = sorted(self._spans), []
        out: list[list] = []
        for path, off, n, crc in spans:
            last = out[-1] if out else None
            if last is not None and last[0] == path and last[1] + last[2] == off:
                last[2], last[3] = last[2] + n, crc32_combine(last[3], crc, n)
            else:
                out.append([path, off, n, crc])
        return [tuple(s) for s in out]

    def absorb(self, spans) -> None:
        self._spans.extend(tuple(s) for s in spans)

    # -------------------------------------------------------------------------------- checking
    def finish(self) -> None:
        """Check every entry the spans fall in; raises :class:`CorruptFile` on the first mismatch."""
        spans, self._spans = self._spans, []
        byfile: dict[str, list[tuple[int, int, int]]] = {}
        for path, off, n, crc in spans:
            byfile.setdefault(path, []).append((off, n, crc))
        for path in sorted(byfile):
            self._check_file(path, byfile[path])

    def prepare(self, paths) -> None:
        """Learn the entries of the files ``paths`` now (what :meth:`finish` would read first), where this process
        would otherwise wait: :mod:`zckpt.engine.forked` while its child copies."""
        for path in paths:
            self._entries_for(path)

    def ensure(self, path: str, offset: int, n: int) -> None:
        """Check, before they are used, the entries holding bytes [offset, offset+n) of ``path``, each read whole
        (once per entry: :func:`zckpt.api.iter_tensors` yields a tensor only after its entry is checked)."""
        starts, entries = self._entries_for(path)
        i = bisect.bisect_right(starts, offset) - 1
        if (i < 0 or offset >= entries[i].data_offset + entries[i].size) and self._from_directory_once(path):
            starts, entries = self._entries_for(path)
            i = bisect.bisect_right(starts, offset) - 1
        i = max(i, 0)
        while i < len(entries) and entries[i].data_offset < offset + n:
            e = entries[i]
            if e.data_offset + e.size > offset and (path, e.data_offset) not in self._done:
                self._compare(path, e, self._read_crc(path, e.data_offset, e.size))
            i += 1

    def check_copy(self, src: str, dst: str) -> None:
        """A file copied whole (local ``dst``): every zip entry of the copy checked; errors name ``src``."""
        for e in zip_entries(dst):
            if e.size:
                self._compare(src, e, self._read_crc(dst, e.data_offset, e.size))

    def directory(self, path: str) -> list[ZipEntry]:
        """The entries of ``path``'s own zip directory (read once; [] for a file that is not a zip), which the check
        then uses for ``path``: a file copied whole is read in pieces cut at their bounds
        (:func:`zckpt.engine.works.copy_work`), every entry checked from the pieces as they are read."""
        self._from_directory_once(path)
        return self._entries_for(path)[1]

    def _from_directory_once(self, path: str) -> bool:
        """Replace what ``entries_of`` said of ``path`` by its own zip directory, once; False when done already."""
        if path in self._from_directory:
            return False
        self._from_directory.add(path)
        found = sorted((e for e in zip_entries(path, self.storage_options) if e.size), key=lambda e: e.data_offset)
        with self._lock:
            self._entries[path] = ([e.data_offset for e in found], found)
        return True

    def _entries_for(self, path: str) -> tuple[list[int], list[ZipEntry]]:
        got = self._entries.get(path)
        if got is None:
            entries = sorted((e for e in self._entries_of(path) if e.size), key=lambda e: e.data_offset)
            got = ([e.data_offset for e in entries], entries)
            with self._lock:
                self._entries[path] = got
        return got

    def _check_file(self, path: str, spans: list[tuple[int, int, int]]) -> None:
        starts, entries = self._entries_for(path)
        per_entry: dict[int, list[tuple[int, int, int]]] = {}
        for off, n, crc in spans:
            i = bisect.bisect_right(starts, off) - 1
            if i >= 0 and off + n <= entries[i].data_offset + entries[i].size:
                per_entry.setdefault(i, []).append((off, n, crc))
            elif self._from_directory_once(path):  # entries_of did not know it: the file's own directory
                return self._check_file(path, spans)
            else:  # a read across entry bounds: each entry it touches is checked from the file (never skipped)
                j = max(i, 0)
                while j < len(entries) and entries[j].data_offset < off + n:
                    if entries[j].data_offset + entries[j].size > off:
                        per_entry.setdefault(j, [])
                    j += 1
        for i in sorted(per_entry):
            e = entries[i]
            if (path, e.data_offset) in self._done:
                continue
            got = self._combine(path, e, sorted(per_entry[i], key=lambda s: (s[0], -s[1])))
            if got is not None:
                self._compare(path, e, got)

    def _combine(self, path: str, e: ZipEntry, spans: list[tuple[int, int, int]]) -> int | None:
        """The CRC of the whole entry from its spans (in order) and reads of what they leave out; None when the
        uncovered part is over ``max_fill`` of the entry (not checked)."""
        end = e.data_offset + e.size
        pos = e.data_offset
        for off, n, _ in spans:  # the common case first: spans that tile the entry, end to end (each byte read once)
            if off != pos:
                break
            pos += n
        else:
            if pos == end:
                crc = 0
                for _, n, c in spans:
                    crc = crc32_combine(crc, c, n)
                return crc
        covered, pos = 0, e.data_offset
        for off, n, _ in spans:
            covered += max(0, off + n - max(off, pos))
            pos = max(pos, off + n)
        if self.max_fill is not None and e.size - covered > self.max_fill * e.size:
            self.unchecked += 1
            return None
        # the cheapest way through the entry (a shortest path over the spans' ends, right to left): span CRCs
        # chained where one ends where the next begins, only bytes no chain covers read again. Bytes read twice
        # in other cuts (convert --to deepspeed reads each master for the optimizer file and again for the cast
        # weights) then chain through one of the reads, not re-read where the cuts overlap (17% of the source)
        start = e.data_offset
        points = sorted({start, end}.union(*((off, off + n) for off, n, _ in spans)))
        at = {p: i for i, p in enumerate(points)}
        from_start: dict[int, list] = {}
        for sp in spans:
            from_start.setdefault(sp[0], []).append(sp)
        best = [0] * len(points)  # bytes read again from this point to the end
        take: list = [None] * len(points)  # the span taken at this point (None: read to the next point)
        for i in range(len(points) - 2, -1, -1):
            p = points[i]
            best[i] = best[i + 1] + points[i + 1] - p
            for sp in from_start.get(p, ()):
                j = at[p + sp[1]]
                if best[j] <= best[i]:
                    best[i], take[i] = best[j], sp
        crc, i, last = 0, 0, len(points) - 1
        while i < last:
            sp = take[i]
            if sp is not None:
                crc = crc32_combine(crc, sp[2], sp[1])
                i = at[points[i] + sp[1]]
                continue
            j = i + 1  # bytes no chosen span covers (partition padding, a cut across): one read
            while j < last and take[j] is None:
                j += 1
            n = points[j] - points[i]
            crc = crc32_combine(crc, self._read_crc(path, points[i], n), n)
            i = j
        return crc

    def _compare(self, path: str, e: ZipEntry, got: int) -> None:
        self._done.add((path, e.data_offset))
        self.checked += 1
        self.checked_bytes += e.size
        if got == e.crc:
            return
        what = ""
        if self._describe is not None:
            held = self._describe(path, e.data_offset, e.data_offset + e.size)
            what = f", which holds {held}" if held else ""
        name = e.name.split("/", 1)[1] if "/" in e.name else e.name
        raise CorruptFile(f"zip entry {name}{what}: its bytes do not match the CRC-32 the file records "
                          f"({got:08x}, recorded {e.crc:08x}): the file is damaged", path=path,
                          hint="copy the file again from where it was saved; `zckpt verify --deep` lists every "
                               "damaged entry")

    def _read_crc(self, path: str, offset: int, n: int) -> int:
        """The CRC-32 of bytes the engine did not read (padding, a copied file, ``ensure``): read in blocks (with
        ``pread``: on the lent host's gVisor kernel a read-only map of the file was slower)."""
        crc, pos, end = 0, offset, offset + n
        local = not storage.is_url(path)
        if local:
            fd = os.open(path, os.O_RDONLY)
            buf = bytearray(min(_READ_BLOCK, max(n, 1)))
        try:
            while pos < end:
                k = min(_READ_BLOCK, end - pos)
                if local:
                    got = os.preadv(fd, [memoryview(buf)[:k]], pos)
                    data = memoryview(buf)[:got]
                    storage.count_read(path, got)  # counted like every other read (resume's bytes_read)
                else:
                    data = storage.read_range(path, pos, k, self.storage_options)
                if len(data) != k:
                    raise CorruptFile(f"short read at byte {pos + len(data)} (file truncated?)", path=path)
                crc = crc32(data, crc)
                pos += k
        finally:
            if local:
                os.close(fd)
        return crc

    def close(self) -> None:
        pass
