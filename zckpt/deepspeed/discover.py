"""Finding a checkpoint's files: save folder, tag folder or Trainer ``checkpoint-N``, by parsing file names.

Accepted inputs::

    save_dir/                       latest ("global_step3", no newline), zero_to_fp32.py, <tag>/...
    save_dir/<tag>/                 *_model_states.pt, *_optim_states.pt
    checkpoint-N/                   a Hugging Face Trainer folder: config.json, trainer_state.json, ... plus a
                                    save folder (latest, global_stepN/)

File names inside a tag folder (DeepSpeed 0.19.8, engine.py ``_get_ckpt_name`` and friends)::

    mp_rank_XX_model_states.pt                          ZeRO 0/1/2: model states, one per model-parallel rank
    zero_pp_rank_R_mp_rank_XX_model_states.pt           ZeRO 3: model states, one per data-parallel rank
    [bf16_]zero_pp_rank_R_mp_rank_XX_optim_states.pt    optimizer partition of data-parallel rank R
    layer_NN-model_states.pt, layer_N_expert_E_...      pipeline layers / MoE experts (refused for now)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from zckpt import storage
from zckpt.errors import CheckpointNotFound, InvalidArgument, UnsupportedLayout

OPTIM_RE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
LAYER_RE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
EXPERT_RE = re.compile(r"^(?:layer_\d+_)?expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
EXPP_RE = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
TAG_SORT_RE = re.compile(r"(\d+)$")

TRAINER_MARKERS = ("trainer_state.json", "training_args.bin")


@dataclass
class RankFile:
    path: str
    name: str
    kind: str  # "model" or "optim"
    dp_rank: int | None
    mp_rank: int
    size: int = -1


@dataclass
class Location:
    """Where a checkpoint's files are."""

    input_path: str
    save_dir: str
    tag: str
    tag_dir: str
    trainer_dir: str | None
    model_files: list[RankFile] = field(default_factory=list)
    optim_files: list[RankFile] = field(default_factory=list)
    other_files: list[str] = field(default_factory=list)
    has_latest: bool = False


def _is_tag_dir(names) -> bool:
    return any(MODEL_RE.match(n) or OPTIM_RE.match(n) or LAYER_RE.match(n) for n in names)


def _tag_key(tag: str):
    m = TAG_SORT_RE.search(tag)
    return (int(m.group(1)) if m else -1, tag)


def _parent(path: str) -> str:
    trimmed = path.rstrip("/")
    if storage.is_url(trimmed):
        head = trimmed.rsplit("/", 1)[0]
        return head if "://" in head and not head.endswith(":/") else trimmed
    return os.path.dirname(os.path.abspath(trimmed))


def _read_latest(path: str) -> str:
    raw = storage.read_range(path, 0, 4096)
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointNotFound("'latest' is not a text file naming a tag", path=path) from None


def locate(path: str, tag: str | None = None) -> Location:
    """Resolve ``path`` (and ``tag``) to the tag folder and its rank files. Reads names only, no file contents."""
    path = str(path)
    if not storage.exists(path):
        raise CheckpointNotFound("no such file or folder", path=path)
    if not storage.isdir(path):
        raise InvalidArgument("expected a checkpoint folder (save folder, tag folder or checkpoint-N), got a file",
                              path=path, hint="pass the folder that holds 'latest' or the *_states.pt files")
    names = storage.listdir(path)
    trainer_dir = path if any(m in names for m in TRAINER_MARKERS) else None

    if _is_tag_dir(names):
        if tag is not None and tag != os.path.basename(path.rstrip("/")):
            raise InvalidArgument(f"--tag {tag} given, but {path} is itself a tag folder", path=path)
        parent = _parent(path)
        loc = Location(path, parent, os.path.basename(path.rstrip("/")), path, None)
        parent_names = storage.listdir(parent) if parent else []
        if any(m in parent_names for m in TRAINER_MARKERS):
            loc.trainer_dir = parent
        loc.has_latest = "latest" in parent_names
        return _fill(loc, names)

    has_latest = "latest" in names
    if tag is None and has_latest:
        tag = _read_latest(storage.join(path, "latest"))
        if not tag or "/" in tag or tag in (".", ".."):
            raise CheckpointNotFound(f"'latest' names an invalid tag {tag!r}", path=storage.join(path, "latest"))
    if tag is None:
        tags = [n for n in names if storage.isdir(storage.join(path, n)) and _is_tag_dir(
            storage.listdir(storage.join(path, n)))]
        if len(tags) == 1:
            tag = tags[0]
        elif tags:
            newest = max(tags, key=_tag_key)
            raise InvalidArgument(f"no 'latest' file and several tags ({', '.join(sorted(tags, key=_tag_key))})",
                                  path=path, hint=f"choose one with --tag, e.g. --tag {newest}")
        else:
            ckpts = sorted((n for n in names if n.startswith("checkpoint-")), key=_tag_key)
            if ckpts:
                raise InvalidArgument("this is a training output folder, not a checkpoint", path=path,
                                      hint=f"pass one of its checkpoints, e.g. {storage.join(path, ckpts[-1])}")
            raise CheckpointNotFound("no DeepSpeed checkpoint here (no 'latest' file and no *_states.pt files)",
                                     path=path, hint="pass a DeepSpeed save folder, a tag folder or a checkpoint-N")
    tag_dir = storage.join(path, tag)
    if not storage.isdir(tag_dir):
        where = "'latest' names" if has_latest else "--tag names"
        raise CheckpointNotFound(f"{where} tag '{tag}' but that folder does not exist", path=tag_dir,
                                 hint="the save may have been interrupted; pick an existing tag with --tag")
    loc = Location(path, path, tag, tag_dir, trainer_dir, has_latest=has_latest)
    return _fill(loc, storage.listdir(tag_dir))


def _fill(loc: Location, names) -> Location:
    for name in sorted(names):
        full = storage.join(loc.tag_dir, name)
        if m := OPTIM_RE.match(name):
            loc.optim_files.append(RankFile(full, name, "optim", int(m.group(2)), int(m.group(3))))
        elif m := MODEL_RE.match(name):
            loc.model_files.append(RankFile(full, name, "model", int(m.group(1)) if m.group(1) else None,
                                            int(m.group(2))))
        elif LAYER_RE.match(name):
            raise UnsupportedLayout("pipeline-parallel checkpoint (layer_*-model_states.pt files); zckpt reads "
                                    "data-parallel checkpoints only for now", path=loc.tag_dir)
        elif EXPERT_RE.match(name) or EXPP_RE.match(name):
            raise UnsupportedLayout("mixture-of-experts checkpoint (expert_* files); zckpt reads data-parallel "
                                    "checkpoints only for now", path=loc.tag_dir)
        else:
            loc.other_files.append(name)
    if not loc.model_files and not loc.optim_files:
        raise CheckpointNotFound("tag folder holds no *_model_states.pt or *_optim_states.pt files",
                                 path=loc.tag_dir)
    mp_ranks = {f.mp_rank for f in loc.model_files + loc.optim_files}
    if len(mp_ranks) > 1 or mp_ranks - {0}:
        raise UnsupportedLayout(f"model-parallel checkpoint (mp ranks {sorted(mp_ranks)}: tensor or pipeline "
                                "parallel); zckpt reads data-parallel checkpoints only for now", path=loc.tag_dir)
    loc.model_files.sort(key=lambda f: (f.dp_rank or 0))
    loc.optim_files.sort(key=lambda f: f.dp_rank)
    return loc
