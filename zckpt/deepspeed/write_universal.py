"""DeepSpeed's universal checkpoint layout, written straight from the source pieces (no temporary copy).

What ``python -m deepspeed.checkpoint.ds_to_universal`` produces (0.19.8: ``deepspeed/checkpoint/ds_to_universal.py``) and
``"checkpoint": {"load_universal": true}`` loads::

    OUT/latest_universal                          "<tag>_universal"
    OUT/<tag>_universal/<model-states files>      as the native output at the target world size and stage
    OUT/<tag>_universal/zero/optimizer_state.pt   rank 0's optimizer dict without the sharded tensors, + param_groups
    OUT/<tag>_universal/zero/<param>/fp32.pt      stage 1/2: {'param': full fp32 tensor, 'cat_dim': 0}
    OUT/<tag>_universal/zero/<param>/exp_avg.pt, exp_avg_sq.pt (same form), step.pt (the step tensor)
                                                  stage 3: raw flat fp32 tensors, no step.pt

Differences from ds_to_universal, all outside what the loader reads: the model-states files are those of the
target layout (so a universal checkpoint can also cross between ZeRO-1/2 and ZeRO-3); the stage-3
``optimizer_state.pt`` keeps the step but not rank 0's fp32 partition and moments (ds_to_universal copies them,
the loader never reads them).
"""

from __future__ import annotations

import os
from collections import OrderedDict

from zckpt.deepspeed.model import Checkpoint, pieces_of
from zckpt.deepspeed.partition import TorchObject
from zckpt.encoding.safeload import LazyTensor
from zckpt.engine.segments import Cast
from zckpt.engine.torchzip import TensorOut

SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")


def _param_file(t: TensorOut, stage: int):
    return {"param": t, "cat_dim": 0} if stage <= 2 else TensorOut(t.dtype, (t.numel,), t.segments)


def plan_universal(ckpt: Checkpoint, tag: str, stage: int, groups: list, has_state: bool,
                   native: list[TorchObject]) -> list[TorchObject]:
    """The universal layout's files, as object trees, from the native files of the target ``stage`` (``native``:
    its model-states files are kept, rank 0's optimizer file gives ``optimizer_state.pt``). ``groups``: the
    source's user param groups (``records``, ``step``); ``has_state``: Adam moments exist."""
    tag_dir = f"{tag}_universal"
    files = [TorchObject(os.path.join(tag_dir, os.path.basename(f.relpath)), f.obj) for f in native
             if f.relpath.endswith("_model_states.pt")]
    rank0 = next(f.obj for f in native if os.path.basename(f.relpath).endswith("_optim_states.pt")
                 and "zero_pp_rank_0_" in os.path.basename(f.relpath))
    files.append(TorchObject(os.path.join(tag_dir, "zero", "optimizer_state.pt"),
                             _optimizer_state(rank0["optimizer_state_dict"], stage)))
    files += _param_files(groups, stage, has_state, tag_dir)
    if stage <= 2:  # 0.19.8 also writes an fp32 "fallback" for every other key of `module`
        done = {rec.name for g in groups for rec in g.records}
        files += _fallback_files(ckpt, done, tag_dir)
    return files


def _optimizer_state(osd: dict, stage: int) -> OrderedDict:
    """``zero/optimizer_state.pt``: rank 0's optimizer dict without the sharded tensors, + the param groups."""
    if stage <= 2:
        out = OrderedDict((k, v) for k, v in osd.items() if k not in SHARDED)
        out["param_groups"] = osd["base_optimizer_state"]["param_groups"]
        return out
    inner = osd["optimizer_state_dict"]
    state = OrderedDict((s, OrderedDict([("step", st["step"])])) for s, st in inner["state"].items())
    out = OrderedDict((k, v) for k, v in osd.items() if k not in ("optimizer_state_dict", "fp32_flat_groups"))
    out["optimizer_state_dict"] = {"state": state, "param_groups": inner["param_groups"]}
    out["param_groups"] = inner["param_groups"]
    return out


def _param_files(groups: list, stage: int, has_state: bool, tag_dir: str) -> list[TorchObject]:
    """``zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt`` (+ ``step.pt`` at stage 1/2) of every trainable param."""
    files = []
    for g in groups:
        for rec in g.records:
            base = os.path.join(tag_dir, "zero", rec.name)
            states = [("fp32", rec.value)]
            if has_state:
                states += [("exp_avg", rec.exp_avg), ("exp_avg_sq", rec.exp_avg_sq)]
            for key, pieces in states:  # kept in the dtype the source stores them in (fp32, or bf16 masters)
                t = TensorOut(pieces[0].dtype if pieces else rec.dtype, rec.shape, list(pieces))
                files.append(TorchObject(os.path.join(base, f"{key}.pt"), _param_file(t, stage)))
            if stage <= 2 and has_state:
                step = g.step
                obj = TensorOut(step.dtype, tuple(step.shape), pieces_of(step)) if isinstance(step, LazyTensor) \
                    else step
                files.append(TorchObject(os.path.join(base, "step.pt"), obj))
    return files


def _fallback_files(ckpt: Checkpoint, done: set, tag_dir: str) -> list[TorchObject]:
    """``zero/<name>/fp32.pt`` ({'param': fp32 copy}) of every other module key: frozen weights, buffers."""
    files = []
    byname = ckpt.by_name()
    for rec in ckpt.records:
        if rec.name in done:
            continue
        src = byname.get(rec.tied_to) if rec.kind == "tied" else rec
        if src is None or not src.value:
            continue
        segs = list(src.value) if src.dtype == "float32" else [Cast(list(src.value), src.dtype)]
        t = TensorOut("float32", src.shape, segs)
        files.append(TorchObject(os.path.join(tag_dir, "zero", rec.name, "fp32.pt"), {"param": t}))
    return files
