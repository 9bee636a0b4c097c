"""torchrun worker for tests/test_resume.py: resume a fixture's training state at another world size / stage.

Every rank rebuilds the fixture's model, optimizer and config (``fixtures/generate.py``) at the job's world size
and stage, like ``tests/ds_oracle.py``, and for each route of the job:

* ``offline``: ``engine.load_checkpoint(<zckpt reshard output>)`` (the reference);
* ``api``: ``zckpt.deepspeed.load_checkpoint(engine, <source>)``;

captures this rank's raw engine state right after the load (``optimizer.state_dict()``: fp32 partitions, Adam
moments and step, loss scaler; module state dict and ZeRO-3 partitions; scheduler; counters; client state) into
``OUT/<route>_rank<r>.pt``, then trains ``train_steps`` more steps on fixed data and records the losses. Rank 0 of
the ``api`` route also writes DeepSpeed's own oracle (``generate.collect_oracle``) into ``OUT/oracle``.

``expect_error``: the API must raise; every rank writes its one-line message to ``OUT/error_rank<r>.txt``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def build_engine(G, spec):
    import torch
    import deepspeed

    torch.manual_seed(spec["seed"] + 99)  # a different init: everything must come from the checkpoint
    group_lrs = [spec["lr"]] if spec["param_groups"] == 1 else [spec["lr"], spec["lr"] / 2]
    cfg = G.build_ds_config(spec, group_lrs)
    if spec["zero_init"]:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = G.build_model(spec["model"])
    else:
        model = G.build_model(spec["model"])
    with torch.no_grad():  # scramble buffers so a load that skips them is caught
        for _, buf in model.named_buffers():
            buf.add_(3.0 if buf.is_floating_point() else 5)
    groups = G._param_groups(model, spec)
    torch_groups = [{"params": g["params"], "lr": g["lr"], "weight_decay": g["weight_decay"]} for g in groups]
    if spec.get("optimizer") == "cpuadam":  # ZeRO-Offload: DeepSpeed's CPU Adam, as the fixture was trained
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam(torch_groups, lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8, adamw_mode=True,
                               **(spec.get("optimizer_kwargs") or {}))
    elif spec.get("optimizer") == "sgd":
        opt = torch.optim.SGD(torch_groups, lr=spec["lr"], momentum=0.9)
    elif spec.get("optimizer") == "lion":
        opt = G.lion_like(torch_groups, spec["lr"])
    else:
        opt = torch.optim.AdamW(torch_groups, lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    G.attach_late_module(model, dict(spec, seed=spec["seed"] + 1))  # other values: the checkpoint must set them
    return engine, model, groups


class ReadTrace:
    """Every read of a file under ``root`` at the operating-system boundary (builtin ``open`` with a
    counting raw file under any buffering, ``os.preadv`` / ``os.pread`` on descriptors from ``os.open``): an
    independent count of what a call read, as (path, offset, bytes) triples."""

    def __init__(self, root: str):
        import builtins
        import io
        import threading
        self.root, self.reads, self.lock, self.fds = os.path.abspath(root) + os.sep, [], threading.Lock(), {}
        self.saved = (builtins.open, os.open, os.preadv, os.pread, os.close)
        trace = self

        class CountingIO(io.FileIO):
            def read(self, n=-1):
                at = self.tell()
                data = super().read(n)
                trace.add(self.name, at, len(data))
                return data

            def readinto(self, buf):
                at = self.tell()
                n = super().readinto(buf)
                trace.add(self.name, at, n or 0)
                return n

            def readall(self):
                at = self.tell()
                data = super().readall()
                trace.add(self.name, at, len(data))
                return data

        real_open, real_os_open, real_preadv, real_pread, real_close = self.saved

        def traced_open(file, mode="r", buffering=-1, *args, **kw):
            if self.covers(file) and mode in ("rb", "br") and not args and not kw:
                raw = CountingIO(file, "r")
                return raw if buffering == 0 else io.BufferedReader(raw)
            return real_open(file, mode, buffering, *args, **kw)

        def traced_os_open(path, flags, *args, **kw):
            fd = real_os_open(path, flags, *args, **kw)
            if self.covers(path):
                self.fds[fd] = os.fspath(path)
            return fd

        def traced_preadv(fd, buffers, offset, *args):
            n = real_preadv(fd, buffers, offset, *args)
            if fd in self.fds:
                self.add(self.fds[fd], offset, n)
            return n

        def traced_pread(fd, n, offset):
            data = real_pread(fd, n, offset)
            if fd in self.fds:
                self.add(self.fds[fd], offset, len(data))
            return data

        def traced_close(fd):
            self.fds.pop(fd, None)
            return real_close(fd)

        self.patched = (traced_open, traced_os_open, traced_preadv, traced_pread, traced_close)

    def covers(self, path) -> bool:
        return isinstance(path, (str, os.PathLike)) and os.path.abspath(os.fspath(path)).startswith(self.root)

    def add(self, path, offset: int, n: int) -> None:
        if n:
            with self.lock:
                self.reads.append((os.path.relpath(os.path.abspath(path), self.root), int(offset), int(n)))

    def __enter__(self):
        import builtins
        builtins.open, os.open, os.preadv, os.pread, os.close = self.patched
        return self

    def __exit__(self, *exc):
        import builtins
        builtins.open, os.open, os.preadv, os.pread, os.close = self.saved
        return False


def capture(engine, client_state) -> dict:
    """This rank's engine state as torch objects (saved at once, before any further step)."""
    opt = engine.optimizer
    st = {"optimizer": opt.state_dict(),
          "module": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
          "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
          "counters": [engine.global_steps, engine.global_samples, engine.skipped_steps],
          "lrs": [g["lr"] for g in opt.param_groups],
          "client_state": {k: v for k, v in (client_state or {}).items()}}
    parts = {n: p.ds_tensor.detach().clone() for n, p in engine.module.named_parameters() if hasattr(p, "ds_tensor")}
    if parts:
        st["ds_tensors"] = parts
    scaler = getattr(opt, "loss_scaler", None)
    if scaler is not None:
        st["loss_scaler"] = {k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool))}
    return st


