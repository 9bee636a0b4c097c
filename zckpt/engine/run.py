"""One process executing a plan: the bytes of every output file written through :class:`zckpt.engine.executor.Worker`
into a scratch folder that :mod:`zckpt.io.publish` renames into place (or commits, on an object store), after the
input check (:class:`zckpt.engine.checked.InputCheck`) has compared the CRC-32 of every input entry read.

Plans are plain data made by the format writers (:mod:`zckpt.hf.writer`, :mod:`zckpt.deepspeed.writer`,
:mod:`zckpt.dcp.plan`); this module reads only their fields, so it imports none of them:

- :func:`run_merge`: a merge plan's shards (safetensors: the header, then tensor chunks; or torch files), the
  index and extra files (a Trainer checkpoint's config, tokenizer);
- :func:`run_reshard`: torch archives laid out once (nothing pickled again) and files copied, then ``latest``;
- :func:`run_convert`: files copied, then each DCP layout's ``.distcp`` files and its ``.metadata`` last.

All three describe their files as :class:`zckpt.engine.works.FileWork` (what a launcher's ranks split, too) and
write them through :func:`write_works`: several files at once (:mod:`zckpt.engine.lanes`), since one file's
writes serialize on its inode.

:mod:`zckpt.engine.distributed` does the same with the ranks of a launcher's job.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

from zckpt.encoding import casting
from zckpt.engine import executor, lanes as _lanes, tees, torchzip, works as works_
from zckpt.engine.checked import InputCheck
from zckpt.engine.segments import source_segments
from zckpt.errors import InvalidArgument
from zckpt.io import allocation, publish
from zckpt.units import format_size

log = logging.getLogger(__name__)

PURE_CAST_BYTES = 32 << 20  # bf16 -> fp32 output bytes below which a pure-Python upcast beats importing numpy


def stepper(total: int, progress: Callable[[int, int], None] | None) -> Callable[[int], None]:
    """``step(n)``: ``n`` more bytes written, reported to ``progress(done, total)`` when given."""
    done = [0]

    def step(n: int) -> None:
        done[0] += n
        if progress:
            progress(done[0], total)

    return step


def shard_jobs(shard) -> Iterator[tuple[int, list, str]]:
    """(byte offset in the file, parts, dtype) of every chunk of a safetensors shard's tensors."""
    for t in shard.tensors:
        for start, parts in executor.chunks(source_segments(t.pieces, t.src_dtype, t.dtype), t.dtype):
            yield t.offset + start, parts, t.dtype


def run_merge(plan, out: str, workers: int | None = None, overwrite: bool = False,
              extra_files: dict[str, bytes] | None = None,
              progress: Callable[[int, int], None] | None = None, durable: bool = False,
              source: publish.Source | None = None, storage_options: dict | None = None,
              output_storage_options: dict | None = None, check: InputCheck | None = None) -> dict:
    """Write a merge ``plan`` (:class:`zckpt.hf.writer.MergePlan`) to the folder ``out`` (local path or URL),
    atomically (:mod:`zckpt.io.publish`); returns what was read from remote sources (bytes, ranged GETs, seconds
    waited for them).

    The folder appears complete or not at all, whenever the process is killed; ``overwrite`` replaces only a
    previous zckpt merge output, and ``source`` (the checkpoint) may not be touched. ``durable=True`` also fsyncs
    every file before the rename, so the result survives a power failure (slower: waits for the disk).
    ``storage_options``: fsspec options for reading pieces behind URLs; ``output_storage_options``: for a URL
    ``out`` (default: ``storage_options``). ``check``: the input check every byte read is reported to
    (:func:`zckpt.state.checksums.input_check`); its entries' CRC-32s are checked before anything is published."""
    out_opts = storage_options if output_storage_options is None else output_storage_options
    publish.check_output(out, "merge", source, overwrite, out_opts)
    workers = workers or works_.write_workers()

    casts = [t for sh in plan.shards for t in sh.tensors if t.dtype != t.src_dtype]
    cast_bytes = sum(t.nbytes for t in casts)
    pure = cast_bytes <= PURE_CAST_BYTES and all((t.src_dtype, t.dtype) == ("bfloat16", "float32") for t in casts)
    worker, maps = executor.Worker(pure_upcast=pure, storage_options=storage_options, check=check), \
        torchzip.SourceMaps()
    began = time.perf_counter()
    worker.use_torch = casting.torch_pays(casting.slow_downcast_bytes(casts))  # torch's one-pass kernel
    worker.stats.imports_seconds += time.perf_counter() - began  # (ml_dtypes and numpy imported here for bf16)
    try:
        with publish.Publisher(out, "merge", source.root if source else None, durable,
                               storage_options=out_opts) as pub:
            works = works_.merge_works(plan, maps, executor.CHUNK_BYTES)
            # done == total at the end: the weight files' bytes, headers included (plan.total_size: tensors only)
            step = stepper(sum(w.size for w in works), progress)
            # an object store's files go up one at a time, each from a local scratch file
            write_works(works, pub, workers, worker, maps, step, durable, lanes=1 if pub.remote else None)
            for name, data in (extra_files or {}).items():
                pub.write_bytes(name, data)
            if plan.index is not None:
                pub.write_bytes(plan.index_name, (json.dumps(plan.index, indent=2) + "\n").encode())
            if check is not None:  # a damaged input is refused here: nothing has been published
                check.finish()
            pub.commit()
    finally:
        worker.close()
        maps.close()
    return worker.stats.to_json()


