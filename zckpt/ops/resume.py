"""Resume a DeepSpeed engine from a checkpoint saved at another world size or ZeRO stage: reshard on load.

Every rank of the user's own launch runs :func:`load_checkpoint` (the same call DeepSpeed's own
``engine.load_checkpoint`` is); nothing but ``torch.distributed`` coordinates them::

    read       open_checkpoint(path)                 metadata of every source file (pickles only, no tensor data)
    target     the engine: dp world size M, dp rank r, stage, BF16 optimizer, precision, sub_group_size ...
    validate   names, shapes, trainable/frozen, optimizer groups and partition sizes against the engine's model
    plan       reshard.plan_ranks(ckpt, M, [r])      this rank's model-states and optimizer-states files only
    read       the plan's byte ranges of the source  (ranged reads; local or fsspec URL) -> torch objects in memory
    agree      one all_reduce of every rank's error (a flag and a one-line message): all raise the same, or go on
    load       engine.load_checkpoint(scratch, tag)  DeepSpeed's own load path, through a CheckpointEngine that
                                                     returns the in-memory objects for the names it asks for

A mixture-of-experts engine (native MoE at ZeRO-1/2, AutoEP at ZeRO-1/2/3) takes a checkpoint of the same MoE
layers at any data-parallel size and at the expert-parallel sizes its modules have (one per layer, read from the
engine: ``Target.ep`` where they differ), planned by the writers ``zckpt reshard --ep`` uses: the rank's optimizer
file (dense groups over every rank, each expert group over the rank's expert-data-parallel group) and the expert
files of the rank's expert-parallel ranks, which DeepSpeed asks for by name (AutoEP at ZeRO-3: the rank's model-
and optimizer-states files, with the placement records DeepSpeed checks); names are compared under the
checkpoint's global expert ids (:func:`zckpt.ops.resume_checks.moe_experts`).

The scratch folder holds only empty placeholders of this rank's model-states file names (DeepSpeed globs and
``os.path.exists`` them before loading; AutoEP checks its expert files too); nothing is written for the model.
DeepSpeed 0.19.8 loads only its own optimizer file (``_get_all_zero_checkpoint_state_dicts``); for other ranks' names (an ``elastic_checkpoint``
engine asks for every one) the engine returns what DeepSpeed itself substitutes, ``{"optimizer_state_dict": None}``:
rigid checkpoints (all that zckpt writes) only use the current rank's.

The in-memory objects are what ``torch.load`` gives for the file ``zckpt reshard`` writes: the same planner, the same
pickle (:func:`zckpt.engine.torchzip.dumps`), unpickled with storages filled from the source byte ranges, so the engine
state is bit-identical to the offline route. The pickle is zckpt's own, made from metadata that passed
:mod:`zckpt.encoding.safeload`'s allow-list, and unpickling it resolves only names on that list. Same world size, stage and optimizer, from a local folder: the checkpoint is loaded as it is, by
``engine.load_checkpoint``, after the same validation.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import pickle
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field

from zckpt import errors
from zckpt.io import storage
from zckpt.state.model import Checkpoint
from zckpt.state.open import open_checkpoint
from zckpt.errors import InvalidArgument, UnsafePickle, UnsupportedLayout
from zckpt.encoding.safeload import ALLOWED_GLOBALS, DTYPE_SIZES
from zckpt.engine.executor import env_int
from zckpt.engine.segments import Cast, Fill, Piece, coalesce
from zckpt.engine.torchzip import TensorOut, dumps
from zckpt.state import checksums
from zckpt.engine.launch import agree
from zckpt.ops.resume_checks import Target, check_compatible, check_plan, engine_target, reorder_groups

log = logging.getLogger(__name__)


def _import_readers() -> None:
    """Import every format's reader now, with this module (a trainer imports it at start-up, beside torch and
    DeepSpeed): the opener asks each in turn, and importing them inside load_checkpoint was 0.06 s of its 0.47 s
    on the lent 16-core host (168M params, 4 -> 6 ranks; docs/benchmarks.md, "resume")."""
    from zckpt.state import formats
    for fmt in formats.readers():
        fmt.preload()


_import_readers()


# ---------------------------------------------------------------------------------------------- materialising

READ_WORKERS = None  # threads per rank reading its ranges; None: read_workers()
READ_CHUNK = 8 << 20  # bytes one read job takes at most: a large tensor is read by every thread, and its CRC-32 is
#                       taken while its bytes are still in the CPU's cache


def read_workers() -> int:
    """Threads per rank for the ranged reads: the CPU count, at most 8 (``ZCKPT_RESUME_WORKERS`` overrides)."""
    return env_int("ZCKPT_RESUME_WORKERS", READ_WORKERS or min(8, os.cpu_count() or 2))


class _Landed:
    """Where source bytes already read sit in the outputs: per source file, (start, end, output, byte position)
    of every piece read, so a later piece or cast over the same bytes copies them instead of reading again."""

    def __init__(self):
        self.spans: dict[str, list[tuple[int, int, int, int]]] = {}

    def add(self, piece, out: int, pos: int) -> None:
        bisect.insort(self.spans.setdefault(piece.path, []), (piece.offset, piece.offset + piece.nbytes, out, pos))

    def find(self, piece) -> list[tuple[int, int, int]] | None:
        """(output, byte position, length) runs holding ``piece``'s bytes, or None when some are not read yet."""
        spans = self.spans.get(piece.path)
        if not spans:
            return None
        runs, cur, end = [], piece.offset, piece.offset + piece.nbytes
        while cur < end:
            i = bisect.bisect_right(spans, (cur, float("inf"))) - 1
            while i >= 0 and spans[i][1] <= cur:  # the nearest span starting at or before cur that reaches past it
                i -= 1
            if i < 0 or spans[i][0] > cur:
                return None
            start, stop, out, pos = spans[i]
            n = min(stop, end) - cur
            runs.append((out, pos + cur - start, n))
            cur += n
        return runs


