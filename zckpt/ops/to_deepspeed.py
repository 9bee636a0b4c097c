"""A DCP checkpoint (FSDP2 + ``torch.optim.AdamW``, ``dcp.save`` of ``get_state_dict``) as native DeepSpeed ZeRO files.

No converter of its own: the DCP reader (:mod:`zckpt.dcp.reader`) gives the training-state model, this module adds
what a DeepSpeed engine needs and DCP does not record, and the DeepSpeed writer (:mod:`zckpt.deepspeed.writer`,
reshard's) lays it out for the world size and stage asked, through the one engine and the one publish path::

    DCP folder --open_dcp--> Checkpoint (format "dcp") --deepspeed_source--> Checkpoint a DeepSpeed writer reads
               --deepspeed.writer.plan_reshard(world_size, stage)--> rank files --engine.run.run_reshard--> OUT/

Taken from DCP: every parameter's value (FSDP2's sharded parameters: the fp32 masters), ``exp_avg``,
``exp_avg_sq``, the step (one per parameter in torch's AdamW; all of a group's must agree, as DeepSpeed keeps one
per group), and every param group's hyperparameters as torch's AdamW saved them (lr, betas, eps, weight_decay...,
in order); the group order and each group's parameter order are the optimizer's, which is what a DeepSpeed engine
built from the same model and groups expects. Taken from the user: the world size and stage, the DeepSpeed config
the job will run with (its precision, ``gradient_clipping``, ``zero_optimization`` options shape the files), and
which module tensors without optimizer state are buffers (DCP does not record it). Refused: an fp16 target (its
loss scaler state is not in DCP), optimizer state that is not Adam's, groups at different steps, params of one
group with and without state, flattened optimizer state (``flatten_optimizer_state_dict=True``: no groups saved).
"""

from __future__ import annotations

import time
from typing import Callable

from zckpt.dcp import titan_hf
from zckpt.dcp.reader import check_stateless_named, open_dcp
from zckpt.dcp.sidestate import check_no_hidden_ties
from zckpt.deepspeed.from_state import bf16_optimizer, deepspeed_source, load_config  # noqa: F401 - load_config too
from zckpt.deepspeed.target import ReshardPlan
from zckpt.deepspeed.writer import plan_reshard
from zckpt.engine import run
from zckpt.errors import InvalidArgument, OptionError
from zckpt.io import publish
from zckpt.ops.outputs import ToDeepSpeedResult, check_out
from zckpt.state import checksums
from zckpt.state.model import Checkpoint
from zckpt.state.open import format_named, format_of


