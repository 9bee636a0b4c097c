"""One rank of megatron-core 0.16.1 resuming a checkpoint that ``zckpt convert --to megatron --megatron-args`` wrote
from a run Megatron did not train (DeepSpeed, FSDP2): the oracle of tests/test_megatron_from_runs.py.

As Megatron-LM's ``pretrain()`` + ``load_checkpoint`` do, with megatron-core's own classes (the model, DDP and
optimizer built by fixtures/megatron/generate.py's ``_build`` at the job's shape): the ``OptimizerParamScheduler`` is
made from the job's constructor values (what ``get_optimizer_param_scheduler`` makes of the flags, computed by the
test) with ``use_checkpoint_opt_param_scheduler=False`` and ``override_opt_param_scheduler=False``, as a
``pretrain_gpt.py`` run without those flags has it, so its ``load_state_dict`` asserts that every value the
checkpoint holds equals the class's; ``dist_checkpointing.load`` of the model's and optimizer's sharded state
dicts, ``load_state_dict`` of each. Rank 0 then gathers every weight, fp32 master, ``exp_avg`` and ``exp_avg_sq``
(megatron-core's ``fully_reshardable`` sharded state dict) and compares them bit for bit with the job's expected
safetensors (the source's state as its own framework gives it, fused by the test); it reports the param groups (as
loaded: settings, Adam's step, members), the lr and weight decay the scheduler set on them, the scheduler's state
and the counters; then one more training iteration runs.

    python -m torch.distributed.run --nproc-per-node N tests/megatron_from_runs_worker.py --jobs J.json --result R.json
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
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    tp, pp, dp = job["shape"]
    spec = {**G.BASE, **job["spec"], "tp": tp, "pp": pp, "dp": dp, "sharding": "fully_reshardable",
            "name": job["name"]}
    assert dist.get_world_size() == tp * pp * dp
    ps.initialize_model_parallel(tp, pp)
    ckpt = Path(job["ckpt"])
    it_dir = ckpt / f"iter_{int((ckpt / 'latest_checkpointed_iteration.txt').read_text()):07d}"
    cfg, ddp, opt, _, _ = G._build(spec, spec["seed"] + 1000)
    G._train(spec, cfg, ddp, opt, None, iterations=1)  # makes the optimizer's state exist (see generate.py)
    sched = OptimizerParamScheduler(opt, **job["scheduler_args"], use_checkpoint_opt_param_scheduler=False,
                                    override_opt_param_scheduler=False)
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
    sched.load_state_dict(state["opt_param_scheduler"])  # asserts each value equals the class's
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
    want = load_file(job["expected"])
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

    def same_bits(x, y):
        return (x.dtype == y.dtype and x.shape == y.shape and
                torch.equal(x.contiguous().view(ints[x.element_size()]), y.contiguous().view(ints[y.element_size()])))

    differ = sorted(k for k in want if k in tensors and not same_bits(want[k], tensors[k]))
    out = {}
    for rank_groups in all_groups:
        for g in rank_groups:
            key = f"{g['chained_optimizer']}.{g['group']}"
            settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                        if k not in ("params", "chained_optimizer", "group")}
            entry = out.setdefault(key, {"settings": settings, "params": set(), "agree": True})
            entry["agree"] &= entry["settings"] == settings
            entry["params"] |= set(g["params"])
    flat = [x for r in all_losses for step in r for x in step]
    return {"name": job["name"], "ckpt": job["ckpt"], "shape": job["shape"], "tensors": len(tensors),
            "sharding": meta["distrib_optim_sharding_type"],
            "keys_equal": set(want) == set(tensors), "missing": sorted(set(want) - set(tensors))[:5],
            "extra": sorted(set(tensors) - set(want))[:5], "differ": differ[:10],
            "groups": {k: {**v, "params": sorted(v["params"])} for k, v in sorted(out.items())},
            "scheduler": sched_state, "iteration": common.get("iteration"),
            "consumed_train_samples": getattr(common["args"], "consumed_train_samples", None),
            "losses": flat, "losses_finite": bool(flat) and all(math.isfinite(x) for x in flat)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", required=True)
    ap.add_argument("--result", required=True)
    a = ap.parse_args()
    sys.path.insert(0, str(FIX))
    import cpu_shim  # noqa: F401 - before megatron
    import generate as G
    import torch.distributed as dist

    dist.init_process_group("gloo")
    cpu_shim.no_cuda_rng_fork()
    cpu_shim.torch_adam_load_fix()
    results = [check(G, job) for job in json.loads(Path(a.jobs).read_text())]
    if dist.get_rank() == 0:
        Path(a.result).write_text(json.dumps(results, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past the exit-time abort of CPU ranks (fixtures/generate.py exit_rank)