def write_works(works: list, pub, workers: int, worker: executor.Worker, maps: torchzip.SourceMaps, step,
                durable: bool, storage_options: dict | None = None, check: InputCheck | None = None,
                lanes: int | None = None) -> None:
    """Every :class:`zckpt.engine.works.FileWork` through ``pub``: the files created at their final size first (a
    full disk or a file-size limit is met before a byte is written; an object store's scratch files instead as
    each is reached), then written several at once (:func:`zckpt.engine.lanes.write_files`), each given its
    headers (``meta``, with its entries' CRC-32s) once its jobs are written; ``step(n)``: bytes written. A file
    copied whole (``src``) is jobs like the others (:func:`zckpt.engine.works.copy_work`), its pieces cut at the
    source's zip entries when ``check`` is given, so that every entry's CRC-32 is checked from the bytes read."""
    works = [w if w.src is None else works_.copy_work(
        w.relpath, w.src, w.size, executor.CHUNK_BYTES, check.directory(w.src) if check is not None else ())
        for w in works]
    targets = []
    for fi, w in enumerate(works):
        path = pub.path(w.relpath)
        if not pub.remote:
            executor.test_delay()
            _lanes.create(path, w.size)
        targets.append(_lanes.Target(fi, path, list(w.jobs), size=w.size if pub.remote else None))
    if not pub.remote and tees.SHARE_READS:  # a cast job also writes the bytes a copy would read (engine/tees)
        shared = tees.share_reads(targets)
        worker.stats.read_once += shared
        if shared:
            log.debug("  %s read once for a cast and a copy", format_size(shared))

    def done(t, fd):  # (its bytes reported by write_files: in a forked child's files, to this process's bar)
        w = works[t.key]
        executor.pwrite_pieces(fd, w.meta({slot: c for slot, (c, _) in t.crcs.items()}))
        # the bytes no job wrote, counted here and not before the writing (where the plan waits for them): each
        # process counts its own files', a few ms for the thousands of jobs of a 13 GB conversion
        return w.size - sum(works_.job_bytes(parts, dtype) for _, _, parts, dtype in w.jobs)

    def closed(t):
        pub.done(works[t.key].relpath)  # URL outputs: uploaded now
        log.debug("  wrote %s (%s)", works[t.key].relpath, format_size(works[t.key].size))

    pool = ThreadPoolExecutor(workers)
    try:
        _lanes.write_files(targets, pool, worker, maps.crc, lanes=lanes, durable=durable, progress=step, done=done,
                           closed=closed)
    finally:
        _lanes.stop_pool(pool)


