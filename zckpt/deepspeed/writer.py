"""The DeepSpeed writer: a training state (:class:`~zckpt.state.model.Checkpoint`, from any format's reader) laid
out as DeepSpeed itself would have saved it at another data-parallel world size and/or ZeRO stage.

It takes the format-neutral model, so every reader's output can be written as DeepSpeed (a DeepSpeed source
at another size or stage: ``zckpt reshard``; a DCP source: ``zckpt convert --to deepspeed``, after
:mod:`zckpt.deepspeed.from_state` has said what DeepSpeed needs that the source does not).

:func:`plan_reshard` lays the training state out at world size M and stage S (partition maths in
:mod:`zckpt.deepspeed.partition`; the target in :mod:`zckpt.deepspeed.target`): per output file, the object tree
with :class:`~zckpt.engine.torchzip.TensorOut` leaves made of source pieces and zero fill (ZeRO-1/2/3 rank files:
:mod:`zckpt.deepspeed.write_zero`; pipeline and MoE: :mod:`zckpt.deepspeed.write_parallel`; the universal layout:
:mod:`zckpt.deepspeed.write_universal`), then pickled once into its final byte layout
(:func:`zckpt.engine.torchzip.plan_archive`): a :class:`~zckpt.deepspeed.target.ReshardPlan` of
:class:`~zckpt.deepspeed.target.PlannedFile` s, plain data whose sizes are the output's; ``--dry-run`` prints its
summary. :func:`plan_ranks` plans the files of some ranks as objects to load (resume). Executing and publishing a
plan is the operation's (:mod:`zckpt.ops.reshard`).

Output (``fmt="deepspeed"``)::

    OUT/latest                                      the source tag
    OUT/<tag>/mp_rank_00_model_states.pt            stage 1/2 (stage 3: zero_pp_rank_{r}_mp_rank_00_model_states.pt)
    OUT/<tag>/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt   r = 0..M-1
    OUT/<side files>                                copied: a checkpoint-N's config, trainer_state.json, scheduler.pt,
                                                    rng_state_{r}.pth for r < min(N, M) (see docs/reshard.md)

A pipeline-parallel source (``PipelineEngine``, ZeRO-1) keeps its stages: ``world_size`` is the new data-parallel
size. A mixture-of-experts source (ZeRO-1/2) keeps its expert-parallel size: dense groups are re-partitioned over
``world_size`` ranks, each expert group over each expert-parallel rank's ``world_size / ep`` ranks; the expert
files are copied.
"""

from __future__ import annotations

import logging

from zckpt.deepspeed import partition as W
from zckpt.deepspeed.partition import TorchObject
from zckpt.state.model import Checkpoint
from zckpt.errors import InvalidArgument, UnsupportedLayout

from zckpt.deepspeed.target import (
    PlannedFile, ReshardPlan, Target, check_world_size, flavour_of, is_elastic, planned, side_planned, target_of,
)
from zckpt.deepspeed.write_parallel import (
    autoep_zero3_target, check_moe, moe_reshard, plan_moe, plan_pipeline, rename_expert_groups,
)
from zckpt.deepspeed.write_zero import plan_autoep_zero3, plan_zero12, plan_zero3

log = logging.getLogger(__name__)

FORMATS = ("deepspeed", "universal")


def _plan_native(t: Target) -> tuple[list[TorchObject], list[dict]]:
    """The target's model- and optimizer-states files as object trees (in the order they are written), and
    the partition sizes per group / sub-group."""
    return plan_zero3(t) if t.stage == 3 else plan_zero12(t)


def _check_state(ckpt: Checkpoint) -> None:
    """Optimizer state the reader could not place (``state_refusal``: SGD's momentum_buffer, ZeRO-0 moments it
    cannot tell apart) is never dropped from a re-partitioned checkpoint with exit 0."""
    if ckpt.state_refusal:
        raise UnsupportedLayout(f"the optimizer state cannot be carried: {ckpt.state_refusal}",
                                path=ckpt.location.tag_dir, hint="zckpt merge / info / verify read this checkpoint")
    ckpt.check_ties()


