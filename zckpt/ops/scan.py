"""Deprecated import path, kept for one release: use zckpt.backup.scan (``check_complete``, ``latest_problem``...),
zckpt.backup.files (``checkpoint_files``, ``files_in_folder``, ``side_files``, ``NotBackedUp``), zckpt.backup.find
(``find_checkpoints``) and zckpt.backup.manifest (``MANIFEST_NAME``, ``RECORD_NAME``).

The backup subsystem is the package :mod:`zckpt.backup`; this module re-exports the names that
``zckpt.ops.scan`` had.
"""

from __future__ import annotations

from zckpt.backup.files import (
    MODEL_RE, OPTIM_RE, TAG_STEP_RE, TRAINER_RE, CheckpointFile, NotBackedUp, checkpoint_files, files_in_folder,
    is_rank_file, is_trainer_folder, side_files,
)
from zckpt.backup.find import LocalCheckpoint, find_checkpoints, step_of
from zckpt.backup.manifest import MANIFEST_NAME, PUSH_FILES, RECORD_NAME
from zckpt.backup.scan import (
    LATEST_NAMES, PUSH_LATEST_FIX, check_complete, check_safetensors, check_save_tag, check_torch_legacy,
    check_torch_zip, latest_problem, newest_mtime, safetensors_problem,
)

__all__ = [
    "LATEST_NAMES", "MANIFEST_NAME", "MODEL_RE", "OPTIM_RE", "PUSH_FILES", "PUSH_LATEST_FIX", "RECORD_NAME",
    "TAG_STEP_RE", "TRAINER_RE", "CheckpointFile", "LocalCheckpoint", "NotBackedUp", "check_complete",
    "check_safetensors", "check_save_tag", "check_torch_legacy", "check_torch_zip", "checkpoint_files",
    "files_in_folder", "find_checkpoints", "is_rank_file", "is_trainer_folder", "latest_problem", "newest_mtime",
    "safetensors_problem", "side_files", "step_of",
]
