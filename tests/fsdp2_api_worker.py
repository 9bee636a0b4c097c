"""torchrun worker for tests/test_fsdp2_api.py: a torchtitan-shaped DCP checkpoint saved by real FSDP2 at one world
size (``save``), loaded at another with ``zckpt.integrations.fsdp2.param_groups`` + ``load`` (``load``).

The layout is what torchtitan's ``CheckpointManager`` writes (read in torchtitan 0.3.0's source,
``components/checkpointer/dcp.py``): model keys at the top level (``ModelWrapper.state_dict()`` merged into the
state dict), ``optimizer`` = the flat FQN-keyed optimizer state (``state.<fqn>.<k>``, ``param_groups.<fqn>.<key>``;
torch's ``flatten_optimizer_state_dict=True`` writes the same keys), ``lr_scheduler`` = ``{"last_epoch": N}``,
``train_state`` = ``{"step", "ntokens_seen"}``. Rank 0 writes the full tensors (``OUT.safetensors``) and the
groups / schedule (``OUT.json``)."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + self.proj(self.norm(x))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList([Block() for _ in range(3)])
        self.out = torch.nn.Linear(8, 16, bias=False)

    def forward(self, ids):
        x = self.tok(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def sharded(seed: int):
    torch.manual_seed(seed)
    model = Model()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def dump(model, opt, sched, out: str, extra: dict) -> None:
    from safetensors.torch import save_file
    names = {id(p): n for n, p in model.named_parameters()}
    full = {}
    for n, p in model.named_parameters():
        full[f"param/{n}"] = p.detach().full_tensor().contiguous().clone()
        for k, v in opt.state.get(p, {}).items():
            full[f"{k}/{n}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).contiguous().clone()
    groups = [{"names": [names[id(p)] for p in g["params"]], "lr": g["lr"], "weight_decay": g["weight_decay"]}
              for g in opt.param_groups]
    if dist.get_rank() == 0:
        save_file(full, out + ".safetensors")
        with open(out + ".json", "w") as f:
            json.dump({"groups": groups, "last_epoch": sched.last_epoch, "world_size": dist.get_world_size(),
                       **extra}, f)


class TrainState:
    """torchtitan's Trainer keeps these two counters as its ``train_state`` (``Trainer.state_dict``)."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def torchtitan_save(base: str, out: str, lam) -> None:
    """torchtitan's own CheckpointManager (0.3.0) saves step 3 into ``base/ckpt/step-3``: its OptimizersContainer
    (two AdamW param groups by FQN pattern), LRSchedulersContainer (LambdaLR) and a train_state."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig
    model = sharded(0)
    kw = {"lr": 1e-2, "betas": (0.9, 0.95)}
    cfg = OptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r".*(norm|bias).*", optimizer_name="AdamW", optimizer_kwargs={**kw, "weight_decay": 0.0}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={**kw, "weight_decay": 0.1})])
    opt = OptimizersContainer(cfg, model_parts=[model])
    sched = LRSchedulersContainer(opt, lam)
    ts = TrainState()
    ck = CheckpointManager(CheckpointManager.Config(enable=True, folder="ckpt", interval=1, last_save_model_only=False),
                           dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched,
                           states={"train_state": ts}, sd_adapter=None, base_folder=base)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        ids = torch.randint(0, 16, (6, 5), generator=gen)
        per = 6 // dist.get_world_size()
        model(ids[dist.get_rank() * per:(dist.get_rank() + 1) * per]).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        ts.step, ts.ntokens_seen = step, step * 30
    ck.save(3, last_step=True)
    ck.close()
    assert len(opt.optimizers) == 1
    dump(model, opt.optimizers[0], sched.schedulers[0], out, {})


def main(mode: str, ckpt: str, out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    lam = lambda s: 1.0 / (s + 1)  # noqa: E731
    if mode == "torchtitan":
        torchtitan_save(ckpt, out, lam)
    elif mode == "save":
        model = sharded(0)
        named = dict(model.named_parameters())
        decay = [p for n, p in named.items() if "norm" not in n and not n.endswith("bias")]
        other = [p for n, p in named.items() if "norm" in n or n.endswith("bias")]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                                lr=1e-2, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            ids = torch.randint(0, 16, (6, 5), generator=gen)
            per = 6 // dist.get_world_size()
            model(ids[dist.get_rank() * per:(dist.get_rank() + 1) * per]).sum().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        dcp.save({**msd, "optimizer": osd, "lr_scheduler": {"last_epoch": sched.last_epoch},
                  "train_state": {"step": 3, "ntokens_seen": 90}}, checkpoint_id=ckpt)
        dump(model, opt, sched, out, {})
    else:
        from zckpt.integrations import fsdp2
        model = sharded(7)
        opt = torch.optim.AdamW(fsdp2.param_groups(model, ckpt))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
        report = fsdp2.load(model, opt, ckpt, scheduler=sched)
        refused = None
        try:
            fsdp2.load(model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95)), ckpt)
        except Exception as exc:
            refused = f"{type(exc).__name__}: {exc}"
        dump(model, opt, sched, out, {"report": str(report), "counters": report.counters, "refused": refused})
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:4])
