"""Megatron-Core's own route from a `torch_dist` checkpoint to consolidated tensors, in ONE process, no model built.

Run with the python that has megatron-core (``/work/venv-mcore/bin/python``); ``bench_megatron.py`` times it:

    python mcore_route.py weights  ITER_DIR OUT.safetensors   # model tensors as saved (bf16), Megatron's names
    python mcore_route.py masters  ITER_DIR OUT.safetensors   # fp32 masters (optimizer.state.param.*), prefix cut
    python mcore_route.py dcp      ITER_DIR OUT_DIR           # load_plain_tensors (all of it) + torch DCP save
    python mcore_route.py startup  ITER_DIR -                 # the fixed cost only: imports + process group

``startup`` imports what the other modes import (megatron.core.dist_checkpointing, torch DCP, safetensors),
makes and destroys the process group and reads nothing: the part of each route's time that does not grow with
the checkpoint.

``weights`` / ``masters``: ``dist_checkpointing.load_tensors_metadata(ITER_DIR)`` (a ShardedTensor of the full
global shape per saved key, what ``load_plain_tensors`` builds), kept to the model keys or to the
``optimizer.state.param.`` keys, then ``dist_checkpointing.load(..., validate_access_integrity=False)`` (exactly
``load_plain_tensors``' call, on a subset) and ``safetensors.torch.save_file``. Layers stay stacked
(``decoder.layers.X`` with a leading layer axis), names stay Megatron's: no Hugging Face map, no q/k/v split.

``dcp``: ``dist_checkpointing.load_plain_tensors(ITER_DIR)`` (every tensor: weights, masters, both moments, plus
the common state) and ``torch.distributed.checkpoint.save`` of that dict. Not a resumable FSDP2 state (Megatron
names, stacked layers, no torch AdamW layout): the nearest Megatron-native comparable to ``zckpt convert --to
dcp``, for time and memory only.

megatron-core's torch_dist loader needs a process group (``mcore_to_pyt_state_dict`` asks for the rank): a
single-process gloo group is made (world size 1, a file store).
"""

from __future__ import annotations

import os
import sys
import tempfile


def main(argv: list[str]) -> int:
    mode, ckpt, out = argv
    import torch
    import torch.distributed as dist

    store = tempfile.mktemp(prefix="mcore-route-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        from megatron.core import dist_checkpointing as dc
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        if mode == "startup":
            import torch.distributed.checkpoint as dcp
            from safetensors.torch import save_file
            assert dcp.save and save_file and dc.load
            return 0
        if mode == "dcp":
            import torch.distributed.checkpoint as dcp

            sd = dc.load_plain_tensors(ckpt)
            dcp.save(sd, checkpoint_id=out)
            return 0
        from safetensors.torch import save_file

        meta = dc.load_tensors_metadata(ckpt)
        head = "optimizer.state.param."
        if mode == "weights":
            keep = {k: v for k, v in meta.items() if isinstance(v, ShardedTensor) and not k.startswith("optimizer.")}
        elif mode == "masters":
            keep = {k: v for k, v in meta.items() if isinstance(v, ShardedTensor) and k.startswith(head)}
        else:
            raise SystemExit(f"mode {mode!r}: weights, masters or dcp")
        assert keep, f"no {mode} tensors in {ckpt}"
        loaded = dc.load(keep, ckpt, validate_access_integrity=False)
        tensors = {(k[len(head):] if mode == "masters" else k): v.contiguous()
                   for k, v in loaded.items() if isinstance(v, torch.Tensor)}
        assert len(tensors) == len(keep), (sorted(tensors), sorted(keep))
        save_file(tensors, out)
        return 0
    finally:
        dist.destroy_process_group()
        if os.path.exists(store):
            os.unlink(store)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
