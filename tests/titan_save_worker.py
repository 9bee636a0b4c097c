"""torchrun worker (gloo, CPU ranks) for fixtures/gen_titan_qwen3.py: torchtitan 0.3.0's own Qwen3 models (MoE and
dense) trained two optimizer steps and saved by its own ``CheckpointManager`` (model + ``OptimizersContainer`` +
``LRSchedulersContainer`` + a train state), the sources of ``zckpt merge`` / ``convert --to deepspeed`` of a
torchtitan run under a transformers class's names (tests/test_titan_to_deepspeed.py).

Run as ``titan_save_worker.py JOB.json``; each case builds ``Qwen3Model`` at ``case["dims"]`` (``moe``: its
``_build_qwen3_moe_layers``, GroupedExperts w1_EFD/w2_EDF/w3_EFD and a TokenChoiceTopKRouter; else the dense
``_build_qwen3_layers``; ``family`` ``deepseek_v3``: ``DeepSeekV3Model`` from tests/titan_dsv3_build.py,
fixtures/gen_titan_dsv3.py), fused q/k/v unless ``fuse_qkv`` is false, ``load_balance_coeff`` as stated (None: no
``expert_bias_E``), ``enable_weight_tying`` as ``tied`` (torchtitan's default for its dense Qwen3 sizes), ``fully_shard`` per layer and at the root, AdamW in two param groups by FQN pattern (everything
but the experts first, the experts without weight decay; the dense model: norms and the rest). No forward runs
(torchtitan's FlexAttention has no CPU backward; torchtitan 0.3.0 refuses sdpa for its language models): each step
sets seeded gradients on every parameter and steps torchtitan's optimizer and scheduler containers, which is what a
training step leaves in them. Then ``CheckpointManager.save(curr_step=2)`` into ``BASE/checkpoint/step-2``; rank
0 writes ``OUT.safetensors`` (``param/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``, ``step/<name>``: the
full tensors, torchtitan's names, the fused ``wqkv`` as the optimizer holds it) and ``OUT.json`` (groups, the
model state dict's keys, last_epoch, train state).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build(case: dict):
    from moe_dcp_worker import _titan_kernels_stub
    _titan_kernels_stub()
    if case.get("family") == "deepseek_v3":  # (fixtures/gen_titan_dsv3.py)
        from titan_dsv3_build import dsv3_config
        return dsv3_config(case["dims"], case.get("load_balance_coeff", 1e-3)).build()
    if case.get("family") == "llama3":
        return build_llama3(case)
    from torchtitan.models import qwen3 as Q
    from torchtitan.models.common.embedding import Embedding
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3.model import Qwen3Model

    d = case["dims"]
    rope = CosSinRoPE.Config(dim=d["head_dim"], max_seq_len=64, theta=1000000.0)
    common = dict(n_layers=d["layers"], dim=d["dim"], n_heads=d["heads"], n_kv_heads=d["kv_heads"],
                  head_dim=d["head_dim"], attn_backend="flex", fuse_qkv=case.get("fuse_qkv", True), rope=rope)
    if case["moe"]:
        layers = Q._build_qwen3_moe_layers(moe_hidden_dim=d["moe_hidden"], num_experts=d["experts"],
                                           top_k=d["top_k"], moe_comm_backend="standard", **common)
        for layer in layers:
            layer.moe.load_balance_coeff = case.get("load_balance_coeff")
    else:
        layers = Q._build_qwen3_layers(hidden_dim=d["hidden"], **common)
    cfg = Qwen3Model.Config(
        vocab_size=d["vocab"], dim=d["dim"], norm=Q._qwen3_norm(d["dim"]),
        tok_embeddings=Embedding.Config(num_embeddings=d["vocab"], embedding_dim=d["dim"],
                                        param_init=Q._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=d["dim"], out_features=d["vocab"], param_init=Q._LINEAR_INIT),
        layers=layers, enable_weight_tying=case.get("tied", False))
    return cfg.build()


def build_llama3(case: dict):
    """torchtitan 0.3.0's own Llama 3 (``Llama3Model``, ``_build_llama3_layers``: head size dim / heads, its
    ComplexRoPE with Llama scaling as its named sizes have) at ``case["dims"]`` (fixtures/gen_titan_llama3.py)."""
    from torchtitan.models import llama3 as L
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3.model import Llama3Model

    d = case["dims"]
    rope = ComplexRoPE.Config(dim=d["dim"] // d["heads"], max_seq_len=64, theta=500000, scaling="llama")
    cfg = Llama3Model.Config(
        dim=d["dim"], vocab_size=d["vocab"], enable_weight_tying=case.get("tied", False),
        tok_embeddings=Embedding.Config(num_embeddings=d["vocab"], embedding_dim=d["dim"],
                                        param_init=L._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=d["dim"], param_init=L._NORM_INIT),
        lm_head=Linear.Config(in_features=d["dim"], out_features=d["vocab"],
                              param_init=L._output_linear_init(d["dim"])),
        layers=L._build_llama3_layers(n_layers=d["layers"], dim=d["dim"], n_heads=d["heads"],
                                      n_kv_heads=d["kv_heads"], hidden_dim=d["hidden"], rope=rope,
                                      fuse_qkv=case.get("fuse_qkv", True), attn_backend="flex"))
    return cfg.build()


def save_case(case: dict, mesh, rank: int) -> None:
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig
    from moe_dcp_worker import _full, _save
    from titan_worker import TrainState

    torch.manual_seed(3)
    model = build(case)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
        for n, b in model.named_buffers():
            if n.endswith("expert_bias_E"):
                b.copy_(torch.randn(b.shape))  # what torchtitan's load-balancing hook leaves: not all zero
    for layer in model.layers.values() if hasattr(model.layers, "values") else model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kw = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8}
    first = r"^(?!.*\.inner_experts\.)" if case["moe"] else r"norm\.weight$"
    ocfg = OptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=first, optimizer_name="AdamW", optimizer_kwargs={**kw, "weight_decay": 0.01}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={**kw, "weight_decay": 0.0})])
    opt = OptimizersContainer(ocfg, model_parts=[model])
    sched = LRSchedulersContainer(opt, lambda s: 1.0 / (s + 1))
    ts = TrainState()
    gen = torch.Generator().manual_seed(11)
    for step in (1, 2):
        for p in model.parameters():
            g = torch.randn(p.shape, generator=gen)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if hasattr(p, "device_mesh") else g
        opt.step()
        sched.step()
        opt.zero_grad()
        ts.step, ts.ntokens_seen = step, 96 * step
    ck = CheckpointManager(CheckpointManager.Config(enable=True, folder="checkpoint", last_save_model_only=False,
                                                    keep_latest_k=0),
                           dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched,
                           states={"train_state": ts}, sd_adapter=None, base_folder=case["base"])
    assert ck.save(curr_step=2, last_step=True)
    ck.close()
    (o,) = opt.optimizers
    saved = {}
    for n, p in model.named_parameters():
        saved[f"param/{n}"] = _full(p.detach())
        for k, v in o.state.get(p, {}).items():
            saved[f"{k}/{n}"] = _full(v).reshape(-1) if k == "step" else _full(v)
    for n, b in model.named_buffers():
        saved[f"buffer/{n}"] = _full(b)
    names = {id(p): n for n, p in model.named_parameters()}
    info = {"keys": sorted(model.state_dict()), "dims": case["dims"], "moe": case["moe"],
            "fuse_qkv": case.get("fuse_qkv", True), "load_balance_coeff": case.get("load_balance_coeff"),
            "tied": case.get("tied", False), "family": case.get("family", "qwen3"),
            "groups": [{"names": [names[id(p)] for p in g["params"]], "lr": g["lr"], "betas": list(g["betas"]),
                        "eps": g["eps"], "weight_decay": g["weight_decay"], "initial_lr": g["initial_lr"]}
                       for g in o.param_groups],
            "last_epoch": sched.schedulers[0].last_epoch, "train_state": ts.state_dict(),
            "torch": torch.__version__, "torchtitan": __import__("importlib.metadata").metadata.version("torchtitan")}
    if rank == 0:
        _save(Path(case["out"] + ".safetensors"), saved)
        Path(case["out"] + ".json").write_text(json.dumps(info, indent=1))


def main(job_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    job = json.loads(Path(job_path).read_text())
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for case in job["cases"]:
        save_case(case, mesh, dist.get_rank())
        dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