def _check_target(ckpt: Checkpoint, world_size, stage, bf16_optimizer) -> tuple[int, int, str]:
    check_world_size(world_size)
    if ckpt.reshard_refusal:  # pipeline / MoE layouts (zckpt.deepspeed.pipeline, .moe): merge yes, reshard no
        raise UnsupportedLayout(ckpt.reshard_refusal, path=ckpt.location.tag_dir,
                                hint="zckpt merge / info / verify read this layout")
    stage = ckpt.stage if stage is None else stage
    if is_elastic(ckpt) and (stage == 3 or bf16_optimizer):
        raise UnsupportedLayout("an elastic checkpoint (elastic_checkpoint=true) saves no optimizer "
                                "hyperparameters, which a ZeRO-3 or BF16-optimizer file needs",
                                path=ckpt.location.tag_dir, hint="reshard it at ZeRO-1 or ZeRO-2")
    if stage not in (1, 2, 3):
        raise InvalidArgument(f"must be 1, 2 or 3, got {stage!r}", param="stage")
    if stage == 3 and ckpt.no_group and ckpt.stage != 3:
        names = [r.name for r in ckpt.no_group]
        raise UnsupportedLayout(f"{len(names)} parameters in no optimizer group ({', '.join(names[:3])}"
                                f"{', ...' if len(names) > 3 else ''}): a ZeRO-3 engine partitions them and its "
                                "files would hold them nowhere", path=ckpt.location.tag_dir,
                                hint="keep stage 1 or 2 (they stay in 'module'), or put them in a param group")
    if ckpt.offload:
        log.info("source used optimizer offload; the partitions are the same, offload is a config choice")
    if bf16_optimizer is None:
        bf16_optimizer = ckpt.flavour == "bf16_optimizer" and stage == 1
    if bf16_optimizer and (stage != 1 or ckpt.precision != "bf16"):
        raise InvalidArgument("the BF16 optimizer needs `stage`=1 and a bf16 checkpoint", param="bf16_optimizer",
                              hint="drop `bf16_optimizer`, or use `stage`=1 on a bf16 checkpoint")
    zcfg = ckpt.ds_config.get("zero_optimization") or {}
    if isinstance(zcfg, dict) and zcfg.get("round_robin_gradients"):
        raise UnsupportedLayout("round_robin_gradients reorders the flat groups per world size; not supported",
                                path=ckpt.location.tag_dir)
    return world_size, stage, flavour_of(stage, bf16_optimizer)


def plan_reshard(ckpt: Checkpoint, world_size: int, stage: int | None = None, bf16_optimizer: bool | None = None,
                 fmt: str = "deepspeed", side=(), ep: int | None = None,
                 max_group_size: int | None = None) -> ReshardPlan:
    """Plan the files of ``ckpt`` re-partitioned for ``world_size`` ranks at ``stage`` (default: unchanged):
    every torch file laid out once into its final bytes (:class:`PlannedFile`), then the ``side`` files
    (:func:`zckpt.deepspeed.target.side_planned`: copied, RNG states renamed for the new ranks)."""
    if fmt not in FORMATS:
        raise InvalidArgument(f"unknown format {fmt!r}", param="fmt", hint="use deepspeed or universal")
    for sub in [ckpt] + list(ckpt.extra.get("pipeline_stages") or []):
        _check_state(sub)
    if ckpt.parallel == "pipeline" and ckpt.extra.get("pipeline_stages"):
        return plan_pipeline(ckpt, world_size, stage, bf16_optimizer, fmt, side)
    if ckpt.parallel == "moe":
        return moe_reshard(ckpt, world_size, stage, bf16_optimizer, fmt, side, ep, max_group_size)
    if max_group_size is not None:
        raise InvalidArgument("mixture-of-experts checkpoints only; this one has no experts",
                              param="max_group_size", path=ckpt.location.tag_dir, hint="drop --max-group-size")
    if ep is not None:
        raise InvalidArgument("an expert-parallel size is for mixture-of-experts checkpoints; this one has no "
                              "experts", param="ep", path=ckpt.location.tag_dir, hint="drop --ep")
    world_size, stage, flavour = _check_target(ckpt, world_size, stage, bf16_optimizer)
    if fmt == "universal" and is_elastic(ckpt):
        raise UnsupportedLayout("an elastic checkpoint saves no optimizer hyperparameters, which the universal "
                                "layout's optimizer_state.pt needs", path=ckpt.location.tag_dir,
                                hint="reshard it in the DeepSpeed layout: an elastic engine loads it at any size")
    t = target_of(ckpt, world_size, stage, flavour)
    objects, partitions = _plan_native(t)
    if fmt == "universal":
        from zckpt.deepspeed import write_universal as universal
        if t.has_state and t.state_keys[:2] != ["exp_avg", "exp_avg_sq"] or len(t.state_keys) > 2:
            raise UnsupportedLayout(f"optimizer state {', '.join(repr(k) for k in t.state_keys)}: zckpt writes "
                                    "the universal layout for Adam's moments only", path=ckpt.location.tag_dir,
                                    hint="reshard in the DeepSpeed layout (drop --format universal)")
        objects = universal.plan_universal(ckpt, t.tag, stage, t.groups, t.has_state, objects)
    files = [planned(o) for o in objects] + side_planned(side, world_size)
    plan = ReshardPlan(ckpt.location.input_path, t.tag, fmt, ckpt.stage, ckpt.flavour, ckpt.world_size, stage,
                       flavour, world_size, ckpt.precision, files, partitions=partitions)
    if not t.has_state:
        plan.notes.append("the source has no optimizer state yet (saved before the first step); none is written")
    return plan




