"""A training state under Hugging Face Llama's names (a DCP checkpoint, or a DeepSpeed one: FSDP2's or DeepSpeed's
own, or zckpt's conversion of a Megatron run) written as Megatron-Core's ``fully_reshardable`` ``torch_dist`` tensors: the exact inverse of the
reader's split (:mod:`zckpt.megatron.hf_names`): q/k/v fused per query group (``[q of the group's heads, k, v]``,
group after group), gate and up fused as ``[gate; up]``, the layers stacked, the norms under TE's fused names.

What Megatron needs and a Hugging Face state does not hold is read from the files or refused in one line, never
defaulted: the model from the ``config.json`` beside the checkpoint (a ``LlamaConfig``: layers, heads, key/value
heads, FFN, vocabulary, ``rms_norm_eps``, ``rope_theta``, ties, ``torch_dtype`` for the training precision); the
param groups' Megatron settings (``wd_mult``, ``lr_mult``, ``max_lr``, ``min_lr``, which a Megatron run's groups
carry and torch's AdamW's do not), each group's members as megatron-core's standard rule makes them (1-D
parameters without weight decay); the scheduler (``opt_param_scheduler``) and counters from the source's side
state. Weights are the fp32 masters cast to the training dtype (what Megatron's copy after each step holds).

A run Megatron did not train (DeepSpeed, FSDP2) holds neither the scheduler nor the groups' settings nor its
global batch: the user states them as the ``pretrain_gpt.py`` flags the job resumes with (``megatron_args``,
:mod:`zckpt.megatron.run_args`), and they are made from those as Megatron-LM makes them, checked against what the
source says; without them such a source is refused naming the flags, and with them a source that holds Megatron's
own is refused too.
"""

from __future__ import annotations

import json
import re

from zckpt.engine.segments import Cast, slice_segments
from zckpt.engine.torchzip import TensorOut
from zckpt.errors import OptionError, UnsupportedLayout
from zckpt.io import storage
from zckpt.megatron import run_args
from zckpt.state.model import Checkpoint

CONFIG = "config.json"
_NEEDED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
           "vocab_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "torch_dtype", "hidden_act")
_GROUP_KEYS = ("wd_mult", "lr_mult", "max_lr", "min_lr")
_DTYPES = {"bfloat16": "bfloat16", "float32": "float32"}
_LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TRAINER_FILES = {"scheduler.pt": "the Trainer's lr schedule (Megatron's is the one --megatron-args states)",
                  "trainer_state.json": "the Trainer's log and counters (the iteration and samples are carried)",
                  "model.safetensors": "the Trainer's bf16 weights (Megatron's are the masters' cast)"}


def read_config(ckpt: Checkpoint) -> dict:
    """The ``LlamaConfig`` beside the checkpoint (its folder, or the Trainer checkpoint's), checked: every field
    Megatron needs, a SwiGLU Llama without biases; one line naming what is missing otherwise."""
    loc = ckpt.location
    where = [d for d in (loc.input_path, loc.trainer_dir) if d]
    path = next((storage.join(d, CONFIG) for d in where
                 if storage.exists(storage.join(d, CONFIG), ckpt.storage_options)), None)
    if path is None:
        raise UnsupportedLayout(f"no {CONFIG} beside the checkpoint: Megatron's model (layers, heads, key/value "
                                "heads, FFN, vocabulary, norm epsilon, rotary base) is read from it", path=loc.input_path,
                                hint=f"put the model's Hugging Face {CONFIG} in the checkpoint folder")
    try:
        cfg = json.loads(storage.read_bytes(path, ckpt.storage_options))
    except (ValueError, UnicodeDecodeError):
        raise UnsupportedLayout(f"{CONFIG} is not JSON", path=path) from None
    if not isinstance(cfg, dict):
        raise UnsupportedLayout(f"{CONFIG} is not a JSON object", path=path)
    cfg = _current(cfg, path)
    if cfg.get("model_type") != "llama":
        raise UnsupportedLayout(f"{CONFIG} says model_type {cfg.get('model_type')!r}: the name map covers Llama",
                                path=path)
    missing = [k for k in _NEEDED if cfg.get(k) is None]
    if missing:
        raise UnsupportedLayout(f"{CONFIG} does not say {', '.join(missing)}, which Megatron's model needs",
                                path=path)
    if cfg["hidden_act"] != "silu" or cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise UnsupportedLayout(f"{CONFIG}: hidden_act {cfg['hidden_act']!r}, biases "
                                f"{bool(cfg.get('attention_bias') or cfg.get('mlp_bias'))}: the name map covers "
                                "SwiGLU Llama without biases", path=path)
    if _DTYPES.get(cfg["torch_dtype"]) is None:
        raise UnsupportedLayout(f"{CONFIG}: torch_dtype {cfg['torch_dtype']!r}; Megatron's weights are written as "
                                "bfloat16 or float32", path=path)
    return cfg


