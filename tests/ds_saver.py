"""A real DeepSpeed training job (CPU ranks) that saves a checkpoint after every step, slowly: the writer for the
push-while-training test. Run under torchrun: ``ds_saver.py SAVE_DIR STEPS PAUSE_SECONDS``."""

import os
import sys
import time

import torch
import deepspeed

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fixtures.generate as G  # noqa: E402


def main():
    save_dir, steps, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    spec = G.make_spec(stage=2, dtype="bf16", world_size=int(os.environ["WORLD_SIZE"]), scheduler=False,
                       model={"hidden": 64, "ffn": 256, "vocab": 512})  # ~200 KB per rank file
    torch.manual_seed(0)
    model = G.build_model(spec["model"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=G.build_ds_config(spec))
    for step in range(steps):
        x = torch.randint(0, spec["model"]["vocab"], (spec["micro_batch"], spec["seq_len"]))
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(save_dir)
        time.sleep(pause)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past the exit-time abort of CPU ranks (fixtures/generate.py exit_rank)
