"""AutoEP checkpoints merged under the names and fusion of the Hugging Face model class they were made from.

DeepSpeed's AutoEP swaps each MoE block of a transformers model for an ``AutoEPMoELayer`` (``ds_autoep_layers``):
the block's router becomes ``{mlp}.router.gate.weight`` (with the alias ``{mlp}.gate.gate.weight``) and its fused
experts ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]`` become ``experts.w1`` (gate),
``experts.w3`` (up) ``[E, I, H]`` and ``experts.w2 [E, H, I]`` (``deepspeed/moe/ep_repack.py``, the
``gate_up_first`` layout: ``w1 = gate_up_proj[:, :I]``, ``w3 = gate_up_proj[:, I:]``). The reader keeps AutoEP's
names; ``merge`` writes the model's own (:func:`merge_view`, the reader's ``MERGE_VIEW``), so that
``from_pretrained`` of that class loads the output with no missing or unexpected key::

    {mlp}.router.gate.weight                    {mlp}.gate.weight
    {mlp}.gate.gate.weight (the router alias)   - (not a key of the model)
    {mlp}.experts.w1, {mlp}.experts.w3          {mlp}.experts.gate_up_proj: per expert e, w1[e] then w3[e]
    {mlp}.experts.w2                            {mlp}.experts.down_proj

Which class the run started from is read, never guessed: the ``config.json`` beside the checkpoint (a Trainer's
``checkpoint-N``, or the save folder that holds ``latest``) must have a ``model_type`` whose transformers 5 class
fuses its experts so (``mixtral``, ``qwen3_moe``, ``deepseek_v2``, ``deepseek_v3``: :mod:`.hf_moe_families`, which
also says what else each MoE block holds, DeepSeek's shared experts and V3's router ``e_score_correction_bias``,
and which layers are MoE blocks) and a ``transformers_version`` of 5 or later (4.x Mixtral keeps one module per
expert). Without it, with anything else in a layer (a router bias), a name of the class's block missing, or MoE
layers and experts other than the config's, AutoEP's names are kept and a note says why. The values are the same
bytes either way: each name is slices of the same pieces.

``convert --to dcp`` writes the same names (:func:`training_view`) with the optimizer state mapped as the values
are: ``gate_up_proj``'s fp32 master, ``exp_avg`` and ``exp_avg_sq`` are, per expert e, w1's then w3's; the param
groups name the model's parameters (``gate.weight`` in the router's group, ``gate_up_proj`` / ``down_proj`` in the
experts'), each with its group's step, so that FSDP2 + AdamW over the transformers class loads it with
``dcp.load`` + ``set_state_dict``.
"""

from __future__ import annotations

import dataclasses
import json
import re

from zckpt.deepspeed.hf_moe_families import CLASSES, FAMILIES, config_mismatch
from zckpt.deepspeed.model import Checkpoint, TensorRecord
from zckpt.engine.segments import slice_pieces
from zckpt.errors import OptionError, UnsupportedLayout
from zckpt.io import storage
from zckpt.state import titan_dsv3

_DTYPE = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
          "float16": "float16"}




def _config(ckpt: Checkpoint) -> tuple[dict | None, str, str]:
    """(config.json, its path, why not) of the folder beside the checkpoint: the Trainer's ``checkpoint-N``, else
    the save folder."""
    loc, opts = ckpt.location, ckpt.storage_options
    for folder in (loc.trainer_dir, loc.save_dir):
        if not folder:
            continue
        path = storage.join(folder, "config.json")
        if storage.exists(path, opts):
            try:
                cfg = json.loads(storage.read_bytes(path, opts))
            except ValueError:
                return None, path, f"{path} is not valid JSON"
            return (cfg, path, "") if isinstance(cfg, dict) else (None, path, f"{path} is not a JSON object")
    return None, "", "no config.json beside the checkpoint says which model class it was made from"


def _why_not(cfg: dict, path: str) -> str:
    mtype = cfg.get("model_type")
    if mtype not in CLASSES:
        return f"{path} says model_type {mtype!r}, not one of {', '.join(sorted(CLASSES))}"
    arch = cfg.get("architectures")
    if isinstance(arch, list) and arch and not all(str(a).startswith(CLASSES[mtype][:-len("ForCausalLM")])
                                                   for a in arch):
        return f"{path} names architectures {arch}, not {mtype}'s"
    version = str(cfg.get("transformers_version") or "")
    if not version.split(".")[0].isdigit() or int(version.split(".")[0]) < 5:
        return (f"{path} was written by transformers {version or '(version not said)'}; only transformers 5's "
                "fused experts (gate_up_proj, down_proj) are written")
    return ""


