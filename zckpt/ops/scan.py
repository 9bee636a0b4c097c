"""A checkpoint's files, and which checkpoints in a folder are complete.

:func:`checkpoint_files` is the one definition of "the checkpoint's files" (push sends them, verify and info list
and check them, reshard copies the ones outside the tag): every file below the checkpoint folder, whatever the
folder is called, or a refusal naming what cannot be copied. :func:`find_checkpoints` says what a push's SRC holds
(a Trainer checkpoint however named, a tag folder, a training output folder, a DeepSpeed save folder);
:func:`check_complete` whether a checkpoint is whole: every rank file named by the layout there and whole (zip
directory and safetensors header readable, ``dp_world_size`` ranks present, Trainer state written). Folders holding
a zckpt output marker (``.zckpt.json``: merged weights, reshard results) are never taken for checkpoints nor swept
into one's upload (and are reported). Nothing here unpickles tensors or imports torch.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import re
import stat
import struct

from zckpt.io import links, storage
from zckpt.deepspeed.discover import EXPERT_RE, LAYER_RE, TRAINER_MARKERS
from zckpt.deepspeed.discover import MODEL_RE as DS_MODEL_RE
from zckpt.deepspeed.discover import OPTIM_RE as DS_OPTIM_RE
from zckpt.errors import CheckpointNotFound, InvalidArgument, LinkOutside, ZckptError
from zckpt.encoding.legacy import is_legacy
from zckpt.encoding.zipentries import LOCAL_SIG, read_file_entries
from zckpt.io.publish import MARKER, has_marker, read_marker

log = logging.getLogger(__name__)

TRAINER_RE = re.compile(r"^checkpoint-(\d+)$")
TAG_STEP_RE = re.compile(r"^global_step(\d+)(_universal)?$")
OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_RE = re.compile(r"^(zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


# ================================================================================= the checkpoint's files

MANIFEST_NAME = "zckpt-manifest.json"  # push's commit record at DEST (zckpt.ops.destinations writes it)
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


# ============================================================================================ scanning


@dataclasses.dataclass
class LocalCheckpoint:
    """A checkpoint folder under SRC. ``name`` is its path relative to SRC ("" when SRC is the checkpoint).

    ``kind``: "trainer" (a Trainer checkpoint, whatever its name), "deepspeed" (one tag folder), "skip" (a folder
    next to the checkpoints that is not pushed: ``reason`` says why, and push reports it)."""

    name: str
    path: str
    kind: str  # "trainer" | "deepspeed" | "skip"
    step: int | None
    reason: str = ""
    save_dir: str = ""  # a tag of the DeepSpeed save folder SRC: its `latest` decides (:func:`check_save_tag`)


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
        return any(MODEL_RE.match(n) or OPTIM_RE.match(n) for n in os.listdir(folder))
    except OSError:
        return False


def _subfolders(src: str) -> list[str]:
    return [n for n in sorted(os.listdir(src)) if os.path.isdir(os.path.join(src, n))]


def find_checkpoints(src: str) -> tuple[list[LocalCheckpoint], list[str]]:
    """Checkpoints under ``src`` (oldest first) and the save folder's own files to mirror after them.

    What SRC is decides what its checkpoints are (the first rule that fits)::

        checkpoint-N, or a folder with trainer_state.json / training_args.bin and no checkpoint-N inside
                                      one Trainer checkpoint: every file (a renamed copy, a reshard output...)
        a folder with rank files      one tag folder: every file
        a folder with checkpoint-N/   a training output folder: each checkpoint-N (or renamed Trainer
                                      checkpoint) inside is one; other folders (runs/...) are not checkpoints
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
        return [LocalCheckpoint("", src, "trainer", step_of(base))], []
    if _has_rank_files(src):
        return [LocalCheckpoint("", src, "deepspeed", step_of(base))], []
    found: list[LocalCheckpoint] = []
    save_folder = not trainer_inside and (any(n in names for n in ("latest", "latest_universal"))
                                          or any(_has_rank_files(os.path.join(src, n)) for n in subs))
    for name in subs:
        path = os.path.join(src, name)
        inner = os.listdir(path) if os.access(path, os.R_OK | os.X_OK) else []
        sub_kind = _zckpt_output(path)
        if sub_kind is not None:  # a zckpt output next to the checkpoints: never one of them
            found.append(LocalCheckpoint(name, path, "skip", step_of(name),
                                         f"a zckpt {sub_kind} output, not one of the checkpoints"
                                         + (f" (push it on its own: zckpt push {path} DEST)"
                                            if sub_kind in ("reshard", "convert") else "")))
        elif TRAINER_RE.match(name) or "trainer_state.json" in inner:  # however it is called now
            found.append(LocalCheckpoint(name, path, "trainer", step_of(name)))
        elif not save_folder and "training_args.bin" in inner and not _has_rank_files(path):
            continue  # trainer.save_model("final"): a saved model, not a checkpoint (like runs/)
        elif _has_rank_files(path):
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
    """What only a checkpoint (or a save folder) has: ``latest``, ``trainer_state.json``, rank files."""
    return any(n in ("latest", "latest_universal", *TRAINER_MARKERS) or MODEL_RE.match(n) for n in names)


