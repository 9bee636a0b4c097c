"""One command, many processes: merge / reshard split across the ranks of a launcher's job by bytes.

Under ``torchrun``, the ``deepspeed`` launcher or ``srun``, every process runs the same command; nothing but
``torch.distributed`` (gloo: a few small collectives) coordinates them::

    launcher   RANK / WORLD_SIZE / MASTER_ADDR (torchrun, deepspeed), SLURM_PROCID / SLURM_STEP_NUM_TASKS (srun,
               MASTER_ADDR / MASTER_PORT as the user sets them)          -> init_process_group("gloo")
    plan       every rank: open_checkpoint + plan, from metadata alone (the same plan on every rank)
    agree      rank 0's serialization ids broadcast; the layout's digest compared; any rank's error -> all raise it
    scratch    rank 0: the publish scratch folder (next to OUT, on the shared filesystem), every file at its size
    write      rank r: the jobs (<= CHUNK_BYTES of one output file) whose bytes fall in [r*T/P, (r+1)*T/P) of the
               plan's T output bytes, in plan order: it reads only the source ranges those jobs need and pwrites
               them into the shared scratch files; CRC-32s of its part of every zip entry (combined in rank order)
    agree      every rank's error flag (one all-reduce) and CRCs (one all-gather)
    headers    rank r: the zip headers and central directories of files r, r+P, r+2P ... (they need the CRCs)
    publish    rank 0: side files, the marker, rename into place; then a last agreement, so every rank exits
               with the same status

A URL output (``s3://``) has no shared scratch: whole output files are dealt out by bytes (largest first, to the
least loaded rank), each rank writes its files through a local scratch file of one shard at most and uploads it
(multipart); rank 0 writes the ``writing`` marker first and the commit marker last (:mod:`zckpt.io.publish`).

A failure on any rank (an exception) fails every rank with the same one-line error; a rank that dies makes the
launcher stop the others (torchrun does; under srun pass ``--kill-on-bad-exit=1``): nothing is published, and the
next run sweeps the scratch folder. The work is described generically, as output files x byte ranges x segments
(:class:`zckpt.engine.works.FileWork`), so any plan the engine writes (merge, reshard, conversion) is split the
same way. Without a launcher nothing here runs, and torch is not imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from zckpt.engine import executor, lanes, torchzip
from zckpt.engine.checked import InputCheck
from zckpt.engine.launch import Group
from zckpt.engine.works import (  # noqa: F401 - the work and its split, re-exported for callers of this module
    MIN_CHUNK_BYTES, FileWork, archive_work, chunk_size, convert_works, default_workers, job_bytes, merge_works,
    part_path, placed_work, reshard_works, safetensors_work, split_files, split_ranges)
from zckpt.errors import InvalidArgument, StorageError
from zckpt.io import publish, storage

log = logging.getLogger(__name__)


# ============================================================================================ writing


def _test_hooks(group: Group, count: int) -> None:
    """Fault injection for the tests: ZCKPT_TEST_RANK_EXIT=r makes rank r die (os._exit) after its first job (a
    chunk or a copied file); ZCKPT_TEST_RANK_FAIL=r makes it raise."""
    if count != 1:
        return
    if os.environ.get("ZCKPT_TEST_RANK_EXIT") == str(group.rank):
        os._exit(17)
    if os.environ.get("ZCKPT_TEST_RANK_FAIL") == str(group.rank):
        raise StorageError(f"injected failure on rank {group.rank}", hint="a test asked for it")


class _Writer:
    """One rank's share: jobs into files that already exist at their final size; CRC parts per (file, slot)."""

    def __init__(self, group: Group, pool, worker: executor.Worker, maps: torchzip.SourceMaps, progress,
                 durable: bool, storage_options: dict | None):
        self.group, self.pool, self.worker, self.maps = group, pool, worker, maps
        self.progress, self.durable, self.storage_options = progress, durable, storage_options
        self.crcs: dict[tuple[int, int], tuple[int, int]] = {}  # (file, slot) -> (crc, length) of this rank's part
        self.count = 0
        self.bytes = 0

    def write_targets(self, targets: list[lanes.Target]) -> dict[tuple[int, int], tuple[int, int]]:
        """Jobs into several files at once (:mod:`zckpt.engine.lanes`); their CRC parts kept per (file, slot), and
        returned."""
        def after_job():
            self.count += 1
            _test_hooks(self.group, self.count)

        def step(n):
            self.bytes += n
            if self.progress:
                self.progress(n)

        got = lanes.write_files(targets, self.pool, self.worker, self.maps.crc, durable=self.durable, progress=step,
                                after_job=after_job)
        for key, (crc, n) in got.items():
            c, length = self.crcs.get(key, (0, 0))
            self.crcs[key] = (torchzip.crc32_combine(c, crc, n) if length else crc, length + n)
        return got

    def copy(self, work: FileWork, dst: str) -> None:
        if storage.is_url(work.src):
            data = storage.read_bytes(work.src, self.storage_options)
            with open(dst, "wb") as f:
                f.write(data)
        else:
            shutil.copyfile(work.src, dst)
        if self.durable:
            fd = os.open(dst, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if self.worker.check is not None:
            self.worker.check.check_copy(work.src, dst)
        self.bytes += work.size
        self.count += 1
        if self.progress:
            self.progress(work.size)
        _test_hooks(self.group, self.count)

    def whole_file(self, fi: int, work: FileWork, path: str) -> None:
        """``work`` written whole into a new local file ``path`` (URL outputs: the upload's scratch)."""
        if work.src is not None:
            self.copy(work, path)
            return
        got = self.write_targets([lanes.Target(fi, path, work.jobs, size=work.size)])
        _write_meta(path, work.meta({slot: c for (_, slot), (c, _) in got.items()}), self.durable)


def _write_meta(path: str, meta: list[tuple[int, bytes]], durable: bool) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        executor.pwrite_pieces(fd, meta)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def _combine(parts_by_rank: list[list[int]], slots: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """The CRC of every (file, slot) from each rank's (crc, length) parts, combined in rank order."""
    out = {}
    for k, key in enumerate(slots):
        crc, length = 0, 0
        for row in parts_by_rank:
            c, n = row[2 * k], row[2 * k + 1]
            if n:
                crc = torchzip.crc32_combine(crc, c & 0xFFFFFFFF, n) if length else c & 0xFFFFFFFF
                length += n
        out[key] = crc
    return out


def _align_archives(group: Group, archives: list[torchzip.Archive]) -> None:
    """Every rank's archives get rank 0's serialization ids (torch.save's random per-file id)."""
    mine = b"".join(torchzip.serialization_id(a) for a in archives)
    ids = group.broadcast_bytes(mine)
    if len(ids) != len(mine):
        raise InvalidArgument("the ranks planned different outputs (another number of torch files)",
                              hint="every rank must see the same checkpoint at the same path")
    pos = 0
    for a in archives:
        n = len(torchzip.serialization_id(a))
        torchzip.set_serialization_id(a, ids[pos:pos + n])
        pos += n


def _check_same_plan(group: Group, works: list[FileWork]) -> None:
    h = hashlib.sha256()
    for w in works:
        w.digest(h)
    mine = h.digest()
    theirs = group.broadcast_bytes(mine)
    if theirs != mine:
        raise InvalidArgument(f"rank {group.rank} planned another output than rank 0 (the checkpoint differs "
                              "between the processes)", hint="every rank must see the same checkpoint, "
                              "e.g. on a shared filesystem, at the same path")


@dataclass
class Stats:
    """What one distributed execution did: ranks, bytes (this rank's and all), seconds, remote reads."""

    ranks: int
    total_bytes: int
    rank_bytes: int = 0
    seconds: float = 0.0
    fetch: dict = field(default_factory=dict)
    split_entries: int = 0  # zip entries written by more than one rank (their CRCs combined across ranks)
    # rank 0's seconds per step; write_max / write_min: the slowest and fastest rank's writing; start_spread: from
    # the first rank to the last entering the execution (their opening and planning took that much longer)
    phases: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"ranks": self.ranks, "rank_bytes": self.rank_bytes, "total_bytes": self.total_bytes,
                "seconds": round(self.seconds, 3), "split_entries": self.split_entries, **self.fetch,
                **({"phases": {k: round(v, 3) for k, v in self.phases.items()}} if self.phases else {})}


def execute(group: Group, works: list[FileWork], archives: list[torchzip.Archive], out: str, kind: str,
            check_out: Callable[[], None], source: str | None, finish: Callable, workers: int | None = None,
            progress: Callable[[int, int], None] | None = None, durable: bool = False,
            storage_options: dict | None = None, output_storage_options: dict | None = None,
            worker: executor.Worker | None = None, maps: torchzip.SourceMaps | None = None,
            check: InputCheck | None = None) -> Stats:
    """Write ``works`` into ``out`` with every rank of ``group`` and publish it once, from rank 0.

    ``archives``: the torch zips among the works (their serialization ids are made rank 0's); ``check_out()``: rank
    0's output check (before anything is written); ``finish(pub)``: rank 0 adds the small files (index, ``latest``,
    config) before the commit. ``check``: this rank's input check; rank 0 gathers every rank's spans and checks
    the CRC-32 of every input zip entry read before publishing. Every step ends with an agreement: an error on
    any rank is raised on all."""
    t0, started_us = time.perf_counter(), int(time.time() * 1e6)
    phases: dict[str, float] = {}
    mark = [t0]

    def lap(name: str) -> None:  # rank 0's time in each step (a step's agreement waits for the slowest rank)
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - mark[0]
        mark[0] = now

    remote = storage.is_url(out)
    group.phase(_align_archives, group, archives)
    group.phase(_check_same_plan, group, works)
    total = sum(w.size for w in works)
    spans = None if remote else split_ranges(works, group.world)
    if remote:
        share = sum(works[fi].size for fi in split_files(works, group.world)[group.rank])
    else:
        share = sum(job_bytes(works[fi].jobs[ji][2], works[fi].jobs[ji][3]) if ji >= 0 else works[fi].size
                    for fi, ji in spans[group.rank])
    lap("agree_plan")
    done = [0]

    def step(n):  # this rank's part of the work
        done[0] += n
        if progress:
            progress(min(done[0], share), share)

    workers = workers or default_workers()
    own_worker, own_maps = worker is None, maps is None
    worker = worker or executor.Worker(storage_options=storage_options, check=check)
    maps = maps or torchzip.SourceMaps()
    stack, split = contextlib.ExitStack(), 0
    try:
        pool = stack.enter_context(ThreadPoolExecutor(workers))
        writer = _Writer(group, pool, worker, maps, step, durable, storage_options)
        pub = group.phase(_open_publisher, group, stack, works, out, kind, check_out, source, durable,
                          output_storage_options)
        lap("scratch")
        if remote:
            group.phase(_write_files_remote, group, writer, works, out, output_storage_options)
            lap("write")
            if check is not None:
                group.phase(_check_inputs, group, check)
                lap("crcs")
            group.phase(_publish, group, pub, works, False, finish)
            lap("publish")
        else:
            tmp = group.broadcast_bytes(pub.tmp.encode() if group.rank == 0 else None).decode()
            own = [0.0]  # this rank's own writing, before the agreement waits for the others

            def write_own():
                t_write = time.perf_counter()
                try:
                    _write_ranges(group, writer, works, tmp, spans)
                finally:
                    own[0] = time.perf_counter() - t_write

            group.phase(write_own)
            write_us = int(own[0] * 1e6)
            lap("write")
            slots = sorted({(fi, job[0]) for fi, w in enumerate(works) for job in w.jobs if job[0] >= 0})
            mine = []
            for key in slots:
                c, n = writer.crcs.get(key, (0, 0))
                mine += [c, n]
            rows = group.all_gather_ints(mine + [write_us, started_us])
            phases["write_max"] = max(row[-2] for row in rows) / 1e6
            phases["write_min"] = min(row[-2] for row in rows) / 1e6
            phases["start_spread"] = (max(row[-1] for row in rows) - min(row[-1] for row in rows)) / 1e6
            split = sum(1 for k in range(len(slots)) if sum(1 for row in rows if row[2 * k + 1]) > 1)
            crcs = _combine(rows, slots)
            if check is not None:  # the inputs' CRCs: counted in the same step as the outputs'
                group.phase(_check_inputs, group, check)
            lap("crcs")
            group.phase(_write_headers, group, works, crcs, tmp, durable)
            lap("headers")
            group.phase(_publish, group, pub, works, True, finish)
            lap("publish")
    finally:
        stack.close()
        if own_worker:
            worker.close()
        if own_maps:
            maps.close()
    return Stats(group.world, total, writer.bytes, time.perf_counter() - t0, worker.stats.to_json(), split, phases)


def _check_inputs(group: Group, check: InputCheck) -> None:
    """Rank 0: every rank's input spans joined and the CRC-32 of every input zip entry they fall in checked."""
    import json
    rows = group.gather_bytes(json.dumps(check.export()).encode())
    if rows is None:
        return
    for row in rows:
        check.absorb(json.loads(row))
    check.finish()


def _open_publisher(group: Group, stack, works, out, kind, check, source, durable, output_storage_options):
    """Rank 0: the output check, the scratch folder (local: every file created at its final size)."""
    if group.rank != 0:
        return None
    check()
    pub = stack.enter_context(publish.Publisher(out, kind, source, durable, storage_options=output_storage_options))
    if not storage.is_url(out):
        for w in works:
            lanes.create(pub.path(w.relpath), w.size)
    return pub


def _write_ranges(group: Group, writer: _Writer, works: list[FileWork], tmp: str, spans: list) -> None:
    sharers: dict[int, int] = {}  # file -> how many ranks write into it
    for rank_span in spans:
        for fi in {fi for fi, _ in rank_span}:
            sharers[fi] = sharers.get(fi, 0) + 1
    byfile: dict[int, list] = {}
    for fi, ji in spans[group.rank]:
        byfile.setdefault(fi, []).append(ji)
    targets = []
    for fi, jis in byfile.items():
        w = works[fi]
        path = os.path.join(tmp, w.relpath)
        if w.src is not None:
            writer.copy(w, path)
        else:
            targets.append(lanes.Target(fi, path, [w.jobs[j] for j in jis], writers=sharers[fi]))
    writer.write_targets(targets)


def _rank_scratch(rank: int) -> str:
    """A local folder for this rank's whole files on their way to a URL output, named after its process; those of
    ranks of earlier runs on this host whose process is gone (killed, out of memory) are swept first, as
    :func:`zckpt.io.publish.sweep` does next to a local output."""
    parent = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.listdir(parent):
            fields = entry.split("-")  # .zckpt-rank<r>-<pid>-<random>
            if (len(fields) == 4 and fields[0] == ".zckpt" and fields[1].startswith("rank") and fields[2].isdigit()
                    and not publish.pid_alive(int(fields[2]))):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f".zckpt-rank{rank}-{os.getpid()}-", dir=parent)


