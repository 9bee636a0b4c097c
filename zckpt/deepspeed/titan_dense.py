"""``convert --to dcp --layout torchtitan`` of a DeepSpeed checkpoint of a transformers ``LlamaForCausalLM`` (its
``config.json`` beside: a Trainer's ``checkpoint-N`` or the save folder): the training state under torchtitan
0.3.0's Llama 3 names, so that its ``CheckpointManager`` loads it into its own ``Llama3Model``.

The names are torchtitan's ``Llama3StateDictAdapter.from_hf_map``; the rows of ``q_proj`` / ``k_proj`` are permuted
per head as its ``from_hf`` does (``_reverse_permute``: transformers' halves -> torchtitan's interleaved pairs), and
so are their masters and both moments (:mod:`zckpt.state.titan_llama`). torchtitan's fused-qkv attention (its
default) keeps its optimizer state under ``wqkv``: the writer adds those keys beside ``wq`` / ``wk`` / ``wv``
(``extra["titan_qkv"]``), so a model built with ``fuse_qkv`` either way loads. Tied embeddings stay tied
(torchtitan's ``enable_weight_tying``). Other models keep the source's names (:mod:`zckpt.dcp.titan`).
"""

from __future__ import annotations

import dataclasses
import json

from zckpt.errors import UnsupportedLayout
from zckpt.io import storage
from zckpt.state.model import Checkpoint
from zckpt.state.titan_llama import MODEL_TYPE, permute_rows, qk_heads, titan_name


def _config(ckpt: Checkpoint) -> tuple[dict | None, str]:
    """(config.json, its path) of the folder beside the checkpoint (the Trainer's ``checkpoint-N``, else the save
    folder); (None, "") where there is none or it is not a JSON object."""
    loc, opts = ckpt.location, ckpt.storage_options
    for folder in (loc.trainer_dir, loc.save_dir):
        if folder and storage.exists(storage.join(folder, "config.json"), opts):
            path = storage.join(folder, "config.json")
            try:
                cfg = json.loads(storage.read_bytes(path, opts))
            except ValueError:
                return None, path
            return (cfg, path) if isinstance(cfg, dict) else (None, path)
    return None, ""


def titan_view(ckpt: Checkpoint) -> Checkpoint:
    """``ckpt`` under torchtitan's Llama 3 names with q/k permuted, where its ``config.json`` says ``llama``; else
    ``ckpt`` as it is. Refused in one line where a parameter has no torchtitan name or q/k's rows do not make the
    config's heads."""
    cfg, cpath = _config(ckpt)
    if cfg is None or cfg.get("model_type") != MODEL_TYPE:
        return ckpt
    path = ckpt.location.input_path
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    if not all(isinstance(x, int) and x > 0 for x in (heads, hidden)) or hidden % heads or \
            cfg.get("head_dim") not in (None, hidden // heads):
        raise UnsupportedLayout(f"{cpath} says hidden_size {hidden}, {heads} heads, head_dim {cfg.get('head_dim')}: "
                                "torchtitan's Llama 3 has heads of hidden_size / heads", path=cpath,
                                hint="--layout dcp keeps the model class's names")
    renamed = {}
    for r in ckpt.records:
        new = titan_name(r.name)
        if new is None:
            raise UnsupportedLayout(f"'{r.name}' has no counterpart in torchtitan 0.3.0's Llama 3 (its "
                                    f"Llama3StateDictAdapter table; {cpath} says llama)", path=path,
                                    hint="--layout dcp keeps the model class's names")
        renamed[r.name] = new
    records = []
    for r in ckpt.records:
        rec = dataclasses.replace(r, name=renamed[r.name],
                                  tied_to=renamed.get(r.tied_to, r.tied_to) if r.tied_to else None)
        n_heads = qk_heads(r.name, cfg)
        if n_heads is not None and r.kind != "tied":
            rows, cols = (int(x) for x in r.shape)
            if not isinstance(n_heads, int) or n_heads <= 0 or rows != n_heads * (hidden // heads) or \
                    (hidden // heads) % 2:
                raise UnsupportedLayout(f"{r.name}: {rows} rows do not make {n_heads} heads of {hidden // heads} "
                                        "(an even size: torchtitan's RoPE permutation pairs a head's rows)",
                                        path=cpath, hint="state the config.json of the model this checkpoint is")
            perm = (lambda ps, h=n_heads, n=rows, c=cols: permute_rows(ps, h, n, c, reverse=True) if ps else ps)
            rec = dataclasses.replace(rec, value=perm(rec.value), exp_avg=perm(rec.exp_avg),
                                      exp_avg_sq=perm(rec.exp_avg_sq),
                                      other_state={k: perm(v) for k, v in rec.other_state.items()})
        records.append(rec)
    groups = [dataclasses.replace(g, names=[renamed.get(n, n) for n in g.names]) for g in ckpt.groups]
    kv = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    qkv = [(r.name[:-len("wq.weight")], int(kv)) for r in records
           if r.name.endswith(".attention.qkv_linear.wq.weight") and r.exp_avg and isinstance(kv, int)]
    notes = list(ckpt.notes) + [f"torchtitan Llama 3 names (as {cpath} says; torchtitan 0.3.0's "
                                "Llama3StateDictAdapter table), q/k rows and their masters and moments permuted per "
                                "head as its from_hf does; attention's optimizer state under wq/wk/wv and the fused "
                                "wqkv (fuse_qkv either way)"]
    extra = {**ckpt.extra, "titan_names": "Llama 3", "titan_not_carried": {}, "titan_qkv": qkv}
    return dataclasses.replace(ckpt, records=records, groups=groups, notes=notes, extra=extra)
