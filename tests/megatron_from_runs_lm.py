"""Megatron-LM's own resume of ``zckpt convert --to megatron --megatron-args ...`` output made from runs Megatron did
not train (the sources of tests/test_megatron_from_runs.py: the Trainer's DeepSpeed ZeRO-2 run, the FSDP2 run):
``pretrain_gpt.py --load OUT`` on CPU ranks with the model's flags (from its config.json) and the *same* schedule
flags given to ``--megatron-args``, without ``--use-checkpoint-opt_param-scheduler`` or
``--override-opt_param-scheduler``: Megatron-LM's ``get_optimizer_param_scheduler`` builds its scheduler from the
flags and ``load_state_dict`` asserts that every value the checkpoint holds equals its own (``_check_and_set``).

Right after ``setup_model_and_optimizer`` (which runs ``load_checkpoint``), every rank gathers the loaded model and
optimizer (fixtures/megatron/generate.py's ``_oracle_tensors``) and rank 0 compares them bit for bit with the
source's state as its own framework gives it (tests/test_megatron_from_runs.py's ``_expected``); it records the
groups' lr and weight decay, the scheduler, the iteration and consumed samples; training then goes on for one
iteration (``--exit-interval``). Needs a Megatron-LM tree and the venv of its megatron-core (fixtures/megatron's
README.md); not part of the suite:

    .venv/bin/python tests/megatron_from_runs_lm.py --python /work/venv-mcore/bin/python \\
        --mlm /work/megatron-lm-0.16 --extras /work/mlm-extras-311 deepspeed:1:2:2 fsdp2:2:1:2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures" / "megatron"
COMMON = ["--seq-length", "16", "--micro-batch-size", "2", "--bf16", "--use-distributed-optimizer", "--mock-data",
          "--tokenizer-type", "NullTokenizer", "--make-vocab-size-divisible-by", "16", "--ckpt-format", "torch_dist",
          "--transformer-impl", "local", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
          "--disable-bias-linear", "--swiglu", "--group-query-attention", "--attention-dropout", "0",
          "--hidden-dropout", "0", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
          "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm", "--no-bias-swiglu-fusion",
          "--use-cpu-initialization", "--distributed-backend", "gloo", "--eval-iters", "0", "--eval-interval",
          "1000", "--log-interval", "1", "--seed", "1234", "--clip-grad", "1.0"]


def model_flags(config: dict) -> list[str]:
    """pretrain_gpt.py's model flags for a Hugging Face LlamaConfig (NullTokenizer: --vocab-size + 1 tokens, padded
    to a multiple of 16 x TP, comes to the config's vocabulary at the TPs used here)."""
    rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    flags = ["--num-layers", str(config["num_hidden_layers"]), "--hidden-size", str(config["hidden_size"]),
             "--num-attention-heads", str(config["num_attention_heads"]), "--num-query-groups",
             str(config["num_key_value_heads"]), "--kv-channels", str(config["head_dim"]),
             "--ffn-hidden-size", str(config["intermediate_size"]), "--vocab-size", str(config["vocab_size"] - 1),
             "--max-position-embeddings", str(config["max_position_embeddings"]),
             "--norm-epsilon", str(config["rms_norm_eps"]), "--rotary-base", str(int(rope))]
    return flags + ([] if config["tie_word_embeddings"] else ["--untie-embeddings-and-output-weights"])


