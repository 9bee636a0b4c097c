"""Megatron-LM's own resume of ``zckpt convert --to megatron`` output: ``pretrain_gpt.py --load`` at another
TP/PP, on CPU ranks, for the fixtures Megatron-LM itself saved (fixtures/megatron/lm16_*, lm19_*; made by
fixtures/megatron/generate_lm.py, whose flags, CPU shim and gather this reuses).

For each (source, tp, pp[, layout]): ``zckpt convert SOURCE --to megatron --tp T --pp P [--layout dp_reshardable
--dp D] -o OUT`` (D: the source's ranks / (T x P)), then under torchrun
``pretrain_gpt.py`` with the source's flags at the new TP/PP, ``--load OUT`` and ``--train-iters`` one past the
saved iteration. Right after Megatron-LM's ``setup_model_and_optimizer`` (which runs ``load_checkpoint``), every
rank gathers the loaded model and optimizer (generate.py's ``_oracle_tensors``) and rank 0 compares them with the
source's ``NAME.oracle.safetensors`` (Megatron-LM's load of the source at its own shape) bit for bit, the groups
(settings, Adam step, members), the scheduler, the iteration and consumed samples; then training goes on for one
iteration and its loss is recorded. Needs a Megatron-LM tree and the venv of its megatron-core (README.md of
fixtures/megatron); not part of the suite:

    python tests/megatron_write_lm.py --python /work/venv-mcore/bin/python --mlm /work/megatron-lm-0.16 \\
        --extras /work/mlm-extras-311 lm16_tp2_pp1_dp2:1:2 lm16_tp1_pp2_dp2_fullyresh:2:1
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


def _set(flags: list[str], name: str, value: str) -> list[str]:
    flags = list(flags)
    if name in flags:
        flags[flags.index(name) + 1] = value
    else:
        flags += [name, value]
    return flags


def _scalar(v) -> float:
    """A reduced loss as Megatron-LM returns it: a number, or a (sum, count) pair."""
    import torch
    t = torch.as_tensor(v, dtype=torch.float64).flatten()
    return float(t[0] / t[1]) if t.numel() == 2 else float(t.mean())


def worker(source: str, out: str, tp: int, pp: int, mlm: str, result: str) -> None:
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
    spec = GL.spec_of(source)
    src_doc = json.loads((FIX / f"{source}.oracle.json").read_text())
    flags = _set(_set(GL.flags_of(source), "--tensor-model-parallel-size", str(tp)),
                 "--pipeline-model-parallel-size", str(pp))
    # one iteration past the save; the scheduler's settings from the checkpoint (Megatron-LM refuses a changed
    # --train-iters otherwise: its decay steps follow from it)
    flags = _set(flags, "--train-iters", str(src_doc["iteration"] + 1)) + ["--use-checkpoint-opt_param-scheduler"]
    found: dict = {}
    orig_setup, orig_step = training.setup_model_and_optimizer, training.train_step

    def setup_model_and_optimizer(*a, **k):
        model, optimizer, sched = orig_setup(*a, **k)  # fresh objects, then Megatron-LM's load_checkpoint
        args = get_args()
        tensors, _, groups = generate._oracle_tensors(spec, model[0], optimizer)
        all_groups = [None] * dist.get_world_size()
        dist.all_gather_object(all_groups, groups)
        if dist.get_rank() == 0:
            from safetensors.torch import load_file
            want = load_file(str(FIX / f"{source}.oracle.safetensors"))
            ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            differ = [k for k in want if k in tensors and not (
                want[k].dtype == tensors[k].dtype and want[k].shape == tensors[k].shape and torch.equal(
                    want[k].contiguous().view(ints[want[k].element_size()]),
                    tensors[k].contiguous().view(ints[tensors[k].element_size()])))]

            def summary(per_rank):
                out = {}
                for rank_groups in per_rank:
                    for g in rank_groups:
                        settings = {x: (list(v) if isinstance(v, tuple) else v) for x, v in g.items()
                                    if x not in ("params", "chained_optimizer", "group")}
                        e = out.setdefault(f"{g['chained_optimizer']}.{g['group']}", {"settings": settings,
                                                                                       "params": set()})
                        e["params"] |= set(g["params"])
                return {k: {**v, "params": sorted(v["params"])} for k, v in sorted(out.items())}

            found.update(
                keys_equal=set(want) == set(tensors), tensors=len(tensors), differ=differ[:10],
                groups_equal=summary(all_groups) == summary(src_doc["param_groups_per_rank"]),
                scheduler_equal=sched.state_dict() == src_doc["scheduler"], iteration=args.iteration,
                consumed_train_samples=args.consumed_train_samples,
                consumed_expected=src_doc.get("consumed_train_samples"), shape=[tp, pp, args.data_parallel_size])
        return model, optimizer, sched

    def train_step(*a, **k):
        res = orig_step(*a, **k)
        found.setdefault("losses", []).append({key: _scalar(v) for key, v in (res[0] or {}).items()})
        return res

    training.setup_model_and_optimizer = setup_model_and_optimizer
    training.train_step = train_step
    GL._run_pretrain(mlm, flags + ["--load", out])
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, found.get("losses", []))
    if dist.get_rank() == 0:
        flat = [v for r in losses for step in r for v in step.values()]
        found.update(losses=flat, losses_finite=bool(flat) and all(math.isfinite(v) for v in flat))
        Path(result).write_text(json.dumps(found, default=str))
    dist.barrier()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobs", nargs="*", help="SOURCE:TP:PP[:dp_reshardable] (default layout fully_reshardable)")
    ap.add_argument("--python", default="/work/venv-mcore/bin/python")
    ap.add_argument("--mlm", default="/work/megatron-lm-0.16")
    ap.add_argument("--extras", default=None)
    ap.add_argument("--work", default="/tmp/zckpt-megatron-write-lm")
    ap.add_argument("--_worker", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._worker:
        s, out, tp, pp, mlm, result = a._worker
        worker(s, out, int(tp), int(pp), mlm, result)
        return 0
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for job in a.jobs:
        source, tp, pp, *layout = job.split(":")
        out = work / f"{source}-tp{tp}pp{pp}{''.join('-' + x for x in layout)}"
        n = json.loads((FIX / f"{source}.oracle.json").read_text())["world_size"]
        more = ["--layout", layout[0], "--dp", str(n // (int(tp) * int(pp)))] if layout else []  # same ranks
        r = subprocess.run([sys.executable, "-m", "zckpt", "convert", str(FIX / source), "--to", "megatron",
                            "--tp", tp, "--pp", pp, *more, "-o", str(out), "--overwrite", "--quiet"],
                           env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": "",
               "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
        env.pop("PYTHONPATH", None)
        if a.extras:
            env["PYTHONPATH"] = a.extras
        res = work / f"{out.name}.json"
        res.unlink(missing_ok=True)
        cmd = [a.python, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port",
               str(29700 + len(results)), str(Path(__file__).resolve()), "--_worker", source, str(out), tp, pp,
               a.mlm, str(res)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(work))
        if p.returncode != 0:
            print(f"{job}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}", file=sys.stderr)
            return 1
        results.append({"job": job, **json.loads(res.read_text())})
        print(json.dumps(results[-1]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
