#!/usr/bin/env python
"""``zckpt convert --to megatron`` against megatron-core's own route, on one real ``dp_reshardable`` torch_dist save.

Megatron-LM's default optimizer layout (``dp_reshardable``) cannot be resumed at another TP/PP; the way out within
Megatron is to load it at the shape it was saved at and save it again ``fully_reshardable``. Both routes here turn
the same save (made once, cached, by ``fixtures/megatron/generate.py --spec ... --no-oracle``: megatron-core 0.16.1,
real training iterations on CPU ranks) into a ``fully_reshardable`` one:

* zckpt: ``convert SAVE --to megatron -o OUT`` (one process; masters and moments placed from the flat buckets,
  each master checked against its saved weight; every byte read CRC-checked);
* megatron-core: under torchrun at the saved shape, ``GPTModel`` + DDP + ``DistributedOptimizer`` built, one
  training iteration (on CPU a fresh torch-optim DistributedOptimizer has no state to load into:
  fixtures/megatron/README.md), ``dist_checkpointing.load`` + ``load_state_dict``, then the ``fully_reshardable``
  state dict saved with the fully parallel torch_dist strategy. Timed by phase; the route is load + save, building
  the model is reported apart.

Peak RSS: the largest process (``wait4``) and the process tree summed (psutil, every 50 ms; shared pages of
forked writers counted in each), as bench_reshard's ``run_measured``. Afterwards the two outputs'
``.metadata`` must name the same tensors with the same shapes and dtypes.

    python benchmarks/bench_megatron_write.py --json-out benchmarks/results/DATE/megatron-write.json
    python benchmarks/bench_megatron_write.py --layout dp_reshardable --json-out ...   # both write dp_reshardable
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
DEFAULT_SPEC = "layers=8,hidden=1024,heads=8,groups=4,ffn=4096,vocab=32000,dp=2,sharding=dp_reshardable"


def route(save: str, out: str, spec_text: str, result: str, layout: str = "fully_reshardable") -> None:
    """One rank of megatron-core's route (under torchrun at the saved shape)."""
    sys.path.insert(0, str(ROOT / "fixtures" / "megatron"))
    import cpu_shim  # noqa: F401 - before megatron
    import generate as G
    import torch.distributed as dist

    dist.init_process_group("gloo")
    cpu_shim.no_cuda_rng_fork()
    cpu_shim.torch_adam_load_fix()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    spec = {**G.BASE, **G.parse_spec(spec_text)}
    ps.initialize_model_parallel(spec["tp"], spec["pp"])
    it = int((Path(save) / "latest_checkpointed_iteration.txt").read_text())
    it_dir = Path(save) / f"iter_{it:07d}"
    t0 = time.perf_counter()
    cfg, ddp, opt, sched, _ = G._build(spec, spec["seed"] + 1000)
    G._train(spec, cfg, ddp, opt, None, iterations=1)
    dist.barrier()
    t1 = time.perf_counter()
    meta = dist_checkpointing.load_content_metadata(str(it_dir))
    sd, _, _ = G._state_dict({**spec, "sharding": meta["distrib_optim_sharding_type"]}, ddp, opt, sched, True)
    sd.pop("args")
    state = dist_checkpointing.load(sd, str(it_dir), strict="assume_ok_unexpected")
    G._unwrap(ddp).load_state_dict(state["model"], strict=True)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["opt_param_scheduler"])
    dist.barrier()
    t2 = time.perf_counter()
    new = {**spec, "sharding": layout}
    sd2, _, content = G._state_dict(new, ddp, opt, sched, False)
    target = Path(out) / f"iter_{it:07d}"
    if dist.get_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"),
                                                ps.get_data_parallel_group(with_context_parallel=True), False)
    dist_checkpointing.save(sd2, str(target), strategy, validate_access_integrity=True, content_metadata=content)
    dist.barrier()
    t3 = time.perf_counter()
    if dist.get_rank() == 0:
        (Path(out) / "latest_checkpointed_iteration.txt").write_text(str(it))
        Path(result).write_text(json.dumps({"build_and_warmup_s": t1 - t0, "load_s": t2 - t1, "save_s": t3 - t2}))
    dist.destroy_process_group()


def tensors_of(out: Path) -> dict:
    from zckpt.encoding import dcpmeta
    it = next(out.glob("iter_*"))
    md = dcpmeta.read_metadata((it / ".metadata").read_bytes(), str(it / ".metadata"))
    return {k: [list(t.shape), t.dtype] for k, t in md.tensors.items() if not k.startswith("rng_state")}


def main(argv=None) -> int:
    from bench_megatron import du, ensure_checkpoint
    from bench_reshard import run_measured
    from fixtures.megatron.generate import BASE, parse_spec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=str(ROOT / ".bench" / "megatron"))
    ap.add_argument("--spec", default=DEFAULT_SPEC)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--mcore-python", default="/work/venv-mcore/bin/python")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--layout", default="fully_reshardable", choices=("fully_reshardable", "dp_reshardable"),
                    help="the output's optimizer layout, both routes (dp_reshardable: at the saved shape)")
    ap.add_argument("--_route", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._route:
        route(*args._route)
        return 0
    spec = {**BASE, **parse_spec(args.spec)}
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    save, gen_s = ensure_checkpoint(work, args.spec, args.iters, args.mcore_python)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    menv = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    menv.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    n = spec["tp"] * spec["pp"] * spec["dp"]
    rows = []
    for rep in range(args.repeat):
        zo, mo, res = work / "out-zckpt-megatron", work / "out-mcore-megatron", work / "route.json"
        for p in (zo, mo):
            shutil.rmtree(p, ignore_errors=True)
        more = "" if args.layout == "fully_reshardable" else (  # generate.py's DDP: overlap off (one bucket)
            f", layout='dp_reshardable', dp={spec['dp']}, ddp_config='overlap_grad_reduce=false,"
            "grad_reduce_in_fp32=true,pad_buckets_for_high_nccl_busbw=false'")
        code = f"from zckpt.ops.convert import convert; convert({str(save)!r}, to='megatron', out={str(zo)!r}{more})"
        zs, zpeak, ztree = run_measured([sys.executable, "-c", code], env)
        cmd = [args.mcore_python, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port",
               str(29500 + 7 + rep), str(Path(__file__).resolve()), "--_route", str(save), str(mo), args.spec,
               str(res), args.layout]
        ms, mpeak, mtree = run_measured(cmd, menv)
        phases = json.loads(res.read_text())
        same = tensors_of(zo) == tensors_of(mo)
        rows.append({"zckpt_s": round(zs, 2), "zckpt_peak_rss_mib": zpeak >> 20, "zckpt_tree_rss_mib": ztree >> 20,
                     "zckpt_bytes": du(zo), "mcore_s": round(ms, 2), "mcore_peak_rss_mib": mpeak >> 20,
                     "mcore_tree_rss_mib": mtree >> 20, "mcore_bytes": du(mo),
                     "mcore_phases_s": {k: round(v, 2) for k, v in phases.items()}, "same_tensors": same})
        print(json.dumps(rows[-1]), flush=True)
    doc = {"spec": args.spec, "layout": args.layout, "save": str(save), "save_bytes": du(save), "ranks": n,
           "generated_s": gen_s,
           "cpus": os.cpu_count(), "runs": rows}
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
