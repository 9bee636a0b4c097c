"""Resume a DCP checkpoint in FSDP2 with one call, and build its param groups with another: nothing to guess.

    import torch
    from torch.distributed.fsdp import fully_shard
    from zckpt.integrations import fsdp2

    model = build_model()                               # the model class that was trained (same parameter names)
    for block in model.blocks:
        fully_shard(block)                              # any mesh, any world size
    fully_shard(model)
    opt = torch.optim.AdamW(fsdp2.param_groups(model, "ckpt-fsdp/"))
    report = fsdp2.load(model, opt, "ckpt-fsdp/", scheduler=sched)   # model + optimizer (+ scheduler)

Both layouts zckpt writes and FSDP2 users save are read (:func:`zckpt.dcp.reader.dcp_parts`):

    ckpt/.metadata                          one DCP folder: ``model.<fqn>`` and ``optim.*`` (``dcp.save`` of
                                            ``{"model": msd, "optim": osd}``; ``optimizer.*`` too)
    ckpt/pytorch_model_fsdp_0/.metadata     a Trainer / Accelerate FSDP ``checkpoint-N``: ``{"model": msd}``
    ckpt/optimizer_0/.metadata                                                       and ``{"optimizer": osd}``
    ckpt/scheduler.pt, trainer_state.json   the Trainer's scheduler and counters (rng_state_<r>.pth: per rank)

:func:`load` reads the checkpoint's metadata first (zckpt's reader, no tensor bytes), checks the optimizer's param
groups against the checkpoint's (the parameter names of each group; lr, betas, eps, weight_decay,
decoupled_weight_decay, amsgrad, maximize; ``initial_lr`` instead of ``lr`` when a scheduler set both) and the
model's state dict keys against the checkpoint's, and refuses any difference in one line
(:class:`zckpt.errors.InvalidArgument`) before anything is loaded. Then ``get_state_dict`` -> ``dcp.load`` ->
``set_state_dict`` (torch's own, at any world size), the scheduler from ``scheduler.pt`` (or a torch scheduler's
state saved under ``lr_scheduler``), and a :class:`LoadReport` of what was restored, the counters, and what was not
restored with why.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from zckpt.dcp.reader import OPTIM_ROOTS, dcp_parts, open_dcp
from zckpt.errors import InvalidArgument, UnsupportedLayout
from zckpt.io import storage
from zckpt.state.model import GroupInfo

# parameter-name prefixes torch's get_state_dict strips (torch.distributed.checkpoint.state_dict._get_fqns)
_WRAPPERS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "module_wrapped")
COMPARED = ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "amsgrad", "maximize")
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "initial_lr")
COUNTERS = ("global_steps", "global_samples", "skipped_steps")


@dataclass
class LoadReport:
    """What :func:`load` did. ``restored``: what was loaded into the objects passed; ``counters``: the training
    counters the checkpoint holds (``global_steps``, ``global_samples``, ``skipped_steps``, the Trainer's
    ``global_step``...), for the caller's loop; ``not_restored``: {what: why} for everything else it holds."""

    path: str
    layout: str
    restored: list[str] = field(default_factory=list)
    counters: dict = field(default_factory=dict)
    not_restored: dict = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"{self.path} ({self.layout} layout): restored " + "; ".join(self.restored)]
        if self.counters:
            lines.append("counters: " + ", ".join(f"{k}={v}" for k, v in self.counters.items()))
        lines += [f"not restored: {k}: {v}" for k, v in self.not_restored.items()]
        return "\n".join(lines)