def _sliced(srcs: list[TensorRecord], attr: str, key: str | None, n: int, blocks: list[int]) -> list:
    """Per expert e, the e-th block of each of ``srcs``' pieces (``attr``: value / exp_avg / exp_avg_sq, or
    ``other_state[key]``): the fused tensor's pieces, in expert order."""
    lists = [getattr(s, attr) if key is None else s.other_state[key] for s in srcs]
    return [p for e in range(n) for pieces, b in zip(lists, blocks) for p in slice_pieces(pieces, e * b, b)]


def _fused(name: str, shape: tuple, srcs: list[TensorRecord], n: int, state: bool) -> TensorRecord:
    """One record of ``srcs`` put together expert by expert (``state``: the masters' moments and every other
    per-element state with them, cut at the same places)."""
    first = srcs[0]
    blocks = [int(s.numel) // n for s in srcs]
    rec = TensorRecord(name, shape, first.kind, first.dtype, _sliced(srcs, "value", None, n, blocks),
                       group=first.group, lp_dtype=first.lp_dtype)
    if state and first.exp_avg:
        rec.exp_avg = _sliced(srcs, "exp_avg", None, n, blocks)
        rec.exp_avg_sq = _sliced(srcs, "exp_avg_sq", None, n, blocks)
    if state:
        rec.other_state = {k: _sliced(srcs, "other_state", k, n, blocks) for k in first.other_state}
    return rec


def _layer_records(layer: dict, by: dict[str, TensorRecord], state: bool = False,
                   block: dict | None = None) -> tuple[dict[str, list[TensorRecord]], str]:
    """{AutoEP name: the model's records} for one MoE layer, or why it cannot be mapped (``state``: with the
    moments and every other per-element state, mapped as the values are; else the values only, for merge;
    ``block``: what the layer holds beside its experts, AutoEP's name -> the class's, hf_moe_families)."""
    mp = layer["layer"]
    block = block or {"router.gate.weight": "gate.weight"}
    names = {n for n in by if n.startswith(mp + ".")}
    w1, w2, w3 = (by.get(f"{mp}.experts.{w}") for w in ("w1", "w2", "w3"))
    router = by.get(f"{mp}.router.gate.weight")
    alias = by.get(f"{mp}.gate.gate.weight")
    known = {f"{mp}.experts.w1", f"{mp}.experts.w2", f"{mp}.experts.w3"} | {f"{mp}.{k}" for k in block}
    missing = [k for k in block if f"{mp}.{k}" not in by]
    if alias is not None:
        if alias.kind != "tied" or alias.tied_to != f"{mp}.router.gate.weight":
            return {}, f"'{mp}.gate.gate.weight' is not the router's alias"
        known.add(alias.name)
    extra = sorted(names - known)
    if extra or None in (w1, w2, w3, router):
        return {}, f"layer {mp} holds {extra[0] if extra else 'not all of experts.w1/w2/w3, router.gate.weight'}"
    if missing:
        return {}, f"layer {mp} holds no {missing[0]}, which the model class has"
    n, inter, hidden = (int(d) for d in w1.shape)
    if tuple(w3.shape) != (n, inter, hidden) or tuple(w2.shape) != (n, hidden, inter) or w1.dtype != w3.dtype:
        return {}, f"layer {mp}: experts.w1 {list(w1.shape)}, w3 {list(w3.shape)}, w2 {list(w2.shape)}"
    if state and (w1.group != w3.group or w1.state_dtype != w3.state_dtype
                  or set(w1.other_state) != set(w3.other_state) or bool(w1.exp_avg) != bool(w3.exp_avg)):
        return {}, f"layer {mp}: experts.w1 and experts.w3 are in different param groups or keep different state"
    gate_up = _fused(f"{mp}.experts.gate_up_proj", (n, 2 * inter, hidden), [w1, w3], n, state)
    out = {w1.name: [gate_up], w3.name: [], w2.name: [_renamed(w2, f"{mp}.experts.down_proj", state)]}
    for old, new in block.items():  # the router, and shared experts and the like where the class has them
        rec = by[f"{mp}.{old}"]
        out[rec.name] = [rec] if old == new else [_renamed(rec, f"{mp}.{new}", state)]
    if alias is not None:
        out[alias.name] = []
    return out, ""


def _renamed(rec: TensorRecord, name: str, state: bool = False) -> TensorRecord:
    if state:
        return dataclasses.replace(rec, name=name)
    return dataclasses.replace(rec, name=name, exp_avg=[], exp_avg_sq=[], other_state={})


def _mapped(ckpt: Checkpoint, state: bool) -> tuple[dict[str, list[TensorRecord]], str, dict | None, str]:
    """({AutoEP name: the model's records}, why not, config.json, its path) for every AutoEP layer of ``ckpt``."""
    layers = [x for x in ckpt.extra.get("moe_coverage") or [] if x.get("fused") is not None]
    cfg, path, why = _config(ckpt)
    why = why or _why_not(cfg, path)
    by = ckpt.by_name()
    mapped: dict[str, list[TensorRecord]] = {}
    for layer in [] if why else layers:
        got, why = _layer_records(layer, by, state, FAMILIES[cfg["model_type"]].block)
        if why:
            break
        mapped.update(got)
    if not why:  # the class that config.json builds has these MoE layers, of these experts
        why = config_mismatch(cfg, path, layers, {x["layer"]: tuple(by[f"{x['layer']}.experts.w1"].shape)
                                                  for x in layers})
    return mapped, why, cfg, path


def _coverage(layers: list[dict]) -> list[dict]:
    """The MoE layers' coverage entries under the model's names (state/experts checks them as it did AutoEP's)."""
    return [{**x, "router": f"{x['layer']}.gate.", "fused": [f"{x['layer']}.experts.gate_up_proj",
                                                            f"{x['layer']}.experts.down_proj"]}
            if x.get("fused") is not None else x for x in layers]


def is_autoep(ckpt: Checkpoint) -> bool:
    return any(x.get("fused") is not None for x in ckpt.extra.get("moe_coverage") or [])


# torchtitan 0.3.0's Qwen3 (models/qwen3/state_dict_adapter.py, Qwen3StateDictAdapter.from_hf_map): the Hugging Face
# name of each parameter -> torchtitan's; AutoEP's experts are torchtitan's GroupedExperts as they are (w1/w3
# [E, F, D], w2 [E, D, F]) and its router torchtitan's TokenChoiceTopKRouter gate
_L = r"model\.layers\.(\d+)\."
TITAN = {"qwen3_moe": (
    (r"model\.embed_tokens\.weight", "tok_embeddings.weight"),
    (_L + r"self_attn\.q_proj\.weight", "layers.{}.attention.qkv_linear.wq.weight"),
    (_L + r"self_attn\.k_proj\.weight", "layers.{}.attention.qkv_linear.wk.weight"),
    (_L + r"self_attn\.v_proj\.weight", "layers.{}.attention.qkv_linear.wv.weight"),
    (_L + r"self_attn\.o_proj\.weight", "layers.{}.attention.wo.weight"),
    (_L + r"self_attn\.q_norm\.weight", "layers.{}.attention.q_norm.weight"),
    (_L + r"self_attn\.k_norm\.weight", "layers.{}.attention.k_norm.weight"),
    (_L + r"mlp\.gate_proj\.weight", "layers.{}.feed_forward.w1.weight"),
    (_L + r"mlp\.up_proj\.weight", "layers.{}.feed_forward.w3.weight"),
    (_L + r"mlp\.down_proj\.weight", "layers.{}.feed_forward.w2.weight"),
    (_L + r"input_layernorm\.weight", "layers.{}.attention_norm.weight"),
    (_L + r"post_attention_layernorm\.weight", "layers.{}.ffn_norm.weight"),
    (_L + r"mlp\.experts\.w1", "layers.{}.moe.routed_experts.inner_experts.w1_EFD"),
    (_L + r"mlp\.experts\.w2", "layers.{}.moe.routed_experts.inner_experts.w2_EDF"),
    (_L + r"mlp\.experts\.w3", "layers.{}.moe.routed_experts.inner_experts.w3_EFD"),
    (_L + r"mlp\.router\.gate\.weight", "layers.{}.moe.router.gate.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
), "deepseek_v3": titan_dsv3.autoep_table()}  # (torchtitan's DeepSeekV3StateDictAdapter: zckpt.state.titan_dsv3)
TITAN_UNMAPPED = ("qwen3_5_moe_text",)  # models torchtitan 0.3.0 has (models/qwen3_5)
TITAN_NOT_CARRIED = {
    "expert_bias_E": "torchtitan's load-balancing bias (a persistent buffer of its MoE when load_balance_coeff is "
                     "set) has no counterpart in the source's router: build the model with load_balance_coeff=None",
    "tokens_per_expert_E": "not persistent: torchtitan saves it neither",
}


def _titan_name(name: str, table) -> str | None:
    for pattern, out in table:
        m = re.fullmatch(pattern, name)
        if m:
            return out.format(*m.groups())
    return None


def titan_view(ckpt: Checkpoint) -> Checkpoint:
    """``ckpt`` (AutoEP) under the names of torchtitan's model of the family its ``config.json`` says (Qwen3-MoE:
    torchtitan's own Hugging Face table; DeepSeek-V3: :mod:`zckpt.state.titan_dsv3`'s, the router's
    ``e_score_correction_bias`` as torchtitan's ``expert_bias_E`` buffer), experts stacked ``[E, ...]`` as AutoEP keeps them, every master, moment,
    group and step as it is; refused in one line where the class is not said or has no torchtitan model, or a
    parameter has no torchtitan name."""
    cfg, path, why = _config(ckpt)
    why = why or _why_not(cfg, path)
    table = TITAN.get((cfg or {}).get("model_type"))
    if why or table is None:
        mt = cfg.get("model_type")  # torchtitan 0.3.0 has DeepSeek-V3 and Qwen3.5 models, zckpt no table of them
        why = why or (f"zckpt has no table of torchtitan 0.3.0's {mt} names" if mt in TITAN_UNMAPPED
                      else f"torchtitan 0.3.0 has no {mt} model")
        raise UnsupportedLayout(f"--layout torchtitan of an AutoEP checkpoint names the state as torchtitan's model "
                                f"of its family: {why}",
                                path=ckpt.location.input_path,
                                hint=f"--layout dcp writes the transformers class's names (torchtitan's models "
                                     f"zckpt names: {', '.join(sorted(TITAN))})")
    renamed: dict[str, str] = {}
    for r in ckpt.records:
        if r.kind == "tied" and r.name.endswith(".mlp.gate.gate.weight"):  # AutoEP's router alias: no module's
            continue
        new = _titan_name(r.name, table)
        if new is None:
            raise UnsupportedLayout(f"'{r.name}' has no counterpart in torchtitan's {cfg['model_type']} model",
                                    path=ckpt.location.input_path, hint="--layout dcp keeps the model class's names")
        renamed[r.name] = new
    records = [dataclasses.replace(r, name=renamed[r.name],
                                   tied_to=renamed.get(r.tied_to, r.tied_to) if r.tied_to else None)
               for r in ckpt.records if r.name in renamed]
    groups = [dataclasses.replace(g, names=[renamed[n] for n in g.names]) for g in ckpt.groups]
    layers = [{**x, "layer": renamed[f"{x['layer']}.router.gate.weight"][:-len(".router.gate.weight")],
               "router": renamed[f"{x['layer']}.router.gate.weight"][:-len("gate.weight")],
               "fused": [renamed[n] for n in x["fused"]]} if x.get("fused") is not None else x
              for x in ckpt.extra.get("moe_coverage") or []]
    dsv3 = cfg["model_type"] in titan_dsv3.CLASSES  # (its router's e_score_correction_bias is expert_bias_E)
    notes = list(ckpt.notes) + [f"torchtitan {cfg['model_type']} names (as {path} says; torchtitan 0.3.0's "
                                "state_dict_adapter table), experts stacked [E, ...] as AutoEP keeps them, " + (
                                    "the router's e_score_correction_bias as expert_bias_E: build the model with "
                                    "load_balance_coeff set" if dsv3 else
                                    "attention's optimizer state under wq/wk/wv and the fused wqkv (fuse_qkv either "
                                    "way); expert_bias_E not carried: build the model with load_balance_coeff=None")]
    kv = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    qkv = [(n[:-len("wq.weight")], int(kv)) for n in (r.name for r in records)
           if n.endswith(".attention.qkv_linear.wq.weight") and isinstance(kv, int)]
    extra = {**ckpt.extra, "moe_coverage": layers, "merge_notes": [], "titan_names": cfg["model_type"],
             "titan_not_carried": {k: v for k, v in TITAN_NOT_CARRIED.items() if not (dsv3 and k == "expert_bias_E")},
             "titan_qkv": qkv}
    return dataclasses.replace(ckpt, records=records, groups=groups, notes=notes, extra=extra)


def training_view(ckpt: Checkpoint, native_names: bool = False, layout: str = "dcp") -> Checkpoint:
    """``ckpt`` with its AutoEP layers under the model class's names and fusion, with the optimizer state:
    each master and every moment mapped as merge maps the values (``gate_up_proj``'s ``exp_avg``: per expert e,
    w1's then w3's), the param groups naming the model's parameters, the steps as they are, the MoE coverage
    under the new names. ``native_names``: AutoEP's names (refused for a checkpoint without AutoEP layers: the
    option would do nothing). Where the files do not say the class, AutoEP's names with a note saying why."""
    if not is_autoep(ckpt):
        if native_names:
            raise OptionError("--native-names applies to a Megatron-Core source or an AutoEP checkpoint; this "
                              "deepspeed checkpoint records its own names", path=ckpt.location.input_path,
                              hint="drop --native-names")
        return ckpt
    if native_names:
        return ckpt
    if layout == "torchtitan":
        return titan_view(ckpt)
    mapped, why, cfg, path = _mapped(ckpt, state=True)
    if why:
        return dataclasses.replace(ckpt, notes=list(ckpt.notes) + [
            f"AutoEP names kept (experts.w1/w2/w3, router.gate.weight): {why}; --native-names keeps them without "
            "this note"])
    records = [m for r in ckpt.records for m in mapped.get(r.name, [r])]
    renamed = {old: [r.name for r in new] for old, new in mapped.items()}
    order = {r.name: i for i, r in enumerate(records)}  # each group in the model's order, as an optimizer built
    groups = [dataclasses.replace(g, names=sorted((m for n in g.names for m in renamed.get(n, [n])),  # from it
                                                  key=lambda n: order.get(n, len(order))))
              for g in ckpt.groups]  # lists them (AutoEP's groups list the routers last)
    notes = list(ckpt.notes) + [f"{CLASSES[cfg['model_type']]} names and fused experts, with the optimizer state "
                                f"(as {path} says); --native-names keeps AutoEP's"]
    extra = {**ckpt.extra, "moe_coverage": _coverage(ckpt.extra.get("moe_coverage") or []), "merge_notes": []}
    return dataclasses.replace(ckpt, records=records, groups=groups, notes=notes, extra=extra)


def merge_view(ckpt: Checkpoint, dtype: str) -> tuple[Checkpoint, dict[str, bytes], list[str]]:
    """``ckpt`` with its AutoEP layers under the model class's names and fusion, the ``config.json`` to write
    beside them and the notes; ``ckpt`` as it is (AutoEP's names) with a note saying why where the files do not say
    which class, and unchanged, without a note, for any checkpoint that is not AutoEP."""
    notes = list(ckpt.extra.get("merge_notes") or [])
    if not is_autoep(ckpt):
        return ckpt, {}, notes
    mapped, why, cfg, path = _mapped(ckpt, state=False)
    if why:
        return ckpt, {}, notes + [f"AutoEP names kept (experts.w1/w2/w3, router.gate.weight): {why}; "
                                  "--native-names keeps them without this note"]
    records = [m for r in ckpt.records for m in mapped.get(r.name, [r])]
    fam = FAMILIES[cfg["model_type"]]
    keep = {r.name: "float32" for r in records if fam.kept_fp32(r.name)} if dtype in ("bf16", "fp16") else {}
    view = dataclasses.replace(ckpt, records=records, extra={**ckpt.extra, "merge_notes": [], "keep_dtype": keep})
    cfg = {**cfg, **{k: _DTYPE.get(dtype, dtype) for k in ("dtype", "torch_dtype") if k in cfg or k == "dtype"}}
    notes.append(f"{CLASSES[cfg['model_type']]} names and fused experts (as {path} says); --native-names keeps "
                 "AutoEP's")
    if keep:  # what from_pretrained would upcast from the rounded values: written as the class holds them
        notes.append(f"{len(keep)} tensor(s) kept in fp32 ({', '.join(fam.keep_fp32)}), as {fam.cls} holds them at "
                     f"{dtype} (its _keep_in_fp32_modules_strict)")
    return view, {"config.json": (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()}, notes