# ========================================================================================= completeness


def _model_meta(path: str) -> dict:
    """``dp_world_size``, ``mp_world_size`` and whether ZeRO is on, from a model-states file, running no code."""
    from zckpt.encoding import safeload
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

    The checks of :func:`zckpt.encoding.zipentries.read_entries`: every entry inside the file and agreeing with its local
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
    """Why a legacy (non-zip) torch file is not whole: the checks of :func:`zckpt.encoding.legacy.locate` (its
    pickles end, its storage keys match the object pickle, the storages' sizes end the file exactly and agree with
    their size fields); reads the pickles and the 8-byte size fields only."""
    from zckpt.encoding import safeload
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


def check_safetensors(path: str, storage_options: dict | None = None) -> str | None:
    """Why a ``.safetensors`` file is not whole (header JSON parses and its last offset ends the file), naming it."""
    why = safetensors_problem(path, storage_options)
    return f"{storage.basename(path)} {why}" if why else None


def safetensors_problem(path: str, storage_options: dict | None = None) -> str | None:
    """What is wrong with a ``.safetensors`` file's header ("is truncated (header)", ...), or None."""
    try:
        size = storage.size(path, storage_options)
        with storage.open_input(path, storage_options) as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                return "is truncated (header)"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError, IndexError) as exc:
        return f"has no valid header ({exc})"
    if 8 + n + end != size:
        return f"is {size} bytes, its header says {8 + n + end}"
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


LATEST_NAMES = ("latest", "latest_universal")  # DeepSpeed's (load_universal_checkpoint: the second)


def latest_problem(folder: str, storage_options: dict | None = None) -> tuple[str | None, str | None]:
    """``(tag, None)`` when DeepSpeed's ``load_checkpoint(folder)`` (``tag=None``, as a Trainer resume calls it)
    finds the tag to load in ``folder`` (a save folder or a Trainer ``checkpoint-N`` with tag folders); else
    ``(tag or None, why)``. The rules (docs/guide.md, "Complete means resumable", lists them)::

        a 'latest' (or 'latest_universal') file      DeepSpeed warns and loads nothing without one
        its text a tag name (UTF-8, no '/')          what DeepSpeed reads, stripped, as the tag folder's name
        that tag folder there                        else the load fails on the first rank file
        a Trainer checkpoint: the tag of its step    trainer_state.json's global_step N and a global_stepN folder
                                                     there: 'latest' must name it (else the Trainer resumes
                                                     another step's weights with this step's state)

    Reads only ``latest`` and ``trainer_state.json``; a ``latest`` that is a link out of ``folder`` is refused
    (:mod:`zckpt.io.links`)."""
    opts = storage_options
    names = storage.listdir(folder, opts)
    present = [n for n in LATEST_NAMES if n in names]
    if not present:
        return None, ("no 'latest' file (DeepSpeed's load_checkpoint with tag=None, how the Trainer resumes, "
                      "loads nothing)")
    tag = None
    for name in present:
        path = storage.join(folder, name)
        links.check([path], folder)
        raw = storage.read_range(path, 0, 4096, opts)
        try:
            named = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            return None, f"'{name}' is not a text file naming a tag"
        if not named or "/" in named or named in (".", ".."):
            return None, f"'{name}' names an invalid tag {named!r}"
        if not storage.isdir(storage.join(folder, named), opts):
            return named, f"'{name}' names {named!r}, which is missing"
        tag = tag or named
    if "trainer_state.json" in names and "latest" in present:
        step = _trainer_step(storage.join(folder, "trainer_state.json"), opts)
        own = f"global_step{step}" if step is not None else None
        if own and own != tag and storage.isdir(storage.join(folder, own), opts):
            return tag, (f"'latest' names {tag!r}, but this checkpoint is at step {step} (trainer_state.json) and "
                         f"holds {own}: the Trainer would resume {tag}'s weights with step {step}'s state")
    return tag, None