def _current(cfg: dict, path: str) -> dict:
    """transformers 5 writes ``dtype`` (was ``torch_dtype``) and the rotary base in ``rope_parameters`` (was
    ``rope_theta``): either spelling read; a rotary scaling Megatron's plain RoPE does not apply is refused."""
    cfg = dict(cfg)
    if cfg.get("torch_dtype") is None and cfg.get("dtype") is not None:
        cfg["torch_dtype"] = cfg["dtype"]
    for key in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise UnsupportedLayout(f"{CONFIG}: {key} is not an object", path=path)
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise UnsupportedLayout(f"{CONFIG}: {key} says rope_type {kind!r}; Megatron's model is written with "
                                    "plain RoPE (no scaling)", path=path)
        if cfg.get("rope_theta") is None and rope.get("rope_theta") is not None:
            cfg["rope_theta"] = rope["rope_theta"]
    return cfg


def _rows(segs: list, row: int, start: int, n: int) -> list:
    return slice_segments(segs, start * row, n * row)


def _fused(recs: dict, cfg: dict, i: int, kind) -> dict:
    """Layer ``i``'s Megatron tensors (name after ``decoder.layers.`` -> segments) of one kind of state."""
    h, heads, groups = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    kv = cfg.get("head_dim") or h // heads
    per = heads // groups
    p = f"model.layers.{i}."
    q, k, v = (kind(recs[p + f"self_attn.{n}_proj.weight"]) for n in "qkv")
    qkv = []
    for g in range(groups):
        qkv += _rows(q, h, g * per * kv, per * kv) + _rows(k, h, g * kv, kv) + _rows(v, h, g * kv, kv)
    return {"self_attention.linear_qkv.layer_norm_weight": kind(recs[p + "input_layernorm.weight"]),
            "self_attention.linear_qkv.weight": qkv,
            "self_attention.linear_proj.weight": kind(recs[p + "self_attn.o_proj.weight"]),
            "mlp.linear_fc1.layer_norm_weight": kind(recs[p + "post_attention_layernorm.weight"]),
            "mlp.linear_fc1.weight": kind(recs[p + "mlp.gate_proj.weight"]) + kind(recs[p + "mlp.up_proj.weight"]),
            "mlp.linear_fc2.weight": kind(recs[p + "mlp.down_proj.weight"])}


def megatron_tensors(ckpt: Checkpoint, cfg: dict) -> tuple[dict, list[str]]:
    """{Megatron key: TensorOut} for the weights and ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``; and the
    names of the source's records the map used (each must be used once)."""
    recs = {r.name: r for r in ckpt.records if r.kind in ("trainable", "frozen")}
    L, h, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    groups, ffn, vocab = cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg.get("head_dim") or h // heads
    dtype = _DTYPES[cfg["torch_dtype"]]
    tied = bool(cfg["tie_word_embeddings"])
    shapes = {"self_attention.linear_qkv.layer_norm_weight": (h,),
              "self_attention.linear_qkv.weight": ((heads + 2 * groups) * kv, h),
              "self_attention.linear_proj.weight": (h, heads * kv), "mlp.linear_fc1.layer_norm_weight": (h,),
              "mlp.linear_fc1.weight": (2 * ffn, h), "mlp.linear_fc2.weight": (h, ffn)}
    top = {"embedding.word_embeddings.weight": ("model.embed_tokens.weight", (vocab, h)),
           "decoder.final_layernorm.weight": ("model.norm.weight", (h,))}
    if not tied:
        top["output_layer.weight"] = ("lm_head.weight", (vocab, h))
    want = {n for n, _ in top.values()} | {f"model.layers.{i}.{n}" for i in range(L) for n in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
        "post_attention_layernorm.weight")}
    missing = sorted(want - set(recs))
    extra = sorted(n for n in recs if n not in want and not (tied and n == "lm_head.weight"))
    if missing or extra:
        raise UnsupportedLayout(f"the checkpoint's parameters are not the {CONFIG}'s Llama: "
                                + (f"missing {missing[0]}" if missing else f"no Megatron name for {extra[0]}")
                                + (f" and {len(missing) + len(extra) - 1} more" if len(missing) + len(extra) > 1
                                   else ""), path=ckpt.location.input_path)
    stateless = [n for n in want if not recs[n].exp_avg]
    if stateless:
        raise UnsupportedLayout(f"'{stateless[0]}' has no optimizer state: Megatron's distributed optimizer holds "
                                "every parameter's", path=ckpt.location.input_path)
    kinds = {"weight": lambda r: list(r.value) if r.dtype == dtype else [Cast(list(r.value), r.dtype)],
             "param": lambda r: list(r.value), "exp_avg": lambda r: list(r.exp_avg),
             "exp_avg_sq": lambda r: list(r.exp_avg_sq)}
    for r in (recs[n] for n in want):
        if r.dtype != "float32" or any(p.dtype != "float32" for p in list(r.exp_avg) + list(r.exp_avg_sq)):
            raise UnsupportedLayout(f"'{r.name}' is stored as {r.dtype}, not fp32 masters and moments",
                                    path=ckpt.location.input_path)
    out = {}
    for kind, take in kinds.items():
        key = (lambda k: k) if kind == "weight" else (lambda k, kind=kind: f"optimizer.state.{kind}.{k}")
        dt = dtype if kind == "weight" else "float32"
        for mkey, (hf, shape) in top.items():
            out[key(mkey)] = TensorOut(dt, shape, take(recs[hf]))
        layers = [_fused(recs, cfg, i, take) for i in range(L)]
        for rest, shape in shapes.items():
            out[key(f"decoder.layers.{rest}")] = TensorOut(dt, (L,) + shape, [s for lay in layers for s in lay[rest]])
    for i in range(L):  # the local spec's extra state, one object per layer and linear
        for lin in _LINEARS:
            out[f"decoder.layers.{lin}._extra_state/shard_{i}_{L}"] = [None]
    return out, sorted(want)


