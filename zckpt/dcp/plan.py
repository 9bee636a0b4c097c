"""The DCP writer's plan: a training state laid out as one DCP folder (``layout="dcp"``) or as the two DCP folders
of a Hugging Face Trainer / Accelerate FSDP2 ``checkpoint-N`` (``layout="trainer"``), with the Trainer's own files
copied beside them: plain data (:class:`ConvertPlan`), which :func:`zckpt.ops.convert.execute` writes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from zckpt.dcp import titan, writer as dcpw
from zckpt.dcp.fsdp2_state import ADAM_MODES, dcp_state
from zckpt.errors import InvalidArgument
from zckpt.state.model import Checkpoint


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


LAYOUTS = ("auto", "dcp", "trainer", "torchtitan")
TRAINER_MODEL_DIR, TRAINER_OPTIM_DIR = "pytorch_model_fsdp_0", "optimizer_0"  # accelerate's FSDP_MODEL_NAME_0, ...


def plan_dcp(ckpt: Checkpoint, adam_mode: str | None = None, checkpoint_id: str | None = None,
             chunk_bytes: int = dcpw.CHUNK_BYTES, file_bytes: int = dcpw.FILE_BYTES, layout: str = "auto",
             copies=(), config_mode=None, torchtitan: dict | None = None) -> ConvertPlan:
    """The whole output of converting ``ckpt``, laid out as plain data (nothing is read or written).

    ``layout="dcp"``: one DCP folder holding ``model``, ``optim`` and the extras. ``layout="trainer"`` (the
    default for a Trainer ``checkpoint-N``): the checkpoint folder a Hugging Face Trainer / Accelerate run with
    FSDP2 and ``SHARDED_STATE_DICT`` saves and resumes from: ``pytorch_model_fsdp_0/`` (DCP of ``{"model": ...}``),
    ``optimizer_0/`` (DCP of ``{"optimizer": ...}``), and the Trainer's own files copied (``scheduler.pt``,
    ``trainer_state.json``, ``rng_state_*.pth``, config, tokenizer), DeepSpeed's tag folders left out. ``copies``:
    (relpath, source file, size) of a Trainer checkpoint's own files, copied beside the DCP files;
    ``config_mode``: see :func:`zckpt.dcp.fsdp2_state.torch_group`. ``layout="torchtitan"``: one DCP folder as
    torchtitan's ``CheckpointManager`` saves a ``step-<N>`` (:mod:`zckpt.dcp.titan`), with what the source does not
    hold stated in ``torchtitan`` (``ntokens_seen``, ``lr_last_epoch``, ``initial_lr``)."""
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
    if torchtitan and layout != "torchtitan":
        raise InvalidArgument(f"{', '.join(titan.STATED[k] for k in titan.check_stated(torchtitan))} are for "
                              "--layout torchtitan", hint="add --layout torchtitan")
    state, notes, optimizer = dcp_state(ckpt, adam_mode, config_mode)
    if layout == "torchtitan":
        return _plan_titan(ckpt, state, notes, optimizer, checkpoint_id, chunk_bytes, file_bytes, copies, torchtitan)
    meta_notes = notes + list(ckpt.notes)
    source_format = ckpt.format
    roots = [k for k in state if k not in ("model", "optim", "zckpt")]
    carried = ["model"] + (["optimizer"] if "optim" in state else []) + \
        (["tied aliases (zckpt.tied)"] if "zckpt" in state else [])
    skipped = {"latest, zero_to_fp32.py": "DeepSpeed's own files"} if trainer_dir else {}
    if layout == "dcp":
        part = dcpw.plan_dcp(state, checkpoint_id, chunk_bytes, file_bytes)
        side, copies = list(copies), []
        if trainer_dir:  # the Trainer's own files travel beside the DCP files (dcp.load reads only what it names)
            own = {f.name for f in part.files} | {dcpw.METADATA}
            copies = [c for c in side if c[0] not in own]
            left = [c[0] for c in side if c[0] in own]
            if left:
                meta_notes.append(f"left out the Trainer's {', '.join(sorted(left))}: DCP's own files have "
                                  "those names")
                skipped[", ".join(sorted(left))] = "DCP's own files have those names"
        carried += [_flat_names(r, state[r]) for r in roots] + [rel for rel, _, _ in copies]
        return ConvertPlan(ckpt.location.input_path, ckpt.tag, "dcp", source_format, [("", part)], meta_notes,
                           optimizer, "dcp", copies, carried, skipped)
    model_part = {"model": state["model"], **({"zckpt": state["zckpt"]} if "zckpt" in state else {})}
    parts = [(TRAINER_MODEL_DIR, dcpw.plan_dcp(model_part, _sub(checkpoint_id, TRAINER_MODEL_DIR),
                                                chunk_bytes, file_bytes))]
    if "optim" in state:
        parts.append((TRAINER_OPTIM_DIR, dcpw.plan_dcp({"optimizer": state["optim"]},
                                                       _sub(checkpoint_id, TRAINER_OPTIM_DIR), chunk_bytes,
                                                       file_bytes)))
    copies = list(copies)
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
    return ConvertPlan(ckpt.location.input_path, ckpt.tag, "dcp", source_format, parts, meta_notes, optimizer,
                       "trainer", copies, carried, skipped)


def _plan_titan(ckpt, state, notes, optimizer, checkpoint_id, chunk_bytes, file_bytes, copies, stated) -> ConvertPlan:
    out, carried, skipped, more = titan.titan_state(ckpt, state, list(copies), stated)
    steps = out["train_state"]["step"]
    if checkpoint_id and os.path.basename(os.path.normpath(checkpoint_id)) != f"step-{steps}":
        more.append(f"torchtitan loads <checkpoint.folder>/step-{steps} for load(step={steps}): name the folder so")
    if copies:
        skipped["the Trainer's own files"] = "torchtitan reads none of them (scheduler.pt: last_epoch is carried)"
    part = dcpw.plan_dcp(out, checkpoint_id, chunk_bytes, file_bytes)
    return ConvertPlan(ckpt.location.input_path, ckpt.tag, "dcp", ckpt.format, [("", part)],
                       notes + list(ckpt.notes) + more, optimizer, "torchtitan", [], carried, skipped)


def _flat_names(root: str, value) -> str:
    """``train_state.{global_steps,global_samples}``: a root and its keys, as one name."""
    keys = list(value) if isinstance(value, dict) else []
    return f"{root}.{{{','.join(map(str, keys))}}}" if len(keys) > 1 else f"{root}.{keys[0]}" if keys else root


def _sub(checkpoint_id: str | None, folder: str) -> str | None:
    return os.path.join(checkpoint_id, folder) if checkpoint_id else None