def plan_ranks(ckpt: Checkpoint, world_size: int, ranks, stage: int | None = None,
               bf16_optimizer: bool | None = None, zero: dict | None = None, ep: int | None = None,
               max_group_size: int | tuple | None = None) -> ReshardPlan:
    """Like :func:`plan_reshard` (DeepSpeed layout), but only the model- and optimizer-states files of ``ranks``
    (no side files): what one rank of a job resuming at ``world_size`` loads (:mod:`zckpt.ops.resume`). The files
    are object trees to load (kind "object"), not laid out for writing.
    ``zero``: ``zero_optimization`` values of the target engine that shape the layout (``sub_group_size``,
    ``parameter_alignment``), applied where they differ from the source config's. ``ep``: an MoE source at other
    expert-parallel sizes, one for every MoE layer or one per layer in order (the writers ``reshard --ep`` uses:
    :func:`zckpt.deepspeed.write_parallel.check_moe`, AutoEP at ZeRO-3
    :func:`zckpt.deepspeed.write_zero.plan_autoep_zero3`); ``max_group_size``: where they cut expert groups (as
    ``reshard --max-group-size``, or the engine's range: :func:`zckpt.deepspeed.group_cuts.limit_of`)."""
    layout, shapes, autoep_z3 = None, {}, None
    _check_state(ckpt)
    if ckpt.parallel == "moe" and ckpt.stage == 3 and ckpt.model_state.get("ds_autoep_layers"):
        t, autoep_z3, _ = autoep_zero3_target(ckpt, world_size, stage, bf16_optimizer, "deepspeed", ep, ranks)
        stage, flavour = 3, ckpt.flavour
    else:
        if ckpt.parallel == "moe":
            layout, shapes = check_moe(ckpt, world_size, stage, bf16_optimizer, "deepspeed", ep, max_group_size)
            stage, flavour = ckpt.stage, ckpt.flavour
        else:
            world_size, stage, flavour = _check_target(ckpt, world_size, stage, bf16_optimizer)
        t = target_of(ckpt, world_size, stage, flavour, ranks)
    zcfg = t.cfg.setdefault("zero_optimization", {})
    defaults = {"sub_group_size": W.DEFAULT_SUB_GROUP_SIZE, "parameter_alignment": False}
    for key, value in (zero or {}).items():
        if value is not None and zcfg.get(key, defaults.get(key)) != value:
            zcfg[key] = value
    if shapes:
        rename_expert_groups(t, layout, shapes)
    if autoep_z3 is not None:
        objects, partitions = plan_autoep_zero3(t, autoep_z3, max_group_size)
    else:
        objects, partitions = _plan_native(t) if layout is None else plan_moe(t, layout, "object", shapes)
    files = [PlannedFile(o.relpath, "object", 0, obj=o.obj) for o in objects]
    return ReshardPlan(ckpt.location.input_path, t.tag, "deepspeed", ckpt.stage, ckpt.flavour, ckpt.world_size,
                       stage, flavour, world_size, ckpt.precision, files, partitions=partitions)
