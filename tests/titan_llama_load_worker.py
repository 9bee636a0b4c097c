"""torchrun worker (gloo, CPU ranks) for tests/test_titan_llama.py: torchtitan 0.3.0's own ``Llama3Model``
(tests/titan_save_worker.build_llama3, sized from the source's transformers ``config.json``, ``fuse_qkv`` as the
case says, another seed so everything must come from the checkpoint), ``fully_shard`` per layer and at the root,
its ``OptimizersContainer`` (AdamW, two param groups by FQN pattern: the norms, then the rest; wrong lr, betas and
weight decay on purpose), ``LRSchedulersContainer`` (LambdaLR) and ``CheckpointManager`` over ``BASE`` with a train
state, ``load(step=N)`` as torchtitan's Trainer calls it, of what ``zckpt convert --to dcp --layout torchtitan``
wrote from a DeepSpeed checkpoint of a transformers Llama. Rank 0 writes what was loaded into ``OUT.safetensors``
(``param/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``, ``step/<name>``) and ``OUT.json``.

    titan_llama_load_worker.py JOB.json      (JOB: {"cases": [{"config", "base", "step", "out", "fuse_qkv"}]})
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def load_case(case: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig
    from titan_save_worker import build
    from titan_worker import TrainState

    hf = json.loads(Path(case["config"]).read_text())
    dims = {"vocab": hf["vocab_size"], "dim": hf["hidden_size"], "layers": hf["num_hidden_layers"],
            "heads": hf["num_attention_heads"], "kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
            "hidden": hf["intermediate_size"]}
    torch.manual_seed(777)
    model = build({"family": "llama3", "dims": dims, "tied": bool(hf.get("tie_word_embeddings")),
                   "fuse_qkv": case["fuse_qkv"]})
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    for layer in model.layers.values() if hasattr(model.layers, "values") else model.layers:
        fully_shard(layer)
    fully_shard(model)
    kw = {"lr": 99.0, "betas": (0.5, 0.6), "eps": 1e-3}
    ocfg = OptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"norm\.weight$", optimizer_name="AdamW",
                         optimizer_kwargs={**kw, "weight_decay": 0.5}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={**kw, "weight_decay": 0.7})])
    opt = OptimizersContainer(ocfg, model_parts=[model])
    sched = LRSchedulersContainer(opt, lambda s: 1.0 / (s + 1))
    ts = TrainState()
    ck = CheckpointManager(CheckpointManager.Config(enable=True, folder="checkpoint",
                                                    exclude_from_loading=["dataloader"]),
                           dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched,
                           states={"train_state": ts}, sd_adapter=None, base_folder=case["base"])
    assert ck.load(step=int(case["step"]))
    ck.close()

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    (o,) = opt.optimizers
    loaded = {}
    for n, p in model.named_parameters():
        loaded[f"param/{n}"] = full(p.detach())
        for k, v in o.state.get(p, {}).items():
            loaded[f"{k}/{n}"] = full(v).reshape(-1) if k == "step" else full(v)
    names = {id(p): n for n, p in model.named_parameters()}
    info = {"tied": model.lm_head.weight is model.tok_embeddings.weight,
            "groups": [{"names": [names[id(p)] for p in g["params"]], "lr": g["lr"], "betas": list(g["betas"]),
                        "eps": g["eps"], "weight_decay": g["weight_decay"], "initial_lr": g["initial_lr"]}
                       for g in o.param_groups],
            "last_epoch": sched.schedulers[0].last_epoch, "train_state": ts.state_dict()}
    if dist.get_rank() == 0:
        from safetensors.torch import save_file
        save_file({k: v.detach().contiguous().clone() for k, v in loaded.items()}, case["out"] + ".safetensors")
        Path(case["out"] + ".json").write_text(json.dumps(info))


def main(job_path: str) -> None:
    import torch
    import torch.distributed as dist
    from moe_dcp_worker import _titan_kernels_stub
    _titan_kernels_stub()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for case in json.loads(Path(job_path).read_text())["cases"]:
        load_case(case)
        dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