def _trainer_step(path: str, storage_options: dict | None) -> int | None:
    try:
        step = json.loads(storage.read_bytes(path, storage_options)).get("global_step")
    except (OSError, ValueError, AttributeError, ZckptError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


PUSH_LATEST_FIX = "write the tag's name into 'latest' as DeepSpeed does (printf TAG > latest), then push again"


def check_save_tag(save_dir: str, tag: str) -> tuple[bool, str]:
    """A tag of a DeepSpeed save folder, pushed as a checkpoint of its own: resumable once the save folder's
    ``latest`` is valid (:func:`latest_problem`) and the tag is not newer than the one it names (DeepSpeed's rank 0
    writes ``latest`` once its own rank files are written: a newer tag is a save that has not finished, or one made
    with ``save_latest=False``)."""
    named, why = latest_problem(save_dir)
    if why:
        return False, f"not resumable from {save_dir}: {why}; {PUSH_LATEST_FIX}"
    if named != tag and (step_of(tag) or -1) > (step_of(named) or -1):
        return False, (f"newer than {named!r}, the tag 'latest' names: its save has not finished (DeepSpeed's rank 0 "
                       "writes 'latest' after its rank files)")
    return True, "complete"


def check_complete(checkpoint_dir: str) -> tuple[bool, str]:
    """``(True, "complete")`` when a checkpoint folder is whole, else ``(False, reason)``.

    No link may lead out of the folder (:mod:`zckpt.io.links`); Trainer folders need ``trainer_state.json`` (the
    Trainer writes it last); a folder holding tag folders (a Trainer ``checkpoint-N``, a save folder) must be
    resumable as saved (:func:`latest_problem`: ``latest`` there, naming its tag); every DeepSpeed tag folder
    needs all rank files (dp ranks 0..W-1 per mp rank, W from
    ``dp_world_size`` in the model states); every torch zip needs an intact central directory and a
    ``data.pkl``; every ``.safetensors`` a header that matches its size. One function, so a deeper check
    (``zckpt.ops.verify``) can replace it.
    """
    checkpoint_dir = os.path.abspath(storage.local_path(checkpoint_dir))
    if not os.path.isdir(checkpoint_dir):
        return False, "folder is missing"
    base = os.path.basename(checkpoint_dir.rstrip(os.sep))
    entries = os.listdir(checkpoint_dir)
    trainer = is_trainer_folder(base, entries)
    try:  # a link out of the folder first: nothing of this checkpoint is read through it, let alone uploaded
        files, unlisted = checkpoint_files(checkpoint_dir), None
    except LinkOutside as exc:
        return False, exc.render()
    except NotBackedUp as exc:
        files, unlisted = [], exc
    if trainer and "trainer_state.json" not in entries:
        return False, "trainer_state.json missing (the Trainer writes it last)"
    inner = [os.path.join(checkpoint_dir, e) for e in sorted(entries)
             if os.path.isdir(os.path.join(checkpoint_dir, e)) and _has_rank_files(os.path.join(checkpoint_dir, e))
             and not has_marker(os.path.join(checkpoint_dir, e))]
    if inner or any(n in entries for n in LATEST_NAMES):  # a save folder or checkpoint-N: resumable as saved
        try:
            _named, why = latest_problem(checkpoint_dir)
        except LinkOutside as exc:
            return False, exc.render()
        if why:
            return False, f"not resumable: {why}; {PUSH_LATEST_FIX}"
    tags = ([checkpoint_dir] if _has_rank_files(checkpoint_dir) else []) + inner
    if not tags and not trainer:
        return False, "no DeepSpeed rank files and no trainer_state.json"
    for tag in tags:
        ok, reason = _check_tag(tag)
        if not ok:
            where = os.path.relpath(tag, checkpoint_dir)
            return False, reason if where == "." else f"{where}: {reason}"
    if unlisted is not None:
        return False, unlisted.message
    for f in files:
        name = f.rel.rsplit("/", 1)[-1]
        reason = None
        if name.endswith((".pt", ".pth")) or (name.endswith(".bin") and (_is_zip(f.path) or _is_legacy(f.path))):
            reason = check_torch_zip(f.path)
        elif name.endswith(".safetensors"):
            reason = check_safetensors(f.path)
        if reason:
            where = f.rel.rsplit("/", 1)[0] if "/" in f.rel else "."
            return False, reason if where == "." else f"{where}/{reason}"
    return True, "complete"


def newest_mtime(folder: str) -> float:
    """When the newest file of the checkpoint folder changed (every file :func:`checkpoint_files` counts)."""
    newest = 0.0
    with contextlib.suppress(NotBackedUp, LinkOutside):  # (said by check_complete, and again by the push)
        for f in checkpoint_files(folder):
            with contextlib.suppress(OSError):
                newest = max(newest, os.stat(f.path).st_mtime)
    return newest
