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
    layer_NN-model_states.pt                            pipeline layer NN's state_dict (zckpt.deepspeed.pipeline)
    layer_L_expert_E_mp_rank_XX_model_states.pt         MoE layer L's expert E (zckpt.deepspeed.moe)
"""

from __future__ import annotations

import os
import re

from zckpt.io import links, storage
from zckpt.state.model import Location, RankFile  # noqa: F401 - where a checkpoint's files are, re-exported
from zckpt.errors import CheckpointNotFound, InvalidArgument, UnsupportedLayout

OPTIM_RE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
LAYER_RE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
EXPERT_RE = re.compile(r"^(?:layer_(\d+)_)?expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
EXPP_RE = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
TAG_SORT_RE = re.compile(r"(\d+)$")

TRAINER_MARKERS = ("trainer_state.json", "training_args.bin")


def _is_tag_dir(names) -> bool:
    return any(MODEL_RE.match(n) or OPTIM_RE.match(n) or LAYER_RE.match(n) for n in names)


def _tag_key(tag: str):
    m = TAG_SORT_RE.search(tag)
    return (int(m.group(1)) if m else -1, tag)


def _read_latest(path: str, storage_options: dict | None = None) -> str:
    links.check([path], storage.parent(path))  # a 'latest' that is a link out of the folder: not read
    raw = storage.read_range(path, 0, 4096, storage_options)
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointNotFound("'latest' is not a text file naming a tag", path=path) from None


def locate(path: str, tag: str | None = None, storage_options: dict | None = None) -> Location:
    """Resolve ``path`` (and ``tag``) to the tag folder and its rank files. Reads names only, no file contents.

    ``storage_options``: fsspec options for a URL ``path`` (endpoint, credentials...); used for every listing
    here and recorded on the result (``Location.storage_options``) for the reads that follow."""
    path = str(path)
    opts = storage_options
    if not storage.exists(path, opts):
        raise CheckpointNotFound("no such file or folder", path=path)
    if not storage.isdir(path, opts):
        raise InvalidArgument("expected a checkpoint folder (save folder, tag folder or checkpoint-N), got a file",
                              path=path, hint="pass the folder that holds 'latest' or the *_states.pt files")
    names = storage.listdir(path, opts)
    trainer_dir = path if any(m in names for m in TRAINER_MARKERS) else None

    if _is_tag_dir(names):
        if tag is not None and tag != storage.basename(path):
            raise InvalidArgument(f"`tag`={tag} given, but {path} is itself a tag folder", path=path)
        parent = storage.parent(path)
        loc = Location(path, parent, storage.basename(path), path, None, storage_options=opts)
        parent_names = storage.listdir(parent, opts) if parent else []
        if any(m in parent_names for m in TRAINER_MARKERS):
            loc.trainer_dir = parent
        loc.has_latest = "latest" in parent_names
        return _checked(_fill(loc, names), parent or path)

    has_latest = "latest" in names
    tag_from_user = tag is not None
    latest_name = "latest"
    if tag is None and not has_latest and "latest_universal" in names:  # ds_to_universal's, or zckpt reshard's
        tag = _read_latest(storage.join(path, "latest_universal"), opts)
        if not tag or "/" in tag or tag in (".", ".."):
            raise CheckpointNotFound(f"'latest_universal' names an invalid tag {tag!r}",
                                     path=storage.join(path, "latest_universal"))
        has_latest, latest_name = True, "latest_universal"
    if tag is None and has_latest:
        tag = _read_latest(storage.join(path, "latest"), opts)
        if not tag or "/" in tag or tag in (".", ".."):
            raise CheckpointNotFound(f"'latest' names an invalid tag {tag!r}", path=storage.join(path, "latest"))
    if tag is None:
        tags = [n for n in names if storage.isdir(storage.join(path, n), opts) and _is_tag_dir(
            storage.listdir(storage.join(path, n), opts))]
        if len(tags) == 1:
            tag = tags[0]
        elif tags:
            newest = max(tags, key=_tag_key)
            raise InvalidArgument(f"no 'latest' file and several tags ({', '.join(sorted(tags, key=_tag_key))})",
                                  path=path, hint=f"choose one with `tag`, e.g. `tag`={newest}")
        else:
            ckpts = sorted((n for n in names if n.startswith("checkpoint-")), key=_tag_key)
            if ckpts:
                raise InvalidArgument("this is a training output folder, not a checkpoint", path=path,
                                      hint=f"pass one of its checkpoints, e.g. {storage.join(path, ckpts[-1])}; "
                                           "zckpt's --latest picks the newest complete one")
            raise CheckpointNotFound("no checkpoint here (no DeepSpeed 'latest' or *_states.pt files, no DCP "
                                     ".metadata, no Megatron latest_checkpointed_iteration.txt or iter_NNNNNNN)",
                                     path=path, hint="pass a DeepSpeed save folder, a tag folder or a checkpoint-N, "
                                                     "a DCP folder, or a Megatron save or iteration folder")
    tag_dir = storage.join(path, tag)
    if not storage.isdir(tag_dir, opts):
        if tag_from_user:
            raise CheckpointNotFound(f"`tag` {tag}: no such tag folder", path=tag_dir,
                                     hint=_existing_tags_hint(path, names, opts))
        where = f"'{latest_name}' names" if has_latest else "the only tag"
        raise CheckpointNotFound(f"{where} tag '{tag}' but that folder does not exist", path=tag_dir,
                                 hint="the save may have been interrupted; pick an existing tag with `tag`")
    loc = Location(path, path, tag, tag_dir, trainer_dir, has_latest=has_latest, storage_options=opts)
    return _checked(_fill(loc, storage.listdir(tag_dir, opts)), path)


def _checked(loc: Location, root: str) -> Location:
    """``loc``, once every rank file is known to lie inside the checkpoint folder ``root`` (the folder given; its
    parent for a tag folder, whose ``latest`` and scripts are read there) with links resolved
    (:mod:`zckpt.io.links`: a link out of it is refused unless ``ZCKPT_FOLLOW_LINKS=1``)."""
    links.check([f.path for f in loc.model_files + loc.optim_files + loc.layer_files + loc.expert_files], root)
    return loc


def _existing_tags_hint(path: str, names, storage_options: dict | None = None) -> str:
    tags = sorted((n for n in names if storage.isdir(storage.join(path, n), storage_options)
                   and _is_tag_dir(storage.listdir(storage.join(path, n), storage_options))), key=_tag_key)
    return f"existing tags: {', '.join(tags)}" if tags else "this folder holds no tag folders"


def _fill(loc: Location, names) -> Location:
    for name in sorted(names):
        full = storage.join(loc.tag_dir, name)
        if m := OPTIM_RE.match(name):
            loc.optim_files.append(RankFile(full, name, "optim", int(m.group(2)), int(m.group(3))))
        elif m := MODEL_RE.match(name):
            loc.model_files.append(RankFile(full, name, "model", int(m.group(1)) if m.group(1) else None,
                                            int(m.group(2))))
        elif m := LAYER_RE.match(name):  # pipeline parallel (zckpt.deepspeed.pipeline)
            loc.layer_files.append(RankFile(full, name, "layer", None, int(m.group(2) or 0), index=int(m.group(1))))
        elif m := EXPERT_RE.match(name):  # mixture of experts (zckpt.deepspeed.moe)
            loc.expert_files.append(RankFile(full, name, "expert", None, int(m.group(3)),
                                             index=int(m.group(1) or 0), expert=int(m.group(2))))
        elif m := EXPP_RE.match(name):  # MoE without ZeRO: expert-parallel rank e's optimizer (zckpt.deepspeed.moe)
            loc.optim_files.append(RankFile(full, name, "expp", int(m.group(1)), int(m.group(2))))
        else:
            loc.other_files.append(name)
    if not loc.model_files and not loc.optim_files:
        raise CheckpointNotFound("tag folder holds no *_model_states.pt or *_optim_states.pt files",
                                 path=loc.tag_dir)
    mp_ranks = {f.mp_rank for f in loc.model_files + loc.optim_files}
    model_mp = sorted(f.mp_rank for f in loc.model_files)
    whole = model_mp == list(range(len(model_mp)))  # one model file per mp rank: AutoTP decides (layout._open)
    if (len(mp_ranks) > 1 or mp_ranks - {0}) and not loc.layer_files and not whole:  # pipeline: mp ranks = stages
        raise UnsupportedLayout(f"model-parallel checkpoint (mp ranks {sorted(mp_ranks)}: tensor or pipeline "
                                "parallel); zckpt reads data-parallel checkpoints only for now", path=loc.tag_dir)
    loc.model_files.sort(key=lambda f: (f.dp_rank or 0))
    loc.optim_files.sort(key=lambda f: f.dp_rank)
    if not loc.optim_files and "zero" in loc.other_files:
        _add_universal(loc)
    return loc


def _add_universal(loc: Location) -> None:
    """The files of a universal checkpoint's ``zero/`` folder (``ds_to_universal`` or ``zckpt reshard --format
    universal``), as ``optim_files`` named relative to the tag folder: ``zero/optimizer_state.pt`` first, then
    ``zero/<param>/<state>.pt`` (state: fp32, exp_avg, exp_avg_sq, step) by parameter name."""
    opts = loc.storage_options
    zero = storage.join(loc.tag_dir, "zero")
    if not storage.isdir(zero, opts):
        return
    names = storage.listdir(zero, opts)
    if "optimizer_state.pt" not in names:
        return
    loc.universal = True
    files = [RankFile(storage.join(zero, "optimizer_state.pt"), "zero/optimizer_state.pt", "universal", None, 0)]
    for param in names:
        if param == "optimizer_state.pt":
            continue
        folder = storage.join(zero, param)
        if not storage.isdir(folder, opts):
            continue
        for state in storage.listdir(folder, opts):
            if state.endswith(".pt"):
                files.append(RankFile(storage.join(folder, state), f"zero/{param}/{state}", "universal", None, 0))
    loc.optim_files = files


# ------------------------------------------------------------------------------------------- side files

SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # DeepSpeed's recovery scripts beside a tag folder
LATEST_FILES = ("latest", "latest_universal")


def is_rank_file(name: str) -> bool:
    """A DeepSpeed rank file's name (model or optimizer states, pipeline layer, MoE expert)."""
    return any(r.match(name) for r in (MODEL_RE, OPTIM_RE, LAYER_RE, EXPERT_RE))


def side_files(loc: Location, storage_options: dict | None = None) -> list:
    """What a reshard carries over as it is (:func:`zckpt.state.files.side_files` with DeepSpeed's own files: its
    tag folders, ``latest``; a tag folder on its own carries the recovery scripts next to it)."""
    from zckpt.state.files import side_files as files_beside
    return files_beside(loc, storage_options, is_rank_file, LATEST_FILES, SCRIPTS)
