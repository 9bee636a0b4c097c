"""``zckpt merge``: any format's reader paired with the Hugging Face folder writer (:mod:`zckpt.hf.writer`): read
metadata, plan, stream bytes, publish atomically. Also the Python loaders (``iter_tensors``, ``load_state_dict``).

1. :func:`zckpt.hf.writer.plan_merge` turns a :class:`~zckpt.state.model.Checkpoint` into a ``MergePlan``: the
   output files (Hugging Face names, greedy sharding as ``huggingface_hub.split_torch_state_dict_into_shards`` does),
   each tensor's dtype, shape, byte offset in its file, and the input pieces it is made of. No bytes read.
2. :func:`execute` (:func:`zckpt.engine.run.run_merge`) writes every file at its final size: the header first (all
   shapes are known), then tensor bytes in chunks of at most ``executor.CHUNK_BYTES`` by a pool of threads, each with
   its own buffer, straight to their offsets (``pwrite``); same-dtype local copies use ``copy_file_range`` and never
   enter user space. Writes into one file are few at a time (the kernel serializes them on its inode), so several
   files are written at once (:mod:`zckpt.engine.lanes`); reads and casts run in parallel. Casts are numpy bit
   operations that round exactly as torch's ``Tensor.to`` (:mod:`zckpt.encoding.casting`).
3. :mod:`zckpt.io.publish` makes the result appear whole: files go into a temporary sibling folder, renamed into
   place with its ``.zckpt.json`` marker; an interrupted merge leaves the previous output, or nothing, where the
   output belongs. For URL outputs each shard is uploaded as soon as it is complete and the marker is written
   last (an output without a complete marker is incomplete). The output is checked first: never the
   checkpoint, inside it or around it; ``overwrite`` replaces only a previous zckpt merge output.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from zckpt.engine import run
from zckpt.engine.checked import InputCheck
from zckpt.io import publish
from zckpt.state import checksums
from zckpt.engine.run import shard_jobs  # noqa: F401 - the engine's, for callers
from zckpt.hf.writer import (  # noqa: F401 - the writer's names, for callers of the operation
    DTYPE_FLAGS, FORMATS, MergePlan, ShardPlan, out_dtype_name, output_tensors, parse_size, plan_merge,
    trainer_files,
)
from zckpt.state.model import Checkpoint
from zckpt.state.open import format_named, open_checkpoint
from zckpt.errors import InvalidArgument, OptionError, require_torch
from zckpt.units import format_size

log = logging.getLogger(__name__)


@dataclass
class MergeResult:
    output: str
    plan: MergePlan
    seconds: float = 0.0
    copied: list[str] = field(default_factory=list)
    dry_run: bool = False
    path: str | None = None  # the checkpoint read
    tag: str | None = None  # the tag read (the one 'latest' names, unless one was asked for)
    stats: dict = field(default_factory=dict)  # ranks, bytes per second, remote reads (engine.distributed.Stats)
    notes: list[str] = field(default_factory=list)  # what the reader says of the output (Megatron: its names)

    def to_dict(self) -> dict:
        """The fields ``--json`` prints (``to_json``, by the name every zckpt result has)."""
        return self.to_json()

    def to_json(self) -> dict:
        return {"path": self.path, "tag": self.tag, "output": self.output, "dry_run": self.dry_run,
                "seconds": round(self.seconds, 3), "copied": self.copied, "notes": self.notes, **self.plan.summary(),
                **({"stats": self.stats} if self.stats else {})}

    def __repr__(self) -> str:
        s = self.plan.summary()
        what = "would write" if self.dry_run else f"wrote in {self.seconds:.2f}s"
        return (f"<MergeResult {self.output!r}: {s['tensors']} tensors, {format_size(s['total_bytes'])} "
                f"{DTYPE_FLAGS.get(self.plan.dtype, self.plan.dtype)} {self.plan.fmt} in {len(self.plan.shards)} "
                f"file(s), {what}>")


def execute(plan: MergePlan, out: str, workers: int | None = None, overwrite: bool = False,
            extra_files: dict[str, bytes] | None = None, progress: Callable[[int, int], None] | None = None,
            durable: bool = False, source: publish.Source | None = None, storage_options: dict | None = None,
            output_storage_options: dict | None = None, check: InputCheck | None = None) -> dict:
    """Write ``plan`` to the folder ``out`` (local path or URL), atomically: :func:`zckpt.engine.run.run_merge`."""
    return run.run_merge(plan, out, workers, overwrite, extra_files, progress, durable, source, storage_options,
                         output_storage_options, check)


def merge(path: str, out: str | None = None, fmt: str = "safetensors", dtype: str = "fp32", tag: str | None = None,
          max_shard_size="5GB", exclude_frozen: bool = False, keep_tied: bool = False, workers: int | None = None,
          dry_run: bool = False, overwrite: bool = False, durable: bool = False,
          progress: Callable[[int, int], None] | None = None, storage_options: dict | None = None,
          output_storage_options: dict | None = None, group=None, native_names: bool = False,
          hf_config=None) -> MergeResult:
    """Consolidate the checkpoint at ``path`` into ``out``.

    Default ``out``: next to the checkpoint, never inside it: ``outputs/checkpoint-4`` ->
    ``outputs/merged-checkpoint-4-<dtype>`` (:func:`zckpt.io.publish.default_output`).

    ``fmt``: "safetensors" or "pt"; ``dtype``: "fp32", "bf16" or "fp16" (floating tensors only);
    ``progress(done_bytes, total_bytes)`` is called as data is written; ``durable=True`` fsyncs before publishing.
    ``storage_options``: fsspec options (``endpoint_url``, ``key``, ``secret``...) for a URL ``path``, and for a
    URL ``out`` unless ``output_storage_options`` are given (another endpoint or account); used for this call only
    (the CLI's ``--storage-option`` and ``--output-storage-option``).
    ``native_names``: keep the source format's own tensor names where its reader offers Hugging Face's
    (its format's ``merge_view``: Megatron-Core's Llama-shaped models get Llama's names and a ``config.json``).
    ``group``: the ranks of a launcher's job (:func:`zckpt.engine.launch.launched`); every rank calls ``merge``
    and writes a share of the bytes, rank 0 publishes (:mod:`zckpt.engine.distributed`). ``progress`` then counts
    this rank's share. ``hf_config``: the ``config.json`` of the transformers class a torchtitan Qwen3 save is
    written as (its names and fused experts, the config beside them: :mod:`zckpt.dcp.titan_hf`).
    """
    t0 = time.perf_counter()
    if hf_config is not None and native_names:
        raise OptionError("--native-names keeps the source's names; --hf-config writes the class's", path=path,
                          hint="drop one of them")
    cfg = None
    if hf_config is not None:  # a torchtitan save under the stated transformers class's names
        from zckpt.dcp import titan_hf
        ckpt, cfg, _ = titan_hf.open_titan(path, hf_config, storage_options, tag)
    else:
        ckpt = open_checkpoint(path, tag, storage_options)
    source = publish.source_of(ckpt.location, picked_tag=tag is not None)
    if out is None:
        out = publish.default_output(source, "merged") + f"-{dtype}"
    notes = list(ckpt.extra.get("merge_notes") or [])
    view = format_named(ckpt.format).merge_view  # the format's records under Hugging Face names, if it has them
    extra = trainer_files(ckpt, dtype)
    if cfg is not None:
        files, notes = titan_hf.merge_files(ckpt, cfg, dtype)
        extra.update(files)
    elif view is not None and not native_names:
        ckpt, files, notes = view(ckpt, dtype)
        extra.update(files)
    plan = plan_merge(ckpt, fmt, dtype, max_shard_size, exclude_frozen, keep_tied)
    log.info("plan: %d tensors in %d file(s), %s %s %s, %d side file(s) -> %s (planned in %.2fs)",
             sum(len(s.tensors) for s in plan.shards), len(plan.shards), format_size(plan.total_size), dtype, fmt,
             len(extra), out, time.perf_counter() - t0)
    for shard in plan.shards:
        log.debug("  %s: %d tensors, %s", shard.filename, len(shard.tensors), format_size(shard.size))
    result = MergeResult(str(out), plan, copied=sorted(extra), dry_run=dry_run, path=str(path),
                         tag=getattr(ckpt.location, "tag", None), notes=notes)
    out_opts = storage_options if output_storage_options is None else output_storage_options
    if dry_run:
        publish.check_output(str(out), "merge", source, overwrite, out_opts)
        return result
    t_plan = time.perf_counter()  # reading the metadata and planning: the rest is moving bytes
    check = checksums.input_check(ckpt)
    try:
        if group is not None:
            from zckpt.engine import distributed
            stats = distributed.run_merge(group, plan, str(out), extra, workers=workers, overwrite=overwrite,
                                          progress=progress, durable=durable, source=source,
                                          storage_options=storage_options, output_storage_options=out_opts,
                                          check=check).to_json()
        else:
            stats = {"ranks": 1, **execute(plan, str(out), workers, overwrite, extra, progress, durable,
                                           source=source, storage_options=storage_options,
                                           output_storage_options=out_opts, check=check)}
    finally:
        check.close()
    stats["crc_checked_entries"] = check.checked
    result.seconds = time.perf_counter() - t0
    result.stats = {**stats, "plan_seconds": round(t_plan - t0, 3),
                    "bytes_per_second": round(plan.total_size / max(result.seconds, 1e-9))}
    log.info("wrote and published %s in %.2fs (%.2fs in all; %s/s, %d process%s)%s", out,  # binary units, as sizes
             time.perf_counter() - t_plan, result.seconds, format_size(plan.total_size / max(result.seconds, 1e-9)),
             stats["ranks"], "es" if stats["ranks"] > 1 else "",
             f"; {stats['remote_bytes']} bytes in {stats['remote_requests']} ranged GETs"
             if stats.get("remote_requests") else "")
    return result


# ----------------------------------------------------------------------------------------- Python loaders

def iter_tensors(path: str, dtype: str = "fp32", tag: str | None = None, exclude_frozen: bool = False,
                 keep_tied: bool = True, storage_options: dict | None = None) -> Iterator[tuple[str, "object"]]:
    """Yield ``(name, torch.Tensor)`` one at a time (only one tensor in memory), in model order.

    Tied aliases are yielded too (as a separate tensor equal to the source) unless ``keep_tied=False``.
    ``path`` may be an opened :class:`Checkpoint` (read with its own ``storage_options``); ``storage_options``:
    fsspec options for a URL ``path``. Needs torch (``pip install 'zckpt[torch]'``): without it,
    :class:`~zckpt.errors.MissingDependency` is raised here, before anything is read.
    """
    require_torch("iter_tensors (it yields torch tensors)")
    return _iter_tensors(path, dtype, tag, exclude_frozen, keep_tied, storage_options)


def _iter_tensors(path, dtype, tag, exclude_frozen, keep_tied, storage_options):
    from zckpt.encoding.tensors import Reader, load_pieces, torch_dtype
    ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path, tag, storage_options)
    tensors, _ = output_tensors(ckpt, dtype, exclude_frozen, keep_tied)
    check = checksums.input_check(ckpt)
    try:
        with Reader(ckpt.storage_options) as reader:
            for t in tensors:
                for p in t.pieces:  # the zip entries holding it checked (each once) before the tensor is yielded
                    check.ensure(p.path, p.offset, p.nbytes)
                value = load_pieces(t.pieces, t.src_dtype, t.shape, reader)
                if t.dtype != t.src_dtype:
                    value = value.to(torch_dtype(t.dtype))
                yield t.name, value
    finally:
        check.close()


def load_state_dict(path: str, dtype: str = "fp32", tag: str | None = None, exclude_frozen: bool = False,
                    storage_options: dict | None = None) -> dict:
    """The consolidated state dict (tied aliases share one tensor, as in the model). ``storage_options``: fsspec
    options for a URL ``path``. Needs torch (:class:`~zckpt.errors.MissingDependency` without it)."""
    require_torch("load_state_dict (it returns torch tensors)")
    ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path, tag, storage_options)
    sd = dict(iter_tensors(ckpt, dtype, exclude_frozen=exclude_frozen, keep_tied=False))
    for rec in ckpt.of_kind("tied"):
        if rec.tied_to in sd:
            sd[rec.name] = sd[rec.tied_to]
    order = [r.name for r in ckpt.records if r.name in sd]
    return {k: sd[k] for k in order}


def load_into_module(module, path: str, tag: str | None = None, strict: bool = True,
                     storage_options: dict | None = None) -> "object":
    """Fill ``module``'s parameters and buffers from the checkpoint, strictly by default.

    Missing or unexpected keys raise :class:`~zckpt.errors.InvalidArgument` (DeepSpeed's own loader uses
    ``strict=False`` and hides them). Values are cast to each destination tensor's dtype. ``storage_options``:
    fsspec options for a URL ``path``.
    """
    torch = require_torch("load_into_module")
    ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path, tag, storage_options)
    target = module.state_dict(keep_vars=True)
    names = {r.name for r in ckpt.records}
    missing = sorted(set(target) - names)
    unexpected = sorted(names - set(target))
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing in checkpoint: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"not in module: {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
        raise InvalidArgument("state dict does not match the module (" + "; ".join(parts) + ")",
                              path=ckpt.location.input_path, hint="pass strict=False to load what matches")
    with torch.no_grad():
        for name, value in iter_tensors(ckpt, "fp32", keep_tied=True):
            dest = target.get(name)
            if dest is None:
                continue
            if tuple(dest.shape) != tuple(value.shape):
                raise InvalidArgument(f"'{name}' has shape {list(value.shape)} in the checkpoint, "
                                      f"{list(dest.shape)} in the module", path=ckpt.location.input_path)
            dest.copy_(value.to(dest.dtype))
    return module