def _write_files_remote(group: Group, writer: _Writer, works, out, output_storage_options) -> None:
    """This rank's whole files, each written to a local scratch file and uploaded (multipart), one at a time."""
    scratch = _rank_scratch(group.rank)
    try:
        for fi in split_files(works, group.world)[group.rank]:
            w = works[fi]
            local = os.path.join(scratch, w.relpath.replace("/", "_"))
            writer.whole_file(fi, w, local)
            storage.put_file(local, storage.join(out, w.relpath), storage_options=output_storage_options,
                             max_concurrency=8)
            os.remove(local)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _write_headers(group: Group, works: list[FileWork], crcs: dict[tuple[int, int], int], tmp: str,
                   durable: bool) -> None:
    """The bytes that needed every rank's CRCs (zip headers and directories), file ``fi`` by rank ``fi % world``."""
    byfile: dict[int, dict[int, int]] = {}
    for (fi, slot), c in crcs.items():
        byfile.setdefault(fi, {})[slot] = c
    for fi, w in enumerate(works):
        if w.src is None and fi % group.world == group.rank:
            _write_meta(os.path.join(tmp, w.relpath), w.meta(byfile.get(fi, {})), durable)


def _publish(group: Group, pub, works, local: bool, finish) -> None:
    """Rank 0: the side files, the marker; the output appears (a local one's files complete already)."""
    if group.rank != 0:
        return
    for w in works:
        if local:
            pub.done(w.relpath)
        else:
            pub.adopt(w.relpath, w.size)
    finish(pub)
    pub.commit()


