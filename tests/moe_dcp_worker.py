"""torchrun worker (gloo, CPU ranks) for tests/test_moe_dcp.py and fixtures/gen_fsdp2_moe.py: a transformers 5 MoE
model (Mixtral / Qwen3-MoE: fused experts ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, router
``mlp.gate.weight``) under FSDP2 (``fully_shard`` per decoder layer and at the root, a 1-D CPU mesh of this world
size) with ``torch.optim.AdamW`` in two param groups: the experts (``.experts.``) and the rest.

Run as ``moe_dcp_worker.py JOB.json``; each case of the job is one of:

``load``: build the model from ``config`` (a folder holding config.json) with another seed, AdamW with wrong
hyperparameters on purpose, then ``get_state_dict`` -> ``dcp.load(checkpoint_id=dcp)`` -> ``set_state_dict`` (what
FSDP2 users resume with). Rank 0 writes ``OUT/loaded.safetensors`` (``param/<name>``, ``exp_avg/<name>``,
``exp_avg_sq/<name>``, ``step/<name>``: the full tensors; ``buffer/<name>``: the persistent buffers) and
``OUT/loaded.json`` (groups, the keys asked for); then one optimizer step on a fixed batch runs and
``OUT/after.json`` records its loss and whether every parameter moved.

``deepspeed`` (a job with ``"deepspeed": true``): DeepSpeed, without AutoEP, at ZeRO-``stage`` (bf16) loads the
DeepSpeed checkpoint ``ckpt`` (:func:`deepspeed_case`); rank 0 writes ``OUT/deepspeed.safetensors`` / ``.json``.

``titan``: torchtitan 0.3.0's Qwen3 MoE model loads ``BASE/ckpt/step-<step>`` with its ``CheckpointManager``
(:func:`titan_case`); rank 0 writes ``OUT/titan.safetensors`` / ``.json``.

``train``: build the model from the dict ``config`` (seed 0), train ``steps`` steps on fixed batches, then
``dcp.save({"model": msd, "optim": osd}, OUT/dcp)`` of ``get_state_dict`` (what an FSDP2 run saves); rank 0 writes
``OUT/config.json`` and the full state (``full_state_dict=True``) as ``OUT/expected/oracle.safetensors``
(``fp32/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``) with ``OUT/expected/oracle.json`` (step, groups).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _model(config, seed: int):
    import torch
    import transformers
    cfg = transformers.AutoConfig.from_pretrained(config) if isinstance(config, str) else \
        transformers.AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    return model, cfg


def _shard(model, mesh) -> None:
    from torch.distributed.fsdp import fully_shard
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _groups(model, lr=None, wd=None, first: str | None = None) -> list[dict]:
    """Two groups: everything but the experts, then the experts; or (``first``, a regex) the parameters it finds
    in their names, then the rest."""
    import re
    named = list(model.named_parameters())
    if first:
        dense = [p for n, p in named if re.search(first, n)]
        experts = [p for n, p in named if not re.search(first, n)]
    else:
        dense = [p for n, p in named if ".experts." not in n]
        experts = [p for n, p in named if ".experts." in n]
    extra = {} if lr is None else {"lr": lr, "weight_decay": wd}
    return [{"params": dense, **extra}, {"params": experts, **extra}]


def _batch(cfg, rank: int, ws: int, rows: int = 4, seq: int = 6):
    import torch
    gen = torch.Generator().manual_seed(4321)
    ids = torch.randint(0, cfg.vocab_size, (rows, seq), generator=gen)
    per = rows // ws
    return ids[rank * per:(rank + 1) * per]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _save(path: Path, tensors: dict) -> None:
    from safetensors.torch import save_file
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(path))


def load_case(case: dict, mesh, rank: int, ws: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, cfg = _model(case["config"], 777)
    _shard(model, mesh)
    opt = torch.optim.AdamW(_groups(model, 99.0, 0.5), betas=(0.5, 0.6), eps=1e-3)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    keys = sorted(flatten_state_dict(sd)[0])
    dcp.load(sd, checkpoint_id=case["dcp"])
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    loaded = {}
    for n, p in model.named_parameters():
        loaded[f"param/{n}"] = _full(p.detach())
        for k, v in opt.state.get(p, {}).items():
            loaded[f"{k}/{n}"] = _full(v).reshape(-1) if k == "step" else _full(v)
    persistent = set(model.state_dict())  # DeepSeek-V3's router e_score_correction_bias: a persistent buffer
    loaded.update({f"buffer/{n}": _full(b.detach()) for n, b in model.named_buffers() if n in persistent})
    names = {id(p): n for n, p in model.named_parameters()}
    info = {"world_size": ws, "target_keys": keys,
            "groups": [{"names": [names[id(p)] for p in g["params"]],
                        **{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}}
                       for g in opt.param_groups]}
    out = Path(case["out"])
    if rank == 0:
        _save(out / "loaded.safetensors", loaded)
        (out / "loaded.json").write_text(json.dumps(info, indent=1, default=str))
    before = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    loss = model(_batch(cfg, rank, ws), labels=_batch(cfg, rank, ws)).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    moved = {n: not torch.equal(before[n], _full(p.detach())) for n, p in model.named_parameters()}
    if rank == 0:
        (out / "after.json").write_text(json.dumps({"loss": float(loss.detach()), "moved": moved}, indent=1))


def train_case(case: dict, mesh, rank: int, ws: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, cfg = _model(case["config"], 0)
    _shard(model, mesh)
    opt = torch.optim.AdamW(_groups(model), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    opt.param_groups[1]["weight_decay"] = 0.0
    torch.manual_seed(1 + rank)
    for step in range(case["steps"]):
        ids = torch.randint(0, cfg.vocab_size, (2, 6))
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    out = Path(case["out"])
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out / "dcp"))
    fmsd, fosd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        cfg.save_pretrained(str(out / "dcp"))
        tensors = {f"fp32/{n}": t for n, t in fmsd.items()}
        steps = set()
        for n, st in fosd["state"].items():
            tensors[f"exp_avg/{n}"], tensors[f"exp_avg_sq/{n}"] = st["exp_avg"], st["exp_avg_sq"]
            steps.add(float(st["step"]))
        _save(out / "expected" / "oracle.safetensors", tensors)
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in fosd["param_groups"]]
        (out / "expected" / "oracle.json").write_text(json.dumps(
            {"world_size": ws, "steps": case["steps"], "step": sorted(steps), "groups": groups,
             "model_type": cfg.model_type, "torch": torch.__version__,
             "transformers": __import__("transformers").__version__}, indent=1, default=str))


def deepspeed_case(case: dict, rank: int, ws: int) -> None:
    """DeepSpeed (no AutoEP: the transformers class as it is) at ZeRO-``stage`` loads ``ckpt`` with a plain
    ``engine.load_checkpoint``; its state captured with DeepSpeed's own API (``fixtures/generate.collect_oracle``:
    ``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``, the optimizer's steps and groups); then one
    training step."""
    import torch
    import deepspeed
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ds_oracle
    G = ds_oracle.generate_module()

    model, cfg = _model(case["config"], 777)
    opt = torch.optim.AdamW(_groups(model, 99.0, 0.5, case.get("first_group")), betas=(0.5, 0.6), eps=1e-3)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
          "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": case["stage"]},
          "bf16": {"enabled": True}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    path, _ = engine.load_checkpoint(case["ckpt"], load_optimizer_states=True, load_lr_scheduler_states=False)
    assert path is not None, case["ckpt"]
    tensors, info = G.collect_oracle(engine, model, {"stage": case["stage"], "optimizer": "adamw"})
    info["groups"] = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                      for g in engine.optimizer.optimizer.param_groups]
    out = Path(case["out"])
    if rank == 0:
        _save(out / "deepspeed.safetensors", tensors)
        (out / "deepspeed.json").write_text(json.dumps(info, indent=1, default=str))
    ids = _batch(cfg, rank, ws)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    if rank == 0:
        (out / "after.json").write_text(json.dumps({"loss": float(loss.detach())}))


def _titan_kernels_stub() -> None:
    """torchtitan 0.3.0's models import ``torchtitan.distributed.minimal_async_ep.kernels``, which imports triton
    (GPU kernels of its asynchronous expert-parallel dispatch) at module level; triton is not installed on these
    CPU ranks. That one module is stood in for by one whose every kernel raises if called (none is: no expert
    parallelism, no forward here); torch's own triton detection is untouched."""
    import types
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if name in sys.modules:
        return
    mod = types.ModuleType(name)

    def attr(k):
        if k.startswith("__"):
            raise AttributeError(k)

        def gpu_only(*a, **kw):
            raise RuntimeError(f"torchtitan's minimal_async_ep kernel {k} needs triton (a GPU)")
        return gpu_only
    mod.__getattr__ = attr
    sys.modules[name] = mod


