"""Which checkpoints in a folder are complete: Trainer ``checkpoint-N`` folders, DeepSpeed tags and save folders.

Used by ``zckpt push`` before anything is sent: a checkpoint counts only when every rank file named by the layout
is there and whole (zip directory and safetensors header readable, ``dp_world_size`` ranks present, Trainer state
written). Folders holding a zckpt output marker (``.zckpt.json``: merged weights, reshard results) are never taken
for checkpoints nor swept into one's upload. Nothing here unpickles tensors or imports torch.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import re
import struct

from zckpt.io import storage
from zckpt.errors import CheckpointNotFound, ZckptError
from zckpt.formats.legacy import is_legacy
from zckpt.formats.zipentries import LOCAL_SIG, read_file_entries
from zckpt.io.publish import has_marker, read_marker

log = logging.getLogger(__name__)

TRAINER_RE = re.compile(r"^checkpoint-(\d+)$")
TAG_STEP_RE = re.compile(r"^global_step(\d+)(_universal)?$")
OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_RE = re.compile(r"^(zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
ROOT_FILES = ("zero_to_fp32.py", "zero_to_torch.py", "latest_universal", "latest")  # DeepSpeed save dir; latest last


# ============================================================================================ scanning


@dataclasses.dataclass
class LocalCheckpoint:
    """A checkpoint folder under SRC. ``name`` is its path relative to SRC ("" when SRC is the checkpoint)."""

    name: str
    path: str
    kind: str  # "trainer" | "deepspeed" | "folder"
    step: int | None


def step_of(name: str) -> int | None:
    for regex in (TRAINER_RE, TAG_STEP_RE):
        m = regex.match(name)
        if m:
            return int(m.group(1))
    m = re.search(r"(\d+)$", name)
    return int(m.group(1)) if m else None


def _zckpt_output(folder: str) -> str | None:
    """The kind ("merge", "reshard") of a zckpt output folder (its ``.zckpt.json`` marker), else None."""
    if not has_marker(folder):
        return None
    doc = read_marker(folder)
    return str(doc.get("kind")) if doc else "unknown"


def _has_rank_files(folder: str) -> bool:
    try:
        return any(MODEL_RE.match(n) for n in os.listdir(folder))
    except OSError:
        return False


def find_checkpoints(src: str) -> tuple[list[LocalCheckpoint], list[str]]:
    """Checkpoints under ``src`` (oldest first) and the DeepSpeed save-dir root files to mirror after them."""
    src = os.path.abspath(storage.local_path(src))
    if not os.path.isdir(src):
        raise CheckpointNotFound("no such folder", path=src, hint="SRC must be a local training output folder")
    base = os.path.basename(src.rstrip(os.sep))
    if TRAINER_RE.match(base):
        return [LocalCheckpoint("", src, "trainer", step_of(base))], []
    if _zckpt_output(src) == "merge":  # merged weights, not a checkpoint
        log.info("%s is a zckpt merge output, not a checkpoint: nothing to push", src)
        return [], []
    found: list[LocalCheckpoint] = []
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if not os.path.isdir(path):
            continue
        if has_marker(path):  # a zckpt merge/reshard output next to the checkpoints: never one of them
            log.info("%s: a zckpt output, not a checkpoint; skipped", path)
            continue
        if TRAINER_RE.match(name):
            found.append(LocalCheckpoint(name, path, "trainer", step_of(name)))
        elif _has_rank_files(path):
            found.append(LocalCheckpoint(name, path, "deepspeed", step_of(name)))
    if not found:  # no checkpoint folders inside: SRC itself is one checkpoint (or nothing)
        if _has_rank_files(src):
            return [LocalCheckpoint("", src, "deepspeed", step_of(base))], []
        if os.path.isfile(os.path.join(src, "trainer_state.json")):
            return [LocalCheckpoint("", src, "trainer", step_of(base))], []
        return [], []
    found.sort(key=lambda c: (c.step if c.step is not None else -1, c.name))
    roots: list[str] = []
    if found and all(c.kind == "deepspeed" for c in found):
        roots = [n for n in ROOT_FILES if os.path.isfile(os.path.join(src, n))]
    return found, roots


# ========================================================================================= completeness


def _model_meta(path: str) -> dict:
    """``dp_world_size``, ``mp_world_size`` and whether ZeRO is on, from a model-states file, running no code."""
    from zckpt.formats import safeload
    try:
        obj = safeload.load(path)  # the allow-list unpickler: no code, no tensor bytes, bounded memory
    except (ZckptError, OSError):  # metadata is a bonus; names and zips are still checked
        return {}
    if not isinstance(obj, dict):
        return {}
    out = {}
    for key in ("dp_world_size", "mp_world_size"):
        if isinstance(obj.get(key), int) and not isinstance(obj.get(key), bool):
            out[key] = obj[key]
    if "param_shapes" in obj:
        out["zero"] = obj["param_shapes"] is not None
    return out


def check_torch_zip(path: str) -> str | None:
    """Why a torch ``.pt`` zip is not whole (None when its directory is intact and fits the file).

    The checks of :func:`zckpt.formats.zipentries.read_entries`: every entry inside the file and agreeing with its local
    header; reads the directory and the local headers only. A legacy (non-zip) torch file: :func:`check_torch_legacy`."""
    if _is_legacy(path):
        return check_torch_legacy(path)
    try:
        entries = read_file_entries(path)
    except OSError as exc:
        return f"{os.path.basename(path)} cannot be read ({exc.strerror or exc})"
    except ZckptError as exc:
        return f"{os.path.basename(path)} is not a complete zip ({exc.message})"
    if not any(name.endswith("data.pkl") for name in entries):
        return f"{os.path.basename(path)} has no data.pkl entry"
    return None


def check_torch_legacy(path: str) -> str | None:
    """Why a legacy (non-zip) torch file is not whole: the checks of :func:`zckpt.formats.legacy.locate` (its
    pickles end, its storage keys match the object pickle, the storages' sizes end the file exactly and agree with
    their size fields); reads the pickles and the 8-byte size fields only."""
    from zckpt.formats import safeload
    try:
        with open(path, "rb") as f:
            safeload.legacy_layout(path, f, os.fstat(f.fileno()).st_size)
    except OSError as exc:
        return f"{os.path.basename(path)} cannot be read ({exc.strerror or exc})"
    except ZckptError as exc:
        return f"{os.path.basename(path)} is not a complete legacy torch file ({exc.message})"
    return None


def _is_legacy(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return is_legacy(f.read(4))
    except OSError:
        return False


def check_safetensors(path: str) -> str | None:
    """Why a ``.safetensors`` file is not whole (header JSON parses and its last offset ends the file)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                return f"{os.path.basename(path)} is truncated (header)"
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as exc:
        return f"{os.path.basename(path)} has no valid header ({exc})"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        return f"{os.path.basename(path)} is {size} bytes, its header says {8 + n + end}"
    return None


