"""A checkpoint's files: the one definition of "the checkpoint's files" (push sends them, verify and info list
and check them, reshard copies the ones outside the tag).

:func:`checkpoint_files`: every file below the checkpoint folder, whatever the folder is called, or a refusal
naming what cannot be copied (:class:`NotBackedUp`); :func:`files_in_folder`: those of the folder a user named;
:func:`side_files`: those a reshard carries over. Folders holding a zckpt output marker (``.zckpt.json``: merged
weights, reshard results) are never swept into a checkpoint's files (and are reported). The names of
checkpoint folders and rank files (:data:`TRAINER_RE`, :data:`TAG_STEP_RE`, :data:`MODEL_RE`, :data:`OPTIM_RE`)
are here too. Nothing here unpickles tensors or imports torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import stat

from zckpt.io import links, storage
from zckpt.deepspeed.discover import EXPERT_RE, LAYER_RE, TRAINER_MARKERS
from zckpt.deepspeed.discover import MODEL_RE as DS_MODEL_RE
from zckpt.deepspeed.discover import OPTIM_RE as DS_OPTIM_RE
from zckpt.errors import InvalidArgument
from zckpt.io.publish import MARKER
from zckpt.backup.manifest import PUSH_FILES

log = logging.getLogger(__name__)

TRAINER_RE = re.compile(r"^checkpoint-(\d+)$")
TAG_STEP_RE = re.compile(r"^global_step(\d+)(_universal)?$")
OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_RE = re.compile(r"^(zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


_WARNED: set[str] = set()


@dataclasses.dataclass(frozen=True)
class CheckpointFile:
    """One file of a checkpoint: ``rel`` (posix, relative to the checkpoint folder), where it is, its size."""

    rel: str
    path: str
    size: int


class NotBackedUp(InvalidArgument):
    """A checkpoint folder holds something zckpt cannot copy as a file (a dangling link, a socket, a folder it
    may not read): refused rather than left out."""


def is_trainer_folder(folder_name: str, names) -> bool:
    """A Trainer checkpoint, whatever it is called now: named ``checkpoint-N``, or holding what the Trainer writes
    (``trainer_state.json``, ``training_args.bin``; the rule ``zckpt info`` uses, :data:`TRAINER_MARKERS`)."""
    return bool(TRAINER_RE.match(folder_name)) or any(m in names for m in TRAINER_MARKERS)


def checkpoint_files(folder: str, storage_options: dict | None = None, *,
                     exclude_dirs: tuple[str, ...] = ()) -> list[CheckpointFile]:
    """Every file of the checkpoint folder ``folder``, recursively, sorted by ``rel``: the one definition push, verify,
    info and reshard use. Left out, by rule: push's own records (``zckpt-manifest.json``, ``.zckpt-push.json``,
    which describe the files), subfolders holding a zckpt output marker (merged weights or a reshard result put
    inside the checkpoint: not part of it; logged) and ``exclude_dirs`` (relative folder names: the other tags of a
    save folder, pushed as checkpoints of their own). Anything that is not a plain file or folder (a dangling
    link, a socket, a folder that cannot be read) raises :class:`NotBackedUp`: never a silent subset.
    Links to files and folders are followed while they stay inside ``folder`` (a link loop is refused); a link
    that leads out of it raises :class:`zckpt.errors.LinkOutside` naming it (:mod:`zckpt.io.links`; followed
    with ``ZCKPT_FOLLOW_LINKS=1``): push never uploads what lies outside the checkpoint."""
    folder = os.fspath(folder)
    if storage.is_url(folder):
        found = storage.list_files(folder, storage_options)
        nested = {rel.rsplit("/", 1)[0] for rel in found if rel.rsplit("/", 1)[-1] == MARKER and "/" in rel}
        return [CheckpointFile(rel, storage.join(folder, rel), size) for rel, size in sorted(found.items())
                if rel.rsplit("/", 1)[-1] not in PUSH_FILES and rel.split("/", 1)[0] not in exclude_dirs
                and not any(rel.startswith(n + "/") for n in nested)]
    root = os.path.abspath(storage.local_path(folder))
    out: list[CheckpointFile] = []
    seen = {os.path.realpath(root)}
    follow = links.followed()

    def walk(path: str, rel: str) -> None:
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError as exc:
            raise NotBackedUp(f"cannot list {rel or '.'} ({exc.strerror or exc})", path=path,
                              hint="make it readable, or move it out of the checkpoint") from exc
        for e in entries:
            r = f"{rel}/{e.name}" if rel else e.name
            try:
                st = os.stat(e.path)  # follows links
            except OSError as exc:
                raise NotBackedUp(f"{r} cannot be read ({exc.strerror or exc}: a dangling link?)", path=e.path,
                                  hint="remove the link or restore what it points to") from exc
            if stat.S_ISDIR(st.st_mode) and not rel and e.name in exclude_dirs:
                continue
            if not follow and e.is_symlink() and (away := links.leaving(e.path, root)) is not None:
                raise links.refusal(*away, folder)
            if stat.S_ISDIR(st.st_mode):
                if os.path.isfile(os.path.join(e.path, MARKER)):
                    if e.path not in _WARNED:  # once per process, not at every scan
                        _WARNED.add(e.path)
                        log.warning("%s: a zckpt output inside the checkpoint, not part of it; left out", e.path)
                    continue
                real = os.path.realpath(e.path)
                if real in seen:
                    raise NotBackedUp(f"{r} links back into the checkpoint (a loop)", path=e.path)
                seen.add(real)
                walk(e.path, r)
                seen.discard(real)
            elif stat.S_ISREG(st.st_mode):
                if e.name not in PUSH_FILES:
                    out.append(CheckpointFile(r, e.path, st.st_size))
            else:
                raise NotBackedUp(f"{r} is not a regular file (a socket, pipe or device)", path=e.path,
                                  hint="move it out of the checkpoint")

    walk(root, "")
    return sorted(out, key=lambda f: f.rel)


def is_rank_file(name: str) -> bool:
    """A DeepSpeed rank file's name (model or optimizer states, pipeline layer, MoE expert)."""
    return any(r.match(name) for r in (DS_MODEL_RE, DS_OPTIM_RE, LAYER_RE, EXPERT_RE))