def _qwen3_config(case: dict, d: dict):
    """torchtitan's Qwen3 MoE config at ``d`` (load_balance_coeff None: no expert_bias_E, the source's router has
    none)."""
    from torchtitan.models import qwen3 as Q
    from torchtitan.models.common.embedding import Embedding
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3.model import Qwen3Model
    cfg = Qwen3Model.Config(
        vocab_size=d["vocab"], dim=d["dim"], norm=Q._qwen3_norm(d["dim"]),
        tok_embeddings=Embedding.Config(num_embeddings=d["vocab"], embedding_dim=d["dim"],
                                        param_init=Q._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=d["dim"], out_features=d["vocab"], param_init=Q._LINEAR_INIT),
        layers=Q._build_qwen3_moe_layers(
            n_layers=d["layers"], dim=d["dim"], n_heads=d["heads"], n_kv_heads=d["kv_heads"],
            head_dim=d["head_dim"], moe_hidden_dim=d["moe_hidden"], num_experts=d["experts"], top_k=d["top_k"],
            attn_backend="flex", moe_comm_backend="standard", fuse_qkv=case.get("fuse_qkv", True),
            rope=CosSinRoPE.Config(dim=d["head_dim"], max_seq_len=64, theta=1000000.0)))
    for layer in cfg.layers:
        layer.moe.load_balance_coeff = None  # no expert_bias_E: the source's router has none
    return cfg


