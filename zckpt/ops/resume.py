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

A mixture-of-experts engine (ZeRO-1/2, native MoE or AutoEP) takes a checkpoint of its own expert-parallel sizes
at any data-parallel size: the plan holds the rank's optimizer file (dense groups over every rank, each expert
group over the rank's expert-data-parallel group) and the expert files of the rank's expert-parallel ranks, which
DeepSpeed asks for by name; names are compared under the checkpoint's global expert ids (:func:`_moe_experts`).

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
from zckpt.engine.segments import Cast, Fill, coalesce
from zckpt.engine.torchzip import TensorOut, dumps
from zckpt.state import checksums
from zckpt.engine.launch import agree

log = logging.getLogger(__name__)



# ---------------------------------------------------------------------------------------------- target

@dataclass
class Target:
    """What the live engine expects: its data-parallel layout and optimizer."""

    world_size: int
    rank: int
    stage: int
    bf16_optimizer: bool
    precision: str
    zero: dict = field(default_factory=dict)  # layout-shaping zero_optimization values

    @property
    def flavour(self) -> str:
        return "zero3" if self.stage == 3 else ("bf16_optimizer" if self.bf16_optimizer else "zero")


def engine_target(engine) -> Target:
    """The target layout of a DeepSpeed engine (raises :class:`UnsupportedLayout` for what zckpt cannot feed)."""
    import deepspeed.comm as dist
    stage = int(engine.zero_optimization_stage())
    if stage == 0 or engine.optimizer is None:
        raise UnsupportedLayout("the engine does not use a ZeRO optimizer (stage 0); load with engine.load_checkpoint")
    if getattr(engine, "pipeline_parallelism", False):
        raise UnsupportedLayout("pipeline-parallel engines are not loaded by zckpt.deepspeed.load_checkpoint: run "
                                "`zckpt reshard --world-size <data-parallel size>` (stages kept), then "
                                "engine.load_checkpoint")
    if int(getattr(engine, "mp_world_size", 1) or 1) > 1:
        raise UnsupportedLayout("model-parallel engines (mp_world_size > 1) are not supported")
    if getattr(engine, "has_moe_layers", False) and stage == 3:
        raise UnsupportedLayout("mixture-of-experts engines at ZeRO-3 are not supported (zckpt reshards MoE "
                                "checkpoints of ZeRO-1/2)")
    if engine.load_universal_checkpoint():
        raise InvalidArgument("the engine config sets checkpoint.load_universal",
                              hint="drop it: zckpt loads DeepSpeed's native layout at any world size")
    if engine.zero_nvme_offload_optimizer():
        raise UnsupportedLayout("NVMe optimizer offload is not supported (CPU offload is)")
    zc = engine._config.zero_config
    if getattr(zc, "round_robin_gradients", False):
        raise UnsupportedLayout("round_robin_gradients reorders the flat groups per world size; not supported")
    group = getattr(engine.optimizer, "dp_process_group", None)
    precision = "bf16" if engine.bfloat16_enabled() else ("fp16" if engine.fp16_enabled() else "fp32")
    bf16_optimizer = type(engine.optimizer).__name__ == "BF16_Optimizer"
    zero = {"sub_group_size": int(zc.sub_group_size)} if stage == 3 else \
        {"parameter_alignment": bool(getattr(zc, "parameter_alignment", False))}
    return Target(dist.get_world_size(group=group), dist.get_rank(group=group), 1 if bf16_optimizer else stage,
                  bf16_optimizer, precision, zero)


# ---------------------------------------------------------------------------------------------- validation

def _engine_params(engine) -> dict:
    """name -> (shape, trainable) of every parameter the engine's module has (tied aliases included), under the
    checkpoint's names (:func:`_moe_experts`: global expert ids, AutoEP's fused experts at their full shape).
    Trainable: ``requires_grad``, and in one of the optimizer's flat groups where the optimizer shows them (a
    parameter in no param group is read from ``module``, as a frozen one)."""
    experts = _moe_experts(engine)
    opt = getattr(engine, "optimizer", None)
    flat = next((getattr(opt, a) for a in ("bit16_groups", "bf16_groups", "fp16_groups")
                 if isinstance(getattr(opt, a, None), list)), None)
    owned = {id(q) for g in flat for q in g} if flat is not None else None
    out = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        shape = tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
        name, shape = experts.get(name, (name, shape))
        out[name] = (shape, bool(p.requires_grad) and (owned is None or id(p) in owned))
    return out