def side_files(loc, storage_options: dict | None = None) -> list[CheckpointFile]:
    """The files of a located checkpoint (:class:`zckpt.deepspeed.discover.Location`) that are neither a DeepSpeed
    tag folder's nor ``latest``: what a reshard carries over as they are. A Trainer checkpoint: every file of it
    (:func:`checkpoint_files`, subfolders included) outside its tag folders; a save folder: every file at its top
    (scripts, configs); a tag folder on its own: the recovery scripts next to it. zckpt's own marker is left out
    (the new output writes its own)."""
    opts = storage_options if storage_options is not None else getattr(loc, "storage_options", None)
    skip = ("latest", "latest_universal", MARKER)
    if loc.trainer_dir:
        files = checkpoint_files(loc.trainer_dir, opts)
        tags = {f.rel.split("/", 1)[0] for f in files if f.rel.count("/") == 1 and is_rank_file(f.rel.split("/")[1])}
        tags.add(loc.tag)
        return [f for f in files if f.rel.split("/", 1)[0] not in tags and f.rel not in skip]
    if not loc.save_dir or loc.save_dir == loc.tag_dir:
        return []
    names = storage.listdir(loc.save_dir, opts)
    if not (loc.has_latest or loc.input_path == loc.save_dir):  # a tag folder on its own: not its parent's files
        names = [n for n in names if n in ("zero_to_fp32.py", "zero_to_torch.py")]
    out = []
    for name in names:
        path = storage.join(loc.save_dir, name)
        if name in skip or name in PUSH_FILES or name == loc.tag or not storage.isfile(path, opts):
            continue
        links.check([path], loc.save_dir)
        out.append(CheckpointFile(name, path, storage.size(path, opts)))
    return out


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
