"""Which checkpoints a push's SRC holds (:func:`find_checkpoints`): a Trainer checkpoint however named, a tag
folder, a training output folder, a DeepSpeed save folder. Folders holding a zckpt output marker (``.zckpt.json``:
merged weights, reshard results) are never taken for checkpoints (and are reported). Whether each is complete is
:mod:`zckpt.backup.scan`'s to say.
"""

from __future__ import annotations

import dataclasses
import json
import os

from zckpt.io import storage
from zckpt.deepspeed.discover import TRAINER_MARKERS
from zckpt.errors import CheckpointNotFound, InvalidArgument
from zckpt.io.publish import has_marker, read_marker
from zckpt.backup.files import (ITER_RE, MEGATRON_TRACKER, MODEL_RE, TAG_STEP_RE, TITAN_STEP_RE, TRAINER_RE,
                                has_dcp_metadata, has_rank_files, is_megatron_save, is_trainer_folder)
from zckpt.backup.manifest import PUSH_FILES

@dataclasses.dataclass
class LocalCheckpoint:
    """A checkpoint folder under SRC. ``name`` is its path relative to SRC ("" when SRC is the checkpoint).

    ``kind``: "trainer" (a Trainer checkpoint, whatever its name), "deepspeed" (one tag folder), "dcp" (one
    torch.distributed.checkpoint folder: FSDP2's ``dcp.save``, torchtitan's ``step-N``), "megatron" (one iteration
    folder of a Megatron-LM save folder, ``save_dir``), "skip" (a folder next to the checkpoints that is not
    pushed: ``reason`` says why, and push reports it)."""

    name: str
    path: str
    kind: str  # "trainer" | "deepspeed" | "dcp" | "megatron" | "skip"
    step: int | None
    reason: str = ""
    save_dir: str = ""  # a tag of the DeepSpeed (Megatron-LM) save folder SRC: its `latest` (tracker file) decides


def step_of(name: str) -> int | None:
    """The step a checkpoint's own folder name states by its framework's convention (the Trainer's
    ``checkpoint-N``, DeepSpeed's ``global_stepN``, Megatron-LM's ``iter_NNNNNNN``, torchtitan's ``step-N``), else None: digits of any other name are not a step
    (``merged-checkpoint-4-fp32`` is not step 32)."""
    for regex in (TRAINER_RE, TAG_STEP_RE, ITER_RE, TITAN_STEP_RE):
        m = regex.match(name)
        if m:
            return int(m.group(1))
    return None


def own_step(path: str, name: str, kind: str) -> int | None:
    """The step of the checkpoint at ``path``: its folder's own name where that is its framework's convention
    (:func:`step_of`; the Trainer sorts and resumes by it), else a Trainer checkpoint's ``trainer_state.json``
    (``global_step``: a renamed or resharded copy keeps it), else None."""
    step = step_of(os.path.basename(path.rstrip(os.sep)) if not name else name.rsplit("/", 1)[-1])
    if step is None and kind == "trainer":
        try:
            with open(os.path.join(path, "trainer_state.json"), encoding="utf-8") as f:
                saved = json.load(f).get("global_step")
            if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 0:
                return saved
        except (OSError, ValueError, AttributeError):
            pass
    return step


def _zckpt_output(folder: str) -> str | None:
    """The kind ("merge", "reshard") of a zckpt output folder (its ``.zckpt.json`` marker), else None."""
    if not has_marker(folder):
        return None
    doc = read_marker(folder)
    return str(doc.get("kind")) if doc else "unknown"


def _subfolders(src: str) -> list[str]:
    return [n for n in sorted(os.listdir(src)) if os.path.isdir(os.path.join(src, n))]


