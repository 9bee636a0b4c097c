"""torchrun worker for tests/test_convert_torchtitan.py: torchtitan 0.3.0's own ``CheckpointManager`` loads zckpt's
``--layout torchtitan`` output of a DeepSpeed fixture at another world size (CPU ranks, gloo).

Every rank builds the fixture's model (``fixtures/generate.py``, another seed and scrambled buffers, so everything
must come from the checkpoint), ``fully_shard`` s each block and the root, builds torchtitan's
``OptimizersContainer`` (AdamW, two param groups by FQN pattern, wrong lr / weight decay / betas on purpose),
``LRSchedulersContainer`` (LambdaLR) and ``CheckpointManager`` over ``BASE/ckpt`` with a train state, and calls
``load(step=N)`` as torchtitan's Trainer does. Rank 0 writes what was loaded into ``OUT.safetensors`` /
``OUT.json``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


class TrainState:
    """torchtitan's Trainer's own ``state_dict`` / ``load_state_dict`` (trainer.py): step and ntokens_seen."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def main(spec_path: str, base: str, step: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    G = __import__("ds_oracle").generate_module()
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(777)
    model = G.build_model(spec["model"])
    with torch.no_grad():
        for _, buf in model.named_buffers():
            buf.add_(3.0 if buf.is_floating_point() else 5)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    kw = {"lr": 99.0, "betas": (0.5, 0.6), "eps": 1e-3}
    cfg = OptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"(\.ln\.|\.bias$)", optimizer_name="AdamW",
                         optimizer_kwargs={**kw, "weight_decay": 0.5}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={**kw, "weight_decay": 0.7})])
    opt = OptimizersContainer(cfg, model_parts=[model])
    sched = LRSchedulersContainer(opt, lambda s: 1.0 / (s + 1))
    ts = TrainState()
    ck = CheckpointManager(CheckpointManager.Config(enable=True, folder="ckpt", exclude_from_loading=["dataloader"]),
                           dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched,
                           states={"train_state": ts}, sd_adapter=None, base_folder=base)
    assert ck.load(step=int(step))
    ck.close()

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    (o,) = opt.optimizers
    loaded = {}
    for n, p in model.named_parameters():
        loaded[f"param/{n}"] = full(p.detach())
        for k, v in o.state.get(p, {}).items():
            loaded[f"{k}/{n}"] = full(v)
    for n, b in model.named_buffers():
        loaded[f"buffer/{n}"] = b
    names = {id(p): n for n, p in model.named_parameters()}
    info = {"world_size": dist.get_world_size(), "tied": model.head.weight is model.emb.weight,
            "frozen": [n for n, p in model.named_parameters() if not p.requires_grad],
            "groups": [{"names": [names[id(p)] for p in g["params"]], "lr": g["lr"], "betas": list(g["betas"]),
                        "eps": g["eps"], "weight_decay": g["weight_decay"], "initial_lr": g["initial_lr"],
                        "decoupled_weight_decay": g["decoupled_weight_decay"]} for g in o.param_groups],
            "last_epoch": sched.schedulers[0].last_epoch, "train_state": ts.state_dict()}
    if dist.get_rank() == 0:
        from safetensors.torch import save_file
        save_file({k: v.detach().contiguous().clone() for k, v in loaded.items()}, out + ".safetensors")
        Path(out + ".json").write_text(json.dumps(info))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:5])
