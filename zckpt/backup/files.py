"""A checkpoint's files as push, verify and info see them (:func:`files_in_folder`: those of the folder a user
named), over the one definition below the formats (:mod:`zckpt.state.files`: :func:`checkpoint_files`, every file
below a checkpoint folder or a refusal naming what cannot be copied, :class:`NotBackedUp`); which files a writer
carries over is each format's to say (its ``side_files``, :mod:`zckpt.state.formats`). Folders holding a zckpt output marker (``.zckpt.json``: merged
weights, reshard results) are never swept into a checkpoint's files (and are reported). The names of
checkpoint folders and rank files (:data:`TRAINER_RE`, :data:`TAG_STEP_RE`, :data:`MODEL_RE`, :data:`OPTIM_RE`;
Megatron-LM's :data:`ITER_RE` and tracker file, torchtitan's :data:`TITAN_STEP_RE`, DCP's ``.metadata``) are here
too. Nothing here unpickles tensors or imports torch.
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
ITER_RE = re.compile(r"^iter_(\d{7,})$")  # Megatron-LM's iteration folders (iter_{:07d}), in its save folder
TITAN_STEP_RE = re.compile(r"^step-(\d+)$")  # torchtitan's checkpoint folders (outputs/checkpoint/step-N)
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's: written last, once every rank's files are
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM writes it after each save has finished
MEGATRON_TORCH_RE = re.compile(r"^mp_rank_\d{2}(_\d{3})?$")  # a Megatron torch-format save's rank folders
# the names of checkpoint folders by their frameworks' conventions (a remote listing's, for --keep-last)
CHECKPOINT_NAME_RES = (TRAINER_RE, TAG_STEP_RE, ITER_RE, TITAN_STEP_RE)


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


def is_checkpoint_name(name: str) -> bool:
    """A folder name its framework gives a checkpoint (:data:`CHECKPOINT_NAME_RES`)."""
    return any(r.match(name) for r in CHECKPOINT_NAME_RES)


def has_dcp_metadata(folder: str) -> bool:
    """A torch.distributed.checkpoint folder (FSDP2's ``dcp.save``, torchtitan's ``step-N``, a Megatron
    ``torch_dist`` iteration): its ``.metadata`` is there."""
    return os.path.isfile(os.path.join(folder, DCP_METADATA))


def is_megatron_save(names) -> bool:
    """A Megatron-LM save folder (``--save``): its tracker file, or iteration folders."""
    return MEGATRON_TRACKER in names or any(ITER_RE.match(n) for n in names)


def has_rank_files(folder: str) -> bool:
    try:
        return any(MODEL_RE.match(n) or OPTIM_RE.match(n) for n in os.listdir(folder))
    except OSError:
        return False
