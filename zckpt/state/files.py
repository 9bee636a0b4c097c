"""A checkpoint's files, below the formats: the one definition of "the files of a checkpoint folder" (push sends
them, verify and info list and check them) and of the files a writer carries over beside a checkpoint's state.

:func:`checkpoint_files`: every file below a folder, or a refusal naming what cannot be copied
(:class:`NotBackedUp`); :func:`side_files`: the files of a located checkpoint that are not its format's own (a
format says which are, through the registry: :mod:`zckpt.state.formats`). Folders holding a zckpt output marker
(``.zckpt.json``) are never swept into a checkpoint's files (and are reported); neither are push's records
(:data:`PUSH_FILES`). Nothing here unpickles tensors or imports torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from typing import Callable

from zckpt.errors import InvalidArgument
from zckpt.io import links, storage
from zckpt.io.publish import MARKER

log = logging.getLogger(__name__)

MANIFEST_NAME = "zckpt-manifest.json"  # push's commit record at DEST (zckpt.backup.destinations writes it)
RECORD_NAME = ".zckpt-push.json"  # push's "a push of this checkpoint began here", written before any file
PUSH_FILES = (MANIFEST_NAME, RECORD_NAME)  # describe a checkpoint's files; never one of them

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


def side_files(loc, storage_options: dict | None = None, is_rank_file: Callable[[str], bool] = lambda name: False,
               own: tuple[str, ...] = (), scripts: tuple[str, ...] = ()) -> list[CheckpointFile]:
    """The files of a located checkpoint (:class:`zckpt.state.model.Location`) that are not its format's own: what
    a writer carries over as they are. The format says which are its own (its ``side_files`` in
    :mod:`zckpt.state.formats`): ``is_rank_file`` names a tag folder's files (a Trainer checkpoint's top folders
    holding one are tags), ``own`` the top-level names it writes itself (``latest``), ``scripts`` what a tag folder
    on its own carries from its parent (DeepSpeed's recovery scripts). A Trainer checkpoint: every file of it
    (:func:`checkpoint_files`, subfolders included) outside its tag folders; a save folder: every file at its top
    (scripts, configs); a tag folder on its own: its ``scripts`` next to it. zckpt's own marker is left out (the
    new output writes its own)."""
    opts = storage_options if storage_options is not None else getattr(loc, "storage_options", None)
    skip = own + (MARKER,)
    if loc.trainer_dir:
        files = checkpoint_files(loc.trainer_dir, opts)
        tags = {f.rel.split("/", 1)[0] for f in files if f.rel.count("/") == 1 and is_rank_file(f.rel.split("/")[1])}
        tags.add(loc.tag)
        return [f for f in files if f.rel.split("/", 1)[0] not in tags and f.rel not in skip]
    if not loc.save_dir or loc.save_dir == loc.tag_dir:
        return []
    names = storage.listdir(loc.save_dir, opts)
    if not (loc.has_latest or loc.input_path == loc.save_dir):  # a tag folder on its own: not its parent's files
        names = [n for n in names if n in scripts]
    out = []
    for name in names:
        path = storage.join(loc.save_dir, name)
        if name in skip or name in PUSH_FILES or name == loc.tag or not storage.isfile(path, opts):
            continue
        links.check([path], loc.save_dir)
        out.append(CheckpointFile(name, path, storage.size(path, opts)))
    return out