HUGE_BYTES = 32 << 20  # tensors this large are allocated in transparent huge pages (below: torch.empty)


def _empty(numel: int, dtype):
    """A new flat CPU tensor; from :data:`HUGE_BYTES` up, backed by its own anonymous map advised to use
    transparent huge pages (``MADV_HUGEPAGE``), where torch's allocator gives 4 KiB pages on hosts that set THP
    to ``madvise``: faulting in fresh pages was about half the cost of reading them from the page cache (0.21
    against 0.10 s for 670 MB on the 2-core machine). The map lives as long as the tensor (DeepSpeed keeps the
    optimizer moments it is given); ``ZCKPT_HUGEPAGES=0``: torch.empty always."""
    import torch
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes < HUGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE") or os.environ.get("ZCKPT_HUGEPAGES", "1") == "0":
        return torch.empty(numel, dtype=dtype)
    try:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return torch.empty(numel, dtype=dtype)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without THP: plain pages
        pass
    return torch.frombuffer(m, dtype=dtype, count=numel)


def _chunks(seg, i: int, pos: int):
    """The read jobs of piece ``seg`` landing at byte ``pos`` of output ``i``: runs of at most :data:`READ_CHUNK`."""
    size = DTYPE_SIZES[seg.dtype]
    step = max(1, READ_CHUNK // size)
    if seg.numel <= step:
        yield seg, i, pos
        return
    for k in range(0, seg.numel, step):
        yield Piece(seg.path, seg.offset + k * size, min(step, seg.numel - k), seg.dtype), i, pos + k * size


class Materializer:
    """Turns planned objects (:class:`TensorOut` leaves) into what ``torch.load`` of the written files returns.

    :meth:`load_all` reads each source byte once for all the objects of a call: every piece is read straight into
    the first output that holds it; a later piece over the same bytes, and a cast (bf16 module weights made from
    fp32 masters a ZeRO-3 source does not store in bf16), copy them from there."""

    def __init__(self, workers: int | None = None, storage_options: dict | None = None, check=None):
        from zckpt.encoding.tensors import Reader
        # thread-safe: one descriptor per file, positioned reads; URLs with the source's ``storage_options``
        self.reader = Reader(storage_options)
        self.reader.check = check  # every piece read reported to the input check (zckpt.engine.checked)
        self.workers = workers or min(8, os.cpu_count() or 2)
        self.bytes_read = 0  # tensor bytes read from the source files
        self.lock = threading.Lock()

    def _read(self, piece, buf) -> None:
        self.reader.read_into(piece, buf)
        with self.lock:
            self.bytes_read += piece.nbytes

    def fill(self, tensors: list[TensorOut]) -> list:
        """Flat torch tensors holding ``tensors``' segments (pieces read, zero fill, casts as torch's ``Tensor.to``)."""
        import torch
        from concurrent.futures import ThreadPoolExecutor
        from zckpt.encoding.tensors import torch_dtype
        outs = [_empty(t.numel, torch_dtype(t.dtype)) for t in tensors]
        raws = [o.view(torch.uint8) if t.numel else None for o, t in zip(outs, tensors)]
        landed, reads, copies, casts = _Landed(), [], [], []
        for i, t in enumerate(tensors):  # plan: which piece is read, which copied, which cast
            pos, size = 0, DTYPE_SIZES[t.dtype]
            for seg in coalesce(t.segments):
                if isinstance(seg, (bytes, bytearray)):
                    raws[i][pos:pos + len(seg)].copy_(torch.frombuffer(bytearray(seg), dtype=torch.uint8))
                    pos += len(seg)
                elif isinstance(seg, Fill):
                    raws[i][pos:pos + seg.numel * size].zero_()
                    pos += seg.numel * size
                elif isinstance(seg, Cast):
                    casts.append((seg, i, pos))
                    pos += seg.numel * size
                else:  # Piece
                    if seg.dtype != t.dtype:
                        raise ValueError(f"piece of {seg.dtype} in a {t.dtype} tensor")
                    runs = landed.find(seg)
                    if runs is None:
                        reads.append((seg, i, pos))
                        landed.add(seg, i, pos)
                    else:
                        copies.append((runs, i, pos))
                    pos += seg.nbytes
            if pos != t.numel * size:
                raise errors.CorruptFile(f"planned segments hold {pos} bytes, the tensor needs {t.numel * size}")

        def read(job):
            seg, i, pos = job
            self._read(seg, memoryview(raws[i][pos:pos + seg.nbytes].numpy()))

        reads = [job for seg, i, pos in reads for job in _chunks(seg, i, pos)]
        if len(reads) > 1 and self.workers > 1:  # reads release the GIL
            with ThreadPoolExecutor(min(self.workers, len(reads))) as pool:
                list(pool.map(read, reads))
        else:
            for job in reads:
                read(job)
        for runs, i, pos in copies:
            pos = self._gather(runs, raws, raws[i], pos)
        for seg, i, pos in casts:
            src = torch.empty(seg.numel, dtype=torch_dtype(seg.src_dtype))
            at, raw = 0, src.view(torch.uint8) if seg.numel else None
            for p in seg.pieces:
                if p.dtype != seg.src_dtype:  # bytes are never relabelled
                    raise ValueError(f"piece of {p.dtype} in a cast from {seg.src_dtype}")
                runs = landed.find(p)
                if runs is None:
                    self._read(p, memoryview(raw[at:at + p.nbytes].numpy()))
                    at += p.nbytes
                else:
                    at = self._gather(runs, raws, raw, at)
            n = seg.numel * outs[i].element_size()
            raws[i][pos:pos + n].copy_(src.to(outs[i].dtype).view(torch.uint8))
        return outs

    @staticmethod
    def _gather(runs, raws, dst, pos: int) -> int:
        for out, at, n in runs:
            dst[pos:pos + n].copy_(raws[out][at:at + n])
            pos += n
        return pos

    def tensor(self, t: TensorOut):
        """A flat torch tensor holding ``t``'s segments."""
        return self.fill([t])[0]

    def load_all(self, objs: list) -> list:
        """``torch.load`` of each file :func:`zckpt.engine.torchzip.save` would write for ``objs``, without the
        files; the source bytes all of them need are read once."""
        import io
        import torch
        dumped = [dumps(obj) for obj in objs]
        flats = self.fill([t for _, tensors in dumped for t in tensors])
        results, base = [], 0
        for pkl, tensors in dumped:
            mine, cache = flats[base:base + len(tensors)], {}
            base += len(tensors)

            class Unpickler(pickle.Unpickler):
                def find_class(self, module, name):
                    if f"{module}.{name}" not in ALLOWED_GLOBALS:  # what safeload let through, nothing else
                        raise UnsafePickle(f"unexpected global {module}.{name} in a planned object")
                    return super().find_class(module, name)

                def persistent_load(self, pid, mine=mine, cache=cache):
                    key = pid[2]
                    st = cache.get(key)
                    if st is None:
                        flat = mine[int(key)]
                        st = torch.storage.TypedStorage(wrap_storage=flat.untyped_storage(), dtype=flat.dtype,
                                                        _internal=True)
                        cache[key] = st
                    return st

            results.append(Unpickler(io.BytesIO(pkl)).load())
        return results

    def load(self, obj):
        """``torch.load`` of the file :func:`zckpt.engine.torchzip.save` would write for ``obj``, without the file."""
        return self.load_all([obj])[0]

    def close(self):
        self.reader.close()


# ---------------------------------------------------------------------------------------------- agreement
# agree(error, device): one all_reduce of every rank's error flag and one-line message, the same for every job that
# coordinates ranks (zckpt.engine.distributed: merge and reshard under a launcher, too)

# ---------------------------------------------------------------------------------------------- the load

def _checkpoint_engine_class():
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class InMemoryCheckpointEngine(CheckpointEngine):
        """Returns the objects zckpt built for the file names DeepSpeed asks for; delegates saving."""

        def __init__(self, objects: dict, other_optim: set, source: str, inner):
            super().__init__(None)
            self.name = "zckpt.InMemoryCheckpointEngine"
            self.objects, self.other_optim, self.source, self.inner = objects, other_optim, source, inner

        def load(self, path: str, map_location=None):
            name = os.path.basename(str(path))
            if name in self.objects:  # the model states are read twice (SDLoaderBase.check_ckpt_list first)
                return self.objects[name]
            if name in self.other_optim:  # another rank's partition: DeepSpeed's own stand-in
                return {"optimizer_state_dict": None}
            raise errors.CheckpointNotFound(f"DeepSpeed asked for {name}, which zckpt did not plan "
                                            f"(planned: {', '.join(sorted(self.objects))})", path=self.source)

        def create(self, info):
            return self.inner.create(info) if self.inner is not None else None

        def save(self, state_dict, path: str):
            return self.inner.save(state_dict, path)

        def commit(self, info):
            return self.inner.commit(info) if self.inner is not None else True

    return InMemoryCheckpointEngine


@dataclass
class ResumeInfo:
    """What :func:`load_checkpoint` did on this rank (``engine.zckpt_resume_info`` after a load)."""

    source: str
    tag: str
    mode: str  # "native" (same layout, plain load) or "reshard"
    source_world_size: int
    world_size: int
    source_stage: int
    stage: int
    rank: int
    bytes_read: int = 0  # every byte zckpt read from the source on this rank: metadata (pickles, zip directories,
    #                      headers) and tensors; in "native" mode DeepSpeed's own reads of its files are not counted
    source_bytes: int = 0  # size of every rank file of the source
    seconds: dict = field(default_factory=dict)
    tensor_bytes_read: int = 0  # the tensor bytes among them (each source byte at most once)
    crc_checked_entries: int = 0  # source zip entries whose CRC-32 this rank checked
    crc_unchecked_entries: int = 0  # entries this rank read only in part (others' partitions), not checked
    # an MoE checkpoint's expert-parallel size per MoE layer (in the checkpoint's layer order) and the engine's
    source_ep: list | None = None
    ep: list | None = None


def load_checkpoint(engine, path, tag: str | None = None, *, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, scratch_dir: str | None = None, force_reshard: bool = False,
                    storage_options: dict | None = None, verify: bool = False, workers: int | None = None):
    """Load the checkpoint at ``path`` into ``engine``, whatever world size and ZeRO stage it was saved at.

    Call it on every rank, like ``engine.load_checkpoint``, whose arguments and result (``(load_path,
    client_state)``) it mirrors. ``path``: a save folder (with ``latest``), a tag folder or a Trainer
    ``checkpoint-N``; local or a URL (``s3://``...: ranged reads). Each rank reads the metadata of every source
    file and the byte ranges of its own new partition plus the module states, and hands them to DeepSpeed's load
    path in memory. A source that does not fit the engine (missing or damaged file, other precision, a shape or
    group mismatch) raises the same one-line :class:`~zckpt.errors.ZckptError` on every rank before any state is
    touched. ``force_reshard``: take the in-memory route even where a plain load would do (tests, benchmarks).
    ``scratch_dir``: where the empty placeholder file goes (default: the system temp folder).
    ``storage_options``: fsspec options for a URL ``path`` (endpoint, credentials...), for this call only.
    ``workers``: threads reading this rank's byte ranges (default: :data:`READ_WORKERS`).

    Checksums: every source zip entry this rank reads whole (or all but a sixteenth of: partition padding) has its
    CRC-32 checked before anything is loaded; an entry it reads only a part of (a partition split across the new
    ranks) cannot be checked from that part. ``verify=True`` reads every entry this rank reads from whole, and in
    the plain-load case (same size and stage) every entry of the files this rank's DeepSpeed loads, and checks
    them all (more reads; ``zckpt verify --deep`` checks every file once, offline).
    """
    t0 = time.perf_counter()
    path = os.fspath(path)
    device = getattr(engine, "device", None)
    objects, plan, target, ckpt, mat, error, check = {}, None, None, None, None, None, None
    native = False
    seconds = {}
    meter = storage.read_meter(path)  # every byte zckpt reads from the source in this call, in any thread
    read = meter.__enter__()
    try:
        target = engine_target(engine)
        ckpt = open_checkpoint(path, tag, storage_options)
        seconds["open"] = time.perf_counter() - t0
        check_compatible(ckpt, engine, target)
        native = (not force_reshard and not storage.is_url(ckpt.location.tag_dir)
                  and ckpt.world_size == target.world_size and ckpt.stage == target.stage
                  and ckpt.flavour == target.flavour and target.ep is None and target.group_order is None)
        if not native and target.stage == 3 and not load_optimizer_states:
            # DeepSpeed then rebuilds the module from the fp32 files on disk (get_fp32_state_dict_from_zero_checkpoint)
            raise InvalidArgument("a ZeRO-3 engine with load_optimizer_states=False reads the source files itself",
                                  hint="use zckpt.load_into_module for weights only")
        if not native and _elastic(ckpt):
            # DeepSpeed rebuilds every rank's partition from all elastic files: each rank would need them all
            raise UnsupportedLayout("elastic ZeRO checkpoint (elastic_checkpoint=true) at another world size or "
                                    "stage", path=ckpt.location.tag_dir, hint="reshard it offline with zckpt reshard")
        if not native:
            from zckpt.deepspeed.writer import plan_ranks
            plan = plan_ranks(ckpt, target.world_size, [target.rank], target.stage, target.bf16_optimizer,
                              zero=target.zero, ep=target.ep, max_group_size=target.max_group_size)
            reorder_groups(plan, target)
            check_plan(plan, engine, target)
            seconds["plan"] = time.perf_counter() - t0 - seconds["open"]
            check = checksums.input_check(ckpt, max_fill=None if verify else 1 / 16)
            mat = Materializer(workers or read_workers(), storage_options=ckpt.storage_options, check=check)
            for f, obj in zip(plan.files, mat.load_all([f.obj for f in plan.files])):
                objects[os.path.basename(f.relpath)] = obj
            check.finish()
            seconds["read"] = time.perf_counter() - t0 - seconds["open"] - seconds["plan"]
        elif verify:
            check = checksums.input_check(ckpt)
            for f in ckpt.files:  # what this rank's DeepSpeed loads: the shared files and its own
                if f.dp_rank in (None, target.rank):
                    check.check_copy(f.path, f.path)
    except Exception as exc:  # noqa: BLE001 - every failure is agreed on, then raised on every rank
        error = exc
    finally:
        if mat is not None:
            mat.close()
        if check is not None:
            check.close()
        meter.__exit__(None, None, None)
    agree(error, device)

    info = ResumeInfo(ckpt.location.input_path, ckpt.tag, "native" if native else "reshard", ckpt.world_size,
                      target.world_size, ckpt.stage, target.stage, target.rank,
                      read.bytes, sum(max(f.size, 0) for f in ckpt.files), seconds,
                      mat.bytes_read if mat is not None else 0,
                      check.checked if check is not None else 0, check.unchecked if check is not None else 0)
    cover = sorted(ckpt.extra.get("moe_coverage") or [], key=lambda x: x["index"])
    if cover:
        info.source_ep = [int(x.get("ep") or 1) for x in cover]
        info.ep = list(info.source_ep) if target.ep is None else \
            [target.ep] * len(cover) if isinstance(target.ep, int) else list(target.ep)
    kw = dict(load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
              load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only)
    t1 = time.perf_counter()
    if native:
        load_dir = os.path.dirname(ckpt.location.tag_dir.rstrip("/"))
        result = original_load_checkpoint(engine)(load_dir, tag=ckpt.tag, **kw)
    else:
        result = _load_in_memory(engine, ckpt, plan, target, objects, scratch_dir, kw)
    seconds["load"] = time.perf_counter() - t1
    engine.zckpt_resume_info = info
    log.info("zckpt: rank %d resumed %s (%s, %d -> %d ranks, stage %d -> %d) in %.2fs", target.rank, path,
             info.mode, ckpt.world_size, target.world_size, ckpt.stage, target.stage, time.perf_counter() - t0)
    return result


def _elastic(ckpt: Checkpoint) -> bool:
    """ZeRO-1/2 saved with ``elastic_checkpoint: true`` (``base_optimizer_state`` is a list of group states)."""
    if ckpt.flavour == "zero3" or not ckpt.optim_states:
        return False
    osd = ckpt.optim_states[0].get("optimizer_state_dict") or {}
    return isinstance(osd.get("base_optimizer_state"), list)


def _load_in_memory(engine, ckpt: Checkpoint, plan, target: Target, objects: dict, scratch_dir, kw):
    prefix = "bf16_" if ckpt.precision == "bf16" else ""
    others = {f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(target.world_size)}
    others -= set(objects)
    tmp = tempfile.mkdtemp(prefix="zckpt-resume-", dir=scratch_dir)
    inner = engine.checkpoint_engine
    try:
        os.makedirs(os.path.join(tmp, ckpt.tag))
        for name in objects:
            if name.endswith("_model_states.pt"):  # DeepSpeed globs for it and asserts it exists: an empty stand-in
                open(os.path.join(tmp, ckpt.tag, name), "wb").close()
        engine.checkpoint_engine = _checkpoint_engine_class()(objects, others, ckpt.location.tag_dir, inner)
        load_path, client_state = original_load_checkpoint(engine)(tmp, tag=ckpt.tag, **kw)
    finally:
        engine.checkpoint_engine = inner
        objects.clear()
        shutil.rmtree(tmp, ignore_errors=True)
    if load_path is not None:
        load_path = storage.join(ckpt.location.tag_dir, os.path.basename(load_path))
    return load_path, client_state


# ---------------------------------------------------------------------------------------------- patching

_ORIGINAL = {}


def original_load_checkpoint(engine):
    """The engine's own ``load_checkpoint`` (bound), even while :func:`patch_deepspeed` is active."""
    fn = _ORIGINAL.get("load_checkpoint")
    if fn is None:
        return engine.load_checkpoint
    return fn.__get__(engine, type(engine))


def is_patched() -> bool:
    """Whether :func:`patch_deepspeed` is in effect."""
    return "load_checkpoint" in _ORIGINAL


def patch_deepspeed(storage_options: dict | None = None) -> None:
    """Route every ``DeepSpeedEngine.load_checkpoint(load_dir, tag, ...)`` call through :func:`load_checkpoint`
    (what the Hugging Face Trainer and Accelerate's ``load_state`` call). Undo with :func:`unpatch_deepspeed`.
    ``storage_options``: fsspec options for a URL ``load_dir``, handed to every patched call (patching again
    replaces them)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    original = _ORIGINAL.setdefault("load_checkpoint", DeepSpeedEngine.load_checkpoint)

    def load_checkpoint_anywhere(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                                 load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        if custom_load_fn is not None:
            return original(self, load_dir, tag, load_module_strict, load_optimizer_states,
                            load_lr_scheduler_states, load_module_only, custom_load_fn)
        return load_checkpoint(self, load_dir, tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                               storage_options=storage_options)

    load_checkpoint_anywhere.__doc__ = original.__doc__
    load_checkpoint_anywhere.__wrapped__ = original
    DeepSpeedEngine.load_checkpoint = load_checkpoint_anywhere


def unpatch_deepspeed() -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine
    original = _ORIGINAL.pop("load_checkpoint", None)
    if original is not None:
        DeepSpeedEngine.load_checkpoint = original


class resume_anywhere:  # noqa: N801 - used as a context manager / decorator, like torch.no_grad
    """``with resume_anywhere(): trainer.train(resume_from_checkpoint=...)``: every DeepSpeed engine's
    ``load_checkpoint`` inside the block reshards on load (see :func:`load_checkpoint`); ``storage_options`` are
    the fsspec options for a URL checkpoint. On leaving, the patch in place before the block (if any) is back."""

    def __init__(self, storage_options: dict | None = None):
        self.storage_options = storage_options

    def __enter__(self):
        from deepspeed.runtime.engine import DeepSpeedEngine
        self._previous = DeepSpeedEngine.load_checkpoint if is_patched() else None
        patch_deepspeed(self.storage_options)
        return self

    def __exit__(self, *exc):
        if self._previous is None:
            unpatch_deepspeed()
        else:
            from deepspeed.runtime.engine import DeepSpeedEngine
            DeepSpeedEngine.load_checkpoint = self._previous
        return False
