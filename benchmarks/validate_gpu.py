#!/usr/bin/env python
"""Validate zckpt on checkpoints written by DeepSpeed on a GPU (issue 8, single-GPU variant).

Stages (each split into parts; results are cached under WORKDIR/results, so a stage that ran out of time
continues where it stopped when the same command is run again):

* ``gpu-train`` (parts ``z2``, ``z3``): ``torchrun --nproc-per-node G`` (``--gpus``, default 1; NCCL) trains a Qwen3-style causal LM with random
  weights (``Qwen3Config`` + ``Qwen3ForCausalLM``, no download; ~0.87B params by default, ``--tiny`` for ~23K)
  for ``--steps`` steps with DeepSpeed bf16 ZeRO-2 / ZeRO-3, a client ``torch.optim.AdamW`` (one param group),
  WarmupLR, fixed seeds and fixed random token data; ``engine.save_checkpoint(WORKDIR/ckpt_zS)``; sha256 of every
  parameter's fp32 master and Adam moments (DeepSpeed's ``safe_get_full_*`` API) at save time; then
  ``--cont-steps`` more steps from the in-memory state (the continuation at the original size).
* ``merge`` (parts ``z2``, ``z3``): ``zckpt merge --dtype fp32`` / ``--dtype bf16`` and DeepSpeed's
  ``CKPT/zero_to_torch.py --dtype fp32`` (time, peak RSS), then zckpt's safetensors vs DeepSpeed's ``.bin`` bit for
  bit (bf16: against DeepSpeed's fp32 cast with torch), and zckpt's fp32 vs the save-time sha256 of the masters.
* ``reshard`` (parts ``z2-ws2``, ``z2-z3-ws2``, ``z3-z2-ws2``, ``z2-wsG-cpu``, ``ds-universal``): ``zckpt.ops.reshard``
  the GPU-written ws=1 checkpoint to M (= ``--cpu-ranks``) ranks / another stage, load it with a plain
  ``engine.load_checkpoint`` at M CPU ranks (gloo), check every fp32 master, exp_avg, exp_avg_sq (bit for bit
  against the source read by zckpt's reader AND against the save-time sha256), the optimizer step, global steps
  and lr, then continue ``--cont-steps`` steps and compare the losses with the GPU continuation.
  ``z2-wsG-cpu`` loads the original checkpoint at G CPU ranks (no reshard): the CPU-vs-GPU loss noise floor.
  ``ds-universal`` times ``ds_to_universal --inject_missing_state`` and ``zckpt reshard --format universal``.
* ``largest-cpu`` (parts ``gen``, ``merge``; only when asked for): the largest ZeRO-2 CPU-rank checkpoint the
  free disk allows (fixtures/generate.py, <= ~1.9B params at 8 ranks), zckpt merge vs zero_to_torch on it.

Run (repo root; DeepSpeed importable)::

    python benchmarks/validate_gpu.py --workdir /tmp/v --out $OUT --stage all          # GPU, ~0.87B
    python benchmarks/validate_gpu.py --workdir /tmp/v --out /tmp/o --stage all --device cpu --tiny   # smoke test

Exit status: 0 all requested parts passed, 1 a part failed, 2 time budget used up (run the same command again).
Writes OUT/validate-<stage>.json (all cached part results of that stage) after every part, and OUT/logs/.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()

DIMS_1B = {"vocab": 32000, "hidden": 2048, "ffn": 6144, "layers": 16, "heads": 16, "kv_heads": 8, "head_dim": 128,
           "tie": True}
DIMS_TINY = {"vocab": 128, "hidden": 32, "ffn": 64, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 8,
             "tie": True}
STAGES = ("gpu-train", "merge", "reshard", "largest-cpu")
MIB = 1024 * 1024


def gen_module():
    """fixtures/generate.py (rank_env, free ports, the relink workaround, make_spec/generate)."""
    name = "zckpt_fixtures_generate"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "fixtures" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# ============================================================================================ shared helpers

def build_model(d: dict):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["ffn"],
                      num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                      num_key_value_heads=d["kv_heads"], head_dim=d["head_dim"], tie_word_embeddings=d["tie"],
                      use_cache=False, attention_dropout=0.0)
    return Qwen3ForCausalLM(cfg)


def count_params(d: dict) -> int:
    h, f, hd = d["hidden"], d["ffn"], d["head_dim"]
    attn = h * d["heads"] * hd * 2 + h * d["kv_heads"] * hd * 2 + 2 * hd
    layer = attn + 3 * h * f + 2 * h
    return d["vocab"] * h * (1 if d["tie"] else 2) + d["layers"] * layer + h


def ds_config(stage: int, micro: int, lr: float) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": lr / 10, "warmup_max_lr": lr,
                                                     "warmup_num_steps": 10, "warmup_type": "linear"}},
    }


def batch_for(step: int, job: dict):
    """The global batch of training step ``step`` (0-based): one of ``data_pool`` fixed random batches."""
    import torch
    g = torch.Generator().manual_seed(job["seed"] * 7919 + step % job["data_pool"])
    return torch.randint(0, job["dims"]["vocab"], (job["batch"], job["seq"]), generator=g)


def sha(t) -> str:
    """sha256 of a tensor's bytes; bf16/fp16 values (bf16 master weights) hashed as their exact fp32 upcast, so
    the hash of a master compares with zckpt's default fp32 output whatever dtype DeepSpeed kept it in."""
    import torch
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return hashlib.sha256(t.view(_int_dtype(t)).numpy().data).hexdigest()


def _int_dtype(t):
    import torch
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def bit_equal(a, b) -> bool:
    import torch
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return torch.equal(a.view(_int_dtype(a)), b.view(_int_dtype(b)))