def titan_case(case: dict, mesh, rank: int, ws: int) -> None:
    """torchtitan 0.3.0's own Qwen3 MoE model (``Qwen3Model`` from its ``_build_qwen3_moe_layers``: attention with
    q/k norms, fused ``wqkv`` unless ``case["fuse_qkv"]`` is false, ``MoE`` of ``GroupedExperts`` w1_EFD/w2_EDF/w3_EFD and a ``TokenChoiceTopKRouter``,
    load_balance_coeff None) at ``case["dims"]``, ``fully_shard`` per layer and at the root, torchtitan's
    ``OptimizersContainer`` (AdamW, experts and the rest by FQN pattern, wrong hyperparameters on purpose),
    ``LRSchedulersContainer`` and ``CheckpointManager.load(step)`` of ``BASE/ckpt/step-<step>`` (then, with
    ``save_step``, its own ``save`` of ``BASE/ckpt/step-<save_step>``). Rank 0 writes
    ``OUT/titan.safetensors`` / ``.json`` (parameters, each Adam state, groups, last_epoch, train state).
    ``case["family"] == "deepseek_v3"``: torchtitan's DeepSeekV3Model instead (tests/titan_dsv3_build.py,
    load_balance_coeff set: its ``expert_bias_E`` buffers, written out as ``buffer/<name>``)."""
    _titan_kernels_stub()
    import torch
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig
    from titan_worker import TrainState

    d = case["dims"]
    if case.get("family") == "deepseek_v3":  # torchtitan's DeepSeek-V3 (tests/titan_dsv3_build.py), expert_bias_E kept
        from titan_dsv3_build import dsv3_config
        cfg = dsv3_config(d, case.get("load_balance_coeff", 1e-3))
    else:
        cfg = _qwen3_config(case, d)
    torch.manual_seed(777)
    model = cfg.build()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    for layer in model.layers.values() if hasattr(model.layers, "values") else model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kw = {"lr": 99.0, "betas": (0.5, 0.6), "eps": 1e-3, "weight_decay": 0.5}
    ocfg = OptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"\.inner_experts\.", optimizer_name="AdamW", optimizer_kwargs=kw),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs=kw)])
    opt = OptimizersContainer(ocfg, model_parts=[model])
    sched = LRSchedulersContainer(opt, lambda s: 1.0 / (s + 1))
    ts = TrainState()
    ck = CheckpointManager(CheckpointManager.Config(enable=True, folder="ckpt", exclude_from_loading=["dataloader"],
                                                    last_save_model_only=False, keep_latest_k=0),
                           dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched,
                           states={"train_state": ts}, sd_adapter=None, base_folder=case["base"])
    assert ck.load(step=int(case["step"]))
    if case.get("save_step"):  # torchtitan's own save of what it loaded: a real torchtitan MoE step folder
        assert ck.save(curr_step=int(case["save_step"]), last_step=True)
    ck.close()
    (o,) = opt.optimizers
    loaded = {}
    for n, p in model.named_parameters():
        loaded[f"param/{n}"] = _full(p.detach())
        for k, v in o.state.get(p, {}).items():
            loaded[f"{k}/{n}"] = _full(v).reshape(-1) if k == "step" else _full(v)
    for n, b in model.named_buffers():
        if n.endswith("expert_bias_E"):
            loaded[f"buffer/{n}"] = _full(b)
    names = {id(p): n for n, p in model.named_parameters()}
    info = {"world_size": ws, "keys": sorted(model.state_dict()),
            "groups": [{"names": [names[id(p)] for p in g["params"]], "lr": g["lr"], "betas": list(g["betas"]),
                        "eps": g["eps"], "weight_decay": g["weight_decay"], "initial_lr": g["initial_lr"]}
                       for g in o.param_groups],
            "last_epoch": sched.schedulers[0].last_epoch, "train_state": ts.state_dict()}
    if rank == 0:
        out = Path(case["out"])
        _save(out / "titan.safetensors", loaded)
        (out / "titan.json").write_text(json.dumps(info, indent=1))


def main(job_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    job = json.loads(Path(job_path).read_text())
    if job.get("deepspeed"):
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (ws,))  # (FSDP2 and torchtitan cases; DeepSpeed's make their own groups)
    for case in job["cases"]:
        if case["mode"] == "deepspeed":
            deepspeed_case(case, rank, ws)
        elif case["mode"] == "titan":
            titan_case(case, mesh, rank, ws)
        else:
            (load_case if case["mode"] == "load" else train_case)(case, mesh, rank, ws)
        dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
