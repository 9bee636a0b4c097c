"""The DCP writer's torchtitan layout: the training state as torchtitan 0.3.0's ``CheckpointManager`` saves one step
(``<dump_folder>/<checkpoint.folder>/step-<N>/``, one ``dcp.save``), so that ``CheckpointManager.load(step=N)``
resumes it at any world size. What its source says (``components/checkpointer/dcp.py``, ``base.py``,
``components/optimizer/utils.py``, ``lr_scheduler.py``, ``trainer.py``)::

    <fqn>                                     ModelWrapper.state_dict(): the model's own keys at the top level
                                              (here the source's parameter names; zckpt renames nothing)
    optimizer.state.<fqn>.step                get_flat_optim_state_dict: torch AdamW's per-parameter state
    optimizer.state.<fqn>.exp_avg, .exp_avg_sq
    optimizer.param_groups.<fqn>.<key>        each parameter's group values (lr, betas, eps, weight_decay, amsgrad,
                                              ..., initial_lr: LambdaLR adds it to every group); no group list
    lr_scheduler.last_epoch                   LRSchedulersContainer.state_dict(): nothing else
    train_state.step, .ntokens_seen           Trainer.state_dict()
    dataloader.*                              per data-parallel rank, never resharded by torchtitan: not written
                                              (load with checkpoint.exclude_from_loading=["dataloader"])

``dcp.load`` is strict: every key the live state dict has must be in the files. What the source does not hold is
stated by the user (:data:`STATED`) or refused in one line naming the option; nothing is invented.
"""

from __future__ import annotations

import math

from zckpt.dcp import writer as dcpw
from zckpt.engine.segments import slice_segments
from zckpt.engine.torchzip import TensorOut
from zckpt.encoding import safeload
from zckpt.errors import InvalidArgument, UnsupportedLayout
from zckpt.state.model import Checkpoint

#: what the user may state (python ``torchtitan={...}``; the CLI's --ntokens-seen, --lr-last-epoch, --initial-lr)
STATED = {"ntokens_seen": "--ntokens-seen", "lr_last_epoch": "--lr-last-epoch", "initial_lr": "--initial-lr"}
ROOTS = ("optimizer", "lr_scheduler", "train_state", "dataloader", "zckpt")


def _int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"{what} must be a whole number >= 0, not {value!r}")
    return value


def check_stated(stated: dict | None) -> dict:
    stated = {k: v for k, v in (stated or {}).items() if v is not None}
    unknown = sorted(set(stated) - set(STATED))
    if unknown:
        raise InvalidArgument(f"unknown torchtitan value {unknown[0]!r}", hint=f"state {', '.join(STATED)}")
    return stated


