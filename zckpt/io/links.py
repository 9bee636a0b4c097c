"""Symbolic links in a checkpoint folder: followed only while they stay inside it.

A checkpoint is a folder; whatever zckpt reads of it (rank files, ``latest``, ``.metadata`` and ``.distcp``
files, a Trainer's side files) and whatever ``zckpt push`` uploads of it must lie inside that folder once every
link is resolved. A link to another file or folder of the same checkpoint is fine (a deduplicated copy, a
``latest`` pointing at a file next to it); a link that leaves the folder is refused with
:class:`zckpt.errors.LinkOutside`, naming the link and where it leads, so that a checkpoint handed over with a
link to a private file never has that file read into a model or uploaded. ``ZCKPT_FOLLOW_LINKS=1`` (the CLI's
``--follow-links``) follows every link, as before. Local paths only: object stores have no links.
"""

from __future__ import annotations

import os

from zckpt.errors import LinkOutside
from zckpt.io import storage

ENV = "ZCKPT_FOLLOW_LINKS"


def followed() -> bool:
    """True when links leaving a checkpoint folder are followed (``ZCKPT_FOLLOW_LINKS`` set to 1/true/yes/on)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _inside(real: str, root_real: str) -> bool:
    return real == root_real or real.startswith(root_real.rstrip(os.sep) + os.sep)


def leaving(path: str, root: str) -> tuple[str, str] | None:
    """``(link, target)`` when the local ``path`` (below the folder ``root``) resolves outside ``root``: ``link`` is
    the first component from ``root`` down whose link leads out (a linked file, or a linked folder above it),
    ``target`` where it leads. None when ``path`` stays inside, or for URLs."""
    if storage.is_url(path) or storage.is_url(root):
        return None
    root_abs = os.path.abspath(storage.local_path(root))
    root_real = os.path.realpath(root_abs)
    full = os.path.abspath(storage.local_path(path))
    if _inside(os.path.realpath(full), root_real):
        return None
    rel = os.path.relpath(full, root_abs)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):  # not below root by name (never given so)
        return full, os.path.realpath(full)
    cur = root_abs
    for part in rel.split(os.sep):
        cur = os.path.join(cur, part)
        if os.path.islink(cur) and not _inside(os.path.realpath(cur), root_real):
            return cur, os.path.realpath(cur)
    return full, os.path.realpath(full)


def refusal(link: str, target: str, root: str, action: str = "refused") -> LinkOutside:
    """The error for ``link`` (leading to ``target``, outside ``root``), naming the link."""
    return LinkOutside(f"a symbolic link to {target}, outside the checkpoint folder {root}: {action}", path=link)


def check(paths, root: str, action: str = "refused") -> None:
    """Raise :class:`zckpt.errors.LinkOutside` for the first of ``paths`` that leaves ``root`` through a link
    (unless links are :func:`followed`)."""
    if followed() or storage.is_url(root):
        return
    for path in paths:
        out = leaving(path, root)
        if out is not None:
            raise refusal(*out, root, action)
