"""A DeepSpeed checkpoint described from metadata alone: every tensor, and where each slice of it lives.

The DeepSpeed format's reader for the one opener (:func:`zckpt.state.open.open_checkpoint`, which asks the other
formats first and gives DeepSpeed whatever they leave). :func:`read` locates the files (:mod:`zckpt.deepspeed.discover`), unpickles every rank file's
metadata safely (:mod:`zckpt.encoding.safeload`, no tensor bytes read) and hands them to the reader of the optimizer
flavour it finds (:mod:`zckpt.deepspeed.zero12` for ZeRO-1/2 and the BF16 optimizer, :mod:`zckpt.deepspeed.zero3`).
The result, :class:`Checkpoint`, lists :class:`TensorRecord` s in the model's ``state_dict`` order; each holds
``Piece`` lists (file, byte offset, element count, dtype) for its value and, for trainable parameters, the fp32
master and both Adam moments. Concatenating a list's pieces gives the flat tensor.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from zckpt.io import storage
from zckpt.deepspeed.discover import Location, locate
from zckpt.deepspeed.model import Checkpoint, load_all, metadata_errors
from zckpt.errors import CorruptFile, IncompleteCheckpoint, UnsupportedLayout, ZckptError
from zckpt.units import format_size

log = logging.getLogger(__name__)


FORMAT = "deepspeed"  # what the package declares to the registry: zckpt.deepspeed.format


def claims(path: str, storage_options: dict | None = None) -> bool:
    """DeepSpeed is the opener's last word: it claims every path the other formats leave, and :func:`read` says
    in one line what a folder lacks to be a checkpoint."""
    return True


def read(path: str, tag: str | None = None, storage_options: dict | None = None) -> Checkpoint:
    """Describe the DeepSpeed checkpoint at ``path`` (save folder, tag folder, Trainer ``checkpoint-N``; local or
    URL); see :func:`zckpt.state.open.open_checkpoint`."""
    t0 = time.perf_counter()
    loc = locate(path, tag, storage_options)
    with metadata_errors(loc.tag_dir), storage.keep_fetched():  # (remote: a scalar is not fetched twice)
        ckpt = _open(loc)
    files = loc.model_files + loc.optim_files + loc.layer_files + loc.expert_files
    log.info("opened %s: tag %s, %d rank files (%s), %d tensors, read metadata in %.2fs", path, loc.tag,
             len(files), format_size(sum(f.size or 0 for f in files)), len(ckpt.records), time.perf_counter() - t0)
    for f in files:
        log.debug("  read %s (%s)", f.path, format_size(f.size))
    return ckpt


def _stat(f, storage_options) -> None:
    try:
        f.size = storage.size(f.path, storage_options)
    except ZckptError:
        raise
    except OSError as exc:
        raise CorruptFile(f"cannot stat ({exc})", path=f.path) from None


def _open(loc: Location) -> Checkpoint:
    files = loc.model_files + loc.optim_files + loc.layer_files + loc.expert_files
    if len(files) > 1 and storage.is_url(loc.tag_dir):  # one round trip, not one per file
        with ThreadPoolExecutor(min(16, len(files))) as pool:
            list(pool.map(lambda f: _stat(f, loc.storage_options), files))
    else:
        for f in files:
            _stat(f, loc.storage_options)
    if not loc.model_files:
        from zckpt.deepspeed.model import missing_model_states
        raise missing_model_states(loc)  # names mp_rank_00_model_states.pt (ZeRO-3: each rank's file)
    # each reader is imported only when its layout is found: a command pays for one reader's import, not seven
    if loc.universal:  # zero/optimizer_state.pt + zero/<param>/*.pt instead of *_optim_states.pt
        from zckpt.deepspeed import universal_read
        return universal_read.build(loc)
    states = load_all(loc.model_files + loc.optim_files, loc.storage_options)  # (remote: all in parallel)
    model_states, optim_states = states[:len(loc.model_files)], states[len(loc.model_files):]
    ms0 = model_states[0]
    for f, ms in zip(loc.model_files, model_states):
        if "module" not in ms and "param_shapes" not in ms:
            raise CorruptFile("not a DeepSpeed model-states file (no 'module' or 'param_shapes')", path=f.path)
    if loc.layer_files or (ms0.get("module") is None and "module" in ms0):  # PipelineEngine: weights per layer
        from zckpt.deepspeed import pipeline
        return pipeline.build(loc, model_states, optim_states)
    mp = int(ms0.get("mp_world_size") or 1)
    mp_ranks = sorted({f.mp_rank for f in loc.model_files + loc.optim_files})
    if mp > 1 or mp_ranks != [0]:
        # AutoTP: merged by the checkpoint's own partition metadata
        from zckpt.deepspeed import tp
        if mp > 1 and tp.affine_map(ms0) is not None:
            return tp.build(loc, model_states, optim_states)
        raise UnsupportedLayout(f"model-parallel checkpoint (mp_world_size={mp}, mp ranks {mp_ranks}) without "
                                "AutoTP partition metadata", path=loc.tag_dir)
    if loc.expert_files or ms0.get("num_experts") or ms0.get("ds_autoep_layers"):  # experts in their own files
        from zckpt.deepspeed import moe
        return moe.build(loc, model_states, optim_states)
    if not optim_states:
        if ms0.get("optimizer") is not None or ms0.get("param_shapes") is None:  # ZeRO-0: all in one file
                from zckpt.deepspeed import zero0
                return zero0.build(loc, model_states)
        raise IncompleteCheckpoint("no *_optim_states.pt files in the tag folder", path=loc.tag_dir)
    for f, st in zip(loc.optim_files, optim_states):
        if not isinstance(st.get("optimizer_state_dict"), dict):
            raise CorruptFile("not a DeepSpeed optimizer-states file (no 'optimizer_state_dict')", path=f.path)

    osd0 = optim_states[0]["optimizer_state_dict"]
    stage = osd0.get("zero_stage")
    if stage is not None and int(stage) == 3:
        from zckpt.deepspeed import zero3
        return zero3.build(loc, model_states, optim_states)
    if stage is not None and int(stage) not in (1, 2):
        raise UnsupportedLayout(f"zero_stage {int(stage)} is not a ZeRO optimizer checkpoint",
                                path=loc.optim_files[0].path)
    if stage is None and "single_partition_of_fp32_groups" not in osd0:
        raise CorruptFile("optimizer file has neither zero_stage nor fp32 partitions", path=loc.optim_files[0].path)
    from zckpt.deepspeed import zero12
    return zero12.build(loc, model_states, optim_states)
