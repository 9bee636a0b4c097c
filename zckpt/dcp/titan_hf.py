"""A torchtitan Qwen3 save (its ``CheckpointManager``'s ``step-<N>`` folder) under the names and fusion of the
transformers 5 class the user states (``--hf-config CONFIG.json``: torchtitan saves no model config), for ``merge``
(``from_pretrained`` loads it) and ``convert --to deepspeed`` (DeepSpeed, with the plain transformers class, loads
the whole training state).

The names are torchtitan 0.3.0's own table read backwards (``models/qwen3/state_dict_adapter.py``,
``Qwen3StateDictAdapter.from_hf_map``; its Qwen3 permutes no q/k rows for RoPE: its ``CosSinRoPE`` rotates halves
as transformers does, and ``to_hf`` copies q/k as they are)::

    tok_embeddings.weight                            model.embed_tokens.weight
    layers.{i}.attention.qkv_linear.wq/wk/wv.weight  model.layers.{i}.self_attn.q_proj/k_proj/v_proj.weight
    layers.{i}.attention.wo.weight                   ...self_attn.o_proj.weight
    layers.{i}.attention.q_norm/k_norm.weight        ...self_attn.q_norm/k_norm.weight
    layers.{i}.attention_norm.weight                 ...input_layernorm.weight
    layers.{i}.ffn_norm.weight                       ...post_attention_layernorm.weight
    layers.{i}.feed_forward.w1/w3/w2.weight          ...mlp.gate_proj/up_proj/down_proj.weight (dense layers)
    layers.{i}.moe.routed_experts.inner_experts      ...mlp.experts.gate_up_proj [E, 2I, H]: per expert e,
        .w1_EFD [E, I, H], .w3_EFD [E, I, H]             w1[e] then w3[e] (Qwen3MoeExperts: gate, up = chunk(2))
        .w2_EDF [E, H, I]                            ...mlp.experts.down_proj [E, H, I]
    layers.{i}.moe.router.gate.weight                ...mlp.gate.weight (Qwen3MoeTopKRouter)
    norm.weight, lm_head.weight                      model.norm.weight, lm_head.weight

With the optimizer state (``convert --to deepspeed``): each master, ``exp_avg`` and ``exp_avg_sq`` mapped as the
values are. torchtitan's fused-qkv attention (its default) keeps its state under ``wqkv`` alone, laid out as
``_merge_qkv_on_load`` fuses the weight (per key-value group g: q's rows of g, then k's, then v's); the config's
``num_key_value_heads`` and head size split it back. torchtitan saves each parameter's group values, not the groups
(``param_groups.<fqn>.<key>``): parameters with equal values are one group, in the saved order (torchtitan's);
each group's parameters in the class's order. Not carried, and said so: ``expert_bias_E`` (torchtitan's
load-balancing bias, load_balance_coeff set; no transformers class routes with one), ``train_state.ntokens_seen``,
the scheduler's ``last_epoch`` (DeepSpeed's scheduler is the job's own) and the data loader.
"""

from __future__ import annotations

import dataclasses
import json
import re

from zckpt.dcp import reader as dcp_reader
from zckpt.dcp import titan_llama
from zckpt.engine.segments import slice_pieces
from zckpt.errors import InvalidArgument, OptionError, UnsupportedLayout
from zckpt.io import storage
from zckpt.state import moe_names, titan_dsv3
from zckpt.state.model import Checkpoint, GroupInfo, TensorRecord

CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM", **titan_llama.CLASSES,
           **titan_dsv3.CLASSES}
