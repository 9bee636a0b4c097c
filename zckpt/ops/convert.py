"""Converting a training checkpoint between formats: one (reader, writer) pair per direction, one engine, one
publish path.

Readers describe the source as the one training-state model (:class:`zckpt.deepspeed.model.Checkpoint`: per
parameter the fp32 master, the Adam moments, its group's hyperparameters and step; frozen weights and buffers;
scheduler and counters). Writers plan the target layout from that model as plain data (``--dry-run`` prints it),
then write it through :mod:`zckpt.engine` into a scratch folder published by :mod:`zckpt.io.publish`.

DeepSpeed -> DCP (``to="dcp"``, :func:`dcp_state` + :mod:`zckpt.dcp.writer`) writes what ``dcp.save`` writes for
``{"model": model_sd, "optim": optim_sd}`` with ``model_sd, optim_sd = get_state_dict(model, AdamW)`` (torch 2.13,
FSDP2), so that FSDP2 at any world size resumes with ``dcp.load`` + ``set_state_dict``::

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

import logging
import os
import shutil
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from zckpt.units import format_size
from zckpt.dcp import writer as dcpw
from zckpt.state.open import open_checkpoint
from zckpt.state.model import Checkpoint
from zckpt.engine import executor, torchzip
from zckpt.engine.checked import InputCheck
from zckpt.engine.torchzip import TensorOut
from zckpt.errors import InvalidArgument, UnsupportedLayout
from zckpt.io import links, publish, storage
from zckpt.state import checksums

log = logging.getLogger(__name__)

FORMATS = ("dcp", "deepspeed")
ADAM_MODES = ("adamw", "adam")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
# torch 2.13 AdamW's param-group defaults besides the four above (what get_state_dict saves for every group)
TORCH_ADAM_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                       "differentiable": False, "fused": None}
_DS_ONLY_KEYS = ("bias_correction", "step")  # FusedAdam / DeepSpeedCPUAdam keys torch's Adam does not have


# ------------------------------------------------------------------------------------------- plan data

@dataclass
class ConvertPlan:
    """``parts``: (sub-folder, DCP layout) pairs (one at the top for ``layout="dcp"``; the Trainer's
    ``pytorch_model_fsdp_0`` and ``optimizer_0`` for ``layout="trainer"``); ``copies``: (relpath, source file,
    size) copied as they are (a Trainer checkpoint's scheduler.pt, trainer_state.json, config...)."""

    source: str
    tag: str
    to: str
    source_format: str
    parts: list[tuple[str, dcpw.DcpPlan]]
    notes: list[str] = field(default_factory=list)
    optimizer: str = ""
    layout: str = "dcp"
    copies: list[tuple[str, str, int]] = field(default_factory=list)
    carried: list[str] = field(default_factory=list)  # what of the source the output holds
    not_carried: dict = field(default_factory=dict)  # {what: why} for what it does not

    @property
    def total_bytes(self) -> int:
        return sum(p.total_bytes for _, p in self.parts) + sum(c[2] for c in self.copies)

    def summary(self) -> dict:
        files = []
        for folder, part in self.parts:
            files += [{"name": _rel(folder, f.name), "bytes": f.size} for f in part.files]
            files.append({"name": _rel(folder, dcpw.METADATA), "bytes": len(part.metadata)})
        files += [{"name": rel, "bytes": size} for rel, _, size in self.copies]
        return {"source": self.source, "tag": self.tag, "from": self.source_format, "to": self.to,
                "layout": self.layout, "optimizer": self.optimizer,
                "keys": sum(len(p.items) for _, p in self.parts), "total_bytes": self.total_bytes,
                "payload_bytes": sum(p.payload_bytes for _, p in self.parts), "files": files, "notes": self.notes,
                "carried": self.carried, "not_carried": self.not_carried}


def _rel(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


@dataclass
class ConvertResult:
    output: str
    plan: ConvertPlan
    seconds: float = 0.0
    dry_run: bool = False
    stats: dict = field(default_factory=dict)  # ranks, bytes, seconds, remote reads (as merge and reshard report)

    def to_json(self) -> dict:
        return {"output": self.output, "dry_run": self.dry_run, "seconds": round(self.seconds, 3),
                **self.plan.summary(), **({"stats": self.stats} if self.stats else {})}

    def __repr__(self) -> str:
        what = "would write" if self.dry_run else f"wrote in {self.seconds:.2f}s"
        return (f"<ConvertResult {self.output!r}: {self.plan.source_format} -> {self.plan.to}, "
                f"{len(self.plan.layout.items)} keys, {len(self.plan.layout.files) + 1} files, "
                f"{format_size(self.plan.total_bytes)}, {what}>")


# ------------------------------------------------------------------------------------------- optimizer mapping

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


def torch_group(hyper: dict, index: int, ds_config: dict, adam_mode: str | None, path: str) -> tuple[dict, str]:
    """One DeepSpeed param group's hyperparameters as torch's Adam keeps them, and the optimizer that resumes it
    (``"AdamW"`` or ``"Adam"``, i.e. Adam with L2 weight decay)."""
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
    mode = {"adamw": True, "adam": False}.get(adam_mode) if adam_mode else config_adam_w_mode(ds_config)
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


def _step_tensor(step, where: str, path: str) -> TensorOut:
    value = float(step)
    packed = struct.pack("<f", value)
    if struct.unpack("<f", packed)[0] != value:
        raise UnsupportedLayout(f"{where}: step {step} is not exact as torch's float32 step", path=path)
    return TensorOut("float32", (), [packed])


# ------------------------------------------------------------------------------------------- DeepSpeed -> DCP

def dcp_state(ckpt: Checkpoint, adam_mode: str | None = None) -> tuple[dict, list[str], str]:
    """The state dict ``dcp.save`` would get from FSDP2 + torch's AdamW, from ``ckpt``'s files (no tensor read):
    ``(state, notes, optimizer name)``."""
    path = ckpt.location.tag_dir
    if ckpt.state_refusal:  # the files hold optimizer state zckpt cannot place: never a DCP without it, exit 0
        raise UnsupportedLayout(f"the optimizer state cannot be carried: {ckpt.state_refusal}", path=path,
                                hint="zckpt merge reads the weights exactly; for the optimizer state, save from an "
                                     "optimizer built from model.named_parameters() (torch then saves the names)")
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
            hyper, kind = torch_group(g.hyperparams, g.index, ckpt.ds_config, adam_mode, path)
            kinds.add(kind)
            if g.step is None:
                raise UnsupportedLayout(f"param group {g.index} has no step", path=path)
            for name in g.names:
                rec = byname[name]
                osd[name] = {"step": _step_tensor(g.step, f"param group {g.index}", path),
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


LAYOUTS = ("auto", "dcp", "trainer")
TRAINER_MODEL_DIR, TRAINER_OPTIM_DIR = "pytorch_model_fsdp_0", "optimizer_0"  # accelerate's FSDP_MODEL_NAME_0, ...
_DEEPSPEED_FILES = ("latest", "latest_universal", "zero_to_fp32.py", "zero_to_torch.py")


def plan_convert(ckpt: Checkpoint, to: str = "dcp", adam_mode: str | None = None, checkpoint_id: str | None = None,
                 chunk_bytes: int = dcpw.CHUNK_BYTES, file_bytes: int = dcpw.FILE_BYTES,
                 layout: str = "auto") -> ConvertPlan:
    """The whole output of converting ``ckpt``, laid out as plain data (nothing is read or written).

    ``layout="dcp"``: one DCP folder holding ``model``, ``optim`` and the extras. ``layout="trainer"`` (the
    default for a Trainer ``checkpoint-N``): the checkpoint folder a Hugging Face Trainer / Accelerate run with
    FSDP2 and ``SHARDED_STATE_DICT`` saves and resumes from: ``pytorch_model_fsdp_0/`` (DCP of ``{"model": ...}``),
    ``optimizer_0/`` (DCP of ``{"optimizer": ...}``), and the Trainer's own files copied (``scheduler.pt``,
    ``trainer_state.json``, ``rng_state_*.pth``, config, tokenizer), DeepSpeed's tag folders left out."""
    if to != "dcp":
        raise InvalidArgument(f"plan_convert writes DCP, not {to!r}", hint="convert(..., to='deepspeed') for DCP "
                                                                              "-> DeepSpeed")
    if adam_mode is not None and adam_mode not in ADAM_MODES:
        raise InvalidArgument(f"unknown adam mode {adam_mode!r}", hint="use adamw or adam")
    if layout not in LAYOUTS:
        raise InvalidArgument(f"unknown layout {layout!r}", hint=f"choose one of {', '.join(LAYOUTS)}")
    trainer_dir = ckpt.location.trainer_dir
    if layout == "auto":
        layout = "trainer" if trainer_dir else "dcp"
    if layout == "trainer" and not trainer_dir:
        raise InvalidArgument("--layout trainer needs a Hugging Face Trainer checkpoint-N as the source",
                              path=ckpt.location.input_path, hint="use --layout dcp for a DeepSpeed save folder")
    state, notes, optimizer = dcp_state(ckpt, adam_mode)
    meta_notes = notes + list(ckpt.notes)
    source_format = ckpt.format
    roots = [k for k in state if k not in ("model", "optim", "zckpt")]
    carried = ["model"] + (["optimizer"] if "optim" in state else []) + \
        (["tied aliases (zckpt.tied)"] if "zckpt" in state else [])
    skipped = {"latest, zero_to_fp32.py": "DeepSpeed's own files"} if trainer_dir else {}
    if layout == "dcp":
        part = dcpw.plan_dcp(state, checkpoint_id, chunk_bytes, file_bytes)
        copies = []
        if trainer_dir:  # the Trainer's own files travel beside the DCP files (dcp.load reads only what it names)
            own = {f.name for f in part.files} | {dcpw.METADATA}
            side = trainer_copies(trainer_dir, ckpt.location.tag_dir, ckpt.storage_options)
            copies = [c for c in side if c[0] not in own]
            left = [c[0] for c in side if c[0] in own]
            if left:
                meta_notes.append(f"left out the Trainer's {', '.join(sorted(left))}: DCP's own files have "
                                  "those names")
                skipped[", ".join(sorted(left))] = "DCP's own files have those names"
        carried += [_flat_names(r, state[r]) for r in roots] + [rel for rel, _, _ in copies]
        return ConvertPlan(ckpt.location.input_path, ckpt.tag, to, source_format, [("", part)], meta_notes,
                           optimizer, "dcp", copies, carried, skipped)
    model_part = {"model": state["model"], **({"zckpt": state["zckpt"]} if "zckpt" in state else {})}
    parts = [(TRAINER_MODEL_DIR, dcpw.plan_dcp(model_part, _sub(checkpoint_id, TRAINER_MODEL_DIR),
                                                chunk_bytes, file_bytes))]
    if "optim" in state:
        parts.append((TRAINER_OPTIM_DIR, dcpw.plan_dcp({"optimizer": state["optim"]},
                                                       _sub(checkpoint_id, TRAINER_OPTIM_DIR), chunk_bytes,
                                                       file_bytes)))
    copies = trainer_copies(trainer_dir, ckpt.location.tag_dir, ckpt.storage_options)
    if not any(rel == "scheduler.pt" for rel, _, _ in copies) and "optim" in state:
        meta_notes.append("no scheduler.pt in the checkpoint: the Trainer loads the optimizer only when it finds "
                          "one")
    for r in roots:  # the Trainer's layout has two DCP folders, model and optimizer, and nothing else
        skipped[_flat_names(r, state[r])] = ("the Trainer layout holds model and optimizer only (--layout dcp "
                                             "keeps it)")
    if roots:
        meta_notes.append(f"left out {', '.join(_flat_names(r, state[r]) for r in roots)}: the Trainer layout "
                          "holds model and optimizer only (the Trainer's own files are copied; --layout dcp keeps "
                          "them)")
    carried += [rel for rel, _, _ in copies]
    return ConvertPlan(ckpt.location.input_path, ckpt.tag, to, source_format, parts, meta_notes, optimizer,
                       "trainer", copies, carried, skipped)


def _flat_names(root: str, value) -> str:
    """``train_state.{global_steps,global_samples}``: a root and its keys, as one name."""
    keys = list(value) if isinstance(value, dict) else []
    return f"{root}.{{{','.join(map(str, keys))}}}" if len(keys) > 1 else f"{root}.{keys[0]}" if keys else root


def _sub(checkpoint_id: str | None, folder: str) -> str | None:
    return os.path.join(checkpoint_id, folder) if checkpoint_id else None


def trainer_copies(trainer_dir: str, tag_dir: str, storage_options: dict | None = None) -> list[tuple[str, str, int]]:
    """The files of a Trainer ``checkpoint-N`` that are not DeepSpeed's (its tag folders, ``latest``, the
    ``zero_to_*.py`` scripts): (name, path, size) of each, copied as they are."""
    out = []
    for name, size in sorted(storage.list_files(trainer_dir, storage_options).items()):
        if "/" in name or name in _DEEPSPEED_FILES or name == publish.MARKER:
            continue
        out.append((name, storage.join(trainer_dir, name), size))
    links.check([path for _, path, _ in out], trainer_dir)  # copied as they are: none from outside the checkpoint
    return out


# ------------------------------------------------------------------------------------------- execute

def _check_out(out: str, overwrite: bool, source: publish.Source | None) -> None:
    if storage.is_url(out):
        raise InvalidArgument("convert writes to a local folder", path=out,
                              hint="convert locally, then `zckpt push` the result")
    publish.check_output(out, "convert", source, overwrite)


def execute(plan: ConvertPlan, out: str, workers: int | None = None, overwrite: bool = False,
            progress: Callable[[int, int], None] | None = None, durable: bool = False,
            source: publish.Source | None = None, storage_options: dict | None = None,
            check: InputCheck | None = None) -> None:
    """Write ``plan`` into the folder ``out``: a scratch sibling, the data files, ``.metadata`` (DCP's commit),
    zckpt's marker, then one rename (:class:`zckpt.io.publish.Publisher`). ``check``: the input check every byte
    read is reported to, checked before the rename."""
    _check_out(out, overwrite, source)
    workers = workers or min(8, os.cpu_count() or 2)
    total, done = plan.total_bytes, [0]

    def step(n):
        done[0] += n
        if progress:
            progress(done[0], total)

    worker, maps = executor.Worker(storage_options=storage_options, check=check), torchzip.SourceMaps()
    try:
        with publish.Publisher(out, "convert", source.root if source else plan.source, durable) as pub:
            for rel, src, _ in plan.copies:  # the Trainer's own files, first: the DCP .metadata files come last
                _copy(src, pub.path(rel), storage_options)
                if check is not None:
                    check.check_copy(src, pub.path(rel))
                pub.done(rel)
                step(os.path.getsize(pub.path(rel)))
            with ThreadPoolExecutor(workers) as pool:
                for folder, part in plan.parts:
                    dcpw.write_plan(part, pub, pool, worker, maps, step, fsync=durable, folder=folder)
            if check is not None:  # a damaged input is refused here: nothing has been published
                check.finish()
            pub.commit()
    finally:
        worker.close()
        maps.close()
    return worker.stats.to_json()


def _copy(src: str, dst: str, storage_options: dict | None = None) -> None:
    if storage.is_url(src):
        with open(dst, "wb") as f:
            f.write(storage.read_bytes(src, storage_options))
    else:
        shutil.copyfile(src, dst)


def default_output(source: publish.Source, to: str) -> str:
    """``outputs/checkpoint-4`` -> ``outputs/converted-checkpoint-4-dcp`` (never inside, never named like one)."""
    return publish.default_output(source, "converted") + f"-{to}"


def convert(path: str, to: str = "dcp", out: str | None = None, tag: str | None = None, dry_run: bool = False,
            overwrite: bool = False, workers: int | None = None,
            progress: Callable[[int, int], None] | None = None, durable: bool = False,
            adam_mode: str | None = None, storage_options: dict | None = None, world_size: int | None = None,
            stage: int | None = None, ds_config=None, buffers=None, tied=None, dtype: str | None = None,
            layout: str = "auto", group=None):
    """Convert the checkpoint at ``path`` into format ``to`` in the folder ``out``.

    ``to="deepspeed"``: a DCP checkpoint (FSDP2 + AdamW) as native DeepSpeed ZeRO-``stage`` files for
    ``world_size`` ranks, for the DeepSpeed config ``ds_config`` (dict or JSON path) or the precision ``dtype``;
    ``buffers`` / ``tied`` say
    what DCP does not (:func:`zckpt.ops.to_deepspeed.to_deepspeed`, which this returns the result of).

    ``to="dcp"``: a PyTorch Distributed Checkpoint that FSDP2 + ``torch.optim.AdamW`` loads at any world size
    with ``dcp.load`` + ``set_state_dict`` (keys in this module's docstring and docs/migrate-fsdp2.md).
    ``adam_mode``: ``"adamw"`` / ``"adam"`` for DeepSpeed's FusedAdam / DeepSpeedCPUAdam when neither the groups
    nor the config say. ``layout``: ``"dcp"`` (one DCP folder), ``"trainer"`` (a Trainer / Accelerate FSDP2
    checkpoint folder; see :func:`plan_convert`), ``"auto"`` (trainer for a Trainer checkpoint-N, else dcp).
    ``progress(done_bytes, total_bytes)``; ``durable=True`` fsyncs before publishing.
    Default ``out``: ``outputs/checkpoint-4`` -> ``outputs/converted-checkpoint-4-dcp``; ``overwrite`` replaces only
    a previous zckpt convert output. ``storage_options``: fsspec options for a URL ``path``. ``group``: the ranks
    of a launcher's job (:func:`zckpt.engine.launch.launched`): each writes a share, rank 0 publishes."""
    t0 = time.perf_counter()
    if to not in FORMATS:
        raise InvalidArgument(f"unknown target format {to!r}", hint=f"choose one of {', '.join(FORMATS)}")
    if to == "deepspeed":
        from zckpt.ops import to_deepspeed
        if group is not None:
            raise InvalidArgument("convert --to deepspeed runs in one process, not under a launcher",
                                  hint="run it without torchrun / srun (then zckpt reshard can use many)")
        if tag is not None:
            raise InvalidArgument("--tag picks a DeepSpeed tag; --to deepspeed reads a DCP folder",
                                  hint="pass the DCP folder itself")
        return to_deepspeed.to_deepspeed(path, out, world_size, stage, ds_config, buffers, tied, dtype, dry_run=dry_run,
                                         overwrite=overwrite, workers=workers, progress=progress, durable=durable,
                                         storage_options=storage_options)
    ckpt = open_checkpoint(path, tag, storage_options)
    source = publish.source_of(ckpt.location, picked_tag=tag is not None)
    out = str(out) if out is not None else default_output(source, to)
    _check_out(out, overwrite, source)  # before planning or writing anything
    plan = plan_convert(ckpt, to, adam_mode, checkpoint_id=os.path.abspath(out), layout=layout)
    result = ConvertResult(out, plan, dry_run=dry_run)
    if dry_run:
        return result
    t_plan = time.perf_counter()
    check = checksums.input_check(ckpt)
    try:
        if group is not None:
            from zckpt.engine import distributed
            stats = distributed.run_convert(group, plan, out, workers=workers, overwrite=overwrite,
                                            progress=progress, durable=durable, source=source,
                                            storage_options=ckpt.storage_options, check=check).to_json()
        else:
            stats = {"ranks": 1, **(execute(plan, out, workers, overwrite, progress, durable, source,
                                            ckpt.storage_options, check) or {})}
    finally:
        check.close()
    stats["crc_checked_entries"] = check.checked
    result.seconds = time.perf_counter() - t0
    result.stats = {**stats, "plan_seconds": round(t_plan - t0, 3),
                    "bytes_per_second": round(plan.total_bytes / max(result.seconds, 1e-9))}
    return result
