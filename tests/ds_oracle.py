"""DeepSpeed as the oracle: load a checkpoint at M CPU ranks with a plain ``engine.load_checkpoint`` and report.

:func:`load_with_deepspeed` launches ``torchrun`` on this file. Every rank rebuilds the fixture's model, optimizer
and config (``fixtures/generate.py``: same seed, groups, ``build_ds_config``) at the new world size and stage,
calls ``engine.load_checkpoint(ckpt)`` (optimizer and scheduler states included; ``load_universal`` when asked),
then captures the training state with DeepSpeed's own API (``generate.collect_oracle``: ``safe_get_full_fp32_param``,
``safe_get_full_optimizer_state``, gathered module weights, buffers, step, global steps, scheduler, loss scaler)
and, optionally, saves the checkpoint again (``resave``) so the files DeepSpeed writes can be compared with ours.
Rank 0 writes ``oracle.safetensors`` and ``oracle.json`` (with the returned ``client_state``) into ``out``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

try:
    from tests import ranks
except ImportError:  # (imported as ``ds_oracle`` with tests/ on the path)
    import ranks


def generate_module():
    spec = importlib.util.spec_from_file_location("zckpt_fixtures_generate", ROOT / "fixtures" / "generate.py")
    mod = sys.modules.get(spec.name)
    if mod is None:
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return mod


def target_spec(source_spec: dict, world_size: int, stage: int | None = None,
                bf16_optimizer: bool | None = None) -> dict:
    """The fixture spec as it would be to train at ``world_size`` / ``stage`` (same model, optimizer, seed)."""
    spec = dict(source_spec)
    spec["world_size"] = int(world_size)
    if stage is not None:
        spec["stage"] = int(stage)
    if bf16_optimizer is None:
        bf16_optimizer = bool(spec.get("grad_accum_dtype") == "fp32" and spec["stage"] == 1)
    spec["grad_accum_dtype"] = "fp32" if bf16_optimizer else None
    if spec["stage"] != 3:
        spec["zero_init"] = False
        spec["sub_group_size"] = None
    return spec


ABORT = b"terminate called without an active exception"


def run_torchrun(cmd: list, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run a torchrun job of CPU ranks. Under load, a DeepSpeed / gloo job here has died in C++ teardown
    (``std::terminate``, SIGABRT) with no Python error on any rank (seen in CI runs; test_resume.run_job does the
    same): that abort, and only that, is retried once, visibly; any other failure is returned as it is."""
    proc = ranks.run(cmd, env=env, timeout=timeout, cwd=str(ROOT))  # (the ranks without torchrun's agent)
    if proc.returncode != 0 and ABORT in proc.stdout and b"Traceback" not in proc.stdout.split(ABORT)[0]:
        print("run_torchrun: a rank aborted in C++ with no Python error; running the job once more")
        proc = ranks.run(cmd, env=env, timeout=timeout, cwd=str(ROOT))
    return proc


def load_with_deepspeed(spec: dict, ckpt: str, out: str, resave: str | None = None, universal: bool = False,
                        timeout: float = 600) -> dict:
    """Run the loader at ``spec['world_size']`` ranks; returns oracle.json (tensors are in out/oracle.safetensors)."""
    G = generate_module()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    job = {"spec": spec, "ckpt": str(ckpt), "out": str(out), "resave": str(resave) if resave else None,
           "universal": bool(universal)}
    with tempfile.TemporaryDirectory(prefix="zckpt-oracle-") as tmp:
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
               str(spec["world_size"]), "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()),
               str(Path(__file__).resolve()), str(job_path)]
        proc = run_torchrun(cmd, G.rank_env({"TMPDIR": tmp}), timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"DeepSpeed load at {spec['world_size']} ranks failed (rc={proc.returncode}):\n"
                               + proc.stdout.decode(errors="replace")[-6000:])
    return json.loads((out / "oracle.json").read_text())


def resume_trainer(spec: dict, ckpt: str, out: str, timeout: float = 900) -> dict:
    """Run ``Trainer.train(resume_from_checkpoint=ckpt)`` at ``spec['world_size']`` ranks (the fixture's HF model,
    data and arguments; ``max_steps`` = the checkpoint's step, so it loads and trains no further) and capture the
    DeepSpeed engine's state as :func:`load_with_deepspeed` does."""
    return load_with_deepspeed(dict(spec, _trainer_resume=True), ckpt, out, timeout=timeout)