_L = r"layers\.(\d+)\."
_M = "model.layers.{}."
# torchtitan 0.3.0's Qwen3StateDictAdapter.from_hf_map, read backwards (the experts' w1/w3: fused, below)
TO_HF = (
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (_L + r"attention\.qkv_linear\.wq\.weight", _M + "self_attn.q_proj.weight"),
    (_L + r"attention\.qkv_linear\.wk\.weight", _M + "self_attn.k_proj.weight"),
    (_L + r"attention\.qkv_linear\.wv\.weight", _M + "self_attn.v_proj.weight"),
    (_L + r"attention\.wo\.weight", _M + "self_attn.o_proj.weight"),
    (_L + r"attention\.q_norm\.weight", _M + "self_attn.q_norm.weight"),
    (_L + r"attention\.k_norm\.weight", _M + "self_attn.k_norm.weight"),
    (_L + r"feed_forward\.w1\.weight", _M + "mlp.gate_proj.weight"),
    (_L + r"feed_forward\.w3\.weight", _M + "mlp.up_proj.weight"),
    (_L + r"feed_forward\.w2\.weight", _M + "mlp.down_proj.weight"),
    (_L + r"moe\.routed_experts\.inner_experts\.w2_EDF", _M + "mlp.experts.down_proj"),
    (_L + r"moe\.router\.gate\.weight", _M + "mlp.gate.weight"),
    (_L + r"attention_norm\.weight", _M + "input_layernorm.weight"),
    (_L + r"ffn_norm\.weight", _M + "post_attention_layernorm.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
)
_EXPERTS = "layers.{}.moe.routed_experts.inner_experts."
NOT_CARRIED = {
    r"layers\.\d+\.moe\.expert_bias_E": "torchtitan's load-balancing bias (load_balance_coeff set), added to the "
                                        "router's scores to pick experts: transformers' Qwen3MoeTopKRouter has none, "
                                        "so the model there routes without it",
}
# the order of a decoder layer's parameters in transformers 5's Qwen3 / Qwen3-MoE (named_parameters)
_ORDER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
          "mlp.down_proj.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight",
          "input_layernorm.weight", "post_attention_layernorm.weight")


def _hf_order(name: str) -> tuple:
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m:
        return (1, int(m.group(1)), _ORDER.index(m.group(2)))
    return ({"model.embed_tokens.weight": 0, "model.norm.weight": 2}.get(name, 3), 0, 0)


def read_config(hf_config, path: str) -> tuple[dict, str]:
    """(config.json, its path) the user states, refused in one line where it is not a transformers 5 config of a
    class zckpt maps torchtitan's names onto."""
    cpath = str(hf_config)
    if storage.isdir(cpath):
        cpath = storage.join(cpath, "config.json")
    try:
        cfg = json.loads(storage.read_bytes(cpath))
    except FileNotFoundError:
        raise InvalidArgument("--hf-config: no such file", path=cpath,
                              hint="pass the config.json of the transformers class to write (or its folder)") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"--hf-config is not a readable JSON file ({exc})", path=cpath) from None
    if not isinstance(cfg, dict):
        raise InvalidArgument("--hf-config is not a JSON object", path=cpath)
    mtype = cfg.get("model_type")
    if mtype not in CLASSES:
        raise UnsupportedLayout(f"--hf-config says model_type {mtype!r}; torchtitan's names are mapped onto "
                                f"{', '.join(CLASSES[k] for k in sorted(CLASSES))} only", path=cpath,
                                hint="state the config.json of a Qwen3, Qwen3-MoE, Llama or DeepSeek-V3 model")
    version = str(cfg.get("transformers_version") or "")
    if mtype in ("qwen3_moe", *titan_dsv3.CLASSES) and (not version.split(".")[0].isdigit()
                                                        or int(version.split(".")[0]) < 5):
        raise UnsupportedLayout(f"--hf-config was written by transformers {version or '(version not said)'}; only "
                                "transformers 5's fused experts (gate_up_proj, down_proj) are written", path=cpath,
                                hint="save the config with transformers 5 (config.save_pretrained)")
    return cfg, cpath


