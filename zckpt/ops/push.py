"""Deprecated import path, kept for one release: use zckpt.backup.push (``push``), zckpt.backup.schedule
(``push_every``, ``Pusher``) and zckpt.backup.scan (``check_complete``).

The backup subsystem is the package :mod:`zckpt.backup`; this module re-exports the names that
``zckpt.ops.push`` had.
"""

from __future__ import annotations

from zckpt.backup.context import UNREACHABLE_AFTER, PushContext, Reachability
from zckpt.backup.destinations import make_destination
from zckpt.backup.faults import retryable, unreachable
from zckpt.backup.find import LocalCheckpoint, find_checkpoints
from zckpt.backup.files import checkpoint_files
from zckpt.backup.hashes import TORCH_SUFFIXES, HashCache, checked_sha256
from zckpt.backup.hub import HubDestination, parse_hf_url
from zckpt.backup.manifest import MANIFEST_FORMAT, MANIFEST_NAME, MANIFEST_VERSION, RECORD_NAME, manifest_bytes
from zckpt.backup.objectstore import FsDestination
from zckpt.backup.push import MIN_PART_SIZE, NothingPushed, nothing_pushed, push
from zckpt.backup.results import CheckpointResult, PushEvent, PushResult, human_bytes
from zckpt.backup.scan import check_complete, check_save_tag, newest_mtime
from zckpt.backup.schedule import Pusher, push_every
from zckpt.backup.transfer import FileChanged, FileTask, RemoteFile, check_unchanged, wait_all

__all__ = [
    "MANIFEST_FORMAT", "MANIFEST_NAME", "MANIFEST_VERSION", "MIN_PART_SIZE", "RECORD_NAME", "TORCH_SUFFIXES",
    "UNREACHABLE_AFTER", "CheckpointResult", "FileChanged", "FileTask", "FsDestination", "HashCache",
    "HubDestination", "LocalCheckpoint", "NothingPushed", "PushContext", "PushEvent", "PushResult", "Pusher",
    "Reachability", "RemoteFile", "check_complete", "check_save_tag", "check_unchanged", "checked_sha256",
    "checkpoint_files", "find_checkpoints", "human_bytes", "make_destination", "manifest_bytes", "newest_mtime",
    "nothing_pushed", "parse_hf_url", "push", "push_every", "retryable", "unreachable", "wait_all",
]
