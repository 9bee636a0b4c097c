"""``--latest``: the newest complete checkpoint of a training output folder, and earlier checkpoints for hints.

A training output folder (``outputs/`` holding ``checkpoint-N/`` folders, or a DeepSpeed save folder holding
``global_stepN/`` tags) is read the way ``zckpt push`` reads its SRC (:func:`zckpt.backup.find.find_checkpoints`), and
each checkpoint's completeness is push's too (:func:`zckpt.backup.scan.check_complete`): the newest by step that is
complete is chosen, never an incomplete one, and :class:`Choice` says in one line which it is and which newer ones
were passed over. Nothing here reads tensors.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from zckpt.errors import CheckpointNotFound, IncompleteCheckpoint, InvalidArgument
from zckpt.io import storage
from zckpt.backup import find, scan

@dataclass
class Choice:
    """The checkpoint ``--latest`` chose in ``src`` (as the user gave it): ``path`` (absolute: what the command then
    reads), ``name`` (relative to src), ``step``, and the newer checkpoints passed over as ``(name, why it is not
    complete)``, newest first."""

    src: str
    path: str
    name: str
    step: int | None
    passed_over: list[tuple[str, str]] = field(default_factory=list)

    def line(self) -> str:
        """One line: ``--latest: outputs/checkpoint-12, step 12; passed over the newer checkpoint-16: <why>``."""
        shown = os.path.join(self.src, self.name) if self.name else self.src
        text = f"--latest: {shown}, " + (f"step {self.step}" if self.step is not None else "no step in its name")
        if not self.passed_over:
            return text + ", the newest checkpoint (complete)"
        names = ", ".join(n for n, _ in self.passed_over[:3]) + (" ..." if len(self.passed_over) > 3 else "")
        return text + f"; passed over the newer {names}, not complete: {self.passed_over[0][1]}"


def _key(c: find.LocalCheckpoint):
    return (c.step if c.step is not None else -1, c.name)


def newest_complete(src: str) -> Choice:
    """The newest complete checkpoint (by step, then name) of the training output folder or DeepSpeed save
    folder ``src`` (a checkpoint itself: that one, when complete). Raises :class:`IncompleteCheckpoint` when none
    is complete, :class:`CheckpointNotFound` when there is none; ``src`` must be local."""
    if storage.is_url(src):
        raise InvalidArgument("--latest takes a local folder (completeness is judged on the files as written)",
                              path=src, hint="pass the checkpoint itself")
    shown = src
    src = os.path.abspath(storage.local_path(src))
    checkpoints, _ = find.find_checkpoints(src)
    candidates = sorted((c for c in checkpoints if c.kind != "skip"), key=_key, reverse=True)
    if not candidates:
        raise CheckpointNotFound("--latest: no checkpoint in this folder (no checkpoint-N, tag folder or rank files)",
                                 path=shown, hint="pass a training output folder or a DeepSpeed save folder")
    passed: list[tuple[str, str]] = []
    for c in candidates:
        ok, reason = scan.check_checkpoint(c)
        if ok:
            return Choice(shown, c.path, c.name, c.step, passed)
        passed.append((c.name or os.path.basename(c.path), reason))
    first, reason = passed[0]
    raise IncompleteCheckpoint(f"--latest: no complete checkpoint here ({len(passed)} found); the newest, {first}: "
                               f"{reason}", path=shown,
                               hint="wait for the save to finish; zckpt verify says what is missing")


_TRAINER_PART = re.compile(r"^checkpoint-(\d+)$")


def earlier_checkpoint(path: str | None) -> str | None:
    """For a path inside a Trainer ``checkpoint-N`` folder of a training output folder: the newest complete
    sibling ``checkpoint-M`` with M < N (its path), else None. Where the earlier state of a ``checkpoint-N`` lies
    (a sibling folder, not another tag of its own)."""
    if not path or storage.is_url(path):
        return None
    parts = os.path.abspath(storage.local_path(path)).split(os.sep)
    for i in range(len(parts) - 1, 0, -1):
        m = _TRAINER_PART.match(parts[i])
        if not m:
            continue
        parent, step = os.sep.join(parts[:i]) or os.sep, int(m.group(1))
        try:
            names = os.listdir(parent)
        except OSError:
            return None
        older = sorted(((int(mm.group(1)), n) for n in names if (mm := _TRAINER_PART.match(n))
                        and int(mm.group(1)) < step), reverse=True)
        for _, name in older:
            if scan.check_complete(os.path.join(parent, name))[0]:
                return os.path.join(parent, name)
        return None
    return None


_EARLIER_TAG = "use an earlier tag with `tag`"


def with_earlier_checkpoint(hint: str, path: str | None) -> str:
    """``hint`` with "use an earlier tag with `tag`" replaced, for a path inside a ``checkpoint-N`` of a training
    output folder, by the earlier complete checkpoint next to it (or ``--latest``'s word when there is none)."""
    if _EARLIER_TAG not in (hint or ""):
        return hint
    if not path or storage.is_url(path):
        return hint
    parts = os.path.abspath(storage.local_path(path)).split(os.sep)
    if not any(_TRAINER_PART.match(p) for p in parts):
        return hint
    earlier = earlier_checkpoint(path)
    instead = f"use the earlier checkpoint {earlier}" if earlier else "no earlier checkpoint next to it is complete"
    return hint.replace(_EARLIER_TAG, instead)