def open_titan(path: str, hf_config, storage_options: dict | None = None, tag: str | None = None,
               tied=None) -> tuple[Checkpoint, dict, str]:
    """The torchtitan DCP at ``path`` (its fused wqkv state kept) under the stated class's names: (checkpoint,
    config, its path)."""
    if tag is not None:
        raise InvalidArgument("`tag` picks a DeepSpeed tag; a DCP folder holds one checkpoint", path=path,
                              hint="drop `tag`, or pass the step folder you want")
    if not dcp_reader.is_dcp(str(path), storage_options):
        raise OptionError("--hf-config states the transformers class of a torchtitan DCP save; this is not a DCP "
                          "folder", path=str(path), hint="drop --hf-config")
    cfg, cpath = read_config(hf_config, path)
    ckpt = dcp_reader.open_dcp(path, storage_options, tied=tied, fused_qkv=True)
    return hf_view(ckpt, cfg, cpath), cfg, cpath


def _table(cfg: dict) -> str:
    if cfg["model_type"] in titan_dsv3.CLASSES:
        return "DeepSeek-V3"
    return "Llama 3 (q/k rows permuted as its to_hf does)" if cfg["model_type"] in titan_llama.CLASSES else "Qwen3"


def _renamed(name: str) -> str | None:
    for pattern, out in TO_HF:
        m = re.fullmatch(pattern, name)
        if m:
            return out.format(*m.groups())
    return None


