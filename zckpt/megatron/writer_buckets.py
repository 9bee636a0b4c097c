"""Megatron-Core's ``dp_reshardable`` optimizer layout written: the distributed optimizer's flat DDP buckets per
model-parallel rank, cut into each data-parallel rank's shards, exactly as megatron-core 0.16.1 saves them.

The input is a ``fully_reshardable`` state (per parameter ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``,
stacked layers under one key), which :func:`to_dp_reshardable` replaces by what
``DistributedOptimizer.sharded_state_dict(..., 'dp_reshardable')`` saves (``distrib_optimizer.py``,
``sharded_param_state_dp_reshardable``, ``state_dict``; the buffer from ``param_and_grad_buffer.py``,
``_ParamAndGradBuffer.__init__``):

- per model-parallel rank ``G = pp_rank * tp + tp_rank`` (``dp_group_idx_G``) and bucket ``B``, three 1-D fp32
  tensors ``optimizer.distributed.dp_group_idx_G.gbuf_idx_0.dtype_(P, G).bucket_idx_B.{param,exp_avg,exp_avg_sq}``
  of the bucket's unpadded size. The bucket holds the rank's trainable parameters (its TP shard of each, in the
  model's ``named_parameters()`` order, :mod:`zckpt.megatron.buckets`) in reverse order, each start padded to 64
  elements; a bucket closes once it holds ``bucket_size`` elements (only on the first pipeline stage, and only
  with ``overlap_grad_reduce``), and a tied embedding's copy (``shared_embedding``, pipeline > 1) has a bucket of
  its own. The bucket is padded to a multiple of lcm(dp, 128) (and 2^16 with ``pad_buckets_for_high_nccl_busbw``)
  and split into dp equal shards; each shard is stored as one chunk per parameter fragment and per gap (the gaps'
  bytes are zeros here; megatron-core saves uninitialised memory there and never reads it back);
- per ``G``: the objects ``...optimizer`` (param groups with Adam's step, no params), ``...per_bucket_numel`` and
  ``...per_bucket_numel_unpadded`` (which megatron-core's load compares with its own buffers).

The facts this depends on that the model does not hold are the target run's DDP settings: the data-parallel size
(``--dp``) and ``overlap_grad_reduce``, ``bucket_size``, ``grad_reduce_in_fp32``, ``pad_buckets_for_high_nccl_busbw``
(megatron-core's ``DistributedDataParallelConfig`` names), each from ``--ddp-config`` or the source's Megatron-LM
args (``overlap_grad_reduce``, ``ddp_bucket_size``, ``accumulate_allreduce_grads_in_fp32``,
``ddp_pad_buckets_for_high_nccl_busbw``), or refused in one line naming it. Shapes megatron-core itself cannot save
or load are refused: a data-parallel rank whose shard of a bucket holds no parameter (``assert bucket_state,
'empty bucket encountered'``), a gap that would run past the bucket's end.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from zckpt.encoding.allowlist import TorchDtype
from zckpt.engine.dcplayout import ChunkedOut, Whole
from zckpt.engine.segments import Fill, slice_segments
from zckpt.engine.torchzip import TensorOut
from zckpt.errors import InvalidArgument, UnsupportedLayout
from zckpt.megatron import buckets

OPTIM_STATE = "optimizer.state."
STATES = ("param", "exp_avg", "exp_avg_sq")
LAYERS = "decoder.layers."
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
ALIGN = 64  # _pad_start_of_param_if_needed
#: megatron-core DistributedDataParallelConfig field -> (Megatron-LM's arg, type)
DDP_KEYS = {"overlap_grad_reduce": ("overlap_grad_reduce", bool), "bucket_size": ("ddp_bucket_size", int),
            "grad_reduce_in_fp32": ("accumulate_allreduce_grads_in_fp32", bool),
            "pad_buckets_for_high_nccl_busbw": ("ddp_pad_buckets_for_high_nccl_busbw", bool)}
_BUCKET_DTYPE = re.compile(r"\.dtype_\(torch\.(\w+), torch\.(\w+)\)\.bucket_idx_")
HINT = "state the target run's DDP settings: --ddp-config overlap_grad_reduce=false,grad_reduce_in_fp32=true,..."


def parse_ddp_config(text) -> dict:
    """``KEY=VALUE[,KEY=VALUE]`` (megatron-core's ``DistributedDataParallelConfig`` names, :data:`DDP_KEYS`) -> a
    dict of typed values; ``bucket_size=none`` is megatron-core's default size. Anything else: exit 2."""
    if text is None or isinstance(text, dict):
        return dict(text or {})
    out = {}
    for item in filter(None, (x.strip() for x in str(text).split(","))):
        key, sep, val = item.partition("=")
        key, val = key.strip(), val.strip().lower()
        if not sep or key not in DDP_KEYS:
            raise InvalidArgument(f"--ddp-config: {item!r} is not KEY=VALUE with KEY one of {', '.join(DDP_KEYS)}")
        kind = DDP_KEYS[key][1]
        if kind is bool:
            if val not in ("true", "false"):
                raise InvalidArgument(f"--ddp-config: {key} is true or false, not {val!r}")
            out[key] = val == "true"
        elif val == "none":
            out[key] = None
        elif val.isdigit() and int(val) > 0:
            out[key] = int(val)
        else:
            raise InvalidArgument(f"--ddp-config: {key} is a positive number of elements or none, not {val!r}")
    return out


@dataclass
class Ddp:
    """The target run's DDP facts the buckets depend on, and where each came from."""

    dp: int
    bucket_size: int | None  # None: one bucket (per stage; a shared embedding's own)
    param_dtype: str
    grad_dtype: str
    pad_busbw: bool
    said: dict = field(default_factory=dict)  # fact -> "--ddp-config" / "args" / "the source's buckets"
    stated: dict = field(default_factory=dict)  # DDP_KEYS field -> the value as stated (bucket_size None: default)

    def args(self, tp: int, pp: int, source_args: dict) -> dict:
        """What a Megatron-LM save at this shape holds of it in its args (Megatron-LM's names): ``world_size``,
        ``data_parallel_size`` and the DDP settings the buckets were laid out with, so that the output converted
        again needs no --ddp-config; ``ddp_num_buckets`` cleared where a stated bucket size replaced it. (Megatron-LM
        does not take these from a checkpoint it loads: a resume at another DP reads its own flags; only its rerun
        state, which zckpt does not write, is kept for the same sizes.)"""
        out = {"world_size": tp * pp * self.dp, "data_parallel_size": self.dp}
        out.update({DDP_KEYS[k][0]: v for k, v in self.stated.items()})
        if source_args.get("ddp_num_buckets") is not None:
            out["ddp_num_buckets"] = None
        return out

    def summary(self) -> dict:
        """--json's ``ddp``: the facts the buckets were laid out for."""
        return {"bucket_size": self.bucket_size, "grad_dtype": self.grad_dtype,
                "pad_buckets_for_high_nccl_busbw": self.pad_busbw, "from": dict(self.said)}


def ddp_facts(args: dict, given: dict, dp, param_dtype: str, path: str, source_keys=()) -> Ddp:
    """The DDP facts for the buckets (module docstring): ``given`` (``--ddp-config``) first, then the source's
    Megatron-LM ``args``; the grad dtype also from a dp_reshardable source's bucket keys (``source_keys``)."""
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise InvalidArgument("--layout dp_reshardable needs --dp N, the data-parallel size the Megatron-LM job "
                              "resumes at (the buckets' padding and each rank's shard depend on it)",
                              hint="add --dp N")
    for key, bad in (("context_parallel_size", lambda v: v not in (None, 1)),
                     ("num_distributed_optimizer_instances", lambda v: v not in (None, 1)),
                     ("overlap_param_gather_with_optimizer_step", lambda v: v is True),
                     ("use_torch_fsdp2", lambda v: v is True), ("use_megatron_fsdp", lambda v: v is True)):
        if bad(args.get(key)):
            raise UnsupportedLayout(f"the args set {key}={args[key]!r}: zckpt writes dp_reshardable buckets for "
                                    "one distributed-optimizer instance without context parallelism", path=path,
                                    hint="write --layout fully_reshardable")
    said, value = {}, {}
    for key, (arg, _) in DDP_KEYS.items():
        if key in given:
            value[key], said[key] = given[key], "--ddp-config"
        elif arg in args:
            value[key], said[key] = args[arg], "args"
    if "grad_reduce_in_fp32" not in value:
        dts = {m.group(2) for k in source_keys if (m := _BUCKET_DTYPE.search(k))}
        if len(dts) == 1:
            value["grad_reduce_in_fp32"], said["grad_reduce_in_fp32"] = dts.pop() == "float32", "the source's buckets"
    need = ["overlap_grad_reduce", "grad_reduce_in_fp32", "pad_buckets_for_high_nccl_busbw"]
    missing = [k for k in need if value.get(k) is None]
    if missing:
        raise UnsupportedLayout(f"the source does not say the target run's {', '.join(missing)} (megatron-core's "
                                "DistributedDataParallelConfig), on which the dp_reshardable buckets depend",
                                path=path, hint=HINT)
    size = None
    if value["overlap_grad_reduce"]:  # DistributedDataParallel.__init__ / Megatron-LM get_model
        if "bucket_size" not in given and args.get("ddp_num_buckets") is not None:
            raise UnsupportedLayout(f"the args set ddp_num_buckets={args['ddp_num_buckets']!r}: state the bucket "
                                    "size", path=path, hint="--ddp-config bucket_size=N")
        size = value.get("bucket_size") or max(40000000, 1000000 * dp)
    grad = "float32" if value["grad_reduce_in_fp32"] else param_dtype
    stated = {k: (bool(value[k]) if k != "bucket_size" else value.get("bucket_size")) for k in DDP_KEYS}
    return Ddp(dp, size, param_dtype, grad, bool(value["pad_buckets_for_high_nccl_busbw"]), said, stated)


@dataclass
class _Param:
    """What the buckets need of one parameter: name, global shape, its state's segments (model space)."""

    name: str
    shape: tuple
    kind: str = "trainable"
    tied_to: str | None = None
    state: dict = field(default_factory=dict)  # "param" / "exp_avg" / "exp_avg_sq" -> segments

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _params(state: dict, tied: bool) -> list[_Param]:
    """Per parameter (stacked layers split) its state's segments, from the ``fully_reshardable`` keys."""
    out: dict[str, _Param] = {}
    for name in STATES:
        pre = f"{OPTIM_STATE}{name}."
        for key, t in state.items():
            if not key.startswith(pre):
                continue
            model_key = key[len(pre):]
            rest = model_key[len(LAYERS):] if model_key.startswith(LAYERS) else None
            if rest is not None and not rest.split(".", 1)[0].isdigit():  # stacked: [layers, ...]
                per = math.prod(t.shape[1:])
                for i in range(t.shape[0]):
                    p = out.setdefault(f"{LAYERS}{i}.{rest}", _Param(f"{LAYERS}{i}.{rest}", tuple(t.shape[1:])))
                    p.state[name] = slice_segments(t.segments, i * per, per)
            else:
                out.setdefault(model_key, _Param(model_key, tuple(t.shape))).state[name] = list(t.segments)
    params = list(out.values())
    if tied and EMBEDDING in out and OUTPUT not in out:
        params.append(_Param(OUTPUT, out[EMBEDDING].shape, "tied", EMBEDDING))
    return params


def _local(p, t: int, tp: int, segs: list) -> list:
    """TP rank ``t``'s shard of a parameter's state (row-major, as its buffer holds it): the inverse of
    :mod:`zckpt.megatron.buckets`'s gather (rows; columns; SwiGLU's [gate_t; up_t]; norms whole)."""
    short = buckets.short_name(p.name)
    if tp == 1 or short not in buckets.ROWS | buckets.FC1 | buckets.COLS:
        return segs
    n = p.numel // tp
    if short in buckets.COLS:
        rows = p.shape[0]
        width = p.numel // rows // tp
        return [s for r in range(rows) for s in slice_segments(segs, r * width * tp + t * width, width)]
    if short in buckets.FC1 and p.swiglu:
        half, lh = p.numel // 2, n // 2
        return [s for h in range(2) for s in slice_segments(segs, h * half + t * lh, lh)]
    return slice_segments(segs, t * n, n)


def _pad(n: int, div: int) -> int:
    return -(-n // div) * div


def layout(params: list, tp: int, bucket_size, first_stage: bool, div: int, path: str) -> list[dict]:
    """One model-parallel rank's buckets (``params``: its stage's, registration order): each {"params": [(param,
    start, end)] in the bucket, "unpadded", "padded"}; ``_ParamAndGradBuffer.__init__``'s loop, line for line."""
    size = bucket_size if first_stage else None  # DistributedDataParallel: no bucketing past the first stage
    out, cur, start_of_bucket, cursor, end = [], [], 0, 0, 0

    def close(at: int) -> int:
        nonlocal cur, start_of_bucket
        padded_end = _pad(at, div)
        out.append({"params": cur, "unpadded": at - start_of_bucket, "padded": padded_end - start_of_bucket})
        cur, start_of_bucket = [], padded_end
        return padded_end

    for p in reversed(params):
        start = _pad(cursor, ALIGN)
        if p.shared and cur:
            start = close(start)
        end = start + buckets.local_numel(p, tp, path)
        cur.append((p, start - start_of_bucket, end - start_of_bucket))
        cursor = close(end) if (size is not None and end - start_of_bucket >= size) or p.shared else end
    if cur:
        close(end)
    return out


def _shards(bucket: dict, dp: int, g: int, b: int, path: str) -> list[tuple[int, int, object, int]]:
    """The bucket's chunks over the data-parallel ranks: (start, end, param or None for a gap, offset in the
    param's shard), as ``sharded_param_state_dp_reshardable`` cuts them; refused where megatron-core cannot."""
    unpadded, per = bucket["unpadded"], bucket["padded"] // dp
    out = []
    for r in range(dp):
        lo, hi = r * per, (r + 1) * per
        frags = [(max(s, lo), min(e, hi), p, max(s, lo) - s) for p, s, e in bucket["params"] if max(s, lo) < min(e, hi)]
        if not frags:
            raise UnsupportedLayout(f"data-parallel rank {r} of {dp} holds no parameter of model-parallel rank {g}'s "
                                    f"bucket {b} ({unpadded} elements): megatron-core cannot save or load that "
                                    "('empty bucket encountered')", path=path, hint="choose a smaller --dp")
        for i in range(-1, len(frags)):
            cur_end = lo if i == -1 else frags[i][1]
            nxt = hi if i == len(frags) - 1 else frags[i + 1][0]
            if nxt != cur_end and cur_end < unpadded:
                if nxt > unpadded:
                    raise UnsupportedLayout(f"model-parallel rank {g}'s bucket {b}: megatron-core would save a gap "
                                            f"[{cur_end}, {nxt}) past the bucket's {unpadded} elements", path=path,
                                            hint="write --layout fully_reshardable")
                out.append((cur_end, nxt, None, 0))
            if i >= 0:
                out.append(frags[i])
    return out


def to_dp_reshardable(state: dict, swiglu: bool, tied: bool, args: dict, tp: int, pp: int, ddp: Ddp, groups: list,
                      path: str) -> list[str]:
    """Replace ``state``'s ``fully_reshardable`` optimizer tensors by the ``dp_reshardable`` buckets and objects
    (module docstring), in place; returns notes (the buckets per rank, where each DDP fact came from)."""
    params = _params(state, tied)
    for p in params:
        if p.kind == "trainable" and set(p.state) != set(STATES):
            raise UnsupportedLayout(f"'{p.name}': not every one of {', '.join(STATES)} is in the state", path=path)
    by_name = {p.name: p for p in params}
    per_stage = buckets.stages(params, pp, swiglu, args, path)
    div = math.lcm(ddp.dp, 128, 2 ** 16 if ddp.pad_busbw else 1)
    dkey = f"dtype_(torch.{ddp.param_dtype}, torch.{ddp.grad_dtype})"
    dtypes = (TorchDtype(ddp.param_dtype), TorchDtype(ddp.grad_dtype))
    for key in [k for k in state if k.startswith(OPTIM_STATE)]:
        del state[key]
    counts = []
    for s, stage in enumerate(per_stage):
        for t in range(tp):
            g = s * tp + t
            bks = layout(stage, tp, ddp.bucket_size, s == 0, div, path)
            counts.append(len(bks))
            pre = f"optimizer.distributed.dp_group_idx_{g}."
            for b, bucket in enumerate(bks):
                chunks = _shards(bucket, ddp.dp, g, b, path)
                for name in STATES:
                    parts = []
                    for lo, hi, p, off in chunks:
                        if p is None:
                            segs = [Fill(hi - lo, "float32")]
                        else:
                            src = by_name[p.rec.tied_to] if p.rec.kind == "tied" else p.rec
                            segs = slice_segments(_local(p, t, tp, src.state[name]), off, hi - lo)
                        parts.append(((lo,), (hi - lo,), TensorOut("float32", (hi - lo,), segs)))
                    key = f"{pre}gbuf_idx_0.{dkey}.bucket_idx_{b}.{name}"
                    state[key] = ChunkedOut("float32", (bucket["unpadded"],), parts)
            state[f"{pre}optimizer/shard_0_1"] = Whole([{"param_groups": groups}])
            state[f"{pre}per_bucket_numel/shard_0_1"] = Whole([[{dtypes: [bk["padded"] for bk in bks]}]])
            state[f"{pre}per_bucket_numel_unpadded/shard_0_1"] = Whole([[{dtypes: [bk["unpadded"] for bk in bks]}]])
    said = ", ".join(f"{k} from {v}" for k, v in ddp.said.items())
    return [f"dp_reshardable for dp {ddp.dp}: buckets per model-parallel rank {counts} (bucket size "
            f"{ddp.bucket_size or 'unbounded'}, grads {ddp.grad_dtype}); {said}"]


def lay_out_common(state: dict, common: dict, args: dict, swiglu: bool, tied: bool, tp: int, pp: int, dp, ddp_config,
                   param_dtype: str, path: str) -> tuple[list[str], Ddp]:
    """``--layout dp_reshardable`` for a save folder built in model space (:mod:`zckpt.megatron.from_hf`): the
    buckets in place of ``state``'s optimizer tensors, ``common`` (its param groups) and ``args`` saying so, in
    place; the notes and the DDP facts."""
    ddp = ddp_facts(args, parse_ddp_config(ddp_config), dp, param_dtype, path)
    groups = common["optimizer"]["optimizer"]["param_groups"]
    notes = to_dp_reshardable(state, swiglu, tied, args, tp, pp, ddp, groups, path)
    common["optimizer"] = {"param_state_sharding_type": "dp_reshardable"}
    content = {k: v for k, v in (common.get("content_metadata") or {}).items()
               if k != "distrib_optim_fully_reshardable_mem_efficient"}
    common["content_metadata"] = {**content, "distrib_optim_sharding_type": "dp_reshardable"}
    args["dist_ckpt_optim_fully_reshardable"] = False
    args.update(ddp.args(tp, pp, args))
    return notes, ddp
