"""One rank of megatron-core 0.16.1 loading a checkpoint ``zckpt convert --to megatron`` wrote, at a (tp, pp, dp)
of the caller's choosing: the oracle of tests/test_megatron_write.py (run under torchrun with the megatron venv).

Megatron-LM's ``load_checkpoint`` path, as fixtures/megatron/generate.py does it for the fixtures (its functions,
imported): fresh ``GPTModel`` + ``DistributedDataParallel`` + ``DistributedOptimizer`` + ``OptimizerParamScheduler``
at the new shape; the content metadata read from the checkpoint; ``dist_checkpointing.load`` of the model's and the
optimizer's sharded state dicts; ``load_state_dict`` of each. Then, on rank 0, every weight, fp32 master,
``exp_avg`` and ``exp_avg_sq`` (gathered back to full tensors by megatron-core's own ``fully_reshardable`` sharded
state dict) must equal the source's ``NAME.oracle.safetensors`` bit for bit; every param group's hyperparameters,
Adam step and members, the scheduler and the counters the source's ``NAME.oracle.json``; and one more training
iteration runs with finite losses. The result is written as JSON to ``--result``.

    python -m torch.distributed.run --nproc-per-node N tests/megatron_write_worker.py --jobs JOBS.json --result R.json

JOBS.json: ``[{"source": NAME, "ckpt": OUT, "shape": [tp, pp, dp], "ddp": {...}}, ...]`` (tp * pp * dp = N each;
``ddp``, optional: ``DistributedDataParallelConfig`` fields the job's DDP is built with instead of generate.py's;
``direct``, optional: also compare each rank's shards parameter by parameter, :func:`_direct`): one process
group, each shape's model parallel groups made and destroyed in turn, so one launch checks several shapes.
``worker``, optional: ``megatron_from_runs_worker`` runs the job with that worker's ``check`` (the job is
tests/test_megatron_from_runs.py's), so one launch serves both test files (tests/megatron_core_loads.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures" / "megatron"


def check(G, job: dict) -> dict | None:
    """Load ``job["ckpt"]`` at ``job["shape"]`` (tp, pp, dp) as Megatron-LM would; rank 0's findings (None
    elsewhere)."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    tp, pp, dp = job["shape"]
    spec = {**G.spec_of(job["source"]), "tp": tp, "pp": pp, "dp": dp}
    assert dist.get_world_size() == tp * pp * dp
    ps.initialize_model_parallel(tp, pp)
    src_doc = json.loads((FIX / f"{job['source']}.oracle.json").read_text())
    ckpt = Path(job["ckpt"])
    it_dir = ckpt / f"iter_{int((ckpt / 'latest_checkpointed_iteration.txt').read_text()):07d}"

    if job.get("ddp"):  # the run's DDP settings (overlap_grad_reduce, bucket_size: several buckets), as given
        import dataclasses
        import megatron.core.distributed as mcd
        plain = getattr(mcd.DistributedDataParallelConfig, "__wrapped__", mcd.DistributedDataParallelConfig)
        mcd.DistributedDataParallelConfig = type("DDPConfig", (plain,), {"__wrapped__": plain, "__init__":
                                                  lambda self, **kw: plain.__init__(self, **{**kw, **job["ddp"]})})
        assert dataclasses.is_dataclass(plain)
    cfg, ddp, opt, sched, _ = G._build(spec, spec["seed"] + 1000)
    if job.get("ddp"):
        import megatron.core.distributed as mcd
        mcd.DistributedDataParallelConfig = mcd.DistributedDataParallelConfig.__wrapped__
    G._train(spec, cfg, ddp, opt, None, iterations=1)  # makes the optimizer's state exist (see generate.py)
    meta = dist_checkpointing.load_content_metadata(str(it_dir))
    sd, _, _ = G._state_dict({**spec, "sharding": meta["distrib_optim_sharding_type"]}, ddp, opt, sched,
                             is_loading=True)
    sd.pop("args")
    common = dist_checkpointing.load_common_state_dict(str(it_dir))
    if getattr(common["args"], "no_save_rng", False):  # Megatron-LM's load_checkpoint then asks for no rng state
        sd.pop("rng_state")
    state = dist_checkpointing.load(sd, str(it_dir), strict="assume_ok_unexpected")
    G._unwrap(ddp).load_state_dict(state["model"], strict=True)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["opt_param_scheduler"])
    direct = _direct(G, job, ddp, opt) if job.get("direct") else None
    tensors, _, groups = G._oracle_tensors(spec, ddp, opt)
    all_groups = [None] * dist.get_world_size()
    dist.all_gather_object(all_groups, groups)
    sched_state = sched.state_dict()
    losses = G._train(spec, cfg, ddp, opt, sched, iterations=1)  # one more iteration at the new shape
    all_losses = [None] * dist.get_world_size()
    dist.all_gather_object(all_losses, losses)
    all_direct = [None] * dist.get_world_size()
    dist.all_gather_object(all_direct, direct)
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

    def summary(per_rank):  # per group: settings and step (all ranks agree), members (union over ranks)
        # A data-parallel rank whose shards hold no element of a group's parameters has the group with no params,
        # so no Adam state and no step (adam_step []): its step is not a disagreement (several buckets over dp 2:
        # each bucket's 1-D parameters, the wd_mult 0 group, all fall in rank 0's half)
        out = {}
        for rank_groups in per_rank:
            for g in rank_groups:
                key = (g["chained_optimizer"], g["group"])
                settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                            if k not in ("params", "chained_optimizer", "group")}
                entry = out.setdefault(key, {"settings": settings, "params": set(), "agree": True, "empty": None})
                if entry["empty"] is not None:
                    drop = ("adam_step",) if entry["empty"] or not g["params"] else ()
                    entry["agree"] &= ({k: v for k, v in entry["settings"].items() if k not in drop} ==
                                       {k: v for k, v in settings.items() if k not in drop})
                if entry["empty"] is not False and g["params"]:
                    entry["settings"] = settings
                entry["empty"] = not g["params"] if entry["empty"] is None else entry["empty"] and not g["params"]
                entry["params"] |= set(g["params"])
        return {f"{k[0]}.{k[1]}": {**{n: x for n, x in v.items() if n != "empty"}, "params": sorted(v["params"])}
                for k, v in sorted(out.items())}

    got, expect = summary(all_groups), summary(src_doc["param_groups_per_rank"])
    flat = [x for r in all_losses for step in r for x in step]
    return {**job, "direct": all_direct if direct is not None else None,
            "tensors": len(tensors), "keys_equal": set(want) == set(tensors),
            "missing": sorted(set(want) - set(tensors))[:5], "extra": sorted(set(tensors) - set(want))[:5],
            "differ": differ[:10], "groups_equal": got == expect, "groups": got, "groups_expected": expect,
            "scheduler_equal": sched_state == src_doc["scheduler"], "scheduler": sched_state,
            "iteration": common.get("iteration"), "iteration_expected": src_doc["iteration"],
            "consumed_train_samples": getattr(common["args"], "consumed_train_samples", None),
            "losses": flat, "losses_finite": bool(flat) and all(math.isfinite(x) for x in flat)}


