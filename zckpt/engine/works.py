"""The work of a plan as output files x byte ranges x segments (:class:`FileWork`), whatever wrote the plan (merge,
reshard, conversion), and its split across the ranks of a launcher's job: by output bytes into a shared folder
(:func:`split_ranges`), or by whole files for an object store (:func:`split_files`). Used by
:mod:`zckpt.engine.distributed`; plain data, no torch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from zckpt.engine import executor, torchzip
from zckpt.engine.segments import Piece, seg_numel
from zckpt.encoding.safeload import DTYPE_SIZES
from zckpt.errors import InvalidArgument

MIN_CHUNK_BYTES = 256


# ============================================================================================ the work


@dataclass
class FileWork:
    """One output file as byte ranges x segments: ``jobs`` ``(slot, offset, parts, dtype)`` (``slot``: the zip
    entry whose CRC-32 the job's bytes are part of, or -1), and ``meta(crcs)``: the file's other bytes
    ``[(offset, bytes)]`` once the CRC of every slot is known. ``src``: a file copied whole instead (one process
    writes it as :func:`copy_work`'s jobs; under a launcher one rank copies it). ``layout()``: what ``meta``
    depends on but the CRCs, as bytes, where that is cheaper to say than ``meta({})`` (torch zips: every entry's
    name, offsets and size, and the small entries' bytes)."""

    relpath: str
    size: int
    jobs: list = field(default_factory=list)
    meta: Callable[[dict[int, int]], list[tuple[int, bytes]]] = lambda crcs: []
    src: str | None = None
    layout: Callable[[], bytes] | None = None

    def digest(self, h) -> None:
        """The layout (name, size, job offsets and lengths, the bytes of ``meta`` without CRCs) into ``h``."""
        h.update(f"{self.relpath}\0{self.size}\0{self.src is not None}\0".encode())
        h.update(repr([(slot, off, job_bytes(parts, dtype)) for slot, off, parts, dtype in self.jobs]).encode())
        if self.layout is not None:
            h.update(self.layout())
            return
        for off, data in self.meta({}):
            h.update(f"{off}:".encode() + bytes(data))


def job_bytes(parts: list, dtype: str) -> int:
    return sum(len(p) if isinstance(p, (bytes, bytearray)) else seg_numel(p, dtype) * DTYPE_SIZES[dtype]
               for p in parts)


def write_workers(cpus: int | None = None) -> int:
    """Writing threads of one process on ``cpus`` CPUs (default: this machine's): three quarters of them, at least
    8 and at most 16, never more than the CPUs. Measured on a 16-core host (docs/benchmarks.md, issue 49 item 3):
    8 threads left reshard and convert at 8-11 GB/s against a 16-thread copy's 14-18; 12 and 14 brought both
    within 1.0-1.2x of it and the merges no slower; 16 writers beside the main thread made the casting jobs
    slower again (bf16 merge +10%, DCP -> DeepSpeed +24%)."""
    n = cpus or os.cpu_count() or 2
    return min(n, max(8, min(16, n * 3 // 4)))


def default_workers() -> int:
    """Threads per process: the single-process default (:func:`write_workers`) of this node's CPUs shared by its
    processes (torchrun's LOCAL_WORLD_SIZE, srun's SLURM_NTASKS_PER_NODE), at least 2."""
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]
    try:
        local_n = max(1, int(local))
    except ValueError:
        local_n = 1
    return max(2, write_workers(max(1, (os.cpu_count() or 2) // local_n)))


def chunk_size(total: int, world: int) -> int:
    """Jobs small enough to balance ``world`` ranks within about 1/64 of a share each, at most CHUNK_BYTES."""
    return max(MIN_CHUNK_BYTES, min(executor.CHUNK_BYTES, total // max(1, world * 64)))


def safetensors_work(shard, chunk: int) -> FileWork:
    """A merge shard (``zckpt.hf.writer.ShardPlan``) in safetensors: its header, then tensor chunks."""
    from zckpt.engine.segments import source_segments
    jobs = [(-1, t.offset + start, parts, t.dtype) for t in shard.tensors
            for start, parts in executor.chunks(source_segments(t.pieces, t.src_dtype, t.dtype), t.dtype, chunk)]
    header = shard.header
    return FileWork(shard.filename, shard.size, jobs, lambda crcs: [(0, header)])


def archive_work(relpath: str, archive: torchzip.Archive, maps: torchzip.SourceMaps, chunk: int) -> FileWork:
    """A planned torch zip: tensor chunks whose CRCs are combined per entry; headers and directory at the end."""
    return placed_work(relpath, archive.file_size, [(archive, 0)], maps, chunk)


def placed_work(relpath: str, size: int, placed: list, maps: torchzip.SourceMaps, chunk: int) -> FileWork:
    """A file of torch zips placed at byte offsets (``[(archive, base)]``: one for a ``.pt`` file, many for a DCP
    ``.distcp`` file). Every zip entry of the file is one CRC slot."""
    jobs, parts_meta, first = [], [], 0
    for archive, base in placed:
        ajobs, known = torchzip.archive_jobs(archive, maps, chunk)
        jobs += [(-1 if idx in known else first + idx, base + off, parts, dtype) for idx, off, parts, dtype in ajobs]
        parts_meta.append((archive, base, first, known))
        first += len(archive.entries)

    def meta(crcs: dict[int, int]) -> list[tuple[int, bytes]]:
        out = []
        for archive, base, first_, known in parts_meta:
            mine = {idx: crcs[first_ + idx] for idx in range(len(archive.entries)) if first_ + idx in crcs}
            mine.update(known)
            out += [(base + off, data) for off, data in torchzip.archive_meta(archive, mine)]
        return out

    def layout() -> bytes:
        out = []
        for archive, base, _, _ in parts_meta:
            out.append(repr((base, archive.size, archive.file_size, [
                (e.name, e.header_offset, e.data_offset, e.size) for e in archive.entries])).encode())
            out += [bytes(e.data) for e in archive.entries if not isinstance(e.data, torchzip.TensorOut)]
        return b"\0".join(out)

    return FileWork(relpath, size, jobs, meta, layout=layout)


def copy_work(relpath: str, src: str, size: int, chunk: int, entries=()) -> FileWork:
    """A file copied as it is (a side file, an expert file that does not depend on the new layout) as jobs of at
    most ``chunk`` bytes of ``src``, written by the lanes with the rest. Pieces never cross the bounds of
    ``entries`` (the source's zip entries): each piece read lies in one entry or between two, so the input check
    combines every entry's CRC-32 from the pieces as they are read, without reading the file again."""
    cuts = sorted({0, size, *(b for e in entries for b in (e.data_offset, e.data_offset + e.size) if 0 < b < size)})
    jobs, parts, start = [], [], 0
    for lo, hi in zip(cuts, cuts[1:]):
        pos = lo
        while pos < hi:
            n = min(hi - pos, start + chunk - pos)
            parts.append(Piece(src, pos, n, "uint8"))
            pos += n
            if pos - start >= chunk:
                jobs.append((-1, start, parts, "uint8"))
                parts, start = [], pos
    if parts:
        jobs.append((-1, start, parts, "uint8"))
    return FileWork(relpath, size, jobs)


# ============================================================================================ the jobs' files


def merge_works(plan, maps: torchzip.SourceMaps, chunk: int) -> list[FileWork]:
    """A merge plan's shards (``zckpt.hf.writer.MergePlan``): safetensors, or torch files for ``fmt="pt"``."""
    return [archive_work(s.filename, s.archive, maps, chunk) if plan.fmt == "pt" else safetensors_work(s, chunk)
            for s in plan.shards]


def reshard_works(plan, maps: torchzip.SourceMaps, chunk: int) -> list[FileWork]:
    """A reshard plan's files (``zckpt.deepspeed.target.ReshardPlan``): planned torch archives and copies."""
    works = []
    for f in plan.files:
        if f.kind == "torch":
            works.append(archive_work(f.relpath, f.archive, maps, chunk))
        elif f.kind == "copy":
            works.append(FileWork(f.relpath, f.nbytes, src=f.src))
        else:
            raise InvalidArgument("this plan's files are objects to load (plan_ranks), not files to write",
                                  hint="plan with plan_reshard")
    return works


def part_path(folder: str, name: str) -> str:
    """A DCP part's file ``name`` inside its sub-folder (``""``: the output folder itself)."""
    return f"{folder}/{name}" if folder else name


def convert_works(plan, maps: torchzip.SourceMaps, chunk: int) -> list[FileWork]:
    """A DCP conversion plan's files (``zckpt.dcp.plan.ConvertPlan``): the copies (a Trainer's own files), then
    every part's ``.distcp`` files; its ``.metadata`` files (the commits) are the caller's, last."""
    works = [FileWork(r, size, src=src) for r, src, size in plan.copies]
    works += [placed_work(part_path(folder, f.name), f.size, f.placed, maps, chunk)
              for folder, part in plan.parts for f in part.files]
    return works


# ============================================================================================ splitting


def split_ranges(works: list[FileWork], world: int) -> list[list[tuple[int, int]]]:
    """Per rank, the ``(file index, job index)`` pairs it writes: the plan's output bytes in order, cut into
    ``world`` equal spans (a job belongs to the span holding its middle byte; a copied file is one job)."""
    items = []
    for fi, w in enumerate(works):
        if w.src is not None:
            items.append((fi, -1, w.size))
        else:
            items += [(fi, ji, job_bytes(job[2], job[3])) for ji, job in enumerate(w.jobs)]
    total = sum(n for _, _, n in items) or 1
    out: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    pos = 0
    for fi, ji, n in items:
        rank = min(world - 1, (2 * pos + n) * world // (2 * total))
        out[rank].append((fi, ji))
        pos += n
    return out


def split_files(works: list[FileWork], world: int) -> list[list[int]]:
    """Per rank, whole files: largest first, each to the least loaded rank (ties: the lowest rank)."""
    loads, out = [0] * world, [[] for _ in range(world)]
    for fi in sorted(range(len(works)), key=lambda i: (-works[i].size, i)):
        r = min(range(world), key=lambda k: (loads[k], k))
        out[r].append(fi)
        loads[r] += works[fi].size
    for files in out:
        files.sort()
    return out