def titan_state(ckpt: Checkpoint, state: dict, copies, stated: dict | None) -> tuple[dict, list, dict, list]:
    """``(state, carried, not_carried, notes)``: :func:`zckpt.dcp.fsdp2_state.dcp_state`'s ``state`` laid out as
    torchtitan saves it. ``copies``: a Trainer checkpoint-N's own files (its ``scheduler.pt`` is read, never
    copied); ``stated``: the values of :data:`STATED` the user gives."""
    stated = check_stated(stated)
    path = ckpt.location.tag_dir
    if "ntokens_seen" not in stated:
        raise InvalidArgument("torchtitan's train_state needs ntokens_seen, which no DeepSpeed file records",
                              path=path, hint="pass --ntokens-seen N (torchtitan counts the tokens each rank saw; "
                                              "0 starts the count again)")
    if "optim" not in state:
        raise UnsupportedLayout("the checkpoint holds no optimizer state; torchtitan's CheckpointManager loads the "
                                "optimizer with the model at every step but 0", path=path,
                                hint="zckpt merge writes the weights (torchtitan's initial_load_path, model only)")
    model = state["model"]
    clash = sorted(k for k in model if k.split(".")[0] in ROOTS)
    if clash:
        raise UnsupportedLayout(f"parameter '{clash[0]}' has the name of a torchtitan checkpoint root", path=path)
    out: dict = {k: (dcpw.SameAs((v.path[1],)) if isinstance(v, dcpw.SameAs) else v) for k, v in model.items()}
    notes: list[str] = []
    carried = ["model (top-level keys, the source's names)"]
    optim = state["optim"]
    flat: dict = {f"state.{n}.{k}": v for n, st in optim["state"].items() for k, v in st.items()}
    for g in _with_initial_lr(optim["param_groups"], stated, notes, path):
        for n in g["params"]:
            flat.update({f"param_groups.{n}.{k}": v for k, v in g.items() if k != "params"})
    for prefix, groups in ckpt.extra.get("titan_qkv") or []:  # torchtitan's fused-qkv attention's optimizer keys
        _fused_qkv(flat, prefix, groups)
    out["optimizer"] = flat
    carried.append("optimizer (flat: state.<fqn>.*, param_groups.<fqn>.*)")
    out["lr_scheduler"] = {"last_epoch": _last_epoch(ckpt, state, copies, stated, notes, path)}
    carried.append(f"lr_scheduler.last_epoch = {out['lr_scheduler']['last_epoch']}")
    steps = ckpt.model_state.get("global_steps")
    if not isinstance(steps, int) or isinstance(steps, bool):
        raise UnsupportedLayout("the checkpoint records no global_steps: torchtitan's train_state.step is unknown",
                                path=path)
    out["train_state"] = {"step": steps, "ntokens_seen": _int(stated["ntokens_seen"], "ntokens_seen")}
    carried.append(f"train_state.step = {steps} (global_steps), train_state.ntokens_seen (as stated)")
    if "zckpt" in state:
        out["zckpt"] = state["zckpt"]
        carried.append("tied aliases (zckpt.tied)")
    not_carried = {"dataloader": "not in the source: load with checkpoint.exclude_from_loading=['dataloader']"}
    counters = state.get("train_state", {})
    for k in ("global_samples", "skipped_steps"):
        if k in counters:
            not_carried[f"train_state.{k}"] = "torchtitan's train_state has step and ntokens_seen only"
    for root in ("client_state", "loss_scaler"):
        if root in state:
            not_carried[root] = "torchtitan's checkpoint has no place for it"
    if isinstance(state.get("lr_scheduler"), dict) or any(rel == "scheduler.pt" for rel, _, _ in copies):
        not_carried["the schedule itself"] = ("torchtitan's LambdaLR recomputes the lr from its own config and "
                                              "last_epoch")
    if ckpt.extra.get("titan_names"):  # (an AutoEP source named as torchtitan's model of its family)
        not_carried.update(ckpt.extra.get("titan_not_carried") or {})
        carried[0] = f"model (top-level keys, torchtitan {ckpt.extra['titan_names']}'s names)"
    else:
        notes.append("keys are the source's parameter names: build the torchtitan model with the same names")
    notes.append("torchtitan's CheckpointManager.load needs checkpoint.exclude_from_loading=['dataloader']")
    return out, carried, not_carried, notes


