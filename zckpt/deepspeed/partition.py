"""Building DeepSpeed-format objects for :mod:`zckpt.engine.torchzip`: partition layouts and pickled DeepSpeed classes.

Nothing here reads tensor bytes or imports DeepSpeed. Tensors are :class:`~zckpt.engine.torchzip.TensorOut` whose
segments are slices of the source pieces plus :class:`~zckpt.engine.torchzip.Fill` zeros, so the executor streams them.

The partition math reproduces DeepSpeed 0.19.8 exactly:

ZeRO-1/2 and the BF16 optimizer (``stage_1_and_2.py`` ~430-560, ``bf16_optimizer.py`` ~160-225), per param
group at world size M::

    flat = p0 [pad0] p1 [pad1] ... pk          padI = (-offset) % (16 / gcd(16, lp itemsize)) with
                                               parameter_alignment, else 0; the last param has none
    flat padded at the tail to a multiple of 2*M; rank r owns [r*P, (r+1)*P), P = len / M
    group_paddings[r] = how much of rank r's window lies past the params (tail padding)

ZeRO-3 (``stage3.py`` ``_create_fp16_sub_groups``): every param split in M slices of ceil(n/M) (the last
zero-padded); within each user param group, params are cut into sub-groups, closing one as soon as the sum of
its params' ceil(n/M) reaches ``sub_group_size`` (default 1e9), or at the group's last param.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from zckpt.encoding.safeload import DTYPE_SIZES, EnumValue, Inert, LazyTensor, TorchDevice, TorchDtype
from zckpt.engine.segments import Fill, slice_segments
from zckpt.engine.torchzip import GlobalRef, Reduce, TensorOut, enum_member, plain_object

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
NCCL_START_ALIGNMENT_FACTOR = 2


# ------------------------------------------------------------------------------------------ pickled objects

def torch_size(shape) -> Reduce:
    return Reduce(GlobalRef("torch", "Size"), (tuple(int(d) for d in shape),))


def fragment_address(numel: int, start: int) -> Reduce:
    return plain_object("deepspeed.utils.tensor_fragment", "fragment_address",
                        {"numel": int(numel), "start": int(start)})


def zero_stage_enum(stage: int) -> Reduce:
    return enum_member("deepspeed.runtime.zero.config", "ZeroStageEnum", int(stage))


def default_loss_scaler() -> Reduce:
    """What DeepSpeed's bf16/fp32 ZeRO optimizers hold: a static ``LossScaler`` of scale 1."""
    return plain_object("deepspeed.runtime.fp16.loss_scaler", "LossScaler", {"cur_scale": 1.0, "dynamic": False})


class Converter:
    """Turns metadata read by :mod:`zckpt.encoding.safeload` back into objects torchzip can write.

    Lazy tensors become TensorOut copying their bytes (the same storage maps to the same TensorOut, so
    aliases stay aliases), inert DeepSpeed objects are re-emitted under their original class name.

    Each container is converted once (``done``: by identity): a value the pickle shares stays shared, so a pickle of
    a few hundred bytes whose tuples each hold the one before twice (2**40 paths through 40 objects) converts in 40
    steps rather than forever, and a list that holds itself is converted, not recursed into without end.
    """

    def __init__(self):
        self.memo: dict = {}
        self.done: dict = {}  # id of a source container -> (its conversion, the source kept alive)

    def tensor(self, t: LazyTensor) -> TensorOut:
        from zckpt.deepspeed.model import pieces_of
        key = (t.storage.path, t.storage.key, t.storage_offset, tuple(t.shape), tuple(t.stride), t.dtype)
        out = self.memo.get(key)
        if out is None:
            out = TensorOut(t.dtype, tuple(t.shape), pieces_of(t))
            self.memo[key] = out
        return out

    def __call__(self, obj):
        if isinstance(obj, LazyTensor):
            return self.tensor(obj)
        if isinstance(obj, EnumValue):
            module, name = obj._qualname.rsplit(".", 1)
            return enum_member(module, name, int(obj))
        if isinstance(obj, TorchDtype):
            return GlobalRef("torch", str(obj))
        if isinstance(obj, TorchDevice):
            return Reduce(GlobalRef("torch", "device"), (str(obj),))
        if not isinstance(obj, (Inert, dict, list, tuple)):
            return obj
        got = self.done.get(id(obj))
        if got is not None:
            return got[0]
        if isinstance(obj, Inert):
            module, name = obj._qualname.rsplit(".", 1)
            state: dict = {}
            out = plain_object(module, name, state)
            self.done[id(obj)] = (out, obj)
            state.update((k, self(v)) for k, v in obj.__dict__.items() if not k.startswith("_"))
            return out
        if isinstance(obj, dict):  # (an OrderedDict stays one)
            out = OrderedDict() if isinstance(obj, OrderedDict) else {}
            self.done[id(obj)] = (out, obj)
            out.update((k, self(v)) for k, v in obj.items())
            return out
        if isinstance(obj, list):
            out = []
            self.done[id(obj)] = (out, obj)
            out.extend(self(v) for v in obj)
            return out
        out = tuple(self(v) for v in obj)  # (a tuple is made whole: one that holds itself goes through a list)
        self.done[id(obj)] = (out, obj)
        return out