def plan_to_deepspeed(ckpt: Checkpoint, world_size: int, stage: int, ds_config: dict,
                      buffers=None, config_known: bool = True, side: dict | None = None) -> ReshardPlan:
    """The DeepSpeed rank files of ``ckpt`` at ``world_size`` and ``stage``: plain data. ``ckpt``: a DCP
    checkpoint, or (``side`` given: what it holds beside model and optimizer) another format's training state
    with its groups placed (its format's ``training_state``: Megatron's)."""
    if stage not in (1, 2, 3):
        raise InvalidArgument(f"--stage must be 1, 2 or 3, got {stage!r}")
    cfg = dict(ds_config)
    cfg["zero_optimization"] = {**(cfg.get("zero_optimization") or {}), "stage": stage}
    copied = []
    if side is None:
        check_stateless_named(ckpt, buffers)
        fmt = format_named(ckpt.format)
        side = fmt.side_state(ckpt)
        # a Trainer FSDP checkpoint's own files (config, trainer_state.json, scheduler.pt, RNG states) are copied;
        # its DCP folders are what the rank files replace
        copied = fmt.side_files(ckpt)
    src = deepspeed_source(ckpt, cfg, buffers, config_known, side)
    plan = plan_reshard(src, world_size, stage, bf16_optimizer(cfg, stage), "deepspeed", copied)
    carried = ["model", "optimizer (masters, exp_avg, exp_avg_sq, step, param groups)"]
    carried += [f"train_state.{k}" for k in side["train_state"]]
    carried += ["lr_scheduler"] if side["lr_scheduler"] else []
    carried += [f"client_state.{k}" for k in side["client_state"]]
    left = dict(side["left"])
    if not side["lr_scheduler"]:
        plan.notes.append(f"{'DCP' if ckpt.format == 'dcp' else 'the source'} holds no DeepSpeed LR scheduler "
                          "state: load with load_lr_scheduler_states=False when the engine has a scheduler")
    if "global_samples" not in side["train_state"]:
        left["train_state.global_samples"] = (f"not in the {ckpt.format} checkpoint: DeepSpeed derives it from "
                                              "global_steps")
    for root, why in left.items():
        plan.notes.append(f"left out {root}: {why}")
    carried += [f.relpath for f in plan.files if f.kind == "copy"]
    plan.carried, plan.not_carried = carried, left
    plan.source_format = ckpt.format
    if not config_known:
        plan.notes.append("no DeepSpeed config given: DeepSpeed's defaults shape the files (sub_group_size 1e9, no "
                          "parameter_alignment); gradient clipping is left to the engine's config")
    tied = [r.name for r in src.records if r.kind == "frozen" and r.name in (ckpt.extra.get("stateless") or [])]
    if tied:
        plan.notes.append(f"{len(tied)} module tensor(s) without optimizer state written as frozen weights "
                          f"({', '.join(tied[:3])}{'...' if len(tied) > 3 else ''}); a tied alias among them "
                          "loads with the same values, or name it with --tied ALIAS=SOURCE")
    return plan


def parse_tied(tied) -> dict | None:
    """``--tied`` values: ``{"alias": "source"}``, or strings ``"alias=source"`` (one per tie, or comma-separated);
    ``""`` (or ``{}``): no ties. ``None`` (or no value): the ties the files state (:func:`zckpt.dcp.reader.files_ties`)."""
    if tied is None or (isinstance(tied, (list, tuple)) and not tied):
        return None
    if isinstance(tied, dict):
        return dict(tied)
    out = {}
    for item in ([tied] if isinstance(tied, str) else list(tied)):
        for part in (p.strip() for p in item.split(",") if p.strip()):
            alias, eq, src = part.partition("=")
            if not eq or not alias.strip() or not src.strip():
                raise InvalidArgument(f"--tied {part!r}: expected ALIAS=SOURCE, e.g. lm_head.weight=embed.weight")
            out[alias.strip()] = src.strip()
    return out


