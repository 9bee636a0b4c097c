"""A DCP checkpoint (FSDP2 + ``torch.optim.AdamW``, ``dcp.save`` of ``get_state_dict``) as native DeepSpeed ZeRO files.

No converter of its own: the DCP reader (:mod:`zckpt.dcp.reader`) gives the training-state model, this module adds
what a DeepSpeed engine needs and DCP does not record, and the reshard writer (:mod:`zckpt.ops.reshard`) lays it
out for the world size and stage asked, through the one engine and the one publish path::

    DCP folder --open_dcp--> Checkpoint (format "dcp") --deepspeed_source--> Checkpoint a DeepSpeed writer reads
               --reshard.plan_reshard(world_size, stage)--> rank files --reshard.execute--> OUT/ (latest, tag/)

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

import dataclasses
import json
import time
from collections import OrderedDict
from typing import Callable

from zckpt.dcp.reader import TRAINER_PARTS, check_stateless_named, is_dcp, matches, open_dcp, tie_candidates
from zckpt.errors import InvalidArgument, UnsupportedLayout
from zckpt.io import publish, storage
from zckpt.ops import reshard
from zckpt.state import checksums
from zckpt.state.model import LP_DTYPES, Checkpoint
from zckpt.encoding.safeload import FLOATING

DS_LAYOUT_VERSION = "0.19.8"  # the DeepSpeed release whose file layout the writer reproduces


def _precision(cfg: dict) -> str:
    for key, name in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        sub = cfg.get(key)
        if isinstance(sub, dict) and sub.get("enabled") is True:
            return name
    return "fp32"


def load_config(ds_config, dtype: str | None = None) -> tuple[dict, bool]:
    """(config, whether it is the job's own): ``ds_config`` a dict or the path of a DeepSpeed JSON config; without
    one, ``dtype`` ("bf16" / "fp32", the engine's precision) and DeepSpeed's defaults for everything else."""
    if ds_config is None:
        if dtype not in ("bf16", "fp32", "fp16"):
            raise InvalidArgument("DCP does not record the precision the DeepSpeed engine trains in",
                                  hint="pass --dtype bf16 or --dtype fp32, or --ds-config ds_config.json (the "
                                       "job's config: precision, gradient_clipping, zero_optimization)")
        return {"bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16"}}, False
    if isinstance(ds_config, dict):
        cfg = json.loads(json.dumps(ds_config))
        _check_dtype(cfg, dtype)
        return cfg, True
    try:
        cfg = json.loads(storage.read_bytes(str(ds_config)))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read the DeepSpeed config ({exc})", path=str(ds_config)) from None
    if not isinstance(cfg, dict):
        raise InvalidArgument("the DeepSpeed config is not a JSON object", path=str(ds_config))
    _check_dtype(cfg, dtype)
    return cfg, True


def _check_dtype(cfg: dict, dtype: str | None) -> None:
    if dtype is not None and _precision(cfg) != dtype:
        raise InvalidArgument(f"--dtype {dtype} disagrees with the DeepSpeed config ({_precision(cfg)})",
                              hint="drop --dtype: the config says the precision")


def deepspeed_source(ckpt: Checkpoint, ds_config: dict, buffers=None, config_known: bool = True) -> Checkpoint:
    """``ckpt`` (read from DCP) with what the DeepSpeed writer needs: records classified, one step tensor per
    group, the model-states facts (``module`` order, ``buffer_names``, ``shared_params``, steps) and the config."""
    path = ckpt.location.tag_dir
    if ckpt.format != "dcp":
        raise InvalidArgument("not a DCP checkpoint", path=path)
    precision = _precision(ds_config)
    if precision == "fp16":
        raise UnsupportedLayout("an fp16 DeepSpeed engine needs its loss scaler's state, which a DCP checkpoint "
                                "does not have", path=path, hint="convert for a bf16 or fp32 config")
    if ckpt.extra.get("flat_param_groups") or not ckpt.groups:
        raise UnsupportedLayout("the DCP checkpoint records no optimizer param groups (saved with "
                                "flatten_optimizer_state_dict=True, or without an optimizer)", path=path,
                                hint="save with get_state_dict's default options: {'model': msd, 'optim': osd}")
    check_stateless_named(ckpt, buffers)
    records = []
    for rec in ckpt.records:
        rec = dataclasses.replace(rec)
        if rec.kind in ("frozen", "buffer") and rec.group is None:
            rec.kind = "buffer" if matches(rec.name, buffers) else "frozen"
            if rec.kind == "frozen":
                rec.lp_dtype = LP_DTYPES[precision] if rec.dtype in FLOATING else rec.dtype
        records.append(rec)
    byname = {r.name: r for r in records}
    group_steps = {}
    for g in ckpt.groups:
        recs = [byname[n] for n in g.names]
        with_state = [r for r in recs if r.exp_avg]
        if with_state and len(with_state) != len(recs):
            missing = next(r.name for r in recs if not r.exp_avg)
            raise UnsupportedLayout(f"param group {g.index}: '{missing}' has no Adam state while others do (a frozen "
                                    "parameter passed to the optimizer?)", path=path,
                                    hint="DeepSpeed keeps state for every parameter of a group")
        step = next((ckpt.extra["step_tensors"][n] for n in g.names if n in ckpt.extra["step_tensors"]), None)
        if with_state and step is None:
            raise UnsupportedLayout(f"param group {g.index} has Adam moments but no step", path=path)
        group_steps[g.index] = step
    other = [r.name for r in records if r.kind == "trainable" and r.group is None]
    if other:
        raise UnsupportedLayout(f"'{other[0]}' has optimizer state but is in no param group", path=path)
    steps = {g.step for g in ckpt.groups if g.step is not None}
    step = int(max(steps)) if steps else 0
    side = side_state(ckpt)
    counters = side["train_state"]
    if "global_steps" in counters and counters["global_steps"] != step:
        raise UnsupportedLayout(f"train_state.global_steps is {counters['global_steps']}, the optimizer's step "
                                f"{step}", path=path, hint="the DCP folder mixes two saves; use one save's folder")
    model_state = OrderedDict([
        ("module", OrderedDict((r.name, None) for r in records)),
        ("buffer_names", [r.name for r in records if r.kind == "buffer"]),
        ("shared_params", {r.name: r.tied_to for r in records if r.kind == "tied"}),
        ("lr_scheduler", side["lr_scheduler"]), ("data_sampler", None), ("random_ltd", None),
        ("skipped_steps", counters.get("skipped_steps", 0)), ("global_steps", step),
        ("global_samples", counters.get("global_samples")), ("mp_world_size", 1),
        ("ds_config", ds_config), ("ds_version", DS_LAYOUT_VERSION),
    ])
    if model_state["global_samples"] is None:
        model_state.pop("global_samples")  # DeepSpeed derives it from global_steps when absent
    for k, v in side["client_state"].items():  # DeepSpeed hands the extra keys back as load_checkpoint's client state
        if k not in model_state:
            model_state[k] = v
    loc = dataclasses.replace(ckpt.location, tag=f"global_step{step}")
    # without the job's config, clip_grad is left out of the files: DeepSpeed then keeps its configured value
    osd = OrderedDict() if config_known else OrderedDict([("clip_grad", None)])
    return dataclasses.replace(ckpt, location=loc, records=records, precision=precision, model_state=model_state,
                               optim_states=[{"optimizer_state_dict": osd}], model_states=[model_state],
                               reshard_refusal=None, extra={**ckpt.extra, "group_steps": group_steps})


SIDE_ROOTS = ("train_state", "lr_scheduler", "client_state")


def side_state(ckpt: Checkpoint) -> dict:
    """The plain values a DCP checkpoint holds beside the model and optimizer, by what DeepSpeed does with them:
    ``train_state`` counters (``global_steps``, ``global_samples``, ``skipped_steps``: zckpt's DeepSpeed -> DCP
    output; ints only), ``lr_scheduler`` (the dict DeepSpeed's ``lr_scheduler.load_state_dict`` gets; None
    without), ``client_state``; ``left``: {root: why} for the rest (``loss_scaler``, ``dataloader``, ...)."""
    md = ckpt.extra["metadata"]
    out = {"train_state": {}, "lr_scheduler": None, "client_state": {}, "left": {}}
    for key, value in (ckpt.extra.get("values") or {}).items():
        p = md.path_of(key)
        if p[0] == "zckpt":
            continue
        if p[0] == "train_state" and len(p) == 2 and isinstance(value, int) and not isinstance(value, bool):
            out["train_state"][p[1]] = value
        elif p[0] == "lr_scheduler" and len(p) >= 2:
            out["lr_scheduler"] = out["lr_scheduler"] or {}
            out["lr_scheduler"][".".join(map(str, p[1:]))] = value
        elif p[0] == "client_state" and len(p) >= 2:
            out["client_state"][".".join(map(str, p[1:]))] = value
        else:
            why = ("the loss scaler's state: DeepSpeed keeps one for fp16 only, and an fp16 target is refused"
                   if p[0] == "loss_scaler" else
                   "DeepSpeed has no place for it")
            out["left"].setdefault(".".join(map(str, p[:1])), why)
    tensors = sorted({md.path_of(k)[0] for k in ckpt.extra.get("other") or [] if k in md.tensors})
    for root in tensors:
        out["left"].setdefault(root, "tensors outside model / optimizer state")
    return out


def _bf16_optimizer(cfg: dict, stage: int) -> bool:
    dtypes = cfg.get("data_types") if isinstance(cfg.get("data_types"), dict) else {}
    return stage == 1 and _precision(cfg) == "bf16" and dtypes.get("grad_accum_dtype") == "fp32"


def plan_to_deepspeed(ckpt: Checkpoint, world_size: int, stage: int, ds_config: dict,
                      buffers=None, config_known: bool = True) -> reshard.ReshardPlan:
    """The DeepSpeed rank files of ``ckpt`` (a DCP checkpoint) at ``world_size`` and ``stage``: plain data."""
    if stage not in (1, 2, 3):
        raise InvalidArgument(f"--stage must be 1, 2 or 3, got {stage!r}")
    cfg = dict(ds_config)
    cfg["zero_optimization"] = {**(cfg.get("zero_optimization") or {}), "stage": stage}
    src = deepspeed_source(ckpt, cfg, buffers, config_known)
    plan = reshard.plan_reshard(src, world_size, stage, _bf16_optimizer(cfg, stage), "deepspeed")
    # a Trainer FSDP checkpoint's own files (config, trainer_state.json, scheduler.pt, RNG states) are copied by the
    # writer; its DCP folders are what the rank files replace
    plan.files = [f for f in plan.files if not (f.kind == "copy" and _dcp_file(f.relpath))]
    side = side_state(ckpt)
    carried = ["model", "optimizer (masters, exp_avg, exp_avg_sq, step, param groups)"]
    carried += [f"train_state.{k}" for k in side["train_state"]]
    carried += ["lr_scheduler"] if side["lr_scheduler"] else []
    carried += [f"client_state.{k}" for k in side["client_state"]]
    left = dict(side["left"])
    if not side["lr_scheduler"]:
        plan.notes.append("DCP holds no LR scheduler state: the files have none; load with "
                          "load_lr_scheduler_states=False when the engine has a scheduler")
    if "global_samples" not in side["train_state"]:
        left["train_state.global_samples"] = "not in the DCP checkpoint: DeepSpeed derives it from global_steps"
    for root, why in left.items():
        plan.notes.append(f"left out {root}: {why}")
    carried += [f.relpath for f in plan.files if f.kind == "copy"]
    plan.carried, plan.not_carried = carried, left
    if not config_known:
        plan.notes.append("no DeepSpeed config given: DeepSpeed's defaults shape the files (sub_group_size 1e9, no "
                          "parameter_alignment); gradient clipping is left to the engine's config")
    tied = [r.name for r in src.records if r.kind == "frozen" and r.name in (ckpt.extra.get("stateless") or [])]
    if tied:
        plan.notes.append(f"{len(tied)} module tensor(s) without optimizer state written as frozen weights "
                          f"({', '.join(tied[:3])}{'...' if len(tied) > 3 else ''}); a tied alias among them "
                          "loads with the same values, or name it with --tied ALIAS=SOURCE")
    return plan


def check_no_hidden_ties(ckpt: Checkpoint) -> None:
    """A module tensor without optimizer state whose bytes equal a trainable one's is likely a tied alias (most
    small Hugging Face language models tie their embeddings), or a frozen copy: never assumed, refused."""
    pairs = ckpt.extra.get("tie_candidates")
    pairs = tie_candidates(ckpt) if pairs is None else pairs
    if pairs:
        a, b = pairs[0]
        more = f" ({len(pairs) - 1} more such pair{'s' if len(pairs) > 2 else ''})" if len(pairs) > 1 else ""
        raise UnsupportedLayout(f"'{a}' has no optimizer state and the same bytes as the trainable '{b}': a tied "
                                f"weight or a frozen copy, and the files do not say which{more}",
                                path=ckpt.location.tag_dir,
                                hint=f"--tied {a}={b} if it is tied (DeepSpeed's shared_params); --tied '' if "
                                     "nothing is tied (then it is written as a frozen weight)")


def _dcp_file(relpath: str) -> bool:
    """A file of the DCP checkpoint itself (its folders, ``.metadata``, data files): replaced by the rank files."""
    top = relpath.split("/")[0]
    return top in TRAINER_PARTS or top == ".metadata" or (top.startswith("__") and top.endswith(".distcp"))


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


class ToDeepSpeedResult(reshard.ReshardResult):
    """A reshard's result, plus what the DCP checkpoint held that the DeepSpeed files carry and what they do not."""

    def to_json(self) -> dict:
        return {**super().to_json(), "carried": list(getattr(self.plan, "carried", [])),
                "not_carried": dict(getattr(self.plan, "not_carried", {}))}


def to_deepspeed(path: str, out: str | None, world_size: int, stage: int, ds_config=None, buffers=None, tied=None,
                 dtype: str | None = None, dry_run: bool = False, overwrite: bool = False, workers: int | None = None,
                 progress: Callable[[int, int], None] | None = None, durable: bool = False,
                 storage_options: dict | None = None) -> ToDeepSpeedResult:
    """Write the DCP checkpoint at ``path`` as DeepSpeed ZeRO-``stage`` files for ``world_size`` ranks into the
    folder ``out`` (``OUT/latest``, ``OUT/global_step<N>/...``), loadable with a plain ``engine.load_checkpoint(out)``.

    ``ds_config``: the DeepSpeed config (dict or JSON path) the job will run with; or ``dtype`` ("bf16" / "fp32":
    the engine's precision) and DeepSpeed's defaults for the rest, gradient clipping left to the engine; ``buffers``: fnmatch patterns
    of the module tensors without optimizer state that are buffers (``[]`` when none are; required when the
    checkpoint has such tensors; a comma-separated string is split); ``tied``: ``{alias: source}`` (or ``"alias=source"`` strings) for weights FSDP2
    saved under both names, written as DeepSpeed's ``shared_params``. Default ``out``: next to the source,
    ``runs/step-1200`` -> ``runs/converted-step-1200-deepspeed``. The output is published like a reshard's (temp
    folder, ``latest`` and the marker last, rename)."""
    t0 = time.perf_counter()
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise InvalidArgument(f"--world-size must be a positive integer, got {world_size!r}",
                              hint="pass --world-size N: the number of ranks the DeepSpeed job runs on")
    if stage not in (1, 2, 3):
        raise InvalidArgument(f"--stage must be 1, 2 or 3, got {stage!r}", hint="pass --stage S")
    if not is_dcp(path, storage_options):
        raise InvalidArgument("--to deepspeed reads a PyTorch DCP checkpoint (a folder with .metadata)", path=path,
                              hint="for a DeepSpeed checkpoint at another size or stage use zckpt reshard")
    if isinstance(buffers, str):
        buffers = [b for b in buffers.split(",") if b]
    cfg, config_known = load_config(ds_config, dtype)
    ckpt = open_dcp(path, storage_options, tied=parse_tied(tied))
    if ckpt.extra.get("tie_source") is None:  # neither --tied nor the files say: refuse what looks like a tie
        check_no_hidden_ties(ckpt)
    source = publish.source_of(ckpt.location)
    out = str(out) if out is not None else publish.default_output(source, "converted") + "-deepspeed"
    if storage.is_url(out):
        raise InvalidArgument("convert writes to a local folder", path=out,
                              hint="convert locally, then `zckpt push` the result")
    publish.check_output(out, "convert", source, overwrite)
    plan = plan_to_deepspeed(ckpt, world_size, stage, cfg, buffers, config_known)
    result = ToDeepSpeedResult(out, plan, dry_run=dry_run)
    if dry_run:
        return result
    t_plan = time.perf_counter()
    check = checksums.input_check(ckpt)
    try:
        stats = reshard.execute(plan, out, workers, overwrite, progress, durable=durable, source=source,
                                storage_options=storage_options, kind="convert", check=check)
    finally:
        check.close()
    stats["crc_checked_entries"] = check.checked
    result.seconds = time.perf_counter() - t0
    result.stats = {"ranks": 1, **(stats or {}), "plan_seconds": round(t_plan - t0, 3),
                    "bytes_per_second": round(plan.total_bytes / max(result.seconds, 1e-9))}
    return result