def _is_zip(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == LOCAL_SIG
    except OSError:
        return False


def _check_tag(tag_dir: str) -> tuple[bool, str]:
    """Every rank file of one DeepSpeed tag folder present (dp 0..W-1 for each mp rank)."""
    names = os.listdir(tag_dir)
    optim: dict[int, set[int]] = collections.defaultdict(set)
    model3: dict[int, set[int]] = collections.defaultdict(set)
    model_mp: set[int] = set()
    for n in names:
        m = OPTIM_RE.match(n)
        if m:
            optim[int(m.group(3))].add(int(m.group(2)))
            continue
        m = MODEL_RE.match(n)
        if m:
            model_mp.add(int(m.group(3)))
            if m.group(2) is not None:
                model3[int(m.group(3))].add(int(m.group(2)))
    if not model_mp:
        return False, "no *model_states.pt file"
    first_model = min(n for n in names if MODEL_RE.match(n))
    meta = _model_meta(os.path.join(tag_dir, first_model))
    mp_ws = meta.get("mp_world_size") or max(model_mp) + 1
    if model_mp != set(range(mp_ws)):
        missing = sorted(set(range(mp_ws)) - model_mp)
        return False, f"model states for mp rank(s) {missing} missing"
    universal = os.path.isdir(os.path.join(tag_dir, "zero"))
    all_dp = set().union(*optim.values(), *model3.values()) if (optim or model3) else set()
    dp_ws = meta.get("dp_world_size") or (max(all_dp) + 1 if all_dp else 1)
    want = set(range(dp_ws))
    if optim or (meta.get("zero") and not universal):
        for mp in range(mp_ws):
            if optim.get(mp, set()) != want:
                missing = sorted(want - optim.get(mp, set()))
                return False, f"optimizer shards for dp rank(s) {missing} (mp {mp}) missing, expected {dp_ws}"
    if model3:
        for mp in range(mp_ws):
            if model3.get(mp, set()) != want:
                missing = sorted(want - model3.get(mp, set()))
                return False, f"ZeRO-3 model states for dp rank(s) {missing} (mp {mp}) missing"
    return True, "complete"


def check_complete(checkpoint_dir: str) -> tuple[bool, str]:
    """``(True, "complete")`` when a checkpoint folder is whole, else ``(False, reason)``.

    Trainer folders need ``trainer_state.json`` (the Trainer writes it last); ``latest`` must name a tag
    folder that exists; every DeepSpeed tag folder needs all rank files (dp ranks 0..W-1 per mp rank, W from
    ``dp_world_size`` in the model states); every torch zip needs an intact central directory and a
    ``data.pkl``; every ``.safetensors`` a header that matches its size. One function, so a deeper check
    (``zckpt.ops.verify``) can replace it.
    """
    checkpoint_dir = os.path.abspath(storage.local_path(checkpoint_dir))
    if not os.path.isdir(checkpoint_dir):
        return False, "folder is missing"
    base = os.path.basename(checkpoint_dir.rstrip(os.sep))
    entries = os.listdir(checkpoint_dir)
    trainer = bool(TRAINER_RE.match(base)) or "trainer_state.json" in entries
    if trainer and "trainer_state.json" not in entries:
        return False, "trainer_state.json missing (the Trainer writes it last)"
    if "latest" in entries and os.path.isfile(os.path.join(checkpoint_dir, "latest")):
        with open(os.path.join(checkpoint_dir, "latest"), encoding="utf-8", errors="replace") as f:
            tag = f.read().strip()
        if tag and not os.path.isdir(os.path.join(checkpoint_dir, tag)):
            return False, f"latest names {tag!r}, which is missing"
    tags = [checkpoint_dir] if _has_rank_files(checkpoint_dir) else []
    tags += [os.path.join(checkpoint_dir, e) for e in sorted(entries)
             if os.path.isdir(os.path.join(checkpoint_dir, e)) and _has_rank_files(os.path.join(checkpoint_dir, e))
             and not has_marker(os.path.join(checkpoint_dir, e))]
    if not tags and not trainer:
        return False, "no DeepSpeed rank files and no trainer_state.json"
    for tag in tags:
        ok, reason = _check_tag(tag)
        if not ok:
            where = os.path.relpath(tag, checkpoint_dir)
            return False, reason if where == "." else f"{where}: {reason}"
    for dirpath, dirs, files in os.walk(checkpoint_dir):
        dirs[:] = [d for d in dirs if not has_marker(os.path.join(dirpath, d))]  # nested zckpt outputs: not pushed
        for name in files:
            path = os.path.join(dirpath, name)
            reason = None
            if name.endswith((".pt", ".pth")) or (name.endswith(".bin") and (_is_zip(path) or _is_legacy(path))):
                reason = check_torch_zip(path)
            elif name.endswith(".safetensors"):
                reason = check_safetensors(path)
            if reason:
                where = os.path.relpath(dirpath, checkpoint_dir)
                return False, reason if where == "." else f"{where}/{reason}"
    return True, "complete"


def newest_mtime(folder: str) -> float:
    newest = 0.0
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                newest = max(newest, os.stat(os.path.join(dirpath, name)).st_mtime)
    return newest
