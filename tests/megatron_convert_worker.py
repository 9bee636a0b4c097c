"""torchrun worker for tests/test_megatron_convert.py: a Megatron-Core checkpoint converted by zckpt, loaded by the
real framework into transformers' ``LlamaForCausalLM`` of the fixture's shape, at a world size the source did not
have. Rank 0 writes what was loaded (``DUMP.safetensors``: ``param/<n>``, ``exp_avg/<n>``, ``exp_avg_sq/<n>``,
``step/<n>``) and the groups (``DUMP.json``).

``fsdp2 CKPT``: FSDP2 (``fully_shard`` per decoder layer and the root) + ``torch.optim.AdamW`` built from
``zckpt.integrations.fsdp2.param_groups``, then ``fsdp2.load``: as docs/megatron.md shows.
``deepspeed CKPT STAGE``: ``deepspeed.initialize`` with torch's AdamW over Megatron's standard two groups (2-D
weights with weight decay, 1-D norms without), then a plain ``engine.load_checkpoint``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def llama(meta: dict):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=meta["hidden_size"], intermediate_size=meta["ffn_hidden_size"],
                      num_hidden_layers=meta["num_layers"], num_attention_heads=meta["num_attention_heads"],
                      num_key_value_heads=meta["num_query_groups"], head_dim=meta["kv_channels"],
                      vocab_size=meta["vocab_size"], tie_word_embeddings=meta["tied_embeddings"],
                      attention_bias=False, mlp_bias=False)
    torch.manual_seed(1234)  # another init: every value must come from the checkpoint
    return LlamaForCausalLM(cfg).float()


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().contiguous().clone()


def fsdp2_case(ckpt: str, meta: dict) -> tuple[dict, list]:
    from torch.distributed.fsdp import fully_shard
    from zckpt.integrations import fsdp2
    model = llama(meta)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(fsdp2.param_groups(model, ckpt))
    report = fsdp2.load(model, opt, ckpt)
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for n, p in model.named_parameters():
        out[f"param/{n}"] = full(p)
        for k, v in opt.state.get(p, {}).items():
            out[f"{k}/{n}"] = full(v)
    groups = [{"names": [names[id(p)] for p in g["params"]], "lr": g["lr"], "weight_decay": g["weight_decay"],
               "betas": list(g["betas"]), "eps": g["eps"]} for g in opt.param_groups]
    return out, groups, {"report": str(report), "counters": report.counters}


def deepspeed_case(ckpt: str, meta: dict, stage: int) -> tuple[dict, list]:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    model = llama(meta)
    named = list(model.named_parameters())
    groups = [{"params": [p for _, p in named if p.ndim > 1], "weight_decay": 0.5},  # the wrong values on
              {"params": [p for _, p in named if p.ndim == 1], "weight_decay": 0.5}]  # purpose: the load sets them
    names = {id(p): n for n, p in named}
    member_names = [[names[id(p)] for p in g["params"]] for g in groups]  # DeepSpeed then swaps in flat partitions
    opt = torch.optim.AdamW(groups, lr=1.0)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": stage}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    path, client = engine.load_checkpoint(ckpt, load_optimizer_states=True, load_lr_scheduler_states=False)
    assert path is not None
    if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):
        # DeepSpeed 0.19.8 links each param's view of the optimizer state once, lazily, at its first step (none has
        # run): link now with DeepSpeed's own code (fixtures/generate.py _relink_hp_optimizer_state says why)
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    out = {}
    for n, p in named:
        out[f"param/{n}"] = safe_get_full_fp32_param(p).contiguous().clone()
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{k}/{n}"] = safe_get_full_optimizer_state(p, k).contiguous().clone()
    steps = {float(s["step"]) for s in engine.optimizer.optimizer.state.values()}
    groups = [{"names": m, "lr": g["lr"], "weight_decay": g["weight_decay"], "betas": list(g["betas"]),
               "eps": g["eps"]} for m, g in zip(member_names, engine.optimizer.param_groups)]
    return out, groups, {"steps": sorted(steps), "global_steps": engine.global_steps,
                         "global_samples": engine.global_samples,
                         "client": {k: v for k, v in client.items() if k in ("opt_param_scheduler",
                                                                            "num_floating_point_operations_so_far")}}


def main() -> None:
    mode, ckpt, meta_path, dump = sys.argv[1:5]
    meta = json.loads(open(meta_path).read())
    dist.init_process_group("gloo")
    if mode == "fsdp2":
        out, groups, info = fsdp2_case(ckpt, meta)
    else:
        out, groups, info = deepspeed_case(ckpt, meta, int(sys.argv[5]))
    if dist.get_rank() == 0:
        from safetensors.torch import save_file
        save_file(out, dump + ".safetensors")
        with open(dump + ".json", "w") as f:
            json.dump({"world_size": dist.get_world_size(), "groups": groups, **info}, f, default=str)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past the exit-time abort of CPU ranks (fixtures/generate.py exit_rank)