def megatron_groups(ckpt: Checkpoint, step) -> list[dict]:
    """The groups as Megatron's optimizer saves them (its settings, Adam's step), each checked to hold what
    megatron-core's standard rule puts in it: 1-D parameters in the group with ``wd_mult`` 0, the rest in the
    others."""
    path = ckpt.location.input_path
    shapes = {r.name: r.shape for r in ckpt.records}
    out = []
    for g in ckpt.groups:
        hyper = {k: v for k, v in g.hyperparams.items() if k not in ("params", "step")}
        missing = [k for k in _GROUP_KEYS if k not in hyper]
        if missing:
            raise UnsupportedLayout(f"param group {g.index} has no {', '.join(missing)}: Megatron's groups carry "
                                    "them and this run's do not (a run not trained by Megatron)", path=path)
        dims = {len(shapes[n]) == 1 for n in g.names}
        if len(dims) != 1 or ((hyper["wd_mult"] == 0.0) != dims.pop()):
            raise UnsupportedLayout(f"param group {g.index} is not one of megatron-core's standard groups (1-D "
                                    "parameters alone, with wd_mult 0)", path=path)
        out.append({**hyper, "step": float(step)})
    return out


def plan_from_hf(ckpt: Checkpoint, checkpoint_id: str | None, tp: int | None, pp: int | None, layout: str | None,
                 side: dict | None, chunk_bytes: int | None = None, file_bytes: int | None = None,
                 megatron_args=None, dp: int | None = None, ddp_config=None):
    """The Megatron-LM save folder of ``ckpt`` (Hugging Face Llama names) for ``tp`` / ``pp`` (default 1: the
    source has no Megatron shape), ``side``: the source format's side state (counters, client state);
    ``megatron_args``: the pretrain_gpt.py flags that state what a run not trained by Megatron lacks (the schedule,
    the global batch; :mod:`zckpt.megatron.run_args`)."""
    from zckpt.engine import dcplayout, torchzip
    from zckpt.engine.torchzip import GlobalRef, NewObj
    from zckpt.megatron import writer as w

    path = ckpt.location.input_path
    layout = layout or "fully_reshardable"
    if layout not in w.LAYOUTS:
        raise UnsupportedLayout(f"unknown Megatron layout {layout!r}", path=path, hint=f"one of {', '.join(w.LAYOUTS)}")
    w.check_dp_options(layout, dp, ddp_config)
    if ckpt.state_refusal:  # optimizer state the reader holds but cannot place: never a Megatron save without it
        raise UnsupportedLayout(f"the optimizer state cannot be carried: {ckpt.state_refusal}", path=path,
                                hint="zckpt merge reads the weights exactly")
    cfg = read_config(ckpt)
    tp, pp = w.positive("tp", tp) if tp is not None else 1, w.positive("pp", pp) if pp is not None else 1
    facts = {"vocab_size": cfg["vocab_size"], "num_attention_heads": cfg["num_attention_heads"],
             "num_query_groups": cfg["num_key_value_heads"], "ffn_hidden_size": cfg["intermediate_size"],
             "num_layers": cfg["num_hidden_layers"]}
    w.check_target(facts, tp, pp, path)
    side = side or {}
    counters, client = side.get("train_state") or {}, side.get("client_state") or {}
    sched = client.get("opt_param_scheduler") if isinstance(client.get("opt_param_scheduler"), dict) else \
        {k.split(".", 1)[1]: v for k, v in client.items() if k.startswith("opt_param_scheduler.")}  # DCP's: flat
    steps = {g.step for g in ckpt.groups}
    if len(steps) != 1 or not ckpt.groups:
        raise UnsupportedLayout("the param groups do not agree on Adam's step", path=path)
    step = steps.pop()
    stated = None
    if megatron_args is not None:
        if sched:
            raise OptionError(f"{run_args.OPTION} does not apply: the source holds Megatron's own scheduler and "
                              "group settings (from a Megatron run), carried as saved", path=path,
                              hint=f"drop {run_args.OPTION}")
        stated = run_args.parse(megatron_args)
    elif not sched and not any("wd_mult" in g.hyperparams for g in ckpt.groups):
        raise OptionError(f"a run not trained by Megatron: its scheduler, param groups' Megatron settings and global "
                          f"batch are not in the files; state them with {run_args.OPTION} (at least "
                          f"{', '.join(run_args.REQUIRED)} and --train-iters or --train-samples, as pretrain_gpt.py "
                          "will run)", path=path, hint=f"e.g. {run_args.OPTION} '{run_args.EXAMPLE}'")
    iteration = counters.get("global_steps", step if stated is not None else None)
    if not sched and stated is None or iteration is None:
        raise UnsupportedLayout("the checkpoint holds no Megatron scheduler state (client_state.opt_param_scheduler)"
                                " and iteration (train_state.global_steps), which Megatron-LM's load needs", path=path)
    if step != iteration:
        raise UnsupportedLayout(f"iteration {iteration} but Adam's step {step}: Megatron keeps them equal here",
                                path=path)
    state, _ = megatron_tensors(ckpt, cfg)
    if stated is not None:
        groups, sched, facts = run_args.megatron_groups(ckpt, stated, step, side.get("adam_w_mode"))
        consumed = int(iteration) * stated["global_batch_size"]
        if counters.get("global_samples") not in (None, consumed):
            raise OptionError(f"the source consumed {counters['global_samples']} samples in {iteration} iterations, "
                              f"not {iteration} x --global-batch-size {stated['global_batch_size']} = {consumed}",
                              path=path, hint="give the run's global batch size")
        counters = {**counters, "global_samples": consumed}
    else:
        groups = megatron_groups(ckpt, step)
    dtype = _DTYPES[cfg["torch_dtype"]]
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    args = {"num_layers": cfg["num_hidden_layers"], "hidden_size": h, "ffn_hidden_size": cfg["intermediate_size"],
            "num_attention_heads": heads, "num_query_groups": cfg["num_key_value_heads"],
            "group_query_attention": True, "kv_channels": cfg.get("head_dim") or h // heads,
            "padded_vocab_size": cfg["vocab_size"], "swiglu": True,
            "untie_embeddings_and_output_weights": not cfg["tie_word_embeddings"], "normalization": "RMSNorm",
            "norm_epsilon": cfg["rms_norm_eps"], "position_embedding_type": "rope", "rotary_base": cfg["rope_theta"],
            "add_bias_linear": False, "bf16": dtype == "bfloat16", "fp16": False,
            "params_dtype": GlobalRef("torch", dtype), "use_distributed_optimizer": True, "optimizer": "adam",
            "ckpt_format": "torch_dist", "dist_ckpt_optim_fully_reshardable": True, "no_save_rng": True,
            "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "iteration": iteration}
    if cfg.get("max_position_embeddings") is not None:
        args["max_position_embeddings"] = cfg["max_position_embeddings"]
    if counters.get("global_samples") is not None:
        args["consumed_train_samples"] = counters["global_samples"]
    if stated is not None:
        args.update(run_args.args_of(stated, groups[0]["betas"], groups[0]["eps"], counters["global_samples"]))
    content = {"distrib_optim_sharding_type": "fully_reshardable",
               "distrib_optim_fully_reshardable_mem_efficient": False, "singleton_local_shards": False,
               "chained_optim_avoid_prefix": True}
    common = {"args": NewObj(GlobalRef("argparse", "Namespace"), args), "checkpoint_version": 3.0,
              "iteration": iteration, "optimizer": {"optimizer": {"param_groups": groups},
                                                    "param_state_sharding_type": "fully_reshardable"},
              "opt_param_scheduler": sched}
    if "num_floating_point_operations_so_far" in client:
        common["num_floating_point_operations_so_far"] = client["num_floating_point_operations_so_far"]
    common["content_metadata"] = content
    if layout == "dp_reshardable":  # the optimizer's buckets for one TP/PP/DP (zckpt.megatron.writer_buckets)
        from zckpt.megatron import writer_buckets
        dp_notes, ddp = writer_buckets.lay_out_common(state, common, args, True, cfg["tie_word_embeddings"], tp, pp,
                                                      dp, ddp_config, dtype, path)
    folder = f"iter_{int(iteration):07d}"
    iter_id = (checkpoint_id.rstrip("/") + "/" + folder) if checkpoint_id else None
    part = dcplayout.plan_dcp(state, iter_id, chunk_bytes or dcplayout.CHUNK_BYTES,
                              file_bytes or dcplayout.FILE_BYTES)
    archive = torchzip.plan_archive(common, "common")
    part.files.append(dcplayout.DcpFile(w.COMMON, [(archive, 0)], archive.file_size))
    written = [(f"{folder}/{w.META_JSON}", json.dumps(w.META_DOC).encode()), (w.LATEST, str(iteration).encode())]
    left = {k: f"the {ckpt.format} checkpoint's own (Megatron has no place for it)"
            for k in list(client) if not k.startswith(("opt_param_scheduler", "num_floating_point"))}
    left.update({k: why for k, why in (side.get("left") or {}).items()})
    notes = [f"from {ckpt.format} under Hugging Face Llama names: q/k/v fused per query group, gate/up fused, layers "
             f"stacked; weights = the fp32 masters cast to {dtype} ({CONFIG}'s torch_dtype)",
             f"args from {CONFIG} (tp {tp}, pp {pp}); RNG states none (no_save_rng)"]
    if stated is not None:
        left.pop("lr_scheduler", None)
        notes.append(f"from {run_args.OPTION} ({' '.join(stated['given'])}): Megatron-LM's scheduler at iteration "
                     f"{iteration} (num_steps {facts['num_steps']} samples), lr {facts['lr']!r} (the source's groups "
                     f"ran at {facts['source_lr']!r}), weight decay {facts['weight_decay']!r}; megatron-core's two "
                     f"groups ({len(facts['members'][0])} parameters with weight decay, {len(facts['members'][1])} "
                     "without), betas and eps the source's; consumed_train_samples "
                     f"{counters['global_samples']}")
        if side.get("lr_scheduler") is not None:
            left["lr_scheduler"] = f"the {ckpt.format} run's own scheduler state (Megatron's is made from " \
                                   f"{run_args.OPTION})"
    notes += [f"left out {k}: {why}" for k, why in left.items()]
    if ckpt.location.trainer_dir:  # a Trainer checkpoint's own files: none has a place in a Megatron-LM save
        from zckpt.state import files
        own = [f.rel for f in files.side_files(ckpt.location, ckpt.storage_options) if f.rel != CONFIG]
        left.update({rel: _TRAINER_FILES.get(rel, "the Trainer checkpoint's own file (Megatron-LM has no place for "
                                                  "it)") for rel in own})
        notes.append(f"left out the Trainer checkpoint's own files ({', '.join(own)}): Megatron-LM has no place for "
                     "them")
    carried = ["model", "optimizer (masters, exp_avg, exp_avg_sq, step, param groups)", "opt_param_scheduler",
               "iteration"] + (["consumed_train_samples"] if "consumed_train_samples" in args else [])
    made = None
    if stated is not None:
        made = {"flags": {f: stated[run_args.FLAGS[f][0]] for f in stated["given"]}, "iteration": int(iteration),
                "num_steps": facts["num_steps"], "lr": facts["lr"], "weight_decay": facts["weight_decay"],
                "consumed_train_samples": counters["global_samples"], "opt_param_scheduler": sched}
    dp_reshardable = layout == "dp_reshardable"
    notes += dp_notes if dp_reshardable else []
    return w.MegatronPlan(path, folder, ckpt.format, [(folder, part)], written, notes, layout, tp, pp,
                          carried=carried, not_carried=left, stated=made, dp=ddp.dp if dp_reshardable else None,
                          ddp=ddp.summary() if dp_reshardable else None)
