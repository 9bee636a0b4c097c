"""``zckpt reshard``: a DeepSpeed checkpoint re-partitioned for another data-parallel world size and/or ZeRO stage.

The pairing of a reader and a writer, and what is the operation's own:

1. read: :func:`zckpt.state.open.open_checkpoint` describes the source from metadata alone (every parameter's fp32
   master and Adam moments as lists of byte ranges in the rank files);
2. plan: :func:`zckpt.deepspeed.writer.plan_reshard` lays the same training state out as DeepSpeed would have
   saved it at world size M and stage S (or in its universal layout), the side files beside it (a Trainer
   checkpoint's files: the source format's ``side_files``, :mod:`zckpt.state.formats`): plain data, what ``--dry-run`` prints;
3. execute: :func:`execute` writes exactly the planned archives (:func:`zckpt.engine.torchzip.write_planned`,
   nothing pickled again) and copies the side files into a temporary sibling of OUT, writes ``latest`` and the
   ``.zckpt.json`` marker last, and renames the folder into place (:mod:`zckpt.io.publish`); under a launcher,
   :func:`zckpt.engine.distributed.run_reshard` splits the same plan across the ranks. The CRC-32 of every input
   zip entry read is checked before anything is published. The source is never modified; no tensor is held whole.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from zckpt.deepspeed.target import PlannedFile, ReshardPlan  # noqa: F401 - the plan's types, for callers
from zckpt.deepspeed.writer import FORMATS, plan_ranks, plan_reshard  # noqa: F401 - the writer, for callers
from zckpt.engine import run
from zckpt.engine.checked import InputCheck
from zckpt.errors import InvalidArgument
from zckpt.io import publish
from zckpt.ops.outputs import ReshardResult, check_out
from zckpt.state import checksums
from zckpt.state.open import format_named, open_checkpoint
from zckpt.units import format_size

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- execute

def _check_out(out: str, overwrite: bool, source: publish.Source | None, kind: str = "reshard") -> None:
    check_out(out, overwrite, source, kind)


def execute(plan: ReshardPlan, out: str, workers: int | None = None, overwrite: bool = False,
            progress: Callable[[int, int], None] | None = None, latest_name: str = "latest",
            durable: bool = False, source: publish.Source | None = None,
            storage_options: dict | None = None, kind: str = "reshard", check: InputCheck | None = None) -> dict:
    """Write ``plan`` into the local folder ``out`` atomically (:func:`zckpt.engine.run.run_reshard`: temp sibling,
    ``latest`` and the ``.zckpt.json`` marker last, rename); ``overwrite`` replaces only a previous zckpt output of
    ``kind`` ("reshard", or "convert" for ``zckpt convert --to deepspeed``). Returns what was read from remote
    sources."""
    _check_out(out, overwrite, source, kind)
    return run.run_reshard(plan, out, workers, overwrite, progress, latest_name, durable, source, storage_options,
                           kind, check)


def default_output(source: publish.Source, world_size: int, stage: int | None, fmt: str) -> str:
    """Next to the checkpoint, never inside it, never named like a checkpoint:
    ``outputs/checkpoint-4`` -> ``outputs/resharded-checkpoint-4-ws<M>[-z<S>][-universal]``."""
    suffix = f"-ws{world_size}" + (f"-z{stage}" if stage else "") + ("-universal" if fmt == "universal" else "")
    return publish.default_output(source, "resharded") + suffix


def reshard(path: str, out: str | None = None, world_size: int | None = None, stage: int | None = None,
            fmt: str = "deepspeed", tag: str | None = None, dry_run: bool = False, overwrite: bool = False,
            workers: int | None = None, progress: Callable[[int, int], None] | None = None,
            bf16_optimizer: bool | None = None, durable: bool = False,
            storage_options: dict | None = None, group=None,
            ep: int | tuple[int, ...] | None = None, max_group_size: int | None = None) -> ReshardResult:
    """Re-partition the checkpoint at ``path`` for ``world_size`` ranks (and ``stage``) into the folder ``out``.

    ``fmt="deepspeed"``: DeepSpeed's native layout, loadable with a plain ``engine.load_checkpoint(out)`` at the
    new size. ``fmt="universal"``: DeepSpeed's universal layout (``"checkpoint": {"load_universal": true}``).
    ``bf16_optimizer``: target the BF16 optimizer (stage 1, bf16, ``grad_accum_dtype: fp32``); default keeps the
    source's choice when the stage stays 1. ``ep``: the expert-parallel size of a DeepSpeed MoE or AutoEP checkpoint
    (default: kept; docs/layouts.md): one size, or one per MoE layer in order (``ep=(4, 2)``: DeepSpeed builds each
    MoE layer with its own). ``max_group_size``: the limit the run passed to DeepSpeed's
    ``split_params_into_different_moe_groups_for_optimizer`` (native MoE), which cuts an expert group into several
    param groups; needed only where the source's own cut does not say how the output's groups are cut.
    ``progress(done_bytes, total_bytes)`` is called as data is written;
    ``durable=True`` fsyncs everything before publishing (survives a power failure, waits for the disk).
    Default ``out``: next to the checkpoint, ``outputs/checkpoint-4`` -> ``outputs/resharded-checkpoint-4-ws<M>``
    (``-z<S>``, ``-universal`` appended when given). ``overwrite`` replaces only a previous zckpt reshard output.
    ``storage_options``: fsspec options for a URL ``path`` (the output is always local), for this call only.
    ``group``: the ranks of a launcher's job (:func:`zckpt.engine.launch.launched`); every rank calls ``reshard``
    and writes a share of the bytes, rank 0 publishes (:mod:`zckpt.engine.distributed`).
    """
    t0 = time.perf_counter()
    if world_size is None:
        raise InvalidArgument("a target world size is required", param="world_size", hint="pass `world_size`")
    ckpt = open_checkpoint(path, tag, storage_options)
    t_open = time.perf_counter()
    source = publish.source_of(ckpt.location, picked_tag=tag is not None)
    out = str(out) if out is not None else default_output(source, world_size, stage, fmt)
    _check_out(out, overwrite, source)  # before planning or writing anything
    # a Trainer checkpoint's files, a save folder's scripts: what the source's format says is not its own
    side = (format_named(ckpt.format).side_files or (lambda c: []))(ckpt)
    plan = plan_reshard(ckpt, world_size, stage, bf16_optimizer, fmt, side, ep, max_group_size)
    log.info("plan: %d file(s), %s, world size %d -> %s (planned in %.2fs)", len(plan.files),
             format_size(plan.total_bytes), world_size, out, time.perf_counter() - t0)
    for f in plan.files:
        log.debug("  %s (%s)", f.relpath, format_size(f.nbytes))
    result = ReshardResult(out, plan, dry_run=dry_run)
    if dry_run:
        return result
    latest = "latest" if fmt == "deepspeed" else "latest_universal"
    t_plan = time.perf_counter()  # reading the metadata and planning: the rest is moving bytes
    check = checksums.input_check(ckpt)
    try:
        if group is not None:
            from zckpt.engine import distributed
            stats = distributed.run_reshard(group, plan, out, workers=workers, overwrite=overwrite,
                                            progress=progress, latest_name=latest, durable=durable, source=source,
                                            storage_options=ckpt.storage_options, check=check).to_json()
        else:
            stats = {"ranks": 1, **execute(plan, out, workers, overwrite, progress, latest_name=latest,
                                           durable=durable, source=source, storage_options=ckpt.storage_options,
                                           check=check)}
    finally:
        check.close()
    stats["crc_checked_entries"] = check.checked
    result.seconds = time.perf_counter() - t0
    result.stats = {**stats, "plan_seconds": round(t_plan - t0, 3), "open_seconds": round(t_open - t0, 3),
                    "bytes_per_second": round(plan.total_bytes / max(result.seconds, 1e-9))}
    log.info("wrote and published %s in %.2fs (%.2fs in all; %s/s, %d process%s)", out,  # binary units, as sizes
             time.perf_counter() - t_plan, result.seconds, format_size(plan.total_bytes / max(result.seconds, 1e-9)),
             stats["ranks"], "es" if stats["ranks"] > 1 else "")
    return result