# ============================================================================================ merge, reshard


def _chunk_for(group: Group, sizes) -> int:
    return chunk_size(sum(sizes), group.world)


def run_merge(group: Group, plan, out: str, extra_files: dict[str, bytes] | None, *, workers=None,
              overwrite: bool = False, progress=None, durable: bool = False, source: publish.Source | None = None,
              storage_options: dict | None = None, output_storage_options: dict | None = None,
              check: InputCheck | None = None) -> Stats:
    """:func:`zckpt.ops.merge.execute` with every rank of ``group``: the same files, byte for byte."""
    maps = torchzip.SourceMaps()
    try:
        chunk = _chunk_for(group, [s.size for s in plan.shards])
        works = merge_works(plan, maps, chunk)
        archives = [s.archive for s in plan.shards if plan.fmt == "pt"]

        def finish(pub):
            for name, data in (extra_files or {}).items():
                pub.write_bytes(name, data)
            if plan.index is not None:
                import json
                pub.write_bytes(plan.index_name, (json.dumps(plan.index, indent=2) + "\n").encode())

        def check_out():
            publish.check_output(out, "merge", source, overwrite, output_storage_options)

        return execute(group, works, archives, out, "merge", check_out, source.root if source else None, finish,
                       workers, progress, durable, storage_options, output_storage_options, maps=maps,
                       check=check)
    finally:
        maps.close()