def _trainer_worker(job: dict) -> None:
    import torch
    import transformers
    from transformers import Trainer, TrainingArguments

    G = generate_module()
    spec = job["spec"]
    transformers.set_seed(spec["seed"] + 99)
    m = spec["model"]
    model = G.build_hf_model(m)

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
    if spec.get("grad_accum_dtype"):
        ds_cfg["data_types"] = {"grad_accum_dtype": spec["grad_accum_dtype"]}
    args = TrainingArguments(
        output_dir=str(Path(job["out"]) / "run"), use_cpu=True, bf16=spec["dtype"] == "bf16",
        fp16=spec["dtype"] == "fp16", deepspeed=ds_cfg, per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=1, max_steps=spec["steps"], save_strategy="no", logging_steps=1,
        learning_rate=spec["lr"], weight_decay=0.01, warmup_steps=0, lr_scheduler_type="linear", max_grad_norm=1.0,
        seed=spec["seed"], report_to="none", disable_tqdm=True, dataloader_num_workers=0)
    n_samples = spec["micro_batch"] * spec["world_size"] * spec["steps"]
    trainer = Trainer(model=model, args=args, train_dataset=DS(n_samples),
                      processing_class=G.build_tokenizer(m["vocab"]))
    trainer.train(resume_from_checkpoint=job["ckpt"])
    eng = trainer.model_wrapped
    _, names = G._ds_groups(eng, trainer.model)
    tensors, info = G.collect_oracle(eng, trainer.model, spec)
    info["hf_global_step"] = trainer.state.global_step
    info["world_size"] = trainer.args.world_size
    info["client_state"] = {}
    if trainer.args.process_index == 0:
        G._write_oracle(Path(job["out"]), tensors, info)
    import deepspeed.comm as dist
    G._finish(dist)


def _worker(job_path: str) -> None:
    import torch
    import deepspeed
    import deepspeed.comm as dist

    G = generate_module()
    job = json.loads(Path(job_path).read_text())
    spec = job["spec"]
    if spec.get("_trainer_resume"):
        return _trainer_worker(job)
    if spec["dtype"] == "fp16":
        G.enable_cpu_fp16()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(spec["seed"] + 99)  # a different init: everything must come from the checkpoint
    group_lrs = [spec["lr"]] if spec["param_groups"] == 1 else [spec["lr"], spec["lr"] / 2]
    cfg = G.build_ds_config(spec, group_lrs)
    if job["universal"]:
        cfg.setdefault("checkpoint", {})["load_universal"] = True
    if spec["zero_init"]:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = G.build_model(spec["model"])
    else:
        model = G.build_model(spec["model"])
    with torch.no_grad():  # scramble buffers so a load that skips them is caught
        for name, buf in model.named_buffers():
            if buf.is_floating_point():
                buf.add_(3.0)
            else:
                buf.add_(5)
    groups = G._param_groups(model, spec)
    torch_groups = [{"params": g["params"], "lr": g["lr"], "weight_decay": g["weight_decay"]} for g in groups]
    if spec["optimizer"] == "cpuadam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam(torch_groups, lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8, adamw_mode=True)
    elif spec["optimizer"] == "sgd":
        opt = torch.optim.SGD(torch_groups, lr=spec["lr"], momentum=0.9)
    elif spec["optimizer"] == "lion":
        opt = G.lion_like(torch_groups, spec["lr"])
    elif spec["optimizer"] == "hybrid":
        opt = G.hybrid_state(torch_groups, spec["lr"])
    else:
        opt = torch.optim.AdamW(torch_groups, lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    G.attach_late_module(model, dict(spec, seed=spec["seed"] + 1))  # other values: the checkpoint must set them
    load_path, client_state = engine.load_checkpoint(job["ckpt"], load_optimizer_states=True,
                                                     load_lr_scheduler_states=True)
    assert load_path is not None, "load_checkpoint returned None"
    tensors, info = G.collect_oracle(engine, model, spec, groups)
    info["client_state"] = {k: v for k, v in (client_state or {}).items() if isinstance(v, (int, float, str))}
    info["world_size"] = dist.get_world_size()
    info["stage"] = engine.zero_optimization_stage()
    if job["resave"]:
        latest = Path(job["ckpt"]) / ("latest_universal" if job["universal"] else "latest")
        tag = latest.read_text().strip() if latest.exists() else None
        engine.save_checkpoint(job["resave"], tag=tag, client_state=dict(info["client_state"]))
    if rank == 0:
        G._write_oracle(Path(job["out"]), tensors, info)
    G._finish(dist)


if __name__ == "__main__":
    _worker(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past the exit-time abort of CPU ranks (fixtures/generate.py exit_rank)