def _moe_experts(engine) -> dict:
    """The engine's expert parameters: live name -> (checkpoint name, checkpoint shape). A native MoE layer's
    local expert i of expert-parallel rank e is global expert ``e * num_local + i``; an AutoEP layer's fused
    ``experts.wK`` of ``[num_local, ...]`` is ``[num_local * ep_size, ...]`` in the checkpoint."""
    if not getattr(engine, "has_moe_layers", False):
        return {}
    import re
    from deepspeed.utils import groups
    out = {}
    for mname, mod in engine.module.named_modules():
        prefix = f"{mname}." if mname else ""
        if type(mod).__name__ == "AutoEPMoELayer":
            for w in ("w1", "w2", "w3"):
                p = getattr(mod.experts, w, None)
                if p is not None:
                    out[f"{prefix}experts.{w}"] = (f"{prefix}experts.{w}", (int(p.shape[0]) * int(mod.ep_size),
                                                                          *p.shape[1:]))
        elif hasattr(mod, "expert_group_name") and hasattr(mod, "num_local_experts") and hasattr(mod, "deepspeed_moe"):
            e, nlocal = groups._get_expert_parallel_rank(mod.expert_group_name), int(mod.num_local_experts)
            pat = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..+)$")
            for name, p in mod.named_parameters(prefix=mname, remove_duplicate=False):
                m = pat.match(name)
                if m:
                    out[name] = (f"{m.group(1)}{e * nlocal + int(m.group(2))}{m.group(3)}", tuple(p.shape))
    return out


def _engine_ep_sizes(engine) -> set[int]:
    """The expert-parallel sizes of the engine's MoE layers (native ``ep_size``, AutoEP ``ep_size``)."""
    sizes = set()
    for _, mod in engine.module.named_modules():
        if type(mod).__name__ == "AutoEPMoELayer" or (hasattr(mod, "expert_group_name") and hasattr(mod, "ep_size")):
            sizes.add(int(mod.ep_size))
    return sizes


def _engine_buffers(engine) -> dict:
    out = {}
    for mname, mod in engine.module.named_modules():
        for bname, buf in mod.named_buffers(recurse=False):
            if buf is not None and bname not in mod._non_persistent_buffers_set:
                out[f"{mname}.{bname}" if mname else bname] = tuple(buf.shape)
    return out


def _engine_groups(engine, target: Target) -> list[list[str]] | None:
    """Parameter names of the engine's flat groups (stage 1/2, BF16 optimizer: one per optimizer param group;
    stage 3: one per sub-group), or None when the optimizer does not expose them."""
    opt = engine.optimizer
    attr = "fp16_groups" if target.stage == 3 else ("bf16_groups" if target.bf16_optimizer else "bit16_groups")
    groups = getattr(opt, attr, None)
    if groups is None:
        return None
    names, experts = getattr(engine, "param_names", {}), _moe_experts(engine)
    return [[experts.get(names.get(p, "?"), (names.get(p, "?"),))[0] for p in g] for g in groups]


def _engine_partitions(engine, target: Target) -> list[int] | None:
    """This rank's fp32 partition sizes per flat group (as held by the optimizer)."""
    opt = engine.optimizer
    attr = "fp32_partitioned_groups_flat" if target.stage == 3 else \
        ("fp32_groups_flat_partition" if target.bf16_optimizer else "single_partition_of_fp32_groups")
    flats = getattr(opt, attr, None)
    if flats is None:
        return None
    return [int(t.numel()) for t in flats]


def check_compatible(ckpt: Checkpoint, engine, target: Target) -> None:
    """Refuse a source that cannot fill this engine: precision, names, shapes, trainable/frozen, groups."""
    path = ckpt.location.tag_dir
    if ckpt.precision != target.precision:
        raise InvalidArgument(f"the checkpoint was trained in {ckpt.precision}, the engine runs {target.precision}",
                              path=path, hint="start the engine with the checkpoint's precision")
    moe = _check_moe_engine(ckpt, engine)
    layout = moe.layout if moe is not None else None
    params, buffers = _engine_params(engine), _engine_buffers(engine)
    recs = ckpt.by_name()
    for name, (shape, trainable) in params.items():
        rec = recs.get(name)
        if rec is None or rec.kind == "buffer":
            raise InvalidArgument(f"the model's parameter '{name}' is not in the checkpoint", path=path,
                                  hint="resume with the model the checkpoint was saved from")
        if tuple(rec.shape) != shape:
            raise InvalidArgument(f"'{name}' has shape {list(rec.shape)} in the checkpoint but {list(shape)} in the "
                                  "model", path=path, hint="resume with the model the checkpoint was saved from")
        kind = recs[rec.tied_to].kind if rec.kind == "tied" and rec.tied_to in recs else rec.kind
        # a zero-element parameter is never the optimizer's (DeepSpeed saves it with the frozen ones, trainable
        # or not): nothing to tell apart, nothing to restore
        if (kind == "trainable") != trainable and 0 not in shape:
            state = "trainable" if kind == "trainable" else "frozen"
            raise InvalidArgument(f"'{name}' is {state} in the checkpoint but not in the model", path=path,
                                  hint="freeze the same parameters as the run that saved it")
    for name, shape in buffers.items():
        rec = recs.get(name)
        if rec is not None and rec.kind == "buffer" and tuple(rec.shape) != shape:
            raise InvalidArgument(f"buffer '{name}' has shape {list(rec.shape)} in the checkpoint but {list(shape)} "
                                  "in the model", path=path)
    extra = [r.name for r in ckpt.records if r.kind != "buffer" and r.name not in params
             and not (moe is not None and r.name in moe.other_experts)]  # other expert-parallel ranks'
    if extra:
        raise InvalidArgument(f"the checkpoint has parameters the model lacks: {', '.join(extra[:5])}"
                              + (" ..." if len(extra) > 5 else ""), path=path)
    want = [list(g.names) for g in ckpt.groups]
    if layout is not None:  # an expert group holds this rank's experts only
        want = [[r.name for _, r in layout.shards[g.index][layout.ep_rank(
            ckpt.model_state, target.world_size, layout.ep[g.index], target.rank, path)[0]]]
                if g.index in layout.ep else names for g, names in zip(ckpt.groups, want)]
    have = _engine_groups(engine, target)
    if have is not None and target.stage != 3 and have != want:
        raise InvalidArgument(f"the optimizer's param groups differ from the checkpoint's ({len(have)} groups of "
                              f"{[len(g) for g in have]} params vs {len(want)} of {[len(g) for g in want]})",
                              path=path, hint="build the optimizer's param groups as the run that saved it did")
    if have is not None and target.stage == 3 and [n for g in have for n in g] != [n for g in want for n in g]:
        raise InvalidArgument("the optimizer's parameters (or their order) differ from the checkpoint's", path=path,
                              hint="build the optimizer's param groups as the run that saved it did")