def du(path: Path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def rmtree(p: Path):
    shutil.rmtree(p, ignore_errors=True)


# ============================================================================================ worker side

def _worker_setup(job: dict):
    import deepspeed
    import deepspeed.comm as dist
    import deepspeed.comm.torch as dct
    import torch

    if not job.get("shm_op"):
        dct.build_shm_op = lambda: None  # no JIT build of DeepSpeed's CPU shm op (needs g++); plain gloo
    if job["device"] == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        deepspeed.init_distributed(dist_backend="nccl")
    else:
        torch.set_num_threads(int(job["threads"]))
        deepspeed.init_distributed(dist_backend="gloo")
    return dist


def _engine(job: dict, stage: int, seed: int):
    import deepspeed
    import torch
    import torch.distributed as tdist

    ws = tdist.get_world_size()
    assert job["batch"] % ws == 0, f"--batch {job['batch']} is not divisible by {ws} ranks"
    cfg = ds_config(stage, job["batch"] // ws, job["lr"])
    for key, value in (job.get("ds_extra") or {}).items():  # e.g. {"bf16": {"bf16_master_weights_and_grads": true}}
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    torch.manual_seed(seed)
    model = build_model(job["dims"])
    opt = torch.optim.AdamW(model.parameters(), lr=job["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine, model, cfg


def _sync(job):
    if job["device"] == "cuda":
        import torch
        torch.cuda.synchronize()


def _train(engine, job: dict, start: int, n: int) -> tuple[list, list]:
    import torch.distributed as tdist

    rank, ws = tdist.get_rank(), tdist.get_world_size()
    mb = job["batch"] // ws
    losses, times = [], []
    for s in range(start, start + n):
        ids = batch_for(s, job)[rank * mb:(rank + 1) * mb].to(engine.device)
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        lv = loss.detach().float().reshape(1).clone()
        if ws > 1:
            tdist.all_reduce(lv)
            lv /= ws
        losses.append(float(lv.item()))
        _sync(job)
        times.append(round(time.perf_counter() - t0, 3))
    return losses, times


def _base_optimizer(engine):
    return getattr(engine, "basic_optimizer", None) or getattr(engine.optimizer, "optimizer", None)


def _opt_steps(engine) -> list:
    base = _base_optimizer(engine)
    vals = set()
    for st in base.state.values():
        if "step" in st:
            s = st["step"]
            vals.add(float(s.item()) if hasattr(s, "item") else float(s))
    return sorted(vals)


def _lrs(engine) -> list:
    return [float(x) for x in engine.get_lr()]


def _full_states(engine, model):
    """Yield (name, fp32, exp_avg, exp_avg_sq) for every trainable param (collective: call on all ranks)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    gen_module()._relink_hp_optimizer_state(engine)  # the DeepSpeed 0.19.8 multi-group bug; harmless with one
    for n, p in model.named_parameters():  # de-duplicated: the tied lm_head.weight is embed_tokens.weight
        if not p.requires_grad:
            continue
        yield (n, safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg"),
               safe_get_full_optimizer_state(p, "exp_avg_sq"))


def _worker_train(job: dict):
    import deepspeed
    import torch
    import torch.distributed as tdist

    dist = _worker_setup(job)
    rank = tdist.get_rank()
    if job.get("fake_cuda_tags"):  # local test only: make the saved files say "cuda:0" like the GPU's do
        import torch.serialization as ser
        orig = ser.location_tag
        ser.location_tag = lambda storage: "cuda:0" if orig(storage) == "cpu" else orig(storage)
    t0 = time.perf_counter()
    engine, model, cfg = _engine(job, job["stage"], job["seed"])
    t_init = time.perf_counter() - t0
    losses, times = _train(engine, job, 0, job["steps"])
    t1 = time.perf_counter()
    engine.save_checkpoint(job["save_dir"], client_state={"validate_gpu": True})
    _sync(job)
    tdist.barrier()
    t_save = time.perf_counter() - t1
    t1 = time.perf_counter()
    hashes = {}
    for n, fp32, m, v in _full_states(engine, model):
        if rank == 0:
            hashes[n] = {"shape": list(fp32.shape), "fp32": sha(fp32), "exp_avg": sha(m), "exp_avg_sq": sha(v),
                         "fp32_norm": float(fp32.float().norm())}
    t_hash = time.perf_counter() - t1
    saved = {"opt_steps": _opt_steps(engine), "global_steps": engine.global_steps, "lr": _lrs(engine)}
    cont, cont_times = _train(engine, job, job["steps"], job["cont_steps"])
    if rank == 0:
        res = {"stage": job["stage"], "world_size": tdist.get_world_size(), "device": job["device"],
               "params": sum(p.numel() for p in model.parameters()), "dims": job["dims"], "ds_config": cfg,
               "losses": losses, "step_s": times, "cont_losses": cont, "cont_step_s": cont_times,
               "init_s": round(t_init, 2), "save_s": round(t_save, 2), "hash_s": round(t_hash, 2),
               "saved": saved, "optimizer_wrapper": type(engine.optimizer).__name__,
               "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                            "transformers": __import__("transformers").__version__, "python": platform.python_version()}}
        if job["device"] == "cuda":
            res["gpu"] = torch.cuda.get_device_name()
            res["gpu_max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
        Path(job["hashes"]).write_text(json.dumps({"saved": saved, "params": hashes}))
        Path(job["result"]).write_text(json.dumps(res, indent=1))
    gen_module()._finish(dist)


def _worker_load(job: dict):
    """Load job['ckpt'] at this world size and stage, check the state, continue training."""
    import torch
    import torch.distributed as tdist

    dist = _worker_setup(job)
    rank, ws = tdist.get_rank(), tdist.get_world_size()
    t0 = time.perf_counter()
    engine, model, cfg = _engine(job, job["stage"], job["seed"] + 99)  # another init: all must come from ckpt
    t_init = time.perf_counter() - t0
    t0 = time.perf_counter()
    load_path, client_state = engine.load_checkpoint(job["ckpt"])
    t_load = time.perf_counter() - t0
    assert load_path is not None, f"engine.load_checkpoint({job['ckpt']}) returned None"

    t0 = time.perf_counter()
    saved = json.loads(Path(job["hashes"]).read_text()) if job.get("hashes") and Path(job["hashes"]).exists() else None
    src = by = reader = None
    if rank == 0:
        import zckpt
        from zckpt.encoding.tensors import Reader
        src = zckpt.open_checkpoint(job["src"])
        by = src.by_name()
        reader = Reader()
    n_params = 0
    bad_src, bad_hash, missing = [], [], []
    for n, fp32, m, v in _full_states(engine, model):
        n_params += 1
        if rank != 0:
            continue
        from zckpt.encoding.tensors import load_pieces
        rec = by.get(n)
        if rec is None or fp32 is None or m is None or v is None:
            missing.append(n)
            continue
        for key, got in (("fp32", fp32), ("exp_avg", m), ("exp_avg_sq", v)):
            pieces = rec.value if key == "fp32" else getattr(rec, key)
            ref = load_pieces(pieces, pieces[0].dtype if pieces else rec.dtype, rec.shape, reader)
            if not (bit_equal(got, ref) or (got.dtype != ref.dtype and bit_equal(got.float(), ref.float()))):
                # (safe_get_full_* hands back bf16 masters/moments upcast to fp32: equal when exactly the same values)
                bad_src.append(f"{n}:{key}")
            if saved is not None and sha(got) != saved["params"].get(n, {}).get(key):
                bad_hash.append(f"{n}:{key}")
    t_check = time.perf_counter() - t0
    loaded = {"opt_steps": _opt_steps(engine), "global_steps": engine.global_steps, "lr": _lrs(engine)}
    res = None
    if rank == 0:
        reader.close()
        src_steps = sorted({float(g.step) for g in src.groups if g.step is not None})
        res = {"world_size": ws, "stage": engine.zero_optimization_stage(), "ds_config": cfg,
               "optimizer_wrapper": type(engine.optimizer).__name__, "params_checked": n_params,
               "mismatch_vs_source": bad_src[:50], "n_mismatch_vs_source": len(bad_src),
               "mismatch_vs_save_time_sha256": bad_hash[:50], "n_mismatch_vs_save_time_sha256": len(bad_hash),
               "save_time_sha256_available": saved is not None, "missing": missing,
               "loaded": loaded, "source_steps_zckpt": src_steps,
               "saved": saved["saved"] if saved else None,
               "client_state_keys": sorted(str(k) for k in (client_state or {})),
               "cont_losses": [], "cont_step_s": [], "threads_per_rank": job["threads"],
               "init_s": round(t_init, 2), "load_s": round(t_load, 2), "check_s": round(t_check, 2)}
        Path(job["result"]).write_text(json.dumps(res, indent=1))  # the state checks survive a timeout below

    # continuation: as many of cont_steps as fit in cont_allow_s (rank 0 decides, every rank follows)
    n_params_all = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    tokens = job["batch"] // ws * job["seq"]
    est = None
    if rank == 0:
        gflops = _bf16_gflops()
        est = 6.0 * n_params_all * tokens / (gflops * 1e9)
        res.update(cpu_bf16_matmul_gflops=round(gflops, 1), est_step_s=round(est, 1),
                   cont_allow_s=job["cont_allow_s"])
    t_start = time.perf_counter()
    for i in range(job["cont_steps"]):
        go = torch.zeros(1)
        if rank == 0:
            spent = time.perf_counter() - t_start
            nxt = res["cont_step_s"][-1] if res["cont_step_s"] else est
            go[0] = 1.0 if spent + nxt <= job["cont_allow_s"] else 0.0
        tdist.all_reduce(go)  # only rank 0 contributes
        if go.item() < 0.5:
            break
        loss, dt = _train(engine, job, engine.global_steps, 1)
        if rank == 0:
            res["cont_losses"] += loss
            res["cont_step_s"] += dt
            Path(job["result"]).write_text(json.dumps(res, indent=1))
    if rank == 0 and len(res["cont_losses"]) < job["cont_steps"]:
        res["cont_truncated"] = (f"{len(res['cont_losses'])} of {job['cont_steps']} continuation steps fit in "
                                 f"{job['cont_allow_s']:.0f}s (estimated {est:.0f}s/step)")
        Path(job["result"]).write_text(json.dumps(res, indent=1))
    gen_module()._finish(dist)


def _bf16_gflops(seconds: float = 1.0) -> float:
    """This process's bf16 matmul speed (CPUs without AVX512-BF16/AMX are ~50x slower than fp32)."""
    import torch
    a = torch.randn(1024, 1024, dtype=torch.bfloat16)
    b = torch.randn(1024, 1024, dtype=torch.bfloat16)
    a @ b
    n, t0 = 0, time.perf_counter()
    while n < 1 or time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return 2 * 1024 ** 3 * n / (time.perf_counter() - t0) / 1e9


def worker_main(job_path: str):
    job = json.loads(Path(job_path).read_text())
    {"train": _worker_train, "load": _worker_load}[job["mode"]](job)


# ============================================================================================ driver side

class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.time(), seconds

    def left(self) -> float:
        return self.seconds - (time.time() - self.t0)


def sub_env(extra: dict | None = None, cpu_ranks: bool = True) -> dict:
    """Environment of subprocesses: the repo on PYTHONPATH; CPU ranks get fixtures/generate.py's rank_env."""
    G = gen_module()
    env = G.rank_env() if cpu_ranks else dict(os.environ)
    pp = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(pp)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_measured(cmd: list, log_path: Path, env: dict, timeout: float) -> dict:
    """Run ``cmd`` in its own session; seconds, peak RSS of the largest process (wait4) and of the tree (psutil)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover
        psutil = None
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(str(c) for c in cmd) + "\n")
        log.flush()
        proc = subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=str(ROOT), start_new_session=True)
    peak, done = [0], threading.Event()

    def sample():
        if psutil is None:
            return
        try:
            root = psutil.Process(proc.pid)
        except psutil.Error:
            return
        while not done.is_set():
            total = 0
            try:
                for p in [root] + root.children(recursive=True):
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
            except psutil.Error:
                break
            peak[0] = max(peak[0], total)
            done.wait(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    timed_out = False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() - t0 > timeout:
            timed_out = True
            pid = 0
            for sig in (15, 9):  # the whole session: torchrun and its ranks
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
                for _ in range(50):
                    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                    if pid:
                        break
                    time.sleep(0.1)
                if pid:
                    break
            if not pid:
                _, status, usage = os.wait4(proc.pid, 0)
            try:
                os.killpg(proc.pid, 9)  # ranks left behind by a torchrun that exited on SIGTERM
            except (ProcessLookupError, PermissionError):
                pass
            break
        time.sleep(0.1)
    dt = time.perf_counter() - t0
    done.set()
    th.join()
    rc = os.waitstatus_to_exitcode(status)
    proc.returncode = rc
    maxrss = usage.ru_maxrss * 1024
    return {"rc": "timeout" if timed_out else rc, "seconds": round(dt, 2), "peak_rss_mib": round(maxrss / MIB),
            "tree_rss_mib": round(max(peak[0], maxrss) / MIB), "log": str(log_path)}


def log_tail(path, n: int = 60) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    G = gen_module()
    return G._summarize_log(text, n)


class Ctx:
    def __init__(self, a):
        self.a = a
        self.work = Path(a.workdir).resolve()
        self.out = Path(a.out).resolve()
        self.results = self.work / "results"
        self.logs = self.work / "logs"
        for d in (self.work, self.out, self.results, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.dims = dict(DIMS_TINY if a.tiny else DIMS_1B)
        self.dims.update(a.dims or {})
        self.budget = Budget(a.budget)
        self.py = sys.executable

    def ckpt(self, z) -> Path:
        return self.work / f"ckpt_z{z}"

    def hashes(self, z) -> Path:
        return self.work / f"ckpt_z{z}.sha256.json"

    def train_result(self, z) -> dict | None:
        p = self.results / f"gpu-train.z{z}.json"
        if p.exists():
            r = json.loads(p.read_text())
            if r.get("ok") and (self.ckpt(z) / "latest").exists():
                return r
        return None

    def job_common(self) -> dict:
        a = self.a
        return {"dims": self.dims, "batch": a.batch, "seq": a.seq, "lr": a.lr, "seed": a.seed,
                "data_pool": a.data_pool, "steps": a.steps, "cont_steps": a.cont_steps, "shm_op": False,
                "ds_extra": a.ds_extra}

    def torchrun(self, nproc: int, job: dict, log: Path, env: dict, timeout: float) -> dict:
        G = gen_module()
        jp = self.work / "jobs" / (log.stem + ".json")
        jp.parent.mkdir(parents=True, exist_ok=True)
        jp.write_text(json.dumps(job, indent=1))
        cmd = [self.py, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()), str(THIS), "--_worker", str(jp)]
        return run_measured(cmd, log, env, timeout)

    def cpu_env(self, nranks: int) -> tuple[dict, int]:
        threads = self.a.cpu_threads or max(1, (os.cpu_count() or 2) // nranks)
        return sub_env({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}), threads

    def tool_env(self) -> dict:
        return sub_env({"OMP_NUM_THREADS": str(os.cpu_count() or 1), "MKL_NUM_THREADS": str(os.cpu_count() or 1)})


# -------------------------------------------------------------------------------------------- gpu-train

def part_train(ctx: Ctx, z: int) -> dict:
    a = ctx.a
    save = ctx.ckpt(z)
    rmtree(save)
    res_path = ctx.work / "jobs" / f"train-z{z}.result.json"
    res_path.unlink(missing_ok=True)
    job = {**ctx.job_common(), "mode": "train", "stage": z, "device": a.device, "save_dir": str(save),
           "hashes": str(ctx.hashes(z)), "result": str(res_path), "fake_cuda_tags": a.fake_cuda_tags}
    if a.device == "cuda":
        env = sub_env({"DS_ACCELERATOR": "cuda", "OMP_NUM_THREADS": "8"}, cpu_ranks=False)
        job["threads"] = 8
    else:
        env, threads = ctx.cpu_env(a.gpus)
        job["threads"] = threads
    r = ctx.torchrun(a.gpus, job, ctx.logs / f"train-z{z}.log", env, ctx.budget.left())
    if r["rc"] != 0 or not res_path.exists():
        return {"ok": False, "error": f"torchrun rc={r['rc']}", "run": r, "log_tail": log_tail(r["log"])}
    res = json.loads(res_path.read_text())
    res.update({"ok": True, "wall_s": r["seconds"], "peak_rss_mib": r["peak_rss_mib"],
                "ckpt": str(save), "ckpt_bytes": du(save),
                "ckpt_files": sorted(str(p.relative_to(save)) for p in save.rglob("*") if p.is_file())})
    return res


def show_train(parts: dict):
    rows = [("part", "params", "losses", "cont losses", "step s (med)", "save s", "ckpt GB", "wall s")]
    for k, r in parts.items():
        if not r.get("ok"):
            rows.append((k, "FAILED", r.get("error", ""), "", "", "", "", ""))
            continue
        st = sorted(r["step_s"][1:] or r["step_s"])
        rows.append((k, f"{r['params'] / 1e6:.1f}M", _fl(r["losses"]), _fl(r["cont_losses"]),
                     f"{st[len(st) // 2]:.2f}", f"{r['save_s']:.1f}", f"{r['ckpt_bytes'] / 1e9:.2f}",
                     f"{r['wall_s']:.0f}"))
    _table(rows)


# -------------------------------------------------------------------------------------------- merge

def _load_safetensors_dir(d: Path) -> dict:
    from safetensors.torch import load_file
    sd = {}
    for f in sorted(d.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def _load_bin_dir(d: Path) -> dict:
    import torch
    sd = {}
    files = sorted(d.glob("pytorch_model*.bin")) or sorted(d.glob("*.bin"))
    for f in files:  # our own DeepSpeed output, trusted: pickle allowed
        sd.update(torch.load(str(f), map_location="cpu", weights_only=False))
    return sd


def compare_merged(zk: dict, ds: dict, cast=None) -> dict:
    """zckpt's tensors vs DeepSpeed's; DeepSpeed's tied aliases (same storage) are matched to the stored name."""
    mism, aliases, missing = [], {}, []
    by_ptr = {}
    for k, v in ds.items():
        by_ptr.setdefault((v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)), []).append(k)
    for k, v in ds.items():
        ref = v if cast is None else v.to(cast)
        if k in zk:
            if not bit_equal(zk[k], ref):
                mism.append(k)
            continue
        alias = [o for o in by_ptr[(v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))]
                 if o != k and o in zk]
        if alias:
            aliases[k] = alias[0]
            if not bit_equal(zk[alias[0]], ref):
                mism.append(k)
        else:
            missing.append(k)
    extra = [k for k in zk if k not in ds]
    return {"equal": not (mism or missing or extra), "n_ds": len(ds), "n_zckpt": len(zk), "mismatch": mism[:20],
            "n_mismatch": len(mism), "missing_in_zckpt": missing[:20], "extra_in_zckpt": extra[:20],
            "tied_aliases": aliases}


def part_merge(ctx: Ctx, z: int) -> dict:
    import torch
    ck = ctx.ckpt(z)
    if ctx.train_result(z) is None:
        return {"ok": None, "skipped": f"no gpu-train result / checkpoint for ZeRO-{z}"}
    m = ctx.work / "merge"
    outs = {"zckpt_fp32": m / f"zckpt_z{z}_fp32", "zckpt_bf16": m / f"zckpt_z{z}_bf16", "ds_fp32": m / f"ds_z{z}_fp32"}
    for p in outs.values():
        rmtree(p)
    m.mkdir(parents=True, exist_ok=True)
    env = ctx.tool_env()
    cmds = {
        "zckpt_fp32": [ctx.py, "-m", "zckpt", "merge", ck, "-o", outs["zckpt_fp32"], "--dtype", "fp32", "-q"],
        "zckpt_bf16": [ctx.py, "-m", "zckpt", "merge", ck, "-o", outs["zckpt_bf16"], "--dtype", "bf16", "-q"],
        "ds_fp32": [ctx.py, ck / "zero_to_torch.py", ck, outs["ds_fp32"], "--dtype", "fp32"],
    }
    res: dict = {"ckpt": str(ck), "ckpt_bytes": du(ck), "runs": {}}
    for k, cmd in cmds.items():
        _sync_disk()
        r = ctx_run(ctx, cmd, f"merge-z{z}-{k}", env)
        r["out_bytes"] = du(outs[k]) if outs[k].exists() else 0
        res["runs"][k] = r
        if r["rc"] != 0:
            res.update(ok=False, error=f"{k} rc={r['rc']}", log_tail=log_tail(r["log"]))
            return res
    t0 = time.perf_counter()
    ds = _load_bin_dir(outs["ds_fp32"])
    zk = _load_safetensors_dir(outs["zckpt_fp32"])
    res["fp32_vs_deepspeed"] = compare_merged(zk, ds)
    hashes = json.loads(ctx.hashes(z).read_text())["params"] if ctx.hashes(z).exists() else {}
    bad = [n for n, h in hashes.items() if n not in zk or sha(zk[n]) != h["fp32"]]
    res["fp32_vs_save_time_sha256"] = {"equal": bool(hashes) and not bad, "checked": len(hashes), "bad": bad[:20]}
    del zk
    zb = _load_safetensors_dir(outs["zckpt_bf16"])
    res["bf16_vs_deepspeed_fp32_cast"] = compare_merged(zb, ds, cast=torch.bfloat16)
    del zb, ds
    res["compare_s"] = round(time.perf_counter() - t0, 1)
    z32, d32 = res["runs"]["zckpt_fp32"], res["runs"]["ds_fp32"]
    res["speedup_fp32"] = round(d32["seconds"] / max(z32["seconds"], 1e-9), 2)
    res["ok"] = all(res[k]["equal"] for k in ("fp32_vs_deepspeed", "fp32_vs_save_time_sha256",
                                              "bf16_vs_deepspeed_fp32_cast"))
    if not ctx.a.keep:
        for p in outs.values():
            rmtree(p)
    return res


def show_merge(parts: dict):
    rows = [("part", "tool", "seconds", "peak RSS MiB", "out GB", "bit-exact")]
    for k, r in parts.items():
        if r.get("skipped"):
            rows.append((k, "skipped", r["skipped"], "", "", ""))
            continue
        for tool, run in r.get("runs", {}).items():
            eq = ""
            if tool == "zckpt_fp32" and "fp32_vs_deepspeed" in r:
                eq = f"vs DS: {r['fp32_vs_deepspeed']['equal']}, vs save sha: {r['fp32_vs_save_time_sha256']['equal']}"
            if tool == "zckpt_bf16" and "bf16_vs_deepspeed_fp32_cast" in r:
                eq = f"vs DS fp32->bf16: {r['bf16_vs_deepspeed_fp32_cast']['equal']}"
            rows.append((k, tool, f"{run['seconds']:.1f}", run["peak_rss_mib"], f"{run.get('out_bytes', 0) / 1e9:.2f}",
                         eq))
        if not r.get("ok"):
            rows.append((k, "FAILED", r.get("error", "comparison"), "", "", ""))
    _table(rows)


# -------------------------------------------------------------------------------------------- reshard

def reshard_cases(M: int, G: int = 1) -> dict:
    """M: the reshard targets' world size; G: the GPU run's (the no-reshard noise-floor case loads at G)."""
    return {
        f"z2-ws{M}": {"src": 2, "stage": 2, "ws": M, "reshard": True},
        f"z2-z3-ws{M}": {"src": 2, "stage": 3, "ws": M, "reshard": True},
        f"z3-z2-ws{M}": {"src": 3, "stage": 2, "ws": M, "reshard": True},
        f"z2-ws{G}-cpu": {"src": 2, "stage": 2, "ws": G, "reshard": False},
        "ds-universal": {"src": 2, "universal": True},
    }


_RESHARD_PY = ("import json, sys, zckpt; a = sys.argv[1:]; "
               "r = zckpt.reshard(a[0], a[1], world_size=int(a[2]), stage=int(a[3]), fmt=a[4], overwrite=True); "
               "print('ZCKPT_RESULT ' + json.dumps({'seconds': r.seconds, 'total_bytes': r.plan.total_bytes, "
               "'notes': r.plan.notes, 'files': len(r.plan.files)}))")


def _zckpt_reshard(ctx: Ctx, src: Path, out: Path, ws: int, stage: int, fmt: str, name: str) -> dict:
    rmtree(out)
    _sync_disk()
    r = ctx_run(ctx, [ctx.py, "-c", _RESHARD_PY, src, out, ws, stage, fmt], name, ctx.tool_env())
    for line in Path(r["log"]).read_text(errors="replace").splitlines():
        if line.startswith("ZCKPT_RESULT "):
            r["api"] = json.loads(line[len("ZCKPT_RESULT "):])
    r["out_bytes"] = du(out) if out.exists() else 0
    return r


def part_reshard(ctx: Ctx, name: str, case: dict) -> dict:
    a = ctx.a
    tr = ctx.train_result(case["src"])
    if tr is None:
        return {"ok": None, "skipped": f"no gpu-train result / checkpoint for ZeRO-{case['src']}"}
    src = ctx.ckpt(case["src"])
    if case.get("universal"):
        return _part_universal(ctx, src, tr)
    res: dict = {"source": str(src), "source_stage": case["src"], "target_stage": case["stage"],
                 "world_size": case["ws"]}
    ckpt = src
    if case["reshard"]:
        ckpt = ctx.work / "reshard" / name
        r = _zckpt_reshard(ctx, src, ckpt, case["ws"], case["stage"], "deepspeed", f"reshard-{name}")
        res["zckpt_reshard"] = r
        if r["rc"] != 0:
            res.update(ok=False, error=f"zckpt reshard rc={r['rc']}", log_tail=log_tail(r["log"]))
            return res
    env, threads = ctx.cpu_env(case["ws"])
    out = ctx.work / "jobs" / f"load-{name}.result.json"
    out.unlink(missing_ok=True)
    allow = max(0.0, min(a.cpu_cont_budget, ctx.budget.left() - a.cpu_load_reserve))
    job = {**ctx.job_common(), "mode": "load", "device": "cpu", "stage": case["stage"], "ckpt": str(ckpt),
           "src": str(src), "hashes": str(ctx.hashes(case["src"])), "result": str(out), "threads": threads,
           "cont_allow_s": allow}
    r = ctx.torchrun(case["ws"], job, ctx.logs / f"load-{name}.log", env, ctx.budget.left())
    res["deepspeed_load"] = r
    if not a.keep and case["reshard"]:
        rmtree(ckpt)
    if not out.exists():
        res.update(ok=False, error=f"DeepSpeed load at {case['ws']} CPU ranks failed (rc={r['rc']})",
                   log_tail=log_tail(r["log"]))
        return res
    ld = json.loads(out.read_text())
    res["load"] = ld
    if r["rc"] != 0:  # the state was checked, the continuation (or the exit) failed
        res["continuation_error"] = f"torchrun rc={r['rc']} after the state checks"
        res["log_tail"] = log_tail(r["log"])
    saved = tr["saved"]
    checks = {
        "state_vs_source_bitwise": ld["n_mismatch_vs_source"] == 0 and not ld["missing"] and ld["params_checked"] > 0,
        "state_vs_save_time_sha256": ld["save_time_sha256_available"] and ld["n_mismatch_vs_save_time_sha256"] == 0,
        "opt_step": ld["loaded"]["opt_steps"] == saved["opt_steps"] == ld["source_steps_zckpt"],
        "global_steps": ld["loaded"]["global_steps"] == saved["global_steps"],
        "lr": ld["loaded"]["lr"] == saved["lr"],
    }
    ref = tr["cont_losses"]
    diffs = [abs(x - y) for x, y in zip(ld["cont_losses"], ref)]
    res["loss"] = {"original_continuation": ref, "resharded_continuation": ld["cont_losses"],
                   "abs_diff": [round(d, 6) for d in diffs], "max_abs_diff": max(diffs) if diffs else None,
                   "tolerance": a.loss_tol}
    checks["losses_finite"] = all(math.isfinite(x) and abs(x) < 1e4 for x in ld["cont_losses"])
    checks["exit_clean"] = r["rc"] == 0
    if ld.get("cont_truncated"):
        res["note"] = ld["cont_truncated"]
    res["loss_close"] = bool(diffs) and max(diffs) <= a.loss_tol
    res["checks"] = checks
    res["ok"] = all(checks.values())
    return res


def _part_universal(ctx: Ctx, src: Path, tr: dict) -> dict:
    tag = (src / "latest").read_text().strip()
    res: dict = {"source": str(src), "tag": tag, "source_bytes": du(src)}
    uni = ctx.work / "reshard" / "ds_universal"
    rmtree(uni)
    _sync_disk()
    cmd = [ctx.py, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", src / tag,
           "--output_folder", uni / f"{tag}_universal", "--inject_missing_state"]
    r = ctx_run(ctx, cmd, "reshard-ds_to_universal", ctx.tool_env())
    r["out_bytes"] = du(uni) if uni.exists() else 0
    res["ds_to_universal"] = r
    rmtree(uni)
    zu = ctx.work / "reshard" / "zckpt_universal"
    res["zckpt_universal"] = _zckpt_reshard(ctx, src, zu, ctx.a.cpu_ranks, tr["stage"], "universal",
                                            "reshard-zckpt_universal")
    rmtree(zu)
    zn = ctx.work / "reshard" / "zckpt_native"
    res["zckpt_native"] = _zckpt_reshard(ctx, src, zn, ctx.a.cpu_ranks, tr["stage"], "deepspeed",
                                         "reshard-zckpt_native")
    rmtree(zn)
    res["ok"] = all(res[k]["rc"] == 0 for k in ("ds_to_universal", "zckpt_universal", "zckpt_native"))
    if not res["ok"]:
        bad = [k for k in ("ds_to_universal", "zckpt_universal", "zckpt_native") if res[k]["rc"] != 0]
        res["error"] = f"{bad} failed"
        res["log_tail"] = log_tail(res[bad[0]]["log"])
    return res


def show_reshard(parts: dict):
    rows = [("part", "zckpt s", "RSS MiB", "load s", "state bitwise", "step/lr", "max|dloss|", "cont losses", "ok")]
    for k, r in parts.items():
        if r.get("skipped"):
            rows.append((k, "skipped: " + r["skipped"], "", "", "", "", "", "", ""))
            continue
        if "ds_to_universal" in r:
            for t in ("ds_to_universal", "zckpt_universal", "zckpt_native"):
                x = r.get(t)
                if x:
                    rows.append((f"{k}:{t}", f"{x['seconds']:.1f}", f"{x['peak_rss_mib']}/{x['tree_rss_mib']}",
                                 "", "", "", "", f"{x.get('out_bytes', 0) / 1e9:.2f} GB", x["rc"] == 0))
            continue
        zr = r.get("zckpt_reshard") or {}
        ld = r.get("load") or {}
        ch = r.get("checks") or {}
        loss = r.get("loss") or {}
        rows.append((k, f"{zr['seconds']:.1f}" if zr else "-", zr.get("peak_rss_mib", "-"),
                     ld.get("load_s", "-"),
                     f"{ch.get('state_vs_source_bitwise')}/{ch.get('state_vs_save_time_sha256')}" if ch else "-",
                     f"{ch.get('opt_step')}/{ch.get('lr')}" if ch else "-",
                     f"{loss['max_abs_diff']:.2e}" if loss.get("max_abs_diff") is not None else "-",
                     _fl(ld.get("cont_losses", [])) + (" (cut short)" if ld.get("cont_truncated") else ""),
                     r.get("ok") if r.get("ok") is not None else r.get("error")))
    _table(rows)


# -------------------------------------------------------------------------------------------- largest-cpu

def _largest_dims(ctx: Ctx) -> dict:
    a = ctx.a
    h, f, v = 1280, 5120, 32000
    per_layer = (h * f + f) + (f * h + h) + 2 * h + h * h  # fixtures/generate.py's test model
    if a.tiny:
        return {"vocab": 512, "hidden": 64, "ffn": 256, "layers": 4}
    if a.largest_layers:
        layers = a.largest_layers
    else:
        free = shutil.disk_usage(ctx.work).free + du(ctx.work / "largest")
        # disk: checkpoint 14 B/param + zckpt fp32 4 + DeepSpeed fp32 4, 10% margin
        # RAM: every rank builds the fp32 model (4 B/param) before DeepSpeed casts and partitions it
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        max_params = min(free * 0.9 / 22, mem * 0.75 / (4 * a.largest_ranks + 4))
        layers = int((max_params - v * h) // per_layer)
        layers = max(1, min(128, layers))
    return {"vocab": v, "hidden": h, "ffn": f, "layers": layers}


def part_largest_gen(ctx: Ctx) -> dict:
    G = gen_module()
    a = ctx.a
    if a.free_gpu_ckpts:
        for z in (2, 3):
            rmtree(ctx.ckpt(z))
    dims = _largest_dims(ctx)
    h, fdim = dims["hidden"], dims["ffn"]
    params = dims["vocab"] * h + dims["layers"] * ((h * fdim + fdim) + (fdim * h + h) + 2 * h + h * h)
    ck = ctx.work / "largest" / "ckpt"
    spec = G.make_spec(name="largest", stage=2, dtype="bf16", world_size=a.largest_ranks, model=dims, steps=1,
                       micro_batch=1, seq_len=8, scheduler=False)
    t0 = time.perf_counter()
    log = ctx.logs / "largest-gen.log"
    try:
        G.generate(spec, ck, expected=False, oracle=False, timeout=max(30, ctx.budget.left()), log_file=log)
    except Exception as e:  # noqa: BLE001
        rmtree(ck)
        return {"ok": False, "error": str(e)[-3000:], "dims": dims, "params": params}
    return {"ok": True, "dims": dims, "params": params, "world_size": a.largest_ranks, "ckpt": str(ck),
            "ckpt_bytes": du(ck), "gen_s": round(time.perf_counter() - t0, 1)}


def part_largest_merge(ctx: Ctx) -> dict:
    gen = ctx.results / "largest-cpu.gen.json"
    ck = ctx.work / "largest" / "ckpt"
    if not gen.exists() or not (ck / "latest").exists():
        return {"ok": None, "skipped": "no largest-cpu checkpoint (run part gen first)"}
    info = json.loads(gen.read_text())
    zo, do = ctx.work / "largest" / "zckpt_fp32", ctx.work / "largest" / "ds_fp32"
    rmtree(zo)
    rmtree(do)
    env = ctx.tool_env()
    res: dict = {"params": info["params"], "ckpt_bytes": du(ck), "world_size": info["world_size"], "runs": {}}
    for k, cmd, o in (("zckpt_fp32", [ctx.py, "-m", "zckpt", "merge", ck, "-o", zo, "--dtype", "fp32", "-q"], zo),
                      ("ds_fp32", [ctx.py, ck / "zero_to_torch.py", ck, do, "--dtype", "fp32"], do)):
        _sync_disk()
        r = ctx_run(ctx, cmd, f"largest-{k}", env)
        r["out_bytes"] = du(o) if o.exists() else 0
        res["runs"][k] = r
        if r["rc"] != 0:
            res.update(ok=False, error=f"{k} rc={r['rc']}", log_tail=log_tail(r["log"]))
            return res
    res["fp32_vs_deepspeed"] = compare_merged(_load_safetensors_dir(zo), _load_bin_dir(do))
    res["speedup_fp32"] = round(res["runs"]["ds_fp32"]["seconds"] / max(res["runs"]["zckpt_fp32"]["seconds"], 1e-9), 2)
    res["ok"] = res["fp32_vs_deepspeed"]["equal"]
    if not ctx.a.keep:
        rmtree(zo)
        rmtree(do)
    return res


def show_largest(parts: dict):
    rows = [("part", "params", "tool", "seconds", "peak RSS MiB", "GB", "ok")]
    for k, r in parts.items():
        if r.get("skipped"):
            rows.append((k, "", "skipped", r["skipped"], "", "", ""))
        elif k == "gen":
            rows.append((k, f"{r.get('params', 0) / 1e9:.2f}B", f"DeepSpeed {r.get('world_size', '?')} CPU ranks",
                         r.get("gen_s", "-"), "", f"{r.get('ckpt_bytes', 0) / 1e9:.2f}", r.get("ok")))
        else:
            for tool, run in r.get("runs", {}).items():
                rows.append((k, f"{r['params'] / 1e9:.2f}B", tool, f"{run['seconds']:.1f}", run["peak_rss_mib"],
                             f"{run.get('out_bytes', 0) / 1e9:.2f}", run["rc"] == 0))
            rows.append((k, "", "bit-exact vs DeepSpeed", "", "", "", r.get("ok")))
    _table(rows)


# -------------------------------------------------------------------------------------------- plumbing

def ctx_run(ctx: Ctx, cmd: list, name: str, env: dict) -> dict:
    return run_measured(cmd, ctx.logs / f"{name}.log", env, max(10.0, ctx.budget.left()))


def _sync_disk():
    if hasattr(os, "sync"):
        os.sync()  # no run pays for the previous one's dirty pages


def _fl(xs) -> str:
    return " ".join(f"{x:.4f}" for x in xs)


def _table(rows):
    rows = [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        print("  " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)))
        if j == 0:
            print("  " + "-+-".join("-" * x for x in w))


SHOW = {"gpu-train": show_train, "merge": show_merge, "reshard": show_reshard, "largest-cpu": show_largest}


def plan(ctx: Ctx) -> list[tuple[str, str, object]]:
    """(stage, part, thunk) in run order."""
    a = ctx.a
    stages = [a.stage] if a.stage != "all" else ["gpu-train", "merge", "reshard"] + (["largest-cpu"] if a.largest else [])
    out = []
    for st in stages:
        if st == "gpu-train":
            for z in a.zero:
                out.append((st, f"z{z}", lambda z=z: part_train(ctx, z)))
        elif st == "merge":
            for z in a.zero:
                out.append((st, f"z{z}", lambda z=z: part_merge(ctx, z)))
        elif st == "reshard":
            for name, case in reshard_cases(a.cpu_ranks, a.gpus).items():
                if a.cases and name not in a.cases:
                    continue
                if case.get("src", 2) not in a.zero or case.get("stage", 2) not in (2, 3):
                    continue
                out.append((st, name, lambda name=name, case=case: part_reshard(ctx, name, case)))
        elif st == "largest-cpu":
            out.append((st, "gen", lambda: part_largest_gen(ctx)))
            out.append((st, "merge", lambda: part_largest_merge(ctx)))
    return out


def write_stage_json(ctx: Ctx, stage: str) -> dict:
    parts = {}
    for p in sorted(ctx.results.glob(f"{stage}.*.json")):
        parts[p.name[len(stage) + 1:-5]] = json.loads(p.read_text())
    doc = {"stage": stage, "workdir": str(ctx.work), "model": ctx.dims, "model_params": count_params(ctx.dims),
           "args": {k: v for k, v in vars(ctx.a).items() if not k.startswith("_")},
           "host": host_info(ctx), "parts": parts}
    (ctx.out / f"validate-{stage}.json").write_text(json.dumps(doc, indent=1))
    return doc


_HOST: dict = {}


def host_info(ctx: Ctx) -> dict:
    if "python" not in _HOST:
        _HOST.update({"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()})
        try:
            _HOST["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
        except (ValueError, OSError):
            pass
        try:
            import torch
            _HOST["torch"] = torch.__version__
            _HOST["transformers"] = __import__("transformers").__version__
            import importlib.metadata as md
            _HOST["deepspeed"] = md.version("deepspeed")
        except Exception as e:  # noqa: BLE001
            _HOST["versions_error"] = repr(e)
        try:
            lines = Path("/proc/cpuinfo").read_text().splitlines()
            _HOST["cpu_model"] = next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
            flags = next(ln for ln in lines if ln.startswith("flags")).split()
            _HOST["cpu_bf16"] = [f for f in ("avx512_bf16", "amx_bf16", "avx512bw") if f in flags]
            import torch
            _HOST["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        except Exception as e:  # noqa: BLE001 - informational only
            _HOST["cpu_info_error"] = repr(e)
    d = dict(_HOST)
    d["disk_free_gb"] = round(shutil.disk_usage(ctx.work).free / 1e9, 1)
    return d


_PREFLIGHT = r"""
import importlib, json, sys
out = {}
def chk(name, fn):
    try:
        out[name] = str(fn())
    except Exception as e:
        out[name] = "ERROR " + type(e).__name__ + ": " + str(e)[:300]
chk("deepspeed", lambda: importlib.import_module("deepspeed").__version__)
chk("transformers.Qwen3", lambda: importlib.import_module("transformers").Qwen3ForCausalLM and
    importlib.import_module("transformers").__version__)
chk("zckpt", lambda: [importlib.import_module(m) for m in ("zckpt.ops.reshard", "zckpt.ops.merge", "zckpt.encoding.tensors",
                                                          "zckpt.cli")] and "ok")
chk("safetensors", lambda: importlib.import_module("safetensors.torch") and "ok")
chk("psutil", lambda: importlib.import_module("psutil").__version__)
chk("torch", lambda: importlib.import_module("torch").__version__)
def cuda():
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False (torch " + torch.__version__ + ")")
    return torch.cuda.get_device_name(0)
if sys.argv[1] == "cuda":
    chk("cuda", cuda)
print("PREFLIGHT " + json.dumps(out))
"""
OPTIONAL = ("psutil",)


def preflight(ctx: Ctx, need_cuda: bool) -> dict:
    """Import everything the stages need, once per workdir (DeepSpeed on the CPU accelerator)."""
    cache = ctx.results / "preflight.json"
    if cache.exists():
        got = json.loads(cache.read_text())
        if not need_cuda or "cuda" in got:
            return got
    r = run_measured([ctx.py, "-c", _PREFLIGHT, "cuda" if need_cuda else "cpu"], ctx.logs / "preflight.log",
                     sub_env({"DS_ACCELERATOR": "cpu"}, cpu_ranks=False), 300)
    got = {"error": f"preflight rc={r['rc']}: {log_tail(r['log'], 20)}"}
    for line in Path(r["log"]).read_text(errors="replace").splitlines():
        if line.startswith("PREFLIGHT "):
            got = json.loads(line[len("PREFLIGHT "):])
    if not any(str(v).startswith("ERROR") for k, v in got.items() if k not in OPTIONAL) and "error" not in got:
        cache.write_text(json.dumps(got, indent=1))
    return got


def copy_logs(ctx: Ctx):
    dst = ctx.out / "logs"
    dst.mkdir(exist_ok=True)
    for f in ctx.logs.glob("*.log"):
        data = f.read_bytes()
        (dst / f.name).write_bytes(data[-400_000:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--stage", choices=STAGES + ("all",), default="all")
    ap.add_argument("--workdir", help="checkpoints and cached results (keep it between commands)")
    ap.add_argument("--out", help="where validate-<stage>.json and logs/ are written")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="gpu-train device (cpu: smoke test)")
    ap.add_argument("--tiny", action="store_true", help="a ~23K-param model (smoke test)")
    ap.add_argument("--gpus", type=int, default=1,
                    help="gpu-train world size: GPUs (NCCL), or CPU ranks with --device cpu")
    ap.add_argument("--dims", type=json.loads, default=None,
                    help='override model dims, JSON, e.g. \'{"layers": 8}\' (keys: vocab hidden ffn layers heads kv_heads '
                    'head_dim tie)')
    ap.add_argument("--zero", type=int, nargs="+", default=[2, 3], choices=[2, 3], help="ZeRO stages to train")
    ap.add_argument("--cases", nargs="+", help="reshard parts to run (default: all): z2-ws2 z2-z3-ws2 z3-z2-ws2 "
                    "z2-wsG-cpu ds-universal")
    ap.add_argument("--parts", nargs="+", help="only these parts of the stage (e.g. z2)")
    ap.add_argument("--redo", action="store_true", help="run parts again even if a passing result is cached")
    ap.add_argument("--ds-extra", type=json.loads, default=None, metavar="JSON",
                    help='merged into the DeepSpeed config of every engine, e.g. '
                         '\'{"bf16": {"bf16_master_weights_and_grads": true, "bf16_optimizer_states": true}}\'')
    ap.add_argument("--steps", type=int, default=3, help="training steps before the save")
    ap.add_argument("--cont-steps", type=int, default=3, help="steps after the save / after each load")
    ap.add_argument("--batch", type=int, default=4, help="global batch (sequences per step)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 128; --tiny: 16)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data-pool", type=int, default=2, help="distinct random batches, cycled")
    ap.add_argument("--cpu-ranks", type=int, default=2, help="M: world size of the reshard targets")
    ap.add_argument("--cpu-threads", type=int, default=0, help="torch threads per CPU rank (default cpus // M)")
    ap.add_argument("--cpu-cont-budget", type=float, default=150,
                    help="seconds the continuation at M CPU ranks may take per reshard part (steps that would "
                    "not fit are skipped; bf16 is slow on CPUs without AVX512-BF16/AMX)")
    ap.add_argument("--cpu-load-reserve", type=float, default=60,
                    help="seconds of budget kept free for the rest of a reshard part")
    ap.add_argument("--loss-tol", type=float, default=0.05, help="|loss_resharded - loss_gpu| flagged above this")
    ap.add_argument("--budget", type=float, default=560, help="seconds this command may use; stops between parts")
    ap.add_argument("--keep", action="store_true", help="keep merged / resharded outputs")
    ap.add_argument("--largest", action="store_true", help="with --stage all: also run largest-cpu")
    ap.add_argument("--largest-layers", type=int, default=0, help="largest-cpu: layers (default: fit free disk)")
    ap.add_argument("--largest-ranks", type=int, default=8)
    ap.add_argument("--free-gpu-ckpts", action="store_true", help="largest-cpu: delete ckpt_z2/ckpt_z3 first")
    ap.add_argument("--fake-cuda-tags", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._worker:
        worker_main(a._worker)
        return 0
    if not a.workdir or not a.out:
        ap.error("--workdir and --out are required")
    if a.seq is None:
        a.seq = 16 if a.tiny else 128
    ctx = Ctx(a)
    n = count_params(ctx.dims)
    print(f"[validate] stage={a.stage} device={a.device} model={'tiny' if a.tiny else 'default'} "
          f"({n / 1e6:.2f}M params, ZeRO-2 ckpt ~{n * 14 / 1e9:.2f} GB) workdir={ctx.work} out={ctx.out} "
          f"budget={a.budget:.0f}s", flush=True)
    todo = plan(ctx)
    if a.parts:
        todo = [t for t in todo if t[1] in a.parts]
    pf = preflight(ctx, need_cuda=a.device == "cuda" and any(t[0] == "gpu-train" for t in todo))
    _HOST["preflight"] = pf
    bad = {k: v for k, v in pf.items() if (str(v).startswith("ERROR") or k == "error") and k not in OPTIONAL}
    print(f"[validate] preflight: {'ok' if not bad else 'FAILED'} {json.dumps(pf)}", flush=True)
    if bad:
        print("[validate] cannot run: " + json.dumps(bad), flush=True)
        (ctx.out / "validate-preflight.json").write_text(json.dumps(pf, indent=1))
        copy_logs(ctx)
        return 1
    status = 0
    touched: list[str] = []
    for st, part, fn in todo:
        cache = ctx.results / f"{st}.{part}.json"
        if cache.exists() and not a.redo:
            prev = json.loads(cache.read_text())
            if prev.get("ok") and not (st == "gpu-train" and not (ctx.ckpt(part[1:]) / "latest").exists()):
                print(f"[validate] {st}:{part} cached (ok) - --redo to run again", flush=True)
                continue
        if ctx.budget.left() < 20:
            print(f"[validate] time budget used up before {st}:{part}; run the same command again to continue",
                  flush=True)
            status = status or 2
            break
        if st not in touched:
            touched.append(st)
        print(f"[validate] {st}:{part} ... ({ctx.budget.left():.0f}s of budget left)", flush=True)
        t0 = time.perf_counter()
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001 - recorded, next part
            res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        res["part_s"] = round(time.perf_counter() - t0, 1)
        cache.write_text(json.dumps(res, indent=1))
        ok = res.get("ok")
        tag = "ok" if ok else ("skipped" if ok is None else "FAILED")
        print(f"[validate] {st}:{part} {tag} in {res['part_s']:.0f}s"
              + (f": {res.get('error') or res.get('skipped')}" if not ok else ""), flush=True)
        if ok is False:
            status = 1
            if res.get("log_tail"):
                print(res["log_tail"], flush=True)
        write_stage_json(ctx, st)
        copy_logs(ctx)
    for st in touched:
        doc = write_stage_json(ctx, st)
        print(f"\n== {st} ({ctx.out / f'validate-{st}.json'})")
        if doc["parts"]:
            SHOW[st](doc["parts"])
        if any(p.get("ok") is False for p in doc["parts"].values()):
            status = status or 1
    if a.stage == "all":
        alld = {st: json.loads((ctx.out / f"validate-{st}.json").read_text()) for st in touched}
        (ctx.out / "validate-all.json").write_text(json.dumps(alld, indent=1))
    copy_logs(ctx)
    print(f"\n[validate] done in {time.time() - ctx.budget.t0:.0f}s: "
          + {0: "all passed", 1: "FAILURES (see above / JSON)", 2: "INCOMPLETE: run again to continue"}[status],
          flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
