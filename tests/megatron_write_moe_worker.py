"""One rank of megatron-core 0.16.1 loading a mixture-of-experts checkpoint ``zckpt convert --to megatron --ep N``
wrote, at an expert-parallel size the source did not have: the oracle of tests/test_megatron_write_moe.py, run in
the shared launch of tests/megatron_write_worker.py (tests/megatron_core_loads.py).

As Megatron-LM's ``load_checkpoint`` does it, with megatron-core's own classes: ``initialize_model_parallel(tp, pp,
expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)``; a ``GPTModel`` of the source's MoE shape
(``get_gpt_decoder_block_spec`` of the local spec, as Megatron-LM's ``gpt_builders`` builds it for
``--num-experts``: SequentialMLP, the source's router, dispatcher and ``--moe-layer-freq``), ``Float16Module``,
``DistributedDataParallel`` and ``get_megatron_optimizer`` (at ep > 1 a chain of the dense and the experts'
optimizers, at ep 1 one); ``dist_checkpointing.load`` + ``load_state_dict`` of each. Then rank 0 compares every
weight (the routers' ``expert_bias`` buffers included), fp32 master, ``exp_avg`` and ``exp_avg_sq``, gathered to
full tensors by megatron-core's own ``fully_reshardable`` sharded state dict, with the source's
``NAME.oracle.safetensors`` bit for bit; each parameter's group settings and Adam step with the source's (by
parameter name: at another ep the experts change optimizer and group); the scheduler; then one more iteration
runs with finite losses.

Job: ``{"source": NAME, "ckpt": OUT, "shape": [tp, pp, dp], "ep": N, "etp": M, "worker":
"megatron_write_moe_worker"}``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures" / "megatron"
_SHIMMED = []


def _ckpt_args(it_dir: Path) -> dict:
    """The model's shape as the output's args state it (what Megatron-LM's --use-checkpoint-args reads)."""
    import torch
    return vars(torch.load(str(it_dir / "common.pt"), weights_only=False)["args"])


def _build(G, spec: dict, a: dict, sched_doc: dict, seed: int):
    """GPTModel with the source's MoE layers, DDP, the distributed optimizer and the run's scheduler."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(seed)
    dt = torch.bfloat16
    cfg = TransformerConfig(
        num_layers=a["num_layers"], hidden_size=a["hidden_size"], num_attention_heads=a["num_attention_heads"],
        num_query_groups=a["num_query_groups"], ffn_hidden_size=a["ffn_hidden_size"], kv_channels=a["kv_channels"],
        gated_linear_unit=a["swiglu"], activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        perform_initialization=True, params_dtype=dt, bf16=True, pipeline_dtype=dt, init_method_std=0.02,
        tensor_model_parallel_size=spec["tp"], pipeline_model_parallel_size=spec["pp"],
        expert_model_parallel_size=spec["ep"], expert_tensor_parallel_size=spec["etp"],
        sequence_parallel=False, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        num_moe_experts=a["num_experts"], moe_router_topk=a["moe_router_topk"],
        moe_ffn_hidden_size=a["moe_ffn_hidden_size"], moe_token_dispatcher_type=a["moe_token_dispatcher_type"],
        moe_layer_freq=a["moe_layer_freq"], moe_aux_loss_coeff=a["moe_aux_loss_coeff"],
        moe_router_load_balancing_type=a["moe_router_load_balancing_type"],
        moe_router_score_function=a["moe_router_score_function"],
        moe_router_enable_expert_bias=a["moe_router_enable_expert_bias"],
        moe_router_bias_update_rate=a["moe_router_bias_update_rate"], moe_grouped_gemm=False,
    )
    block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(cfg, block, vocab_size=a["padded_vocab_size"], max_sequence_length=a["seq_length"],
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=not a["untie_embeddings_and_output_weights"],
                     position_embedding_type="rope")
    model = Float16Module(cfg, model)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=True, check_for_nan_in_grad=False)
    ddp = DistributedDataParallel(cfg, ddp_cfg, model)
    # the run's lr bounds (megatron-core 0.19 matches saved groups by max_lr / min_lr too); the rest wrong on
    # purpose: the load sets every value
    ocfg = OptimizerConfig(optimizer="adam", lr=sched_doc["max_lr"], min_lr=sched_doc["min_lr"], weight_decay=0.5,
                           adam_beta1=0.5, adam_beta2=0.5, adam_eps=0.5, bf16=True, params_dtype=dt, clip_grad=1.0,
                           use_distributed_optimizer=True)
    opt = get_megatron_optimizer(ocfg, [ddp])
    # the run's schedule as its flags state it (Megatron-LM's scheduler asserts each value against the checkpoint's;
    # it sets the groups' weight decay from its own start_wd at the load's step)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, **{k: sched_doc[k] for k in (
        "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd", "end_wd",
        "wd_incr_steps", "wd_incr_style")})
    return cfg, ddp, opt, sched


def _per_param(per_rank: list) -> tuple[dict, list]:
    """{parameter name: its group's settings}, every rank's groups together (a rank whose shard holds none of a
    group's elements has no Adam step for it: left out), and the Adam steps seen."""
    out, steps = {}, set()
    for rank_groups in per_rank:
        for g in rank_groups:
            settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                        if k not in ("params", "chained_optimizer", "group", "adam_step")}
            steps |= set(g["adam_step"])
            for n in g["params"]:
                if out.setdefault(n, settings) != settings:
                    out[n] = {"disagree": [out[n], settings]}
    return out, sorted(steps)


def check(G, job: dict) -> dict | None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    if not _SHIMMED:  # MoE without TransformerEngine (fixtures/megatron/README.md, item 9); after the dense jobs
        import contextlib

        import cpu_shim
        import torch
        cpu_shim.moe_without_te()
        # MoELayer makes a torch.cuda.Stream (as Megatron-LM's get_model does: cpu_shim.megatron_lm's streams and
        # events that do nothing)
        torch.cuda.Stream, torch.cuda.Event = cpu_shim._Stream, cpu_shim._Event
        torch.cuda.current_stream = torch.cuda.default_stream = lambda *a, **k: cpu_shim._Stream()
        torch.cuda.stream = lambda s: contextlib.nullcontext()
        _SHIMMED.append(True)
    tp, pp, dp = job["shape"]
    src_doc = json.loads((FIX / f"{job['source']}.oracle.json").read_text())
    ckpt = Path(job["ckpt"])
    it_dir = ckpt / f"iter_{int((ckpt / 'latest_checkpointed_iteration.txt').read_text()):07d}"
    a = _ckpt_args(it_dir)
    spec = {**G.BASE, "tp": tp, "pp": pp, "dp": dp, "ep": job["ep"], "etp": job.get("etp", 1),
            "vocab": a["padded_vocab_size"], "sharding": "fully_reshardable", "name": job["source"]}
    assert dist.get_world_size() == tp * pp * dp
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=spec["ep"],
                                 expert_tensor_parallel_size=spec["etp"])
    cfg, ddp, opt, sched = _build(G, spec, a, src_doc["scheduler"], 4321)
    G._train(spec, cfg, ddp, opt, None, iterations=1)  # makes the optimizer's state exist (see generate.py)
    meta = dist_checkpointing.load_content_metadata(str(it_dir))
    sd, _, _ = G._state_dict({**spec, "sharding": meta["distrib_optim_sharding_type"]}, ddp, opt, sched,
                             is_loading=True)
    sd.pop("args")
    common = dist_checkpointing.load_common_state_dict(str(it_dir))
    if getattr(common["args"], "no_save_rng", False):
        sd.pop("rng_state")
    state = dist_checkpointing.load(sd, str(it_dir), strict="assume_ok_unexpected")
    G._unwrap(ddp).load_state_dict(state["model"], strict=True)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["opt_param_scheduler"])
    chained = len(getattr(opt, "chained_optimizers", [opt]))
    tensors, _, groups = G._oracle_tensors(spec, ddp, opt)
    all_groups = [None] * dist.get_world_size()
    dist.all_gather_object(all_groups, groups)
    sched_state = sched.state_dict()
    losses = G._train(spec, cfg, ddp, opt, sched, iterations=1)  # one more iteration at the new shape
    all_losses = [None] * dist.get_world_size()
    dist.all_gather_object(all_losses, losses)
    ps.destroy_model_parallel()
    if dist.get_rank() != 0:
        return None
    from safetensors.torch import load_file
    want = load_file(str(FIX / f"{job['source']}.oracle.safetensors"))
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

    def same_bits(x, y):
        return (x.dtype == y.dtype and x.shape == y.shape and
                torch.equal(x.contiguous().view(ints[x.element_size()]), y.contiguous().view(ints[y.element_size()])))

    differ = sorted(k for k in want if k in tensors and not same_bits(want[k], tensors[k]))
    got, got_steps = _per_param(all_groups)
    expect, expect_steps = _per_param(src_doc["param_groups_per_rank"])
    flat = [x for r in all_losses for step in r for x in step]
    return {**job, "tensors": len(tensors), "keys_equal": set(want) == set(tensors),
            "missing": sorted(set(want) - set(tensors))[:5], "extra": sorted(set(tensors) - set(want))[:5],
            "experts": sum(1 for k in tensors if ".mlp.experts.experts." in k), "differ": differ[:10],
            "groups_equal": got == expect, "groups": got, "groups_expected": expect,
            "steps": got_steps, "steps_expected": expect_steps, "chained_optimizers": chained,
            "scheduler_equal": sched_state == src_doc["scheduler"], "scheduler": sched_state,
            "iteration": common.get("iteration"), "iteration_expected": src_doc["iteration"],
            "losses": flat, "losses_finite": bool(flat) and all(math.isfinite(x) for x in flat)}