def worker(name: str, out: str, tp: int, pp: int, mlm: str, job: str) -> None:
    sys.path.insert(0, str(FIX))
    import cpu_shim

    cpu_shim.megatron_lm()
    sys.path.append(mlm)
    cpu_shim.megatron_lm_training()
    import generate
    import generate_lm as GL
    import torch
    import torch.distributed as dist
    from megatron.training import get_args, training

    cpu_shim.torch_adam_load_fix()
    j = json.loads(Path(job).read_text())
    spec = {"sharding": "fully_reshardable", "per_layer": False, "name": name}
    found: dict = {}
    orig_setup, orig_step = training.setup_model_and_optimizer, training.train_step

    def setup_model_and_optimizer(*a, **k):
        model, optimizer, sched = orig_setup(*a, **k)  # get_optimizer_param_scheduler, then load_checkpoint
        args = get_args()
        tensors, _, groups = generate._oracle_tensors(spec, model[0], optimizer)
        all_groups = [None] * dist.get_world_size()
        dist.all_gather_object(all_groups, groups)
        if dist.get_rank() == 0:
            from safetensors.torch import load_file
            want = load_file(j["expected"])
            ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            differ = [k for k in want if k in tensors and not (
                want[k].dtype == tensors[k].dtype and want[k].shape == tensors[k].shape and torch.equal(
                    want[k].contiguous().view(ints[want[k].element_size()]),
                    tensors[k].contiguous().view(ints[tensors[k].element_size()])))]
            settings = sorted({json.dumps({x: g[x] for x in ("lr", "weight_decay", "wd_mult", "betas", "eps",
                                                             "adam_step")}, default=list)
                               for r in all_groups for g in r})
            found.update(keys_equal=set(want) == set(tensors), tensors=len(tensors), differ=differ[:10],
                         groups=[json.loads(s) for s in settings], scheduler=sched.state_dict(),
                         scheduler_equal=sched.state_dict() == j["scheduler"], iteration=args.iteration,
                         consumed_train_samples=args.consumed_train_samples,
                         shape=[tp, pp, args.data_parallel_size])
        return model, optimizer, sched

    def train_step(*a, **k):
        res = orig_step(*a, **k)
        found.setdefault("losses", []).append({key: float(torch.as_tensor(v, dtype=torch.float64).flatten()[0])
                                               for key, v in (res[0] or {}).items()})
        return res

    training.setup_model_and_optimizer = setup_model_and_optimizer
    training.train_step = train_step
    try:
        GL._run_pretrain(mlm, j["flags"] + ["--load", out, "--tensor-model-parallel-size", str(tp),
                                            "--pipeline-model-parallel-size", str(pp)])
    except SystemExit:  # --exit-interval: Megatron-LM exits after the iteration
        pass
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, found.get("losses", []))
    if dist.get_rank() == 0:
        flat = [v for r in losses for step in r for v in step.values()]
        found.update(losses=flat, losses_finite=bool(flat) and all(math.isfinite(v) for v in flat))
        Path(j["result"]).write_text(json.dumps(found, default=str))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobs", nargs="*", help="SOURCE:TP:PP:DP (SOURCE: deepspeed or fsdp2)")
    ap.add_argument("--python", default="/work/venv-mcore/bin/python")
    ap.add_argument("--mlm", default="/work/megatron-lm-0.16")
    ap.add_argument("--extras", default=None)
    ap.add_argument("--work", default="/tmp/zckpt-megatron-from-runs-lm")
    ap.add_argument("--_worker", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._worker:
        name, out, tp, pp, mlm, job = a._worker
        worker(name, out, int(tp), int(pp), mlm, job)
        return 0
    sys.path.insert(0, str(ROOT))
    from tests import test_megatron_from_runs as T
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    for n, job in enumerate(a.jobs):
        name, tp, pp, dp = job.split(":")
        src, schedule, _, iteration, _ = T.SOURCES[name]
        out = work / f"{name}-tp{tp}pp{pp}"
        r = subprocess.run([sys.executable, "-m", "zckpt", "convert", str(src), "--to", "megatron", "--tp", tp,
                            "--pp", pp, "-o", str(out), "--overwrite", "--quiet", "--megatron-args", schedule],
                           env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        lr, wd, sched = T._megatron_lr(schedule, iteration)
        config = json.loads((Path(src) / "config.json").read_text())
        flags = COMMON + model_flags(config) + schedule.replace("=", " ").split() + [
            "--exit-interval", str(iteration + 1)]
        spec = {"expected": str(T._expected(name, work)), "scheduler": sched, "result": str(work / f"{job}.json"),
                "flags": flags}
        (work / f"{job}.job.json").write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": "",
               "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
        env.pop("PYTHONPATH", None)
        if a.extras:
            env["PYTHONPATH"] = a.extras
        Path(spec["result"]).unlink(missing_ok=True)
        cmd = [a.python, "-m", "torch.distributed.run", "--nproc-per-node", str(int(tp) * int(pp) * int(dp)),
               "--master-port", str(29760 + n), str(Path(__file__).resolve()), "--_worker", name, str(out), tp, pp,
               a.mlm, str(work / f"{job}.job.json")]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(work))
        if p.returncode != 0 or not Path(spec["result"]).exists():
            print(f"{job}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}", file=sys.stderr)
            return 1
        got = json.loads(Path(spec["result"]).read_text())
        got.update(job=job, lr_expected=lr, wd_expected=wd)
        print(json.dumps(got), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
