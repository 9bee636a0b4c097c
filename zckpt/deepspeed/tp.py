"""Tensor parallel (DeepSpeed AutoTP, ``tensor_parallel.autotp_size``) over ZeRO-1/2: merged by the checkpoint's
own partition metadata.

A tag folder of tp ranks (and dp ranks) holds::

    mp_rank_{t:02d}_model_states.pt                  rank t's shards in ``module``, shard shapes in param_shapes,
                                                     mp_world_size = tp, universal_checkpoint_info (below)
    [bf16_]zero_pp_rank_{r}_mp_rank_{t:02d}_optim_states.pt    ZeRO-1/2 partitions of rank t's shards

``universal_checkpoint_info['affine_map']`` (format version 1, ``deepspeed/checkpoint/affine.py``) says, per
parameter name pattern, the full tensor's ``logical_shape`` and for each tp rank the ``pieces`` it holds:
``full.as_strided(shape, source_strides, source_offset) == shard.as_strided(shape, dest_strides, dest_offset)``,
``locations`` = the ranks holding that piece (all of them for a replicated parameter). Each tp rank is read with
the ZeRO-1/2 reader (its own files), then every record's pieces are re-ordered into the full tensor. A name with
no pattern, a piece with a scale, pieces that overlap or leave a gap, are refused. Merge, info and verify read it;
reshard does not.
"""

from __future__ import annotations

import dataclasses
import math
import re

from zckpt.deepspeed.discover import Location
from zckpt.deepspeed.model import Checkpoint, Piece, TensorRecord, precision_of
from zckpt.errors import CorruptFile, IncompleteCheckpoint, UnsupportedLayout

REFUSAL = "tensor-parallel (AutoTP) checkpoint: zckpt merges it but does not re-partition tensor parallelism"


def affine_map(ms0: dict) -> dict | None:
    uci = ms0.get("universal_checkpoint_info")
    am = uci.get("affine_map") if isinstance(uci, dict) else None
    return am if isinstance(am, dict) and isinstance(am.get("params"), dict) else None


def build(loc: Location, model_states: list[dict], optim_states: list[dict]) -> Checkpoint:
    from zckpt.deepspeed import zero12

    pairs = sorted(zip(loc.model_files, model_states), key=lambda p: p[0].mp_rank)
    ms0 = pairs[0][1]
    tp = int(ms0.get("mp_world_size") or 1)
    am = affine_map(ms0)
    path = loc.tag_dir
    if am is None:
        raise UnsupportedLayout(f"tensor-parallel checkpoint (mp_world_size={tp}) without AutoTP partition "
                                "metadata (universal_checkpoint_info.affine_map)", path=path)
    if am.get("version") != 1:
        raise UnsupportedLayout(f"AutoTP affine map version {am.get('version')!r}; zckpt reads version 1", path=path)
    bad = (ms0.get("universal_checkpoint_info") or {}).get("autotp_unsupported_parameter_patterns")
    if bad:
        raise UnsupportedLayout(f"AutoTP marks parameters it cannot convert: {', '.join(list(bad)[:3])}", path=path)
    dims = ms0.get("checkpoint_parallel_dimensions") or {}
    if int(dims.get("pp_degree") or 1) != 1 or int(dims.get("tp_degree") or tp) != tp:
        raise UnsupportedLayout(f"model parallelism {dims} is not tensor parallelism alone", path=path)
    if [f.mp_rank for f, _ in pairs] != list(range(tp)):
        raise CorruptFile(f"mp_world_size={tp} but model-states files of mp ranks "
                          f"{[f.mp_rank for f, _ in pairs]}", path=path)
    ranks = []
    for t, (mf, ms) in enumerate(pairs):
        mine = [(f, st) for f, st in zip(loc.optim_files, optim_states) if f.mp_rank == t]
        sub = dataclasses.replace(loc, model_files=[mf], optim_files=[f for f, _ in mine])
        if not mine:
            raise IncompleteCheckpoint(f"no *_optim_states.pt files of mp rank {t}", path=path)
        osd = mine[0][1].get("optimizer_state_dict") or {}
        if osd.get("zero_stage") is not None and int(osd["zero_stage"]) not in (1, 2):
            raise UnsupportedLayout("tensor-parallel checkpoint that is not ZeRO-1/2", path=path)
        ranks.append(zero12.build(sub, [ms], [st for _, st in mine]))
    patterns = [(re.compile(p), p) for p in am["params"]]
    records = []
    for rec in ranks[0].records:
        if rec.kind in ("tied", "buffer"):
            records.append(rec)
            continue
        hits = [p for rx, p in patterns if rx.match(rec.name)]
        if len(hits) != 1:
            raise UnsupportedLayout(f"AutoTP affine map has {len(hits)} entries for '{rec.name}'", path=path)
        records.append(_merge_record(am["params"][hits[0]], [r.by_name().get(rec.name) for r in ranks], path))
    byname = {r.name: r for r in records}
    for i, rec in enumerate(records):  # tied aliases take the full shape of their source
        if rec.kind == "tied" and rec.tied_to in byname:
            records[i] = dataclasses.replace(rec, shape=byname[rec.tied_to].shape)
    base = ranks[0]
    return Checkpoint(loc, base.stage, base.flavour, precision_of(ms0, ms0.get("module")), base.world_size,
                      records, base.groups, ms0, optim_states, model_states, offload=base.offload,
                      parallel="tensor", reshard_refusal=REFUSAL)


