"""A checkpoint's files as push, verify and info see them (:func:`files_in_folder`: those of the folder a user
named), over the one definition below the formats (:mod:`zckpt.state.files`: :func:`checkpoint_files`, every file
below a checkpoint folder or a refusal naming what cannot be copied, :class:`NotBackedUp`); which files a writer
carries over is each format's to say (its ``side_files``, :mod:`zckpt.state.formats`). Folders holding a zckpt output marker (``.zckpt.json``: merged
weights, reshard results) are never swept into a checkpoint's files (and are reported). The names of
checkpoint folders and rank files (:data:`TRAINER_RE`, :data:`TAG_STEP_RE`, :data:`MODEL_RE`, :data:`OPTIM_RE`)
are here too. Nothing here unpickles tensors or imports torch.
"""

from __future__ import annotations

import os
import re

from zckpt.io import storage
from zckpt.deepspeed.discover import TRAINER_MARKERS, is_rank_file  # noqa: F401 - is_rank_file, for callers
from zckpt.deepspeed.discover import side_files as ds_side_files
from zckpt.state.files import CheckpointFile, NotBackedUp, checkpoint_files  # noqa: F401 - moved down, for callers

TRAINER_RE = re.compile(r"^checkpoint-(\d+)$")
TAG_STEP_RE = re.compile(r"^global_step(\d+)(_universal)?$")
OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_RE = re.compile(r"^(zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


def is_trainer_folder(folder_name: str, names) -> bool:
    """A Trainer checkpoint, whatever it is called now: named ``checkpoint-N``, or holding what the Trainer writes
    (``trainer_state.json``, ``training_args.bin``; the rule ``zckpt info`` uses, :data:`TRAINER_MARKERS`)."""
    return bool(TRAINER_RE.match(folder_name)) or any(m in names for m in TRAINER_MARKERS)


def side_files(loc, storage_options: dict | None = None) -> list[CheckpointFile]:
    """A DeepSpeed checkpoint's side files (:func:`zckpt.deepspeed.discover.side_files`), as it was named here."""
    return ds_side_files(loc, storage_options)


def files_in_folder(loc, fmt: str = "deepspeed", storage_options: dict | None = None) -> list[CheckpointFile]:
    """The checkpoint's files in the folder a user named (``loc``: a located checkpoint,
    :class:`zckpt.deepspeed.discover.Location`): :func:`checkpoint_files` of ``loc.input_path``; in a DeepSpeed save
    folder, its top-level files and the chosen tag's (what push sends of it: other tags are checkpoints of their
    own); in a Trainer checkpoint, every file but other tags'. What ``zckpt verify`` checks and ``zckpt info``
    lists; raises :class:`NotBackedUp` like :func:`checkpoint_files`."""
    opts = storage_options if storage_options is not None else getattr(loc, "storage_options", None)
    files = checkpoint_files(loc.input_path, opts)
    if fmt == "dcp" or _key(loc.input_path) == _key(loc.tag_dir):
        return files
    tag = storage.basename(loc.tag_dir)
    if not (loc.trainer_dir and _key(loc.trainer_dir) == _key(loc.input_path)):  # a save folder: as push sends it
        return [f for f in files if "/" not in f.rel or f.rel.split("/", 1)[0] == tag]
    tags = {f.rel.split("/", 1)[0] for f in files if f.rel.count("/") == 1 and is_rank_file(f.rel.split("/")[1])}
    tags.discard(tag)
    return [f for f in files if f.rel.split("/", 1)[0] not in tags]


def _key(path: str) -> str:
    return path if storage.is_url(path) else os.path.abspath(storage.local_path(path))


def has_rank_files(folder: str) -> bool:
    try:
        return any(MODEL_RE.match(n) or OPTIM_RE.match(n) for n in os.listdir(folder))
    except OSError:
        return False
