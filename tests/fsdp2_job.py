"""A real FSDP2 training job on CPU ranks (gloo) that saves a DCP checkpoint: the oracle for the DCP reader.

Run under torchrun: ``fsdp2_job.py OUT STEPS GROUPS DTYPE [DIMS_JSON [nofull]]``. The model is the fixtures' test model
(:func:`fixtures.generate.build_model`: tied embedding/head, a frozen Linear, buffers); ``fully_shard`` per block and
at the root on ``init_device_mesh("cpu", (ws,))``, ``torch.optim.AdamW`` over GROUPS (1 or 2) param groups, STEPS
steps, then ``dcp.save({"model": msd, "optim": osd}, OUT/dcp)`` of ``get_state_dict`` (DTensors sharded on dim 0).
DTYPE "bf16" trains with ``MixedPrecisionPolicy(param_dtype=bfloat16)`` (the sharded parameters stay fp32).
Rank 0 also writes ``OUT/full.pt``: the full (unsharded) model and optimizer state from
``get_state_dict(..., StateDictOptions(full_state_dict=True, cpu_offload=True))``, what tests compare with
(skipped with ``nofull``: benchmarks). DIMS_JSON overrides the model's dimensions (``fixtures.generate`` names).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fixtures.generate as G  # noqa: E402


def main():
    out, steps, groups, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dims = {"hidden": 8, "ffn": 12, "vocab": 13, "layers": 2}
    dims.update(json.loads(sys.argv[5]) if len(sys.argv) > 5 else {})
    full = not (len(sys.argv) > 6 and sys.argv[6] == "nofull")
    dist.init_process_group("gloo")
    ws, rank = dist.get_world_size(), dist.get_rank()
    spec = G.make_spec(stage=3, dtype="fp32", world_size=ws, param_groups=groups,
                       model=dims)
    torch.manual_seed(0)
    model = G.build_model(spec["model"])
    mesh = init_device_mesh("cpu", (ws,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if dtype == "bf16" else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    pgs = [{k: v for k, v in g.items() if k != "names"} for g in G._param_groups(model, spec)]
    opt = torch.optim.AdamW(pgs, lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8)
    torch.manual_seed(1 + rank)
    for _ in range(steps):
        ids = torch.randint(0, spec["model"]["vocab"], (2, 5))
        loss = model(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "dcp"))
    if not full:
        dist.barrier()
        dist.destroy_process_group()
        return
    fmsd, fosd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"model": fmsd, "optim": fosd}, os.path.join(out, "full.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past the exit-time abort of CPU ranks (fixtures/generate.py exit_rank)