def _merge_record(entry: dict, per_rank: list[TensorRecord | None], path: str) -> TensorRecord:
    rec0 = per_rank[0]
    if any(r is None or r.kind != rec0.kind for r in per_rank):
        raise CorruptFile(f"'{rec0.name}' is not held alike by every tensor-parallel rank", path=path)
    shape = tuple(int(d) for d in entry["logical_shape"])
    runs = _runs(entry, [r.shape for r in per_rank], shape, rec0.name, path)

    def full(attr):
        lists = [getattr(r, attr) for r in per_rank]
        if not all(lists):
            return []
        out = []
        for t, start, n in runs:
            out += _slice(lists[t], start, n)
        return out

    return dataclasses.replace(rec0, shape=shape, value=full("value"), exp_avg=full("exp_avg"),
                               exp_avg_sq=full("exp_avg_sq"))


def _slice(pieces: list[Piece], start: int, length: int) -> list[Piece]:
    """Elements [start, start+length) of the concatenation of ``pieces``."""
    out, pos, end = [], 0, start + length
    for p in pieces:
        lo, hi = max(start, pos), min(end, pos + p.numel)
        if lo < hi:
            size = p.nbytes // p.numel
            out.append(Piece(p.path, p.offset + (lo - pos) * size, hi - lo, p.dtype))
        pos += p.numel
        if pos >= end:
            break
    return out


def _runs(entry: dict, shard_shapes: list[tuple], shape: tuple, name: str, path: str) -> list[tuple[int, int, int]]:
    """(tp rank, start in its shard, count) runs covering the full tensor in row-major order."""
    import numpy as np

    numel = math.prod(shape)
    owner = np.full(numel, -1, dtype=np.int32)
    pos = np.zeros(numel, dtype=np.int64)
    ranks = entry.get("ranks") or {}
    for t, shard_shape in enumerate(shard_shapes):
        r = ranks.get(str(t)) or ranks.get(t)
        if not isinstance(r, dict) or tuple(r.get("shard_shape") or ()) != tuple(shard_shape):
            raise CorruptFile(f"'{name}': affine map and rank {t}'s shard shape {list(shard_shape)} disagree",
                              path=path)
        snumel = math.prod(shard_shape)
        for piece in r.get("pieces") or []:
            if piece.get("scale", 1) not in (1, 1.0, None):
                raise UnsupportedLayout(f"'{name}': a scaled AutoTP piece (scale {piece['scale']})", path=path)
            if min(piece.get("locations") or [t]) != t:
                continue  # a replicated piece: read from the lowest rank that holds it
            fi, di = (_index(piece["shape"], *piece[k]) for k in ("source", "dest"))
            if fi.size and (fi.min() < 0 or fi.max() >= numel or di.min() < 0 or di.max() >= snumel):
                raise CorruptFile(f"'{name}': an AutoTP piece lies outside its tensor", path=path)
            if (owner[fi] != -1).any():
                raise CorruptFile(f"'{name}': AutoTP pieces overlap", path=path)
            owner[fi] = t
            pos[fi] = di
    if (owner == -1).any():
        raise CorruptFile(f"'{name}': AutoTP pieces leave {int((owner == -1).sum())} elements uncovered", path=path)
    if numel == 0:
        return []
    cut = np.flatnonzero((owner[1:] != owner[:-1]) | (pos[1:] != pos[:-1] + 1)) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [numel]))
    return [(int(owner[a]), int(pos[a]), int(b - a)) for a, b in zip(starts, ends)]


def _index(shape, offset, strides):
    import numpy as np

    idx = np.full([int(d) for d in shape], int(offset), dtype=np.int64)
    for axis, (n, s) in enumerate(zip(shape, strides)):
        view = [1] * len(shape)
        view[axis] = int(n)
        idx += np.arange(int(n), dtype=np.int64).reshape(view) * int(s)
    return idx.ravel()