@dataclass
class _EngineMoE:
    """The MoE layout of a checkpoint as one rank of the engine sees it."""

    layout: object  # zckpt.deepspeed.moe.MoELayout
    other_experts: set  # expert parameters held by other expert-parallel ranks (absent from this rank's module)


def _check_moe_engine(ckpt: Checkpoint, engine) -> _EngineMoE | None:
    """An MoE engine takes an MoE checkpoint of its expert-parallel sizes (resharded on its data-parallel size
    only), anything else takes a dense one; refused in one line otherwise."""
    path = ckpt.location.tag_dir
    moe_engine = bool(getattr(engine, "has_moe_layers", False))
    if ckpt.parallel == "moe" and not moe_engine:
        raise InvalidArgument("a mixture-of-experts checkpoint into an engine without MoE layers", path=path,
                              hint="resume with the model the checkpoint was saved from")
    if not moe_engine:
        return None
    if ckpt.parallel != "moe":
        raise InvalidArgument("the engine has mixture-of-experts layers, the checkpoint none", path=path,
                              hint="resume with the model the checkpoint was saved from")
    layout = ckpt.extra.get("moe")
    if layout is None:
        raise UnsupportedLayout(ckpt.reshard_refusal or "this mixture-of-experts checkpoint is not resharded",
                                path=path, hint="load it with engine.load_checkpoint")
    have, want = _engine_ep_sizes(engine), set(layout.ep.values())
    if have != want:
        raise UnsupportedLayout(f"the checkpoint's expert-parallel size {sorted(want)} differs from the engine's "
                                f"{sorted(have)}: changing the expert-parallel size is not supported", path=path,
                                hint="start the engine with the checkpoint's expert-parallel size")
    mine = {n for n, _ in _moe_experts(engine).values()}
    names = {r.name for by_rank in layout.shards.values() for recs in by_rank.values() for _, r in recs}
    names |= {key for tensors, _, _ in layout.expert_files.values() for key, _ in tensors}
    return _EngineMoE(layout, names - mine)


def check_plan(plan, engine, target: Target) -> None:
    """The planned fp32 partitions of this rank have the sizes the engine's optimizer holds."""
    have = _engine_partitions(engine, target)
    if have is None:
        return
    osd = _own_optim(plan, target)["optimizer_state_dict"]
    parts = osd["fp32_flat_groups"] if target.stage == 3 else osd["single_partition_of_fp32_groups"]
    want = [t.numel for t in parts]
    if target.stage != 3 and not target.bf16_optimizer:  # the engine holds the padded partition
        want = [t.numel + pad for t, pad in zip(parts, osd["group_paddings"])]
    if want != have:
        raise InvalidArgument(f"rank {target.rank}'s planned partitions ({want}) differ from the engine's ({have})",
                              path=plan.source, hint="the engine's ZeRO settings do not match the checkpoint's")


def _own_optim(plan, target: Target):
    for f in plan.files:
        if "optim_states" in f.relpath:
            return f.obj
    raise InvalidArgument(f"no optimizer file planned for rank {target.rank}", path=plan.source)


# ---------------------------------------------------------------------------------------------- materialising

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
        outs = [torch.empty(t.numel, dtype=torch_dtype(t.dtype)) for t in tensors]
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


def load_checkpoint(engine, path, tag: str | None = None, *, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, scratch_dir: str | None = None, force_reshard: bool = False,
                    storage_options: dict | None = None, verify: bool = False):
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
                  and ckpt.flavour == target.flavour)
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
                              zero=target.zero)
            check_plan(plan, engine, target)
            seconds["plan"] = time.perf_counter() - t0 - seconds["open"]
            check = checksums.input_check(ckpt, max_fill=None if verify else 1 / 16)
            mat = Materializer(storage_options=ckpt.storage_options, check=check)
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