def _by_expert(srcs: list[list], n: int) -> list:
    """Per expert e, the e-th block of each of ``srcs`` (piece lists of [E, ...] tensors), in expert order."""
    blocks = [sum(p.numel for p in s) // n for s in srcs]
    return [p for e in range(n) for s, b in zip(srcs, blocks) for p in slice_pieces(s, e * b, b)]


def _qkv_state(fused: dict, rows: list[int], kv: int, cols: int) -> list[list]:
    """The fused wqkv state's pieces split into q's, k's and v's: per key-value group g, q's rows of g, then k's,
    then v's (torchtitan's ``_merge_qkv_on_load``)."""
    per = [r // kv * cols for r in rows]
    block = sum(per)
    out = [[], [], []]
    for g in range(kv):
        start = g * block
        for i, n in enumerate(per):
            out[i] += slice_pieces(fused, start, n)
            start += n
    return out


def _check_shapes(cfg: dict, cpath: str, by: dict, layers: list[int], fused: dict) -> dict:
    """The class's facts the checkpoint must agree with (else from_pretrained would refuse it, or worse): {wqkv
    fqn: (q, k, v rows, kv heads)} for the fused attentions."""
    def bad(what: str, ours, theirs):
        raise UnsupportedLayout(f"--hf-config says {what} {theirs}, the checkpoint {ours}", path=cpath,
                                hint="state the config.json of the class this torchtitan model is")
    emb = by.get("tok_embeddings.weight")
    if emb is None or len(emb.shape) != 2:
        raise UnsupportedLayout("no tok_embeddings.weight: not a torchtitan Qwen3 save", path=cpath,
                                hint="drop --hf-config")
    if (cfg.get("vocab_size"), cfg.get("hidden_size")) != tuple(emb.shape):
        bad("vocab_size x hidden_size", list(emb.shape), [cfg.get("vocab_size"), cfg.get("hidden_size")])
    if cfg.get("num_hidden_layers") != len(layers):
        bad("num_hidden_layers", len(layers), cfg.get("num_hidden_layers"))
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    hd = cfg.get("head_dim") or (cfg["hidden_size"] // heads if isinstance(heads, int) and heads else None)
    if not all(isinstance(x, int) and x > 0 for x in (heads, kv, hd)) or heads % kv:
        raise UnsupportedLayout(f"--hf-config's heads ({heads}), key-value heads ({kv}), head size ({hd}) do not "
                                "make a grouped-query attention", path=cpath)
    moe_type = cfg["model_type"] == "qwen3_moe"
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    step, dense_only = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
    out = {}
    for i in layers:
        rows = [int(by[f"layers.{i}.attention.qkv_linear.{w}.weight"].shape[0])
                if f"layers.{i}.attention.qkv_linear.{w}.weight" in by else None for w in ("wq", "wk", "wv")]
        if rows != [heads * hd, kv * hd, kv * hd]:
            bad(f"layer {i}'s q/k/v rows (heads x head size)", rows, [heads * hd, kv * hd, kv * hd])
        wqkv = f"layers.{i}.attention.qkv_linear.wqkv.weight"
        if wqkv in fused:
            if fused[wqkv]["shape"] != (sum(rows), cfg["hidden_size"]):
                bad(f"{wqkv}'s optimizer state", list(fused[wqkv]["shape"]), [sum(rows), cfg["hidden_size"]])
            out[wqkv] = (rows, kv)
        w1 = by.get(_EXPERTS.format(i) + "w1_EFD")
        sparse = moe_type and bool(experts) and i not in dense_only and isinstance(step, int) and step > 0 \
            and (i + 1) % step == 0
        if sparse != (w1 is not None):
            raise UnsupportedLayout(f"--hf-config makes layer {i} {'an MoE' if sparse else 'a dense'} layer, the "
                                    f"checkpoint's is {'dense' if sparse else 'MoE'}", path=cpath,
                                    hint="state the config.json of the class this torchtitan model is")
        if w1 is not None and tuple(w1.shape) != (experts, cfg.get("moe_intermediate_size"), cfg["hidden_size"]):
            bad(f"layer {i}'s experts x moe_intermediate_size x hidden_size", list(w1.shape),
                [experts, cfg.get("moe_intermediate_size"), cfg["hidden_size"]])
        ffn = by.get(f"layers.{i}.feed_forward.w1.weight")
        if ffn is not None and int(ffn.shape[0]) != cfg.get("intermediate_size"):
            bad(f"layer {i}'s intermediate_size", int(ffn.shape[0]), cfg.get("intermediate_size"))
    return out


def _tie(ckpt: Checkpoint, cfg: dict, cpath: str) -> bool:
    """Whether ``lm_head.weight`` is the embeddings' (torchtitan's ``enable_weight_tying``: one parameter, its
    optimizer state under ``tok_embeddings.weight``, ``lm_head.weight`` saved beside it with the same bytes), as the
    config must say (``tie_word_embeddings``); refused where they disagree."""
    lm = ckpt.by_name().get("lm_head.weight")
    pair = ("lm_head.weight", "tok_embeddings.weight")
    tied = lm is not None and (lm.kind == "tied" and lm.tied_to == pair[1] or
                               not lm.exp_avg and pair in (ckpt.extra.get("tie_candidates") or []))
    if bool(cfg.get("tie_word_embeddings")) != tied:
        raise UnsupportedLayout(
            f"--hf-config says tie_word_embeddings {bool(cfg.get('tie_word_embeddings'))}, and torchtitan's "
            f"lm_head.weight {'is tok_embeddings.weight (enable_weight_tying)' if tied else 'is a weight of its own'}",
            path=cpath, hint=f"state tie_word_embeddings: {'true' if tied else 'false'}")
    return tied


def hf_view(ckpt: Checkpoint, cfg: dict, cpath: str) -> Checkpoint:
    """``ckpt`` (a torchtitan DCP, read with ``fused_qkv=True``) under the class's names, with its optimizer state,
    groups and steps (see the module's docstring); ``extra["titan_not_carried"]``: {name: why} left out."""
    path = ckpt.location.input_path
    by = ckpt.by_name()
    layers = sorted({int(m.group(1)) for n in by if (m := re.match(_L, n))})
    fused = ckpt.extra.get("fused_qkv") or {}
    dsv3 = cfg["model_type"] in titan_dsv3.CLASSES  # (MLA, shared experts, expert_bias_E: zckpt.state.titan_dsv3)
    if dsv3:
        why, qkv = titan_dsv3.check_shapes(cfg, by, layers), {}
        if why:
            raise UnsupportedLayout(f"--hf-config's {CLASSES[cfg['model_type']]}: {why}", path=cpath,
                                    hint="state the config.json of the class this torchtitan model is")
    else:
        qkv = _check_shapes(cfg, cpath, by, layers, fused)
        titan_llama.check_family(cfg, by, layers, cpath)
    tied = _tie(ckpt, cfg, cpath)
    steps = dict(ckpt.extra.get("step_tensors") or {})
    values = dict(ckpt.extra.get("step_values") or {})
    flat = dict(ckpt.extra.get("flat_groups") or {})
    if ckpt.groups or (not flat and any(r.exp_avg for r in ckpt.records)):
        raise UnsupportedLayout("--hf-config maps a torchtitan save (its optimizer state flat, each parameter's "
                                "group values); this DCP records its own param groups under the model's names",
                                path=path, hint="drop --hf-config")
    source: dict[str, str] = {}  # the class's name -> the torchtitan name its step and group values are under
    records: list[TensorRecord] = []
    not_carried: dict[str, str] = {}
    for r in ckpt.records:
        why = None if dsv3 else next((w for p, w in NOT_CARRIED.items() if re.fullmatch(p, r.name)), None)
        if why is not None:
            not_carried[r.name] = why
            continue
        m = re.fullmatch(_L + r"moe\.routed_experts\.inner_experts\.w([13])_EFD", r.name)
        if m:
            if m.group(2) == "1":
                records.append(_gate_up(by, m.group(1), path))
                source[records[-1].name] = r.name
            continue
        new = titan_dsv3.to_hf(r.name) if dsv3 else _renamed(r.name)
        if new is not None and cfg["model_type"] in titan_llama.CLASSES and titan_llama.NOT_LLAMA.fullmatch(r.name):
            new = None  # (Qwen3's q_norm / k_norm, MoE: none in torchtitan's Llama 3 table)
        if tied and r.name == "lm_head.weight":  # the embeddings' alias, as the class ties it
            records.append(TensorRecord(new, r.shape, "tied", r.dtype, tied_to="model.embed_tokens.weight"))
            source[new] = r.name
            continue
        if new is None:
            raise UnsupportedLayout(f"'{r.name}' has no counterpart in transformers' {CLASSES[cfg['model_type']]} "
                                    f"(torchtitan 0.3.0's {_table(cfg)} table)", path=path,
                                    hint="zckpt maps torchtitan's Qwen3, Qwen3-MoE and Llama 3 models only")
        rec = dataclasses.replace(r, name=new, kind="buffer" if dsv3 and titan_dsv3.is_buffer(r.name) else r.kind)
        wqkv = re.sub(r"\.w[qkv]\.weight$", ".wqkv.weight", r.name)
        if wqkv in qkv:  # the state torchtitan's optimizer keeps under the fused wqkv, split as it fuses it
            rows, kv = qkv[wqkv]
            i = "qkv".index(r.name[-len("q.weight")])
            rec.exp_avg, rec.exp_avg_sq = (_qkv_state(fused[wqkv][k], rows, kv, int(r.shape[1]))[i]
                                           for k in ("exp_avg", "exp_avg_sq"))
            rec.kind = "trainable"
            source[new] = wqkv
        else:
            source[new] = r.name
        if cfg["model_type"] in titan_llama.CLASSES:  # q/k rows (and their state) permuted as its to_hf does
            rec = titan_llama.to_hf_record(rec, cfg, path)
        records.append(rec)
    records.sort(key=lambda r: (titan_dsv3.hf_order if dsv3 else _hf_order)(r.name))
    groups = _groups(records, source, flat, values, path)
    group_of = {n: g.index for g in groups for n in g.names}
    for rec in records:
        rec.group = group_of.get(rec.name)
    known = [r.name for r in records if dsv3 and r.kind == "buffer"]  # (the table's buffers: no --buffers needed)
    stateless = [r.name for r in records if r.kind in ("frozen", "buffer") and r.group is None and r.name not in known]
    extra = {**ckpt.extra, "step_tensors": {n: steps[s] for n, s in source.items() if s in steps},
             "flat_param_groups": False, "flat_groups": {}, "stateless": stateless, "fused_qkv": {},
             "titan_buffers": known, "keep_dtype": {r.name: "float32" for r in records if dsv3 and
                                                    titan_dsv3.kept_fp32(r.name)},
             "step_values": {n: values[s] for n, s in source.items() if s in values},
             "titan_not_carried": not_carried, "merge_notes": [], "hf_class": CLASSES[cfg["model_type"]],
             "moe_coverage": moe_names.layers(records), "tie_candidates": [],
             "tied": {"lm_head.weight": "model.embed_tokens.weight"} if tied else {}}
    notes = [n for n in ckpt.notes if "no optimizer state" not in n and "flattened" not in n]
    notes.append(f"{CLASSES[cfg['model_type']]} names and fusion (as {cpath} says; torchtitan 0.3.0's "
                 f"{_table(cfg)} table read backwards)"
                 f"{', the fused wqkv optimizer state split per key-value group' if qkv else ''}")
    notes.append(f"param groups: torchtitan saves each parameter's group values, not the groups; parameters with "
                 f"equal values are one group, in torchtitan's order ({', '.join(str(len(g.names)) for g in groups)}"
                 " parameters): build the DeepSpeed job's groups so")
    for name, why in not_carried.items():
        notes.append(f"not carried: {name}: {why}")
    extra["state_notes"] = notes[-2 - len(not_carried):]  # (convert --to deepspeed says how the state was placed)
    return dataclasses.replace(ckpt, records=records, groups=groups, notes=notes, extra=extra)


def _gate_up(by: dict, layer: str, path: str) -> TensorRecord:
    """``experts.gate_up_proj`` of one MoE layer: per expert, w1_EFD's block then w3_EFD's, with their state."""
    w1, w3 = by[_EXPERTS.format(layer) + "w1_EFD"], by.get(_EXPERTS.format(layer) + "w3_EFD")
    if w3 is None or tuple(w3.shape) != tuple(w1.shape) or w3.dtype != w1.dtype or bool(w1.exp_avg) != bool(
            w3.exp_avg) or w1.state_dtype != w3.state_dtype:
        raise UnsupportedLayout(f"layer {layer}'s experts: w1_EFD and w3_EFD differ in shape, dtype or state",
                                path=path)
    n, inter, hidden = (int(d) for d in w1.shape)
    rec = TensorRecord(_M.format(layer) + "mlp.experts.gate_up_proj", (n, 2 * inter, hidden), w1.kind, w1.dtype,
                       _by_expert([w1.value, w3.value], n), lp_dtype=w1.lp_dtype)
    if w1.exp_avg:
        rec.exp_avg = _by_expert([w1.exp_avg, w3.exp_avg], n)
        rec.exp_avg_sq = _by_expert([w1.exp_avg_sq, w3.exp_avg_sq], n)
    return rec


def _same(a, b) -> bool:
    norm = (lambda v: list(v) if isinstance(v, tuple) else v)
    return norm(a) == norm(b)


def _groups(records: list[TensorRecord], source: dict, flat: dict, values: dict, path: str) -> list[GroupInfo]:
    """The param groups from torchtitan's per-parameter values: equal values, one group, in the saved order."""
    by_source: dict[str, list[str]] = {}
    for r in records:
        by_source.setdefault(source[r.name], []).append(r.name)
    order = {r.name: i for i, r in enumerate(records)}
    out: list[tuple[list[str], dict]] = []
    for fqn, hp in flat.items():
        hp = {k: v for k, v in hp.items() if k not in ("params", "param_names")}
        names = by_source.get(fqn)
        if names is None:
            if re.search(r"inner_experts\.w3_EFD$", fqn):
                continue  # fused into gate_up_proj with w1_EFD (checked to share its values below)
            raise UnsupportedLayout(f"param group values of '{fqn}', which is not a parameter of the model",
                                    path=path)
        for g in out:
            if set(g[1]) == set(hp) and all(_same(g[1][k], v) for k, v in hp.items()):
                g[0].extend(names)
                break
        else:
            out.append((list(names), hp))
    for fqn, hp in flat.items():
        w1 = fqn.replace("w3_EFD", "w1_EFD")
        if fqn.endswith("w3_EFD") and (w1 not in flat or not all(_same(flat[w1].get(k), v) for k, v in hp.items())):
            raise UnsupportedLayout(f"'{w1}' and '{fqn}' are in different param groups: transformers fuses them "
                                    "into one gate_up_proj", path=path)
    grouped = {n for names, _ in out for n in names}
    missing = [r.name for r in records if r.exp_avg and r.name not in grouped]
    if missing:
        raise UnsupportedLayout(f"'{source[missing[0]]}' has optimizer state but no param group values", path=path)
    groups = []
    for i, (names, hp) in enumerate(out):
        names.sort(key=order.__getitem__)
        steps = {values[n] for n in (source[x] for x in names) if n in values}
        if len(steps) > 1:
            raise UnsupportedLayout(f"param group {i}: parameters at different Adam steps {sorted(steps)}", path=path,
                                    hint="one step per group is what DeepSpeed keeps")
        groups.append(GroupInfo(i, hp, next(iter(steps)) if steps else None, names))
    return groups


_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def merge_files(ckpt: Checkpoint, cfg: dict, dtype: str) -> tuple[dict[str, bytes], list[str]]:
    """merge's side file (the stated config.json, its dtype the merge's) and notes, for :func:`hf_view`'s output."""
    cfg = dict(cfg)
    for k in [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]:
        cfg[k] = _DTYPE.get(dtype, dtype)
    notes = [n.replace(", the fused wqkv optimizer state split per key-value group", "")  # (merge writes none)
             for n in ckpt.notes if not n.startswith("param groups:")]
    keep = ckpt.extra.get("keep_dtype") or {}
    if keep and dtype in ("bf16", "fp16"):  # what from_pretrained would upcast from rounded values
        notes.append(f"{len(keep)} tensor(s) kept in fp32 ({', '.join(titan_dsv3.KEEP_FP32)}), as "
                     f"{CLASSES[cfg['model_type']]} holds them at {dtype} (its _keep_in_fp32_modules_strict)")
    return {"config.json": (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()}, notes


def deepspeed_side(ckpt: Checkpoint) -> dict:
    """What the torchtitan save holds beside model and optimizer, as DeepSpeed's writer takes it (the DCP side
    state's form): ``train_state.step`` is DeepSpeed's ``global_steps`` (checked against the Adam step); the rest is
    left with the reason: ``ntokens_seen`` (DeepSpeed counts no tokens), the scheduler's ``last_epoch``
    (DeepSpeed's scheduler is the job's own), the data loader, :data:`NOT_CARRIED`."""
    from zckpt.dcp.sidestate import side_state
    if not ckpt.groups:
        raise UnsupportedLayout("the torchtitan save holds the model only (no optimizer state: checkpoint."
                                "last_save_model_only, or a model-only export): DeepSpeed's training state is not in "
                                "it", path=ckpt.location.input_path,
                                hint="zckpt merge --hf-config writes the weights; convert a step saved with its "
                                     "optimizer")
    side = side_state(ckpt)
    counters, left = dict(side["train_state"]), dict(side["left"])
    step = counters.pop("step", None)
    adam = {g.step for g in ckpt.groups if g.step is not None}
    if step is not None and adam and step != int(max(adam)):
        raise UnsupportedLayout(f"torchtitan's train_state.step is {step}, its optimizer's Adam step "
                                f"{int(max(adam))}: DeepSpeed keeps one (global_steps)", path=ckpt.location.input_path,
                                hint="convert a save whose optimizer stepped once per training step")
    for k in counters:
        left[f"train_state.{k}"] = "DeepSpeed keeps no such counter"
    if side["lr_scheduler"]:
        said = ", ".join(f"{k} {v}" for k, v in side["lr_scheduler"].items())
        left["lr_scheduler"] = (f"torchtitan's LambdaLR state ({said}): DeepSpeed's scheduler is the job's own (load "
                                "with load_lr_scheduler_states=False)")
    left.update(ckpt.extra.get("titan_not_carried") or {})
    return {"train_state": {"global_steps": step} if step is not None else {}, "lr_scheduler": None,
            "client_state": {}, "left": left}
