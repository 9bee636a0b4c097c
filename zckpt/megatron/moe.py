"""Megatron-Core mixture-of-experts layers (``--num-experts``, the local spec's ``SequentialMLP``) as the reader's
records, and the proof that every expert is there (:mod:`zckpt.state.experts`).

What megatron-core (0.16, 0.19) saves for an MoE layer (``SequentialMLP.sharded_state_dict``, ``TopKRouter``)::

    decoder.layers.mlp.router.weight                        [L, E, H]       stacked like any layer parameter
    decoder.layers.mlp.experts.experts.linear_fc1.weight    [L, E, 2F, H]   an expert axis after the layer axis;
    decoder.layers.mlp.experts.experts.linear_fc2.weight    [L, E, H, F]    each expert-parallel rank writes its own
                                                                            experts (global index = ep rank x E/ep
                                                                            + local index), SwiGLU's gate and up
                                                                            halves as separate chunks
    decoder.layers.<i>.mlp.experts.experts.linear_fc1.weight   [E, 2F, H]   per-layer keys (``--moe-layer-freq``
                                                                            with dense layers: non_homogeneous)

Each expert becomes one record per parameter, ``decoder.layers.<i>.mlp.experts.experts.<e>.<param>`` (``<e>`` the
global expert index: Megatron's own name for one expert, its ``singleton_local_shards`` key), a slice of the
stacked tensor (and, ``fully_reshardable``, of ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``, sharded the
same way). ``dp_reshardable`` state of the experts is in the second optimizer's buckets
(``chained_1.optimizer.distributed.dp_group_idx_<g>``, ``g`` the rank in the expert tensor x expert x pipeline
group), placed by :mod:`zckpt.megatron.buckets`.

Coverage: every MoE layer (a layer with a router) holds experts 0..E-1 exactly once, each with its value and (when
the checkpoint keeps optimizer state) its master and both moments, and its router: :func:`coverage` describes the
layers for :func:`zckpt.state.experts.check`; a checkpoint whose ``.metadata`` does not tile an expert, or names a
data file that is gone, is refused by :func:`diagnose` in one line naming the layer and the expert.
"""

from __future__ import annotations

import bisect
import math
import re

from zckpt.encoding import dcpmeta, safeload
from zckpt.errors import CorruptFile, IncompleteCheckpoint, UnsupportedLayout
from zckpt.state import experts

LAYERS = "decoder.layers."
MARK = "mlp.experts.experts."  # SequentialMLP's sharded prefix (its experts' own "local_experts.<j>." replaced)
_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.experts\.(\d+)\.(.+)$")
_ROUTER = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.router\.")
_STATE = re.compile(r"^optimizer\.state\.(param|exp_avg|exp_avg_sq)\.(.+)$")
_BUCKET = re.compile(r"^chained_1\.optimizer\.distributed\.dp_group_idx_(\d+)\.")
_SHARED = "mlp.shared_experts."


def is_expert_key(key: str) -> bool:
    """A model key of SequentialMLP's experts (stacked or per layer)."""
    return key.startswith(LAYERS) and MARK in key


_BUFFER = re.compile(r"^decoder\.layers\.\d+\.mlp\.router\.(expert_bias|local_tokens_per_expert)$")


def is_buffer(name: str) -> bool:
    """A router's persistent buffer (TopKRouter's ``expert_bias``, aux-loss-free balancing), not a parameter."""
    return bool(_BUFFER.match(name))


