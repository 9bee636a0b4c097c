"""The DCP writer's state: what ``dcp.save`` gets from FSDP2 + torch's AdamW (``get_state_dict``), built from the
training-state model of any reader, every tensor a :class:`~zckpt.engine.torchzip.TensorOut` of source pieces.

A DeepSpeed source (``zckpt convert --to dcp``: :func:`dcp_state` + :mod:`zckpt.dcp.writer`) becomes what
``dcp.save`` writes for ``{"model": model_sd, "optim": optim_sd}`` with ``model_sd, optim_sd =
get_state_dict(model, AdamW)`` (torch 2.13, FSDP2), so that FSDP2 at any world size resumes with ``dcp.load`` + ``set_state_dict``::

    model.<name>                              fp32 master (trainable), frozen weight / buffer as stored
    model.<tied alias>                        the same bytes as its source (e.g. head.weight -> emb.weight)
    optim.state.<name>.step                   float32 0-d: the group's step (torch keeps one per parameter)
    optim.state.<name>.exp_avg, .exp_avg_sq   Adam moments, as stored (tied aliases: under the source name only)
    optim.param_groups.<i>.<key>              torch AdamW's group keys (lr, betas, eps, weight_decay, amsgrad,
                                              maximize, foreach, capturable, differentiable, fused,
                                              decoupled_weight_decay [, initial_lr]) and params = parameter names
    lr_scheduler.<key>                        DeepSpeed's scheduler state as saved (when it has one)
    train_state.{global_steps,global_samples,skipped_steps}, client_state.<key>, loss_scaler.<key>
    zckpt.tied                                [[alias, source], ...]: the tied aliases (zckpt's own record; dcp.load
                                              loads only the keys it is asked for, so loaders never see it)

DeepSpeed's Adam variants map onto torch's: a client ``torch.optim.AdamW`` / ``Adam`` group is carried as saved
(``decoupled_weight_decay`` says which; ``False`` = Adam with L2, i.e. ``torch.optim.Adam``); DeepSpeed's
``FusedAdam`` / ``DeepSpeedCPUAdam`` (groups with ``bias_correction``) keep the same state and step, and become
AdamW groups when ``adam_w_mode`` is on (the config's optimizer says, or ``adam_mode=``), Adam-with-L2 groups when
it is off. Refused in one line: ``bias_correction=False`` and ``amsgrad=True`` (torch's AdamW cannot continue
them exactly), optimizers that are not Adam, groups saved without hyperparameters (``elastic_checkpoint``), and an
unknown ``adam_w_mode`` when some group has weight decay.
"""

from __future__ import annotations

from zckpt.dcp import writer as dcpw
from zckpt.engine.torchzip import TensorOut, step_tensor
from zckpt.errors import UnsupportedLayout
from zckpt.state.model import Checkpoint

ADAM_MODES = ("adamw", "adam")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
# torch 2.13 AdamW's param-group defaults besides the four above (what get_state_dict saves for every group)
TORCH_ADAM_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                       "differentiable": False, "fused": None}
_DS_ONLY_KEYS = ("bias_correction", "step")  # FusedAdam / DeepSpeedCPUAdam keys torch's Adam does not have


def torch_group(hyper: dict, index: int, adam_mode: str | None, path: str, config_mode=None) -> tuple[dict, str]:
    """One param group's hyperparameters (DeepSpeed's FusedAdam / DeepSpeedCPUAdam or torch's Adam) as torch's Adam
    keeps them, and the optimizer that resumes it (``"AdamW"`` or ``"Adam"``, i.e. Adam with L2 weight decay).
    ``config_mode()``: the source's own word on ``adam_w_mode`` when ``adam_mode`` is not given (None: silent)."""
    h = {k: v for k, v in hyper.items() if k != "params"}
    where = f"param group {index}"
    if not h:
        raise UnsupportedLayout(f"{where} was saved without its hyperparameters (elastic_checkpoint): lr, betas, "
                                "eps and weight_decay are unknown", path=path,
                                hint="reshard it to a rigid layout with DeepSpeed, or save with "
                                     "elastic_checkpoint: false")
    missing = [k for k in ADAM_KEYS if k not in h]
    if missing:
        raise UnsupportedLayout(f"{where} has no {', '.join(missing)}: not an Adam optimizer, which is all torch's "
                                "AdamW can continue", path=path)
    for k in ADAM_KEYS:
        dcpw.check_plain(h[k], f"{where} {k}")
    if h.get("amsgrad"):
        raise UnsupportedLayout(f"{where} uses amsgrad; its max_exp_avg_sq is not in the checkpoint", path=path)
    if "decoupled_weight_decay" in h:  # a torch Adam / AdamW group: carried as it is
        return {**h}, "AdamW" if h["decoupled_weight_decay"] else "Adam"
    if "bias_correction" not in h:
        raise UnsupportedLayout(f"{where} is from an optimizer zckpt cannot map onto torch's AdamW "
                                f"(keys: {', '.join(sorted(h))})", path=path)
    if not h["bias_correction"]:
        raise UnsupportedLayout(f"{where} has bias_correction off; torch's AdamW always corrects the moments' "
                                "bias, so it cannot continue this run exactly", path=path)
    mode = {"adamw": True, "adam": False}.get(adam_mode) if adam_mode else (config_mode() if config_mode else None)
    if mode is None:
        if float(h["weight_decay"]) != 0.0:
            raise UnsupportedLayout(f"{where}: DeepSpeed's FusedAdam / DeepSpeedCPUAdam with weight decay, and "
                                    "the checkpoint does not say adam_w_mode (decoupled or L2)", path=path,
                                    hint="pass --adam-mode adamw (the default of FusedAdam and DeepSpeedCPUAdam) "
                                         "or --adam-mode adam")
        mode = True
    out = {k: h[k] for k in ADAM_KEYS}
    out.update(TORCH_ADAM_DEFAULTS)
    out["decoupled_weight_decay"] = mode
    out.update({k: v for k, v in h.items() if k not in out and k not in _DS_ONLY_KEYS})
    return out, "AdamW" if mode else "Adam"