def train(engine, spec, steps: int, rank: int) -> list[float]:
    import torch
    gen = torch.Generator().manual_seed(4321 + rank)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, spec["model"]["vocab"], (spec["micro_batch"], spec["seq_len"]), generator=gen)
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return losses


def trainer_main(job: dict) -> None:
    """Resume a Hugging Face Trainer run (the ``trainer`` fixture) and train ``train_steps`` more steps; rank 0
    writes the logged losses and DeepSpeed's view of the final state (``OUT/oracle``)."""
    import contextlib
    import torch
    import transformers
    from transformers import Trainer, TrainingArguments
    import ds_oracle

    G = ds_oracle.generate_module()
    spec, out = job["spec"], Path(job["out"])
    transformers.set_seed(spec["seed"] + 99)
    m = spec["model"]
    model = G.build_hf_model(m)
    steps = spec["steps"] + job.get("train_steps", 2)

    class DS(torch.utils.data.Dataset):
        def __init__(self, n):
            self.data = torch.randint(4, m["vocab"], (n, spec["seq_len"]), generator=torch.Generator().manual_seed(1))

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            ids = self.data[i]
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    ds_cfg = G._deep_merge({
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
        "zero_optimization": G._deep_merge({"stage": spec["stage"]}, spec.get("zero") or {}),
    }, spec.get("ds_config") or {})
    args = TrainingArguments(
        output_dir=str(out / "run"), use_cpu=True, bf16=spec["dtype"] == "bf16", fp16=spec["dtype"] == "fp16",
        deepspeed=ds_cfg, per_device_train_batch_size=spec["micro_batch"], gradient_accumulation_steps=1,
        max_steps=steps, save_strategy="no", logging_steps=1, learning_rate=spec["lr"], weight_decay=0.01,
        warmup_steps=0, lr_scheduler_type="linear", max_grad_norm=1.0, seed=spec["seed"], report_to="none",
        disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=DS(spec["micro_batch"] * spec["world_size"] * steps),
                      processing_class=G.build_tokenizer(m["vocab"]))
    if job["route"] == "api":
        from zckpt.integrations import resume_anywhere
        ctx = resume_anywhere()
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        trainer.train(resume_from_checkpoint=job["source"])
    eng = trainer.model_wrapped
    tensors, info = G.collect_oracle(eng, trainer.model, spec)
    info["hf_global_step"] = trainer.state.global_step
    info["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    info["client_state"] = {}
    if trainer.args.process_index == 0:
        G._write_oracle(out / "oracle", tensors, info)
    import deepspeed.comm as dist
    G._finish(dist)


def accelerate_main(job: dict) -> None:
    """Accelerate + DeepSpeed: ``save`` trains 2 steps and ``save_state``s (rank 0 writes DeepSpeed's view of the
    state to ``OUT/expected``); ``load`` does ``load_state`` under ``resume_anywhere()`` at this job's size and
    writes the same view to ``OUT/oracle``."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    import ds_oracle

    G = ds_oracle.generate_module()
    spec, out = job["spec"], Path(job["out"])
    torch.manual_seed(spec["seed"] + (0 if job["phase"] == "save" else 99))
    cfg = G.build_ds_config(spec)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what `accelerate launch --use_deepspeed` sets
    accelerator = Accelerator(mixed_precision=spec["dtype"] if spec["dtype"] != "fp32" else "no",
                              deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    model = G.build_model(spec["model"])
    groups = G._param_groups(model, spec)
    opt = torch.optim.AdamW([{"params": g["params"], "lr": g["lr"], "weight_decay": g["weight_decay"]}
                             for g in groups], lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8)
    engine, opt = accelerator.prepare(model, opt)
    if job["phase"] == "save":
        gen = torch.Generator().manual_seed(7 + accelerator.process_index)
        for _ in range(2):
            ids = torch.randint(0, spec["model"]["vocab"], (spec["micro_batch"], spec["seq_len"]), generator=gen)
            loss = engine(ids)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        accelerator.save_state(str(out / "state"))
        where = out / "expected"
    else:
        from zckpt.integrations import resume_anywhere
        with resume_anywhere():
            accelerator.load_state(str(out / "state"))
        where = out / "oracle"
    tensors, info = G.collect_oracle(engine, model, spec)
    if accelerator.process_index == 0:
        G._write_oracle(where, tensors, info)
    accelerator.wait_for_everyone()


def main(job_path: str) -> None:
    import torch
    import deepspeed
    import deepspeed.comm as dist
    import ds_oracle

    G = ds_oracle.generate_module()
    job = json.loads(Path(job_path).read_text())
    if job.get("trainer"):
        return trainer_main(job)
    if job.get("accelerate"):
        return accelerate_main(job)
    spec, out = job["spec"], Path(job["out"])
    if spec["dtype"] == "fp16":
        G.enable_cpu_fp16()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    losses = {}
    for route in job["routes"]:
        if job.get("model_override"):
            spec = dict(spec, model=G._deep_merge(spec["model"], job["model_override"]))
        engine, model, groups = build_engine(G, spec)
        if route == "offline":
            load_path, client = engine.load_checkpoint(job["offline"])
        else:
            import zckpt.deepspeed as zd
            src = job["source"] if not job.get("rank_source") else job["rank_source"].get(str(rank), job["source"])
            try:
                force = job.get("force_reshard", False) and route == "api"  # "api_native": never forced
                if job.get("trace"):
                    with ReadTrace(src) as trace:
                        load_path, client = zd.load_checkpoint(engine, src, force_reshard=force)
                    (out / f"trace_rank{rank}.json").write_text(json.dumps(trace.reads))
                else:
                    load_path, client = zd.load_checkpoint(engine, src, force_reshard=force,
                                                           verify=bool(job.get("verify")))
            except Exception as exc:  # noqa: BLE001
                if not job.get("expect_error"):
                    raise
                (out / f"error_rank{rank}.txt").write_text(f"{type(exc).__name__}|{exc}")
                del engine
                continue
            if job.get("expect_error"):
                raise AssertionError("the load did not fail")
            info = engine.zckpt_resume_info
            (out / f"info_{route}_rank{rank}.json").write_text(json.dumps(info.__dict__, default=str))
        assert load_path is not None, "load_checkpoint returned None"
        torch.save(capture(engine, client), str(out / f"{route}_rank{rank}.pt"))
        if route == "api" and job.get("oracle"):
            tensors, info = G.collect_oracle(engine, model, spec, groups)
            info["client_state"] = {k: v for k, v in (client or {}).items() if isinstance(v, (int, float, str))}
            if rank == 0:
                G._write_oracle(out / "oracle", tensors, info)
        losses[route] = train(engine, spec, job.get("train_steps", 2), rank)
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))
    G._finish(dist)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except Exception:
        traceback.print_exc()
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past the exit-time abort of CPU ranks (fixtures/generate.py exit_rank)
