"""What a DeepSpeed engine needs that a training state from another format does not say.

A DCP checkpoint (FSDP2 + ``torch.optim.AdamW``) holds every parameter's value, ``exp_avg``, ``exp_avg_sq``, a step
per parameter and torch's param groups; a DeepSpeed engine also reads its config (precision, ``gradient_clipping``,
``zero_optimization``, which shape the files), one step per group, the model-states facts (``module`` order,
``buffer_names``, ``shared_params``, ``global_steps``...). :func:`deepspeed_source` adds them, so the DeepSpeed
writer (:mod:`zckpt.deepspeed.writer`) lays the state out as it lays out its own.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections import OrderedDict

from zckpt.encoding.safeload import FLOATING
from zckpt.engine.torchzip import step_tensor
from zckpt.errors import InvalidArgument, UnsupportedLayout
from zckpt.io import storage
from zckpt.state.model import LP_DTYPES, Checkpoint

DS_LAYOUT_VERSION = "0.19.8"  # the DeepSpeed release whose file layout the writer reproduces


def precision_of(cfg: dict) -> str:
    """The precision a DeepSpeed config trains in: bf16, fp16 or fp32."""
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
    if dtype is not None and precision_of(cfg) != dtype:
        raise InvalidArgument(f"--dtype {dtype} disagrees with the DeepSpeed config ({precision_of(cfg)})",
                              hint="drop --dtype: the config says the precision")


def deepspeed_source(ckpt: Checkpoint, ds_config: dict, buffers=None, config_known: bool = True,
                     side: dict | None = None) -> Checkpoint:
    """``ckpt`` (a training state whose reader records one step per parameter, ``extra["step_tensors"]``: DCP's)
    with what the DeepSpeed writer needs: records classified (``buffers``: fnmatch patterns of the tensors without
    optimizer state that are buffers), one step tensor per group, the model-states facts (``module`` order,
    ``buffer_names``, ``shared_params``, steps) and the config. ``side``: the counters and states the source holds
    beside model and optimizer (``train_state``, ``lr_scheduler``, ``client_state``: e.g.
    :func:`zckpt.dcp.sidestate.side_state`)."""
    path = ckpt.location.tag_dir
    precision = precision_of(ds_config)
    if precision == "fp16":
        raise UnsupportedLayout("an fp16 DeepSpeed engine needs its loss scaler's state, which a DCP checkpoint "
                                "does not have", path=path, hint="convert for a bf16 or fp32 config")
    if ckpt.extra.get("flat_param_groups") or not ckpt.groups:
        raise UnsupportedLayout("the DCP checkpoint records no optimizer param groups (saved with "
                                "flatten_optimizer_state_dict=True, or without an optimizer)", path=path,
                                hint="save with get_state_dict's default options: {'model': msd, 'optim': osd}")
    records = []
    for rec in ckpt.records:
        rec = dataclasses.replace(rec)
        if rec.kind in ("frozen", "buffer") and rec.group is None:
            rec.kind = "buffer" if any(fnmatch.fnmatchcase(rec.name, p) for p in buffers or ()) else "frozen"
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
        steps = ckpt.extra.get("step_tensors")
        if steps is None:  # a source with one step per group (Megatron's): torch's float32 step tensor
            step = step_tensor(g.step, f"param group {g.index}", path) if g.step is not None else None
        else:  # DCP: torch's own step tensors, one per parameter
            step = next((steps[n] for n in g.names if n in steps), None)
        if with_state and step is None:
            raise UnsupportedLayout(f"param group {g.index} has Adam moments but no step", path=path)
        group_steps[g.index] = step
    other = [r.name for r in records if r.kind == "trainable" and r.group is None]
    if other:
        raise UnsupportedLayout(f"'{other[0]}' has optimizer state but is in no param group", path=path)
    steps = {g.step for g in ckpt.groups if g.step is not None}
    step = int(max(steps)) if steps else 0
    side = side or {"train_state": {}, "lr_scheduler": None, "client_state": {}}
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


def bf16_optimizer(cfg: dict, stage: int) -> bool:
    """Whether ``cfg`` at ``stage`` runs DeepSpeed's BF16 optimizer (stage 1, bf16, fp32 gradient accumulation)."""
    dtypes = cfg.get("data_types") if isinstance(cfg.get("data_types"), dict) else {}
    return stage == 1 and precision_of(cfg) == "bf16" and dtypes.get("grad_accum_dtype") == "fp32"


def config_adam_w_mode(ds_config: dict) -> bool | None:
    """``adam_w_mode`` of an optimizer DeepSpeed built from its config (``engine._configure_basic_optimizer``:
    type AdamW is always decoupled; type Adam is unless ``adam_w_mode: false``); None when the config has none."""
    opt = ds_config.get("optimizer") if isinstance(ds_config, dict) else None
    if not isinstance(opt, dict) or not isinstance(opt.get("type"), str):
        return None
    kind = opt["type"].lower()
    params = opt.get("params") if isinstance(opt.get("params"), dict) else {}
    if kind == "adamw":
        return True
    if kind == "adam":
        return bool(params.get("adam_w_mode", True))
    raise UnsupportedLayout(f"the config's optimizer is {opt['type']}; only Adam / AdamW map onto torch's AdamW",
                            hint="convert checkpoints of Adam-family optimizers only")