def find_checkpoints(src: str) -> tuple[list[LocalCheckpoint], list[str]]:
    """Checkpoints under ``src`` (oldest first) and the save folder's own files to mirror after them.

    What SRC is decides what its checkpoints are (the first rule that fits)::

        checkpoint-N, or a folder with trainer_state.json / training_args.bin and no checkpoint-N inside
                                      one Trainer checkpoint: every file (a renamed copy, a reshard output...)
        a folder with rank files      one tag folder: every file
        a folder with .metadata       one DCP checkpoint (dcp.save's folder, torchtitan's step-N): every file
        a Megatron-LM save folder     (latest_checkpointed_iteration.txt, iter_NNNNNNN/): each iteration folder is
                                      one; every file at its top is mirrored, the tracker file last
        a folder with checkpoint-N/   a training output folder: each checkpoint-N (or renamed Trainer
                                      checkpoint) or DCP folder (torchtitan's step-N) inside is one; other
                                      folders (runs/...) are not checkpoints
        a folder with tag folders     a DeepSpeed save folder: each tag is one; every file at its top
                                      (latest, zero_to_fp32.py, ...) is mirrored, ``latest`` last
        a zckpt merge output          refused (merged weights are not a checkpoint)

    Folders next to the checkpoints that look like checkpoints but are not pushed (zckpt outputs, a save folder
    inside a training output folder, a tag-named folder without rank files) come back as kind "skip" with a
    reason, so that push can say so."""
    src = os.path.abspath(storage.local_path(src))
    if not os.path.isdir(src):
        raise CheckpointNotFound("no such folder", path=src, hint="SRC must be a local training output folder")
    base = os.path.basename(src.rstrip(os.sep))
    names = os.listdir(src)
    subs = _subfolders(src)
    kind = _zckpt_output(src)
    if kind == "merge":
        raise InvalidArgument("a zckpt merge output (merged weights), not a checkpoint", path=src,
                              hint="push checkpoints; to put merged weights on DEST, zckpt merge -o DEST")
    trainer_inside = [n for n in subs if TRAINER_RE.match(n)]
    if TRAINER_RE.match(base) or (is_trainer_folder(base, names) and not trainer_inside):
        return [LocalCheckpoint("", src, "trainer", own_step(src, "", "trainer"))], []
    if has_rank_files(src):
        return [LocalCheckpoint("", src, "deepspeed", own_step(src, "", "deepspeed"))], []
    if has_dcp_metadata(src) or any(n.endswith(".distcp") for n in names):
        return [LocalCheckpoint("", src, "dcp", own_step(src, "", "dcp"))], []
    if not trainer_inside and is_megatron_save(names):
        return _megatron_save(src, names, subs)
    found: list[LocalCheckpoint] = []
    save_folder = not trainer_inside and (any(n in names for n in ("latest", "latest_universal"))
                                          or any(has_rank_files(os.path.join(src, n)) for n in subs))
    for name in subs:
        path = os.path.join(src, name)
        inner = os.listdir(path) if os.access(path, os.R_OK | os.X_OK) else []
        sub_kind = _zckpt_output(path)
        if sub_kind is not None:  # a zckpt output next to the checkpoints: never one of them
            found.append(LocalCheckpoint(name, path, "skip", None,
                                         f"a zckpt {sub_kind} output, not one of the checkpoints"
                                         + (f" (push it on its own: zckpt push {path} DEST)"
                                            if sub_kind in ("reshard", "convert") else "")))
        elif TRAINER_RE.match(name) or "trainer_state.json" in inner:  # however it is called now
            found.append(LocalCheckpoint(name, path, "trainer", own_step(path, name, "trainer")))
        elif not save_folder and (has_dcp_metadata(path) or any(n.endswith(".distcp") for n in inner)):
            found.append(LocalCheckpoint(name, path, "dcp", step_of(name)))  # torchtitan's step-N, a dcp.save folder
        elif not save_folder and "training_args.bin" in inner and not has_rank_files(path):
            continue  # trainer.save_model("final"): a saved model, not a checkpoint (like runs/)
        elif has_rank_files(path):
            found.append(LocalCheckpoint(name, path, "deepspeed", step_of(name), save_dir=src if save_folder else ""))
        elif save_folder and TAG_STEP_RE.match(name):  # being written: incomplete
            found.append(LocalCheckpoint(name, path, "deepspeed", step_of(name), save_dir=src))
        elif save_folder:
            found.append(LocalCheckpoint(name, path, "skip", None, "not a tag folder of this save folder (no rank "
                                         f"files; push it on its own: zckpt push {path} DEST)"))
        elif _looks_like_checkpoint(inner):
            found.append(LocalCheckpoint(name, path, "skip", None, "holds a checkpoint but is not one itself (a "
                                         f"DeepSpeed save folder? push it on its own: zckpt push {path} DEST)"))
    found.sort(key=lambda c: (c.step if c.step is not None else -1, c.name))
    roots: list[str] = []
    if save_folder and any(c.kind != "skip" for c in found):
        files = [n for n in sorted(names) if os.path.isfile(os.path.join(src, n)) and n not in PUSH_FILES]
        roots = [n for n in files if n not in ("latest", "latest_universal")] + [
            n for n in ("latest_universal", "latest") if n in files]  # ``latest`` last
    return found, roots


def _looks_like_checkpoint(names) -> bool:
    """What only a checkpoint (or a save folder) has: ``latest``, ``trainer_state.json``, rank files, a Megatron-LM
    save folder's tracker or iteration folders."""
    return is_megatron_save(names) or any(n in ("latest", "latest_universal", *TRAINER_MARKERS) or MODEL_RE.match(n)
                                          for n in names)


def _megatron_save(src: str, names: list[str], subs: list[str]) -> tuple[list[LocalCheckpoint], list[str]]:
    """A Megatron-LM save folder: each ``iter_NNNNNNN`` (and ``release``) folder one checkpoint, judged by the
    tracker file (:func:`zckpt.backup.scan.check_megatron_iteration`); the top files mirrored, the tracker last."""
    found: list[LocalCheckpoint] = []
    for name in subs:
        path = os.path.join(src, name)
        sub_kind = _zckpt_output(path)
        if sub_kind is not None:
            found.append(LocalCheckpoint(name, path, "skip", None,
                                         f"a zckpt {sub_kind} output, not one of the checkpoints"))
        elif ITER_RE.match(name) or name == "release":
            found.append(LocalCheckpoint(name, path, "megatron", step_of(name), save_dir=src))
        else:
            found.append(LocalCheckpoint(name, path, "skip", None, "not an iteration folder of this Megatron-LM save "
                                         f"folder (push it on its own: zckpt push {path} DEST)"))
    found.sort(key=lambda c: (c.step if c.step is not None else -1, c.name))
    roots: list[str] = []
    if any(c.kind != "skip" for c in found):
        files = [n for n in sorted(names) if os.path.isfile(os.path.join(src, n)) and n not in PUSH_FILES]
        roots = [n for n in files if n != MEGATRON_TRACKER] + [n for n in files if n == MEGATRON_TRACKER]
    return found, roots