def _fused_qkv(flat: dict, prefix: str, groups: int) -> None:
    """torchtitan's fused-qkv attention (``fuse_qkv=True``, its Qwen3 default) names its one parameter
    ``{prefix}wqkv.weight``: its model state dict splits it into ``wq``/``wk``/``wv`` (``_split_qkv_on_save``),
    its optimizer's does not. The optimizer's state under that name too, laid out as ``_merge_qkv_on_load`` fuses
    the weight: per key-value group g, wq's rows of g, then wk's, then wv's; the split keys stay (a model built with
    ``fuse_qkv=False`` loads them), each ``dcp.load`` reads the keys its model asks for."""
    names = [f"{prefix}{w}.weight" for w in ("wq", "wk", "wv")]
    fused = f"{prefix}wqkv.weight"
    for key in ("exp_avg", "exp_avg_sq"):
        parts = [flat[f"state.{n}.{key}"] for n in names]
        blocks = [math.prod(t.shape) // groups for t in parts]
        segs = [s for g in range(groups) for t, b in zip(parts, blocks) for s in slice_segments(t.segments, g * b, b)]
        rows = sum(int(t.shape[0]) for t in parts)
        flat[f"state.{fused}.{key}"] = TensorOut(parts[0].dtype, (rows, *parts[0].shape[1:]), segs)
    flat[f"state.{fused}.step"] = flat[f"state.{names[0]}.step"]
    for k in [k for k in flat if k.startswith(f"param_groups.{names[0]}.")]:
        flat[f"param_groups.{fused}.{k[len(f'param_groups.{names[0]}.'):]}"] = flat[k]


def _with_initial_lr(groups: list[dict], stated: dict, notes: list[str], path: str) -> list[dict]:
    """torchtitan builds LambdaLR, which adds ``initial_lr`` to every group, so its load asks for it: the source's
    (torch schedulers record it) or the user's (one value, or one per group)."""
    want = stated.get("initial_lr")
    if want is None:
        missing = [i for i, g in enumerate(groups) if "initial_lr" not in g]
        if missing:
            raise InvalidArgument(f"param group {missing[0]} has no initial_lr (no torch scheduler ran on it), and "
                                  "torchtitan's LambdaLR adds one to every group that its load reads", path=path,
                                  hint="pass --initial-lr LR[,LR...] (torchtitan's configured lr of each group, "
                                       "in the source's group order)")
        return groups
    values = list(want) if isinstance(want, (list, tuple)) else [want]
    if len(values) == 1:
        values *= len(groups)
    if len(values) != len(groups):
        raise InvalidArgument(f"--initial-lr gives {len(values)} values for {len(groups)} param groups",
                              hint="one value, or one per param group in the source's order")
    out = []
    for g, v in zip(groups, values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidArgument(f"initial_lr must be a number, not {v!r}")
        out.append({**g, "initial_lr": float(v)})
    notes.append(f"initial_lr {', '.join(str(float(v)) for v in values)} as stated")
    return out


def _last_epoch(ckpt: Checkpoint, state: dict, copies, stated: dict, notes: list[str], path: str) -> int:
    """``lr_scheduler.last_epoch``: stated, or where the source's scheduler state says it exactly: a torch
    scheduler's ``last_epoch`` (DeepSpeed's ``lr_scheduler``, a Trainer's ``scheduler.pt``), or DeepSpeed's own
    schedulers' ``last_batch_iteration`` + 1 (they start at -1 and step by one: the steps taken, as LambdaLR's
    ``last_epoch`` counts them from 0)."""
    if "lr_last_epoch" in stated:
        notes.append(f"lr_scheduler.last_epoch {stated['lr_last_epoch']} as stated")
        return _int(stated["lr_last_epoch"], "lr_last_epoch")
    sched = state.get("lr_scheduler")
    if isinstance(sched, dict) and _count(sched.get("last_epoch")):
        return sched["last_epoch"]
    lbi = sched["last_batch_iteration"] if isinstance(sched, dict) and set(sched) == {"last_batch_iteration"} \
        else None
    if _count(lbi, -1):
        notes.append(f"lr_scheduler.last_epoch {lbi + 1}: DeepSpeed's scheduler stepped that many times "
                     f"(last_batch_iteration {lbi})")
        return lbi + 1
    for rel, file, _ in copies:
        if rel == "scheduler.pt":
            saved = safeload.load(file, storage_options=ckpt.storage_options)
            if isinstance(saved, dict) and _count(saved.get("last_epoch")):
                notes.append(f"lr_scheduler.last_epoch {saved['last_epoch']} from the Trainer's scheduler.pt")
                return saved["last_epoch"]
    what = f"its scheduler state ({', '.join(map(str, sched))}) does not say" if isinstance(sched, dict) else \
        "the checkpoint holds no scheduler state"
    raise InvalidArgument(f"torchtitan's lr_scheduler needs last_epoch, and {what}", path=path,
                          hint="pass --lr-last-epoch N (the scheduler steps taken; torchtitan steps it once a step)")


def _count(value, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