def fqn(name: str) -> str:
    """A parameter's name as ``get_state_dict`` keys it (wrapper modules' prefixes dropped)."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPERS)


def _named(model) -> dict:
    """{fqn: parameter}, each shared parameter once under its first name (as the optimizer state is keyed)."""
    return {fqn(n): p for n, p in model.named_parameters()}


def _open(path, storage_options=None):
    path = str(path).rstrip("/") or "/"
    return path, open_dcp(path, storage_options, tied={})


def _flat_groups(ckpt) -> list:
    """Param groups of an optimizer state saved flattened (torchtitan's ``param_groups.<fqn>.<key>``, torch's
    ``flatten_optimizer_state_dict=True``): the parameters with the same hyperparameters, in the saved order;
    every parameter gets exactly the values saved for it."""
    out = []
    for name, hp in ckpt.extra.get("flat_groups", {}).items():
        hp = {k: v for k, v in hp.items() if k not in ("params", "param_names")}
        for g in out:
            if all(_same(g[1].get(k), v) for k, v in hp.items()) and set(g[1]) == set(hp):
                g[0].append(name)
                break
        else:
            out.append(([name], hp))
    return [GroupInfo(i, hp, None, names) for i, (names, hp) in enumerate(out)]


def _groups(ckpt, path: str) -> list:
    if ckpt.extra.get("flat_param_groups") and ckpt.extra.get("flat_groups") and not ckpt.groups:
        return _flat_groups(ckpt)
    if ckpt.extra.get("flat_param_groups") or not ckpt.groups:
        raise UnsupportedLayout("the checkpoint records no param groups (optimizer state saved flattened, or "
                                "no optimizer saved)", path=path,
                                hint="save with get_state_dict's default options: {'model': msd, 'optim': osd}")
    return ckpt.groups


def param_groups(model, path, storage_options: dict | None = None) -> list[dict]:
    """The checkpoint's param groups over ``model``'s parameters, in the checkpoint's order, ready for
    ``torch.optim.AdamW(...)`` / ``Adam``: ``params`` (the model's parameters the group names), ``lr``, ``betas``,
    ``eps``, ``weight_decay``, ``amsgrad``, ``maximize`` (and ``initial_lr`` when a scheduler saved it). Refuses a
    checkpoint name the model does not have."""
    path, ckpt = _open(path, storage_options)
    named = _named(model)
    out = []
    for g in _groups(ckpt, path):
        missing = [n for n in g.names if n not in named]
        if missing:
            raise InvalidArgument(f"param group {g.index} of the checkpoint names '{missing[0]}'" +
                                  (f" and {len(missing) - 1} more" if len(missing) > 1 else "") +
                                  ", which the model has no parameter of", path=path,
                                  hint="build the model class that was trained (the same parameter names)")
        hp = {k: _plain(g.hyperparams[k]) for k in GROUP_KEYS if k in g.hyperparams}
        out.append({"params": [named[n] for n in g.names], **hp})
    return out


def _plain(v):
    return tuple(v) if isinstance(v, list) else v


def _same(a, b) -> bool:
    a, b = _plain(a), _plain(b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "item"):
        a = a.item()
    if hasattr(b, "item"):
        b = b.item()
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def check_groups(model, optimizer, ckpt, path: str) -> None:
    """Refuse, in one line naming the first differences, an optimizer whose param groups are not the
    checkpoint's: which parameters go together, and each group's hyperparameters."""
    names = {id(p): n for n, p in _named(model).items()}
    ours = []
    for i, g in enumerate(optimizer.param_groups):
        unknown = [p for p in g["params"] if id(p) not in names]
        if unknown:
            raise InvalidArgument(f"optimizer param group {i} holds a tensor that is not a parameter of the model",
                                  path=path, hint="build the optimizer from this model's parameters")
        ours.append([names[id(p)] for p in g["params"]])
    theirs = _groups(ckpt, path)
    if not ckpt.groups:  # flattened: each parameter's own saved values decide, not a group index
        _check_flat(ours, optimizer, ckpt, path)
        return
    where = {n: g.index for g in theirs for n in g.names}
    hint = "build the optimizer with zckpt.integrations.fsdp2.param_groups(model, path)"
    diffs = []
    for i, names_i in enumerate(ours):
        for n in names_i:
            j = where.get(n)
            if j != i:
                wd = f", weight_decay {theirs[j].hyperparams.get('weight_decay')}" if j is not None else ""
                diffs.append(f"'{n}' is in optimizer group {i}, the checkpoint's " +
                             (f"group {j}{wd}" if j is not None else "groups do not have it"))
    mine = {n for names_i in ours for n in names_i}
    diffs += [f"'{n}' (checkpoint group {j}) is in no optimizer group" for n, j in where.items() if n not in mine]
    if len(ours) != len(theirs):
        diffs.insert(0, f"the optimizer has {len(ours)} param group(s), the checkpoint {len(theirs)}")
    if not diffs:
        for g in theirs:
            og = optimizer.param_groups[g.index]
            for k in COMPARED:
                key = "initial_lr" if k == "lr" and "initial_lr" in og and "initial_lr" in g.hyperparams else k
                if key in og and key in g.hyperparams and not _same(og[key], g.hyperparams[key]):
                    diffs.append(f"group {g.index} {key} {_plain(og[key])!r}, the checkpoint's "
                                 f"{_plain(g.hyperparams[key])!r}")
    if diffs:
        more = f" (and {len(diffs) - 2} more)" if len(diffs) > 2 else ""
        raise InvalidArgument("the optimizer's param groups are not the checkpoint's: " + "; ".join(diffs[:2]) + more,
                              path=path, hint=hint)


def _check_flat(ours: list, optimizer, ckpt, path: str) -> None:
    saved = ckpt.extra["flat_groups"]
    diffs = []
    for i, names_i in enumerate(ours):
        og = optimizer.param_groups[i]
        for n in names_i:
            hp = saved.get(n)
            if hp is None:
                diffs.append(f"'{n}' (optimizer group {i}) has no saved param group values")
                continue
            for k in COMPARED:
                key = "initial_lr" if k == "lr" and "initial_lr" in og and "initial_lr" in hp else k
                if key in og and key in hp and not _same(og[key], hp[key]):
                    diffs.append(f"'{n}' {key} {_plain(og[key])!r} in optimizer group {i}, the checkpoint's "
                                 f"{_plain(hp[key])!r}")
    mine = {n for names_i in ours for n in names_i}
    diffs += [f"'{n}' is in no optimizer group" for n in saved if n not in mine]
    if diffs:
        more = f" (and {len(diffs) - 2} more)" if len(diffs) > 2 else ""
        raise InvalidArgument("the optimizer's param groups are not the checkpoint's: " + "; ".join(diffs[:2]) + more,
                              path=path, hint="build the optimizer with zckpt.integrations.fsdp2.param_groups(model, "
                                              "path)")


def _check_model_keys(msd: dict, ckpt, path: str) -> None:
    have = set(ckpt.extra["model_keys"])
    want = set(msd)
    missing, extra = sorted(want - have), sorted(have - want)
    if missing:
        raise InvalidArgument(f"the model has '{missing[0]}'" + (f" and {len(missing) - 1} more" if len(missing) > 1
                              else "") + ", which the checkpoint does not", path=path,
                              hint="build the model class that was trained (the same parameter and buffer names)")
    if extra:
        raise InvalidArgument(f"the checkpoint has '{extra[0]}'" + (f" and {len(extra) - 1} more" if len(extra) > 1
                              else "") + ", which the model does not", path=path,
                              hint="build the model class that was trained (the same parameter and buffer names)")
    sizes = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
    for rec in ckpt.records:
        t = msd.get(rec.name)
        mine = str(getattr(t, "dtype", "")).replace("torch.", "")
        if rec.kind == "trainable" and mine in sizes and sizes.get(rec.dtype, 0) > sizes[mine]:
            raise InvalidArgument(f"the model's '{rec.name}' is {mine}, the checkpoint's {rec.dtype}: loading would "
                                  "round it", path=path,
                                  hint=f"build the model in {rec.dtype} (from_config(..., dtype=torch.{rec.dtype})); "
                                       "FSDP2's MixedPrecisionPolicy(param_dtype=torch.bfloat16) computes in bf16")


def _roots(ckpt) -> tuple[str | None, str | None]:
    md = ckpt.extra["metadata"]
    keys = ckpt.extra["model_keys"]
    first = md.path_of(next(iter(keys.values())))
    model_root = "model" if first[0] == "model" and len(first) > 1 else None
    optim_root = next((md.path_of(k)[0] for k in list(md.tensors) + list(md.values)
                       if md.path_of(k)[0] in OPTIM_ROOTS), None)
    return model_root, optim_root


def load(model, optimizer, path, scheduler=None, storage_options: dict | None = None) -> LoadReport:
    """Load the DCP checkpoint at ``path`` (one DCP folder, or a Trainer ``checkpoint-N`` of
    ``pytorch_model_fsdp_0/`` + ``optimizer_0/``) into ``model`` (FSDP2-sharded at any world size, or a plain
    module) and ``optimizer``, after checking the optimizer's param groups and the model's keys against the
    checkpoint (refused in one line, nothing loaded). ``scheduler``: a torch LR scheduler to restore from the
    Trainer's ``scheduler.pt`` or a torch scheduler state saved under ``lr_scheduler``. Call it on every rank.
    Returns a :class:`LoadReport`."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    path, ckpt = _open(path, storage_options)
    parts = dcp_parts(path, storage_options)
    layout = "trainer" if parts[0] else "dcp"
    model_root, optim_root = _roots(ckpt)
    if optimizer is not None:
        if optim_root is None or (layout == "trainer" and len(parts) < 2):
            raise InvalidArgument("the checkpoint holds no optimizer state" +
                                  (" (no optimizer_0/ folder)" if layout == "trainer" else ""), path=path,
                                  hint="pass optimizer=None to load the model only")
        check_groups(model, optimizer, ckpt, path)
    flat = bool(ckpt.extra.get("flat_param_groups")) and not ckpt.groups
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer, options=options)
    else:
        msd, osd = get_state_dict(model, [])[0], None
    _check_model_keys(msd, ckpt, path)
    report = LoadReport(path, layout)
    if layout == "trainer":
        dcp.load({"model": msd}, checkpoint_id=storage.join(path, parts[0]))
        if osd is not None:
            dcp.load({optim_root: osd}, checkpoint_id=storage.join(path, parts[1]))
    else:
        sd = {model_root: msd} if model_root else dict(msd)
        if osd is not None:
            sd[optim_root] = osd
        dcp.load(sd, checkpoint_id=path)
        msd = sd[model_root] if model_root else {k: sd[k] for k in msd}
        osd = sd.get(optim_root) if osd is not None else None
    if osd is not None:
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd, options=options)
        steps = sorted({g.step for g in ckpt.groups if g.step is not None})
        report.restored.append(f"model ({len(msd)} tensors)")
        report.restored.append(f"optimizer ({len(_groups(ckpt, path))} param groups" +
                               (", saved flattened" if flat else "") +
                               (f", step {steps[0]:g})" if len(steps) == 1 else ")"))
    else:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        set_model_state_dict(model, msd)
        report.restored.append(f"model ({len(msd)} tensors)")
        if optim_root:
            report.not_restored["optimizer"] = "optimizer=None was passed"
    _side_state(ckpt, path, scheduler, report, storage_options, torch)
    return report