def dcp_state(ckpt: Checkpoint, adam_mode: str | None = None, config_mode=None) -> tuple[dict, list[str], str]:
    """The state dict ``dcp.save`` would get from FSDP2 + torch's AdamW, from ``ckpt``'s files (no tensor read):
    ``(state, notes, optimizer name)``. ``config_mode``: see :func:`torch_group`."""
    path = ckpt.location.tag_dir
    if ckpt.state_refusal:  # the files hold optimizer state zckpt cannot place: never a DCP without it, exit 0
        raise UnsupportedLayout(f"the optimizer state cannot be carried: {ckpt.state_refusal}", path=path,
                                hint="zckpt merge reads the weights exactly; " + (
                                    "convert --to deepspeed --hf-config CONFIG.json splits the fused state"
                                    if ckpt.extra.get("fused_qkv") else "for the optimizer state, save from an "
                                    "optimizer built from model.named_parameters() (torch then saves the names)"))
    ckpt.check_ties()
    if ckpt.other_state_keys:  # SGD's momentum_buffer, Lion's exp_avg...: torch's AdamW cannot continue them
        raise UnsupportedLayout(f"optimizer state {', '.join(repr(k) for k in ckpt.other_state_keys)} is not "
                                "Adam's exp_avg / exp_avg_sq, which is all a DCP for torch's AdamW holds", path=path,
                                hint="zckpt merge reads the weights exactly; zckpt reshard carries this state")
    byname = ckpt.by_name()
    model: dict = {}
    for rec in ckpt.records:
        if rec.kind == "tied":
            model[rec.name] = dcpw.SameAs(("model", rec.tied_to))
        else:
            model[rec.name] = TensorOut(rec.dtype, tuple(rec.shape), list(rec.value))
    state: dict = {"model": model}
    ties = [[r.name, r.tied_to] for r in ckpt.records if r.kind == "tied"]
    if ties:  # zckpt's record of the ties (dcp.load loads only the keys asked for, so it costs a loader nothing)
        state["zckpt"] = {"tied": ties}
    notes: list[str] = []
    trainable = ckpt.of_kind("trainable")
    with_state = [r for r in trainable if r.exp_avg]
    optimizer = ""
    if trainable and not with_state:
        notes.append("the checkpoint holds no optimizer state (saved before the first step?): model only")
    elif with_state:
        if len(with_state) != len(trainable):
            missing = next(r.name for r in trainable if not r.exp_avg)
            raise UnsupportedLayout(f"'{missing}' has no Adam moments while other parameters have", path=path)
        osd, groups, kinds = {}, [], set()
        for g in ckpt.groups:
            hyper, kind = torch_group(g.hyperparams, g.index, adam_mode, path, config_mode)
            kinds.add(kind)
            if g.step is None:
                raise UnsupportedLayout(f"param group {g.index} has no step", path=path)
            for name in g.names:
                rec = byname[name]
                osd[name] = {"step": step_tensor(g.step, f"param group {g.index}", path),
                             "exp_avg": TensorOut(rec.state_dtype, tuple(rec.shape), list(rec.exp_avg)),
                             "exp_avg_sq": TensorOut(rec.state_dtype, tuple(rec.shape), list(rec.exp_avg_sq))}
            groups.append({**hyper, "params": list(g.names)})
        if len(kinds) > 1:
            raise UnsupportedLayout("some param groups are AdamW (decoupled weight decay) and some Adam (L2); one "
                                    "torch optimizer cannot continue both", path=path)
        optimizer = kinds.pop()
        state["optim"] = {"state": osd, "param_groups": groups}
        if optimizer == "Adam":
            notes.append("Adam with L2 weight decay (adam_w_mode off): resume with torch.optim.Adam, not AdamW")
    _extra_state(ckpt, state, notes)
    return state, notes, optimizer


def _plain_or_note(value, what: str, notes: list[str]) -> bool:
    try:
        dcpw.check_plain(value, what)
        return True
    except UnsupportedLayout:
        notes.append(f"{what} left out: it holds objects that are not plain data")
        return False


def _extra_state(ckpt: Checkpoint, state: dict, notes: list[str]) -> None:
    ms = ckpt.model_state
    sched = ms.get("lr_scheduler")
    if isinstance(sched, dict) and sched and _plain_or_note(sched, "lr_scheduler", notes):
        state["lr_scheduler"] = dict(sched)
    counters = {k: ms[k] for k in ("global_steps", "global_samples", "skipped_steps") if isinstance(ms.get(k), int)}
    if counters:
        state["train_state"] = counters
    client = {k: v for k, v in ckpt.client_state.items()}
    client = {k: v for k, v in client.items() if _plain_or_note(v, f"client_state {k!r}", notes)}
    if client:
        state["client_state"] = client
    scaler = ckpt.loss_scaler
    if scaler and _plain_or_note(scaler, "loss_scaler", notes):
        state["loss_scaler"] = scaler