def expert_of(name: str) -> tuple[int, int, str] | None:
    """(layer, expert, parameter) of a record name, or None."""
    m = _EXPERT.match(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def _axes(key: str) -> tuple[bool, int | None]:
    """(stacked, the layer of a per-layer key)."""
    head = key[len(LAYERS):].split(".", 1)[0]
    return (False, int(head)) if head.isdigit() else (True, None)


def entries(key: str, shape: tuple, num_layers, num_experts, path: str) -> list[tuple]:
    """(record name, key, layer, shape, flat start, numel) of each (layer, expert) of an expert key."""
    stacked, layer = _axes(key)
    axes = 2 if stacked else 1
    if len(shape) <= axes:
        raise CorruptFile(f"'{key}' has size {list(shape)}: not [layers, experts, ...] as SequentialMLP saves it",
                          path=path)
    if stacked and num_layers is not None and shape[0] != num_layers:
        raise UnsupportedLayout(f"'{key}' has size {list(shape)}: not stacked over the {num_layers} layers the args "
                                "name", path=path)
    n = shape[axes - 1]
    if num_experts is not None and n != num_experts:
        raise CorruptFile(f"'{key}' holds {n} experts, the args name {num_experts} (--num-experts)", path=path)
    param = key.split(MARK, 1)[1]
    per = math.prod(shape[axes:])
    layers = range(shape[0]) if stacked else [layer]
    return [(f"{LAYERS}{i}.{MARK}{e}.{param}", key, i, tuple(shape[axes:]), (li * n + e) * per, per)
            for li, i in enumerate(layers) for e in range(n)]


def facts(args: dict) -> dict:
    """What the args say about the experts (None: a dense model, or not saved)."""
    def num(k):
        v = args.get(k)
        return v if isinstance(v, int) and not isinstance(v, bool) else None
    n = num("num_experts")
    if not n:
        return {}
    ep, tp = num("expert_model_parallel_size") or 1, num("tensor_model_parallel_size")
    return {"num_experts": n, "topk": num("moe_router_topk"), "ep": ep,
            "etp": num("expert_tensor_parallel_size") or tp, "ffn_hidden_size": num("moe_ffn_hidden_size"),
            "layer_freq": args.get("moe_layer_freq"), "token_dispatcher": args.get("moe_token_dispatcher_type"),
            "grouped_gemm": args.get("moe_grouped_gemm"),
            "shared_expert_size": num("moe_shared_expert_intermediate_size")}


def check_supported(keys, f: dict, path: str) -> None:
    """What zckpt reads of MoE: SequentialMLP experts and the TopK router; anything else in one line."""
    other = sorted(k for k in keys if k.startswith(LAYERS) and ".mlp.experts." in k and MARK not in k)
    if f.get("grouped_gemm") is True or other:
        raise UnsupportedLayout("grouped-GEMM experts (--moe-grouped-gemm: TEGroupedMLP/GroupedMLP, experts fused "
                                "in one weight per rank): zckpt reads the local spec's SequentialMLP", path=path,
                                hint="save with the local spec without --moe-grouped-gemm")
    shared = sorted(k for k in keys if _SHARED in k) or (["the args' moe_shared_expert_intermediate_size"]
                                                         if f.get("shared_expert_size") else [])
    if shared:
        raise UnsupportedLayout(f"'{shared[0]}': shared experts (--moe-shared-expert-intermediate-size) are not read",
                                path=path)


def coverage(records, moe: dict, path: str) -> list[dict]:
    """Every MoE layer described (:mod:`zckpt.state.experts`) and checked: its experts 0..E-1 once each, every
    one with its value and each per-element state the checkpoint keeps, and its router."""
    layers: dict[int, set] = {}
    routers: set[int] = set()
    for r in records:
        x = expert_of(r.name)
        if x:
            layers.setdefault(x[0], set()).add(x[1])
        m = _ROUTER.match(r.name)
        if m:
            routers.add(int(m.group(1)))
    n = moe.get("num_experts")
    if n and not layers:
        raise IncompleteCheckpoint(f"the args name {n} experts (--num-experts) and the files hold no expert of "
                                   "SequentialMLP ('decoder.layers...mlp.experts.experts.*')", path=path)
    for i in sorted(routers - set(layers)):
        raise IncompleteCheckpoint(f"MoE layer {i} (decoder.layers.{i}.mlp): a router and no expert", path=path)
    n = n or 1 + max(e for es in layers.values() for e in es)
    out = [{"layer": f"{LAYERS}{i}.mlp", "index": i, "experts": n, "ep": moe.get("ep"),
            "router": f"{LAYERS}{i}.mlp.router.", "prefix": f"{LAYERS}{i}.{MARK}"} for i in sorted(layers)]
    experts.check(out, records, path)
    return out


def check_placed(layers: list[dict], records, placed: dict, path: str) -> None:
    """``dp_reshardable``: every expert's master and moments placed in the expert buckets."""
    for r in records:
        x = expert_of(r.name)
        if x and r.kind == "trainable" and r.name not in placed:
            raise IncompleteCheckpoint(f"MoE layer {x[0]} ({LAYERS}{x[0]}.mlp): expert {x[1]} has no master or "
                                       f"moments in the expert buckets ('{r.name}')", path=path)


# ------------------------------------------------------------------------------------ when .metadata is refused

def _vars(obj) -> dict:
    return vars(obj) if isinstance(obj, safeload.Inert) else {}


def diagnose(data: bytes, mpath: str, sizes: dict, moe: dict | None = None) -> None:
    """Called when DCP's checks refuse ``.metadata`` (a chunk missing or twice, a data file gone): raise in one
    line naming the MoE layer and the expert when an expert's item is the cause; return otherwise (the caller
    re-raises the first error)."""
    try:
        obj = safeload.load_plain(data, mpath, dcpmeta.EXTRA_GLOBALS)
    except Exception:  # noqa: BLE001 - the caller's error stands
        return
    md = _vars(obj)
    sdm, storage = md.get("state_dict_metadata"), md.get("storage_data")
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        return
    where: dict = {}
    for idx, info in storage.items():
        i, s = _vars(idx), _vars(info)
        offs = i.get("offset")
        where[(i.get("fqn"), tuple(offs) if isinstance(offs, (tuple, list)) else None)] = s.get("relative_path")
    folder = mpath.rsplit("/", 1)[0]
    gone = {f for f in where.values() if isinstance(f, str) and f not in sizes}
    for key, entry in sdm.items():
        m = _STATE.match(key) if isinstance(key, str) else None
        model_key, state = (m.group(2), m.group(1)) if m else (key, None)
        if isinstance(key, str) and is_expert_key(model_key):
            _expert_chunks(key, model_key, state, entry, where, gone, folder)
        elif isinstance(key, str) and _ROUTER_KEY.match(model_key):
            _router_chunks(key, model_key, entry, where, gone, folder)
    for key, entry in sdm.items():
        if isinstance(key, str) and gone:
            _bucket_gone(key, entry, where, gone, moe or {}, folder)


def _bucket_gone(key, entry, where, gone, moe: dict, folder: str) -> None:
    m = _BUCKET.match(key)
    if not m:
        return
    for c in _vars(entry).get("chunks") or []:
        offs = _vars(c).get("offsets")
        f = where.get((key, tuple(offs) if isinstance(offs, (tuple, list)) else None))
        if f in gone:
            g = int(m.group(1))
            n, ep, etp = moe.get("num_experts"), moe.get("ep") or 1, moe.get("etp") or 1
            held = ""
            if n:
                r = (g // etp) % ep
                lo, per = r * (n // ep), n // ep
                held = f": the masters and moments of experts {lo}..{lo + per - 1} of every MoE layer"
            raise IncompleteCheckpoint(f"expert-parallel buckets of rank {g} ('{key}') lie in {f}, which is not in "
                                       f"the folder{held}", path=f"{folder}/{f}",
                                       hint="copy the whole iteration folder again from where it was saved")


_ROUTER_KEY = re.compile(r"^decoder\.layers\.(?:\d+\.)?mlp\.router\.weight$")


def _router_chunks(key, model_key, entry, where, gone, folder: str) -> None:
    """A router's chunks: each MoE layer's router rows there once, in a data file that is there."""
    t = _vars(entry)
    shape, chunks = t.get("size"), t.get("chunks")
    if not isinstance(shape, (tuple, list)) or not isinstance(chunks, list) or not shape:
        return
    stacked, layer = _axes(model_key)
    per = math.prod(shape[1:]) if stacked else math.prod(shape)
    count: dict[int, int] = {}
    for c in chunks:
        cf = _vars(c)
        offs, sz = cf.get("offsets"), cf.get("sizes")
        if not isinstance(offs, (tuple, list)) or not isinstance(sz, (tuple, list)) or len(offs) != len(shape):
            return
        f = where.get((key, tuple(offs)))
        for i in range(offs[0], offs[0] + sz[0]) if stacked else [layer]:
            if f in gone:
                raise IncompleteCheckpoint(f"MoE layer {i} ({LAYERS}{i}.mlp): its router ('{key}') lies in {f}, "
                                           "which is not in the folder", path=f"{folder}/{f}",
                                           hint="copy the whole iteration folder again from where it was saved")
            count[i] = count.get(i, 0) + math.prod(sz[1:] if stacked else sz)
    for i in range(shape[0]) if stacked else [layer]:
        if count.get(i, 0) != per:
            raise (IncompleteCheckpoint if count.get(i, 0) < per else CorruptFile)(
                f"MoE layer {i} ({LAYERS}{i}.mlp): its router is " + ("missing" if not count.get(i) else
                                                                      "held in part" if count[i] < per else
                                                                      "held twice") + f": '{key}' in .metadata",
                path=f"{folder}/.metadata", hint="the save did not finish or was put together from several saves; "
                                                 "use a complete iteration folder")


def _expert_chunks(key, model_key, state, entry, where, gone, folder: str) -> None:
    t = _vars(entry)
    shape, chunks = t.get("size"), t.get("chunks")
    if not isinstance(shape, (tuple, list)) or not isinstance(chunks, list):
        return
    stacked, layer = _axes(model_key)
    axes = 2 if stacked else 1
    if len(shape) <= axes:
        return
    param = model_key.split(MARK, 1)[1] + (f" ({state})" if state else "")
    per = math.prod(shape[axes:])
    count: dict[tuple[int, int], int] = {}
    for c in chunks:
        cf = _vars(c)
        offs, sz = cf.get("offsets"), cf.get("sizes")
        if not isinstance(offs, (tuple, list)) or not isinstance(sz, (tuple, list)) or len(offs) != len(shape):
            return
        inner = math.prod(sz[axes:])
        f = where.get((key, tuple(offs)))
        ls = range(offs[0], offs[0] + sz[0]) if stacked else [layer]
        for i in ls:
            for e in range(offs[axes - 1], offs[axes - 1] + sz[axes - 1]):
                if f in gone:
                    raise IncompleteCheckpoint(f"MoE layer {i} ({LAYERS}{i}.mlp): expert {e}'s '{param}' lies in "
                                               f"{f}, which is not in the folder", path=f"{folder}/{f}",
                                               hint="copy the whole iteration folder again from where it was saved")
                count[(i, e)] = count.get((i, e), 0) + inner
    layers = range(shape[0]) if stacked else [layer]
    for i in layers:
        for e in range(shape[axes - 1]):
            got = count.get((i, e), 0)
            if got == per:
                continue
            what = ("is missing" if got == 0 else "is held twice" if got >= 2 * per else
                    f"is held in part ({got} of {per} elements)" if got < per else "overlaps another chunk")
            raise (IncompleteCheckpoint if got < per else CorruptFile)(
                f"MoE layer {i} ({LAYERS}{i}.mlp): expert {e} {what}: '{key}' in .metadata",
                path=f"{folder}/.metadata", hint="the save did not finish or was put together from several saves; "
                                                 "use a complete iteration folder")


# ------------------------------------------------------------------------------------ naming damaged items

def item_names(md, placed: dict | None) -> dict[tuple[str, int], str]:
    """{(data file name, item offset): what the item holds, by MoE layer and expert} for every item of an expert's
    bytes: the chunks of the expert keys (weights; ``fully_reshardable``: masters and moments too) and, with a
    ``dp_reshardable`` placement, the expert buckets' chunks; ``verify --deep`` names a damaged item so."""
    out: dict[tuple[str, int], str] = {}
    for key, te in md.tensors.items():
        m = _STATE.match(key)
        model_key, state = (m.group(2), m.group(1)) if m else (key, None)
        if not is_expert_key(model_key):
            continue
        stacked, layer = _axes(model_key)
        axes = 2 if stacked else 1
        param = model_key.split(MARK, 1)[1]
        for c in te.chunks:
            ls = range(c.offsets[0], c.offsets[0] + c.sizes[0]) if stacked else [layer]
            es = range(c.offsets[axes - 1], c.offsets[axes - 1] + c.sizes[axes - 1])
            what = {"param": "the master of ", "exp_avg": "exp_avg of ", "exp_avg_sq": "exp_avg_sq of "}.get(state, "")
            names = [f"{LAYERS}{i}.{MARK}{e}.{param}" for i in ls for e in es]
            more = f" and {len(names) - 1} more" if names[1:] else ""
            out[(c.file, c.offset)] = f"{key}: {what}'{names[0]}'{more}"
    if placed:
        by_file: dict[str, list] = {}  # file -> sorted (item offset, end, key) of the expert buckets' chunks
        for key, te in md.tensors.items():
            if _BUCKET.match(key):
                for c in te.chunks:
                    by_file.setdefault(c.file, []).append((c.offset, c.offset + c.length, key))
        starts = {f: [x[0] for x in sorted(v)] for f, v in by_file.items()}
        by_file = {f: sorted(v) for f, v in by_file.items()}
        kinds = ("the master of ", "exp_avg of ", "exp_avg_sq of ")
        for name, triple in placed.items():
            if not expert_of(name):
                continue
            for what, pieces in zip(kinds, triple):
                for p in pieces:
                    file = p.path.rsplit("/", 1)[-1]
                    i = bisect.bisect_right(starts.get(file, []), p.offset) - 1
                    if i >= 0 and p.offset < by_file[file][i][1]:
                        lo, _, key = by_file[file][i]
                        out[(file, lo)] = f"{key}: {what}'{name}'"
    return out