def to_deepspeed(path: str, out: str | None, world_size: int, stage: int, ds_config=None, buffers=None, tied=None,
                 dtype: str | None = None, dry_run: bool = False, overwrite: bool = False, workers: int | None = None,
                 progress: Callable[[int, int], None] | None = None, durable: bool = False,
                 storage_options: dict | None = None, groups=None, native_names: bool = False,
                 hf_config=None) -> ToDeepSpeedResult:
    """Write the DCP checkpoint at ``path`` as DeepSpeed ZeRO-``stage`` files for ``world_size`` ranks into the
    folder ``out`` (``OUT/latest``, ``OUT/global_step<N>/...``), loadable with a plain ``engine.load_checkpoint(out)``.

    ``ds_config``: the DeepSpeed config (dict or JSON path) the job will run with; or ``dtype`` ("bf16" / "fp32":
    the engine's precision) and DeepSpeed's defaults for the rest, gradient clipping left to the engine; ``buffers``: fnmatch patterns
    of the module tensors without optimizer state that are buffers (``[]`` when none are; required when the
    checkpoint has such tensors; a comma-separated string is split); ``tied``: ``{alias: source}`` (or ``"alias=source"`` strings) for weights FSDP2
    saved under both names, written as DeepSpeed's ``shared_params``. Default ``out``: next to the source,
    ``runs/step-1200`` -> ``runs/converted-step-1200-deepspeed``. The output is published like a reshard's (temp
    folder, ``latest`` and the marker last, rename). ``hf_config``: the ``config.json`` of the transformers class a
    torchtitan Qwen3 save is written as (its names, fused experts, split qkv state: :mod:`zckpt.dcp.titan_hf`)."""
    t0 = time.perf_counter()
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise InvalidArgument(f"--world-size must be a positive integer, got {world_size!r}",
                              hint="pass --world-size N: the number of ranks the DeepSpeed job runs on")
    if stage not in (1, 2, 3):
        raise InvalidArgument(f"--stage must be 1, 2 or 3, got {stage!r}", hint="pass --stage S")
    fmt = format_of(path, storage_options)
    view = fmt.training_state  # another format's training state, groups placed (Megatron's)
    if fmt.name != "dcp" and view is None:
        if fmt.name == "deepspeed":  # (the reader that claims what is left: a folder of no checkpoint is said so)
            from zckpt.deepspeed.discover import locate
            locate(path, None, storage_options)
        raise InvalidArgument(f"--to deepspeed reads a PyTorch DCP or Megatron checkpoint, not {fmt.name}", path=path,
                              hint="for a DeepSpeed checkpoint at another size or stage use zckpt reshard")
    if isinstance(buffers, str):
        buffers = [b for b in buffers.split(",") if b]
    cfg, config_known = load_config(ds_config, dtype)
    side = None
    if hf_config is not None and (view is not None or native_names or groups):
        raise OptionError("--hf-config names the transformers class of a torchtitan DCP save" +
                          (f"; this is a {fmt.name} checkpoint" if view is not None else
                           ", and --native-names / --groups are a Megatron source's"), path=path,
                          hint="drop --hf-config" if view is not None else "drop --native-names / --groups")
    if hf_config is not None:
        ckpt, _, _ = titan_hf.open_titan(path, hf_config, storage_options, tied=parse_tied(tied))
        side = titan_hf.deepspeed_side(ckpt)  # (a model-only save refused first)
        check_stateless_named(ckpt, buffers)
        buffers = list(buffers or []) + ckpt.extra["titan_buffers"]  # (the buffers its table names: DeepSeek-V3's)
    elif view is not None:
        if tied:
            raise InvalidArgument("--tied names DCP's aliases; a Megatron checkpoint's args say what is tied",
                                  path=path)
        ckpt = view(fmt.read(path, None, storage_options), groups, native_names)
        side = fmt.side_state(ckpt)
    else:
        if groups:
            raise InvalidArgument("--groups states a Megatron checkpoint's param groups; DCP records its own",
                                  path=path)
        ckpt = open_dcp(path, storage_options, tied=parse_tied(tied))
        if ckpt.extra.get("tie_source") is None:  # neither --tied nor the files say: refuse what looks like a tie
            check_no_hidden_ties(ckpt)
    source = publish.source_of(ckpt.location)
    out = str(out) if out is not None else publish.default_output(source, "converted") + "-deepspeed"
    check_out(out, overwrite, source, "convert")
    plan = plan_to_deepspeed(ckpt, world_size, stage, cfg, buffers, config_known, side)
    plan.notes[:0] = ckpt.extra.get("state_notes") or []  # how training_state placed the state (groups, names)
    result = ToDeepSpeedResult(out, plan, dry_run=dry_run)
    if dry_run:
        return result
    t_plan = time.perf_counter()
    check = checksums.input_check(ckpt)
    try:
        stats = run.run_reshard(plan, out, workers, overwrite, progress, "latest", durable, source,
                                storage_options, "convert", check)
    finally:
        check.close()
    stats["crc_checked_entries"] = check.checked
    result.seconds = time.perf_counter() - t0
    result.stats = {"ranks": 1, **(stats or {}), "plan_seconds": round(t_plan - t0, 3),
                    "bytes_per_second": round(plan.total_bytes / max(result.seconds, 1e-9))}
    return result