def _direct(G, job: dict, ddp, opt) -> dict:
    """This rank's loaded distributed-optimizer shards, parameter by parameter (``_get_model_param_range_map``,
    ``_get_main_param_and_optimizer_states``), against the same range of the source's oracle tensors (tp 1 only):
    megatron-core 0.16.1's own gather of several buckets over dp ranks misplaces elements (its
    ``sharded_param_state_fully_reshardable`` warns "param range exceeds unpadded buffer", its issue #504), so a
    layout of several buckets at dp > 1 is checked here instead. {"checked": n, "bad": [(state, name)]}."""
    import torch
    from safetensors.torch import load_file
    assert job["shape"][0] == 1, "the direct check compares whole (tp 1) parameters"
    want = load_file(str(FIX / f"{job['source']}.oracle.safetensors"))
    rename = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
              "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}  # local spec -> saved (TE-style) names
    opts = getattr(opt, "chained_optimizers", [opt])
    first = G._unwrap(ddp)
    layer0 = first.decoder.layers[0].layer_number - 1 if hasattr(first, "decoder") else 0  # pipeline offset
    checked, bad = 0, []
    for name, p in first.named_parameters():
        o = next((o for o in opts if p in o.model_param_gbuf_map), None)
        if o is None:
            continue
        name = name.replace("module.", "")
        for a, b in rename.items():
            name = name.replace(a, b)
        if name.startswith("decoder.layers."):
            i, rest = name[len("decoder.layers."):].split(".", 1)
            name = f"decoder.layers.{int(i) + layer0}.{rest}"
        r = o._get_model_param_range_map(p)["param"]
        got = o._get_main_param_and_optimizer_states(p)
        for kind, key in (("param", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            checked += 1
            exp = want[f"{key}.{name}"].flatten()[r.start:r.end]
            if not torch.equal(got[kind].detach().flatten().view(torch.int32), exp.view(torch.int32)):
                bad.append((kind, name))
    return {"checked": checked, "bad": bad[:10]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", required=True, help="JSON: [{source, ckpt, shape: [tp, pp, dp]}, ...]")
    ap.add_argument("--result", required=True)
    a = ap.parse_args()
    sys.path.insert(0, str(FIX))
    import cpu_shim  # noqa: F401 - before megatron
    import generate as G
    import torch.distributed as dist

    dist.init_process_group("gloo")
    cpu_shim.no_cuda_rng_fork()
    cpu_shim.torch_adam_load_fix()
    sys.path.insert(0, str(ROOT / "tests"))
    import megatron_from_runs_worker
    import megatron_write_moe_worker
    checks = {"megatron_write_worker": check, "megatron_from_runs_worker": megatron_from_runs_worker.check,
              "megatron_write_moe_worker": megatron_write_moe_worker.check}
    results = [checks[job.get("worker", "megatron_write_worker")](G, job)
               for job in json.loads(Path(a.jobs).read_text())]
    if dist.get_rank() == 0:
        Path(a.result).write_text(json.dumps(results, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past the exit-time abort of CPU ranks (fixtures/generate.py exit_rank)