def run_reshard(plan, out: str, workers: int | None = None, overwrite: bool = False,
                progress: Callable[[int, int], None] | None = None, latest_name: str = "latest",
                durable: bool = False, source: publish.Source | None = None,
                storage_options: dict | None = None, kind: str = "reshard", check: InputCheck | None = None) -> dict:
    """Write a DeepSpeed ``plan`` (:class:`zckpt.deepspeed.target.ReshardPlan`: torch archives and copies) into the
    folder ``out`` atomically (:mod:`zckpt.io.publish`: temp sibling, ``latest`` and the
    ``.zckpt.json`` marker last, rename); ``overwrite`` replaces only a previous zckpt output of ``kind`` (the
    command that made it, in the marker: "reshard", or "convert" for ``zckpt convert --to deepspeed``).

    As with merge, the folder appears whole or not at all whenever the process dies; ``durable=True`` also
    fsyncs every file (flushing each while the next is written) before ``latest`` and the rename.
    ``storage_options``: fsspec options for reading a source behind a URL (the checkpoint's). Returns what was read
    from remote sources (bytes, ranged GETs, seconds waited for them). ``check``: the input check every byte read
    is reported to; the CRC-32 of every input zip entry read is checked before anything is published (copied
    files are checked as they are copied)."""
    if any(f.kind not in ("torch", "copy") for f in plan.files):
        raise InvalidArgument("this plan's files are objects to load (plan_ranks), not files to write",
                              hint="plan with plan_reshard")
    publish.check_output(out, kind, source, overwrite)
    workers = workers or works_.write_workers()
    step = stepper(plan.total_bytes, progress)

    worker, maps = executor.Worker(storage_options=storage_options, check=check), torchzip.SourceMaps()
    try:
        with publish.Publisher(out, kind, source.root if source else plan.source, durable) as pub:
            works = works_.reshard_works(plan, maps, executor.CHUNK_BYTES)
            write_works(works, pub, workers, worker, maps, step, durable, storage_options, check)
            # DeepSpeed writes the bare tag, no newline
            pub.write_bytes(latest_name, (plan.tag if plan.fmt == "deepspeed" else f"{plan.tag}_universal").encode())
            if check is not None:  # a damaged input is refused here: nothing has been published
                check.finish()
            pub.commit()
    finally:
        worker.close()
        maps.close()
    return worker.stats.to_json()


def write_dcp_part(plan, pub, pool=None, worker=None, maps=None, progress=None, fsync: bool = False,
                   folder: str = "") -> None:
    """Write one DCP layout ``plan`` (:class:`zckpt.dcp.writer.DcpPlan`) through ``pub`` (a
    :class:`zckpt.io.publish.Publisher`), into its sub-folder ``folder`` when given: every ``.distcp`` file,
    then ``.metadata`` last (DCP's commit marker). ``progress(n)`` is called with the bytes written."""
    for f in plan.files:
        rel = f"{folder}/{f.name}" if folder else f.name
        dst = pub.path(rel)
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            allocation.allocate(fd, f.size)
            torchzip.write_archives(f.placed, fd, pool, progress, worker, maps)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if progress:
            progress(f.size - sum(a.payload_bytes for a, _ in f.placed))
        pub.done(rel)
    pub.write_bytes(f"{folder}/{plan.commit_name}" if folder else plan.commit_name, plan.metadata)
    if progress:
        progress(len(plan.metadata))


def run_convert(plan, out: str, workers: int | None = None, overwrite: bool = False,
                progress: Callable[[int, int], None] | None = None, durable: bool = False,
                source: publish.Source | None = None, storage_options: dict | None = None,
                check: InputCheck | None = None) -> dict:
    """Write a DCP ``plan`` (:class:`zckpt.dcp.plan.ConvertPlan`) into the folder ``out``: a scratch sibling, the
    data files, ``.metadata`` (DCP's commit), zckpt's marker, then one rename (:class:`zckpt.io.publish.Publisher`).
    ``check``: the input check every byte read is reported to, checked before the rename."""
    publish.check_output(out, "convert", source, overwrite)
    workers = workers or works_.write_workers()
    step = stepper(plan.total_bytes, progress)

    worker, maps = executor.Worker(storage_options=storage_options, check=check), torchzip.SourceMaps()
    try:
        with publish.Publisher(out, "convert", source.root if source else plan.source, durable) as pub:
            # the Trainer's own files first; every layout's .distcp files; the DCP .metadata files (commits) last
            works = works_.convert_works(plan, maps, executor.CHUNK_BYTES)
            write_works(works, pub, workers, worker, maps, step, durable, storage_options, check)
            for folder, part in plan.parts:
                pub.write_bytes(works_.part_path(folder, part.commit_name), part.metadata)
                step(len(part.metadata))
            for rel, data in getattr(plan, "written", ()):  # small files a format writes last (Megatron's latest)
                pub.write_bytes(rel, data)
                step(len(data))
            if check is not None:  # a damaged input is refused here: nothing has been published
                check.finish()
            pub.commit()
    finally:
        worker.close()
        maps.close()
    return worker.stats.to_json()