# ------------------------------------------------------------------------------------------ segments

def padded(segs: list, want: int, dtype: str) -> list:
    have = sum(s.numel for s in segs)
    return segs + [Fill(want - have, dtype)] if want > have else segs


# ------------------------------------------------------------------------------------------ ZeRO-1/2 layout

@dataclass
class FlatGroupLayout:
    """One optimizer param group of ZeRO-1/2 (or the BF16 optimizer) at world size ``ws``."""

    numels: list[int]
    param_paddings: list[int]  # param_alignment_paddings
    offsets: list[int]  # start of each param in the flat group
    padded_numel: int  # params + alignment paddings (no tail)
    partition: int  # P
    ws: int

    def group_padding(self, rank: int) -> int:
        left = rank * self.partition
        if self.padded_numel <= left:
            return self.partition
        if self.padded_numel < left + self.partition:
            return left + self.partition - self.padded_numel
        return 0

    def slice_map(self, rank: int) -> list[tuple[int, int, int]]:
        """(param index, numel, start inside the partition) for params intersecting ``rank``."""
        lo, hi = rank * self.partition, (rank + 1) * self.partition
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append((i, b - a, a - lo))
        return out

    def flat(self, per_param: list[list], dtype: str = "float32") -> list:
        """Segments of the whole padded flat group from each param's segments."""
        segs = []
        for segs_i, pad in zip(per_param, self.param_paddings):
            segs.extend(segs_i)
            if pad:
                segs.append(Fill(pad, dtype))
        return padded(segs, self.partition * self.ws, dtype)


def flat_group_layout(numels: list[int], ws: int, lp_itemsize: int, parameter_alignment: bool) -> FlatGroupLayout:
    align = 16 // math.gcd(16, lp_itemsize) if parameter_alignment else 1
    offsets, paddings, cur = [], [], 0
    for i, n in enumerate(numels):
        offsets.append(cur)
        cur += n
        pad = 0 if i == len(numels) - 1 else (-cur) % align
        paddings.append(pad)
        cur += pad
    a = NCCL_START_ALIGNMENT_FACTOR * ws
    total = int(math.ceil(cur / a)) * a
    return FlatGroupLayout(list(numels), paddings, offsets, cur, total // ws, ws)


# ------------------------------------------------------------------------------------------ ZeRO-3 layout

def zero3_part(numel: int, ws: int) -> int:
    return math.ceil(numel / ws)


def zero3_sub_groups(numels: list[int], ws: int, sub_group_size: int | None) -> list[list[int]]:
    """Indices of one user group's params, cut into sub-groups as ``_create_fp16_sub_groups`` does."""
    parts = [zero3_part(n, ws) for n in numels]
    if not numels:
        return []
    if sub_group_size is None or sub_group_size >= sum(parts):
        return [list(range(len(numels)))]
    groups, cur, size = [], [], 0
    for i, p in enumerate(parts):
        cur.append(i)
        size += p
        if size >= sub_group_size or i == len(numels) - 1:
            groups.append(cur)
            cur, size = [], 0
    return groups


def zero3_rank_slice(segs: list, numel: int, ws: int, rank: int, dtype: str) -> list:
    """Rank ``rank``'s ceil(n/ws) slice of a parameter (zero padded at the end)."""
    part = zero3_part(numel, ws)
    take = max(0, min(part, numel - rank * part))
    return padded(slice_segments(segs, rank * part, take) if take else [], part, dtype)


def itemsize(dtype: str) -> int:
    return DTYPE_SIZES[dtype]


@dataclass
class TorchObject:
    """One torch file of a target layout as its object tree (:class:`TensorOut` leaves), not yet pickled: the
    reshard plan lays each one out once (:func:`zckpt.engine.torchzip.plan_archive`) or, on load, reads it."""

    relpath: str
    obj: object
