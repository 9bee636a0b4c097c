"""torchrun worker for tests/test_convert_fsdp2.py: resume zckpt's DCP output with real FSDP2, or continue the
source with real DeepSpeed, on CPU ranks (gloo).

``mode: fsdp2``: for each case every rank builds the fixture's model (``fixtures/generate.py``, another seed and
scrambled buffers, so everything must come from the checkpoint), ``fully_shard`` s each block and the root on a
1-D CPU mesh of this world size, builds ``torch.optim.AdamW`` with the fixture's groups (wrong lr, betas, eps and
weight decay on purpose), then ``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``. Rank 0 writes what was
loaded (full parameters, each Adam state tensor, the groups) into ``OUT/<case>/loaded.*``; with ``train_steps``
the job then trains on fixed global batches split over the ranks (gradient clipping 1.0 and DeepSpeed's WarmupLR
rule, as the fixture's DeepSpeed config has them) and writes the masters after it (``after.safetensors``).

``mode: deepspeed``: the same continuation with DeepSpeed itself from the source checkpoint
(``engine.load_checkpoint``) at the source's world size: ``OUT/<case>/deepspeed.safetensors``
(``safe_get_full_fp32_param`` after the steps) and the losses.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def batches(spec: dict, steps: int, rows: int, rank: int, ws: int):
    """The same global batches for every world size: each rank takes its rows of each."""
    import torch
    gen = torch.Generator().manual_seed(4321)
    per = rows // ws
    for _ in range(steps):
        ids = torch.randint(0, spec["model"]["vocab"], (rows, spec["seq_len"]), generator=gen)
        yield ids[rank * per:(rank + 1) * per]


def warmup_lrs(spec: dict, iteration: int) -> list[float] | None:
    """DeepSpeed WarmupLR (linear) as generate.build_ds_config configures it, at ``last_batch_iteration``."""
    if not spec["scheduler"]:
        return None
    lrs = [spec["lr"]] if spec["param_groups"] == 1 else [spec["lr"], spec["lr"] / 2]
    gamma = iteration / 10 if iteration < 10 else 1.0
    return [lr / 10 + (lr - lr / 10) * gamma for lr in lrs]


def save(out: Path, name: str, tensors: dict, info: dict | None = None) -> None:
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(out / f"{name}.safetensors"))
    if info is not None:
        (out / f"{name}.json").write_text(json.dumps(info, indent=1))


def fsdp2_case(G, case: dict, mesh, rank: int, ws: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    spec = case["spec"]
    torch.manual_seed(777)
    model = G.build_model(spec["model"])
    with torch.no_grad():
        for _, buf in model.named_buffers():
            buf.add_(3.0 if buf.is_floating_point() else 5)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if case.get("bf16_compute") \
        else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    groups = G._param_groups(model, spec)
    opt = torch.optim.AdamW([{"params": g["params"], "lr": 99.0, "weight_decay": 0.5} for g in groups],
                            betas=(0.5, 0.6), eps=1e-3)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    target_keys = sorted(flatten_state_dict(sd)[0])
    dcp.load(sd, checkpoint_id=case["dcp"])
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    loaded = {}
    for n, p in model.named_parameters():
        loaded[f"param/{n}"] = full(p.detach())
        for k, v in opt.state.get(p, {}).items():
            loaded[f"{k}/{n}"] = full(v)
    for n, b in model.named_buffers():
        if n in dict(model.state_dict()):
            loaded[f"buffer/{n}"] = b
    names = {id(p): n for n, p in model.named_parameters()}
    info = {"world_size": ws, "target_keys": target_keys, "tied": model.head.weight is model.emb.weight,
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "groups": [{"names": [names[id(p)] for p in g["params"]], "lr": g["lr"], "betas": list(g["betas"]),
                        "eps": g["eps"], "weight_decay": g["weight_decay"],
                        "decoupled_weight_decay": g["decoupled_weight_decay"]} for g in opt.param_groups]}
    if rank == 0:
        save(Path(case["out"]), "loaded", loaded, info)
    steps = case.get("train_steps", 0)
    if not steps:
        return
    losses, it = [], -1
    if spec["scheduler"]:  # DeepSpeed's WarmupLR state, read back from the DCP output like any other value
        sched = {"lr_scheduler": {"last_batch_iteration": -1}}
        dcp.load(sched, checkpoint_id=case["dcp"])
        it = sched["lr_scheduler"]["last_batch_iteration"]
    for ids in batches(spec, steps, case["rows"], rank, ws):
        loss = model(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        it += 1
        lrs = warmup_lrs(spec, it)
        for g, lr in zip(opt.param_groups, lrs or []):
            g["lr"] = lr
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(float(total) / ws)
    after = {f"param/{n}": full(p.detach()) for n, p in model.named_parameters()}
    if rank == 0:
        save(Path(case["out"]), "after", after, {"losses": losses})


def deepspeed_case(G, case: dict, rank: int, ws: int) -> None:
    import torch
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from resume_worker import build_engine

    spec = dict(case["spec"], world_size=ws)
    engine, model, _ = build_engine(G, spec)
    path, _ = engine.load_checkpoint(case["ckpt"], load_optimizer_states=True, load_lr_scheduler_states=True)
    assert path is not None
    losses = []
    for ids in batches(spec, case["train_steps"], case["rows"], rank, ws):
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        torch.distributed.all_reduce(total)
        losses.append(float(total) / ws)
    after = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            v = safe_get_full_fp32_param(p)  # collective under ZeRO-3
            if v is not None:
                after[f"param/{n}"] = v
    if rank == 0:
        save(Path(case["out"]), "deepspeed", after, {"losses": losses, "deepspeed": deepspeed.__version__})


def accelerate_case(G, case: dict, mesh, rank: int, ws: int) -> None:
    """The Trainer fixture's Llama under FSDP2 (``fully_shard`` per decoder layer and the root), loaded from the
    converted ``checkpoint-N`` by Accelerate's own ``load_fsdp_model`` / ``load_fsdp_optimizer`` (what
    ``Trainer._load_from_checkpoint`` and ``_load_optimizer_and_scheduler`` call for FSDP2 + SHARDED_STATE_DICT;
    Accelerate runs FSDP on GPUs only, so its plugin and accelerator are stood in for by the fields those two
    functions read), plus the Trainer's ``scheduler.pt`` into a fresh linear schedule."""
    import types
    import torch
    import transformers
    from accelerate import PartialState
    from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer
    from torch.distributed.fsdp import StateDictType, fully_shard

    PartialState(cpu=True)  # accelerate's logging wants its state (the process group already exists)
    spec = case["spec"]
    transformers.set_seed(spec["seed"] + 99)
    model = G.build_hf_model(spec["model"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = set(transformers.trainer_pt_utils.get_parameter_names(model, [torch.nn.LayerNorm], ["bias", "norm"]))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for n, p in named if n in decay], "weight_decay": 0.5},
                             {"params": [p for n, p in named if n not in decay], "weight_decay": 0.5}], lr=99.0)
    sched = transformers.get_linear_schedule_with_warmup(opt, 0, 10)
    plugin = types.SimpleNamespace(fsdp_version=2, state_dict_type=StateDictType.SHARDED_STATE_DICT,
                                   state_dict_config=types.SimpleNamespace(offload_to_cpu=False, rank0_only=False),
                                   optim_state_dict_config=None)
    accel = types.SimpleNamespace(wait_for_everyone=torch.distributed.barrier, process_index=rank,
                                  num_processes=ws, is_fsdp2=True, is_main_process=rank == 0)
    load_fsdp_model(plugin, accel, model, case["dcp"])
    load_fsdp_optimizer(plugin, accel, opt, model, case["dcp"])
    sched.load_state_dict(torch.load(Path(case["dcp"]) / "scheduler.pt", weights_only=True))
    loaded = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        loaded[f"param/{n}"] = p.detach().full_tensor()
        for k, v in opt.state.get(p, {}).items():
            loaded[f"{k}/{n}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    info = {"world_size": ws, "last_lr": sched.get_last_lr(), "scheduler": sched.state_dict()["last_epoch"],
            "groups": [{"names": [names[id(p)] for p in g["params"]], "lr": g["lr"], "betas": list(g["betas"]),
                        "eps": g["eps"], "weight_decay": g["weight_decay"]} for g in opt.param_groups]}
    if rank == 0:
        save(Path(case["out"]), "accelerate", loaded, info)


def main(job_path: str) -> None:
    import torch
    import torch.distributed as dist

    G = __import__("ds_oracle").generate_module()
    job = json.loads(Path(job_path).read_text())
    if job["mode"] == "deepspeed":
        import deepspeed
        if any(c["spec"]["dtype"] == "fp16" for c in job["cases"]):
            G.enable_cpu_fp16()
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = None
    if job["mode"] in ("fsdp2", "accelerate"):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (ws,))
    for case in job["cases"]:
        if job["mode"] == "fsdp2":
            fsdp2_case(G, case, mesh, rank, ws)
        elif job["mode"] == "accelerate":
            accelerate_case(G, case, mesh, rank, ws)
        else:
            deepspeed_case(G, case, rank, ws)
        dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