def _side_state(ckpt, path: str, scheduler, report: LoadReport, opts, torch) -> None:
    values = ckpt.extra.get("values") or {}
    md = ckpt.extra["metadata"]
    by_root: dict = {}
    for key, v in values.items():
        p = md.path_of(key)
        by_root.setdefault(p[0], {})[".".join(str(x) for x in p[1:])] = v
    for k in COUNTERS:
        if k in by_root.get("train_state", {}):
            report.counters[k] = by_root["train_state"][k]
    files = {}
    try:
        files = storage.list_files(path, opts)
    except (OSError, ValueError):
        pass
    if "trainer_state.json" in files:
        try:
            ts = json.loads(storage.read_bytes(storage.join(path, "trainer_state.json"), opts))
            for k in ("global_step", "epoch"):
                if k in ts:
                    report.counters[k] = ts[k]
        except ValueError:
            report.not_restored["trainer_state.json"] = "not valid JSON"
    sched_state = by_root.get("lr_scheduler")
    if "scheduler.pt" in files:
        if scheduler is None:
            report.not_restored["scheduler.pt"] = "no scheduler= passed"
        else:
            state = torch.load(os.path.join(path, "scheduler.pt"), weights_only=True)
            scheduler.load_state_dict(state)
            report.restored.append("scheduler (scheduler.pt)")
    elif sched_state:
        if scheduler is not None and set(sched_state) == set(scheduler.state_dict()):
            scheduler.load_state_dict(dict(sched_state))
            report.restored.append("scheduler (lr_scheduler)")
        elif scheduler is not None and set(sched_state) == {"last_epoch"} and \
                isinstance(sched_state["last_epoch"], int) and hasattr(scheduler, "last_epoch"):
            # torchtitan's form: only last_epoch (its schedules are functions of it and the base lrs; the groups'
            # current lr came back with the optimizer)
            state = scheduler.state_dict()
            state.update(last_epoch=sched_state["last_epoch"], _step_count=sched_state["last_epoch"] + 1)
            if "_last_lr" in state:
                state["_last_lr"] = [g["lr"] for g in scheduler.optimizer.param_groups]
            scheduler.load_state_dict(state)
            report.restored.append("scheduler (lr_scheduler.last_epoch)")
        else:
            why = ("its keys (" + ", ".join(sorted(sched_state)) + ") are not this scheduler's state"
                   if scheduler is not None else "no scheduler= passed")
            report.not_restored["lr_scheduler"] = f"{why}: {dict(sorted(sched_state.items()))}"
    elif scheduler is not None:
        report.not_restored["scheduler"] = "the checkpoint holds no scheduler state"
    for root in sorted(by_root):
        if root in ("train_state", "lr_scheduler", "zckpt") or root in OPTIM_ROOTS or root == "model":
            continue
        report.not_restored[root] = "not a model, optimizer or scheduler state: " + ", ".join(sorted(by_root[root]))
    extra = by_root.get("train_state", {})
    for other in sorted(set(extra) - set(COUNTERS)):
        report.counters[other] = extra[other]
    rng = sorted(n for n in files if "/" not in n and n.startswith("rng_state") and n.endswith(".pth"))
    if rng:
        report.not_restored[", ".join(rng)] = "per-rank RNG states: restore them in the training loop if needed"