def run_reshard(group: Group, plan, out: str, *, workers=None, overwrite: bool = False, progress=None,
                latest_name: str = "latest", durable: bool = False, source: publish.Source | None = None,
                storage_options: dict | None = None, check: InputCheck | None = None) -> Stats:
    """:func:`zckpt.ops.reshard.execute` with every rank of ``group``: the same files, byte for byte."""
    maps = torchzip.SourceMaps()
    try:
        chunk = _chunk_for(group, [f.nbytes for f in plan.files])
        works = reshard_works(plan, maps, chunk)
        archives = [f.archive for f in plan.files if f.kind == "torch"]
        tag = (plan.tag if plan.fmt == "deepspeed" else f"{plan.tag}_universal").encode()

        def finish(pub):
            pub.write_bytes(latest_name, tag)  # DeepSpeed writes the bare tag, no newline

        def check_out():
            publish.check_output(out, "reshard", source, overwrite)

        return execute(group, works, archives, out, "reshard", check_out, source.root if source else plan.source,
                       finish, workers, progress, durable, storage_options, None, maps=maps, check=check)
    finally:
        maps.close()


def run_convert(group: Group, plan, out: str, *, workers=None, overwrite: bool = False, progress=None,
                durable: bool = False, source: publish.Source | None = None,
                storage_options: dict | None = None, check: InputCheck | None = None) -> Stats:
    """:func:`zckpt.ops.convert.execute` with every rank of ``group``: the same files, byte for byte. Each DCP part
    (``plan.parts``: sub-folder, layout) has its ``.distcp`` files split by bytes like any other file and its
    ``.metadata`` (DCP's commit, ``part.commit_name``) written by rank 0 at the end; ``plan.copies`` are copied whole."""
    maps = torchzip.SourceMaps()
    try:
        files = [f for _, part in plan.parts for f in part.files]
        chunk = _chunk_for(group, [f.size for f in files])
        works = convert_works(plan, maps, chunk)
        archives = [a for f in files for a, _ in f.placed]

        def finish(pub):
            for folder, part in plan.parts:
                pub.write_bytes(part_path(folder, part.commit_name), part.metadata)

        def check_out():
            publish.check_output(out, "convert", source, overwrite)

        return execute(group, works, archives, out, "convert", check_out, source.root if source else plan.source,
                       finish, workers, progress, durable, storage_options, None, maps=maps, check=check)
    finally:
        maps.close()
