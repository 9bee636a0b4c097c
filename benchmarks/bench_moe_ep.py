#!/usr/bin/env python
"""Issue 47 item 5: an expert-parallel change of a ~1B-parameter DeepSpeed native-MoE ZeRO-2 checkpoint, timed
beside a parallel copy of its output, with its peak RSS.

The checkpoint is made by real DeepSpeed (``deepspeed.moe.layer.MoE``) on ``--world-size`` CPU ranks (torchrun,
gloo, ``DS_ACCELERATOR=cpu``), bf16, ZeRO-2, torch's AdamW over DeepSpeed's MoE param groups
(``split_params_into_different_moe_groups_for_optimizer``), one training step, then ``save_checkpoint``: an
embedding, ``--layers`` blocks of LayerNorm + an MoE layer of ``--experts`` 2-layer MLP experts (``--hidden`` ->
``--ffn`` -> ``--hidden``, GELU; top-2; ``--ep``), an untied head. Then, ``--repeat`` times, page cache warm:

* ``zckpt reshard CK --ep EP2 --world-size WS2 -o OUT --json`` under ``/usr/bin/time -v`` (peak RSS, CPU);
* a ``--threads``-thread copy of OUT (pread / pwrite of 64 MiB ranges dealt round robin over its files, created
  at their size first: ``bench_copybar.parallel_copy``), the same through ``copy_file_range``, and ``cp -r``;

and ``zckpt verify OUT`` once (metadata, every expert present once). ``--max-group-size``: DeepSpeed's helper puts
at most this many elements in one param group (its default, 178956971, splits each rank's experts of a ~1B model
over several groups). Sizes by default: hidden 1024, ffn 4096, 8
experts, 14 layers, vocab 32000: 1.006B parameters, about 14 GB at 4 ranks.

    python benchmarks/bench_moe_ep.py --workdir /tmp/zbench --json-out moe.json
    python benchmarks/bench_moe_ep.py --layers 2 --hidden 64 --ffn 128 --vocab 512 --repeat 1   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def count_params(a) -> int:
    expert = 2 * a["hidden"] * a["ffn"] + a["hidden"] + a["ffn"]
    return a["layers"] * (a["experts"] * expert + a["hidden"] * a["experts"] + 2 * a["hidden"]) + \
        2 * a["vocab"] * a["hidden"]


def worker(spec: dict) -> None:
    """One rank under torchrun: build, one step, save."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    h, f = spec["hidden"], spec["ffn"]

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(h, f)
            self.down = nn.Linear(f, h)

        def forward(self, x):
            return self.down(F.gelu(self.up(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(h)
            self.moe = MoE(hidden_size=h, expert=Expert(), num_experts=spec["experts"], ep_size=spec["ep"], k=2,
                           capacity_factor=4.0, min_capacity=4, use_rts=False)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(spec["vocab"], h)
            self.blocks = nn.ModuleList(Block() for _ in range(spec["layers"]))
            self.head = nn.Linear(h, spec["vocab"], bias=False)

        def forward(self, ids):
            x, aux = self.emb(ids), 0.0
            for b in self.blocks:
                y, a, _ = b.moe(b.ln(x))
                x, aux = x + y, aux + a
            logits = self.head(x).float()
            tgt = torch.roll(ids, shifts=-1, dims=1)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1)) + 0.01 * aux

    t0 = time.time()
    model = Model()
    pg = {"params": [p for p in model.parameters()], "name": "dense", "lr": 1e-3, "weight_decay": 0.01}
    split = {"max_group_size": spec["max_group_size"]} if spec.get("max_group_size") else {}
    opt = torch.optim.AdamW(split_params_into_different_moe_groups_for_optimizer([pg], **split), lr=1e-3,
                            betas=(0.9, 0.95), eps=1e-8)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "steps_per_print": 1000000, "wall_clock_breakdown": False, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    t1 = time.time()
    gen = torch.Generator().manual_seed(1000 + engine.global_rank)
    ids = torch.randint(0, spec["vocab"], (1, 16), generator=gen)
    loss = engine(ids)
    engine.backward(loss)
    engine.step()
    t2 = time.time()
    engine.save_checkpoint(spec["out"])
    if engine.global_rank == 0:
        print(f"built {t1 - t0:.1f}s, step {t2 - t1:.1f}s, saved {time.time() - t2:.1f}s", flush=True)


def generate(out: Path, a: dict, world: int) -> float:
    if (out / "latest").exists():
        return 0.0
    shutil.rmtree(out, ignore_errors=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = dict(a, out=str(out))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 4) // world)),
               CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", PYTHONHASHSEED="0")
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
                    "--master-addr", "127.0.0.1", "--master-port", str(port), __file__, "--worker",
                    json.dumps(spec)], env=env, check=True)
    return time.time() - t0


def main(argv=None) -> int:
    if sys.argv[1:2] == ["--worker"]:
        worker(json.loads(sys.argv[2]))
        return 0
    from benchmarks.bench_copybar import cp_r, env_for, files_of, parallel_copy, rm, sync
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=str(ROOT / ".bench"))
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--to-ep", type=int, default=4)
    ap.add_argument("--to-world-size", type=int, default=8)
    ap.add_argument("--max-group-size", type=float, default=None,
                    help="split_params_into_different_moe_groups_for_optimizer's max_group_size (DeepSpeed's "
                         "default 178956971 splits an expert group of more elements into several param groups)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", default="16", help="the parallel copies' threads; several: 2,16 (each copied)")
    ap.add_argument("--trees", default=None, help="name=DIR,...: the trees whose zckpt runs, alternately (the "
                    "first one's runs get the copies; default: this one)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    threads = [int(n) for n in str(args.threads).split(",")]  # the last one's copies are "pcopy" and "cfr"
    a = {k: getattr(args, k) for k in ("layers", "hidden", "ffn", "experts", "vocab", "ep", "max_group_size")}
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ck = work / (f"moe_z2_bf16_ws{args.world_size}_ep{args.ep}_L{args.layers}_H{args.hidden}_F{args.ffn}_E{args.experts}"
                 + (f"_G{args.max_group_size:.0e}" if args.max_group_size else ""))
    gen_s = generate(ck, a, args.world_size)
    ck_bytes = sum(p.stat().st_size for p in files_of(ck))
    params = count_params(a)
    res = {"checkpoint": str(ck), "params": params, "checkpoint_bytes": ck_bytes, "generate_s": gen_s,
           "files": len(files_of(ck)), "cpus": os.cpu_count(), "runs": []}
    print(f"checkpoint {ck}: {params / 1e9:.3f}B params, {ck_bytes / 1e9:.2f} GB in {res['files']} files "
          f"(made in {gen_s:.0f}s)", flush=True)
    for p in files_of(ck):  # the page cache warm
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass
    out, copy = work / "moe-out", work / "moe-copy"
    cmd = [sys.executable, "-m", "zckpt", "reshard", str(ck), "--ep", str(args.to_ep), "--world-size",
           str(args.to_world_size), "-o", str(out), "--json"]
    trees = {"this": ROOT}
    if args.trees:
        trees = {k: Path(v).resolve() for k, v in (item.split("=", 1) for item in args.trees.split(","))}
    first = next(iter(trees))
    for rep in range(args.repeat):
        for tree, root in trees.items():
            rm(out)
            sync()
            with tempfile.TemporaryFile() as err:
                t0 = time.perf_counter()
                proc = subprocess.run(["/usr/bin/time", "-v"] + cmd, env=env_for(root), stdout=subprocess.PIPE,
                                      stderr=err)
                wall = time.perf_counter() - t0
                err.seek(0)
                etext = err.read().decode(errors="replace")
            if proc.returncode != 0:
                raise RuntimeError(f"reshard failed:\n{proc.stdout.decode()[-2000:]}\n{etext[-3000:]}")
            doc = json.loads([ln for ln in proc.stdout.decode().splitlines() if ln.startswith("{")][-1])
            tv = {ln.split(":", 1)[0].strip(): ln.split(":", 1)[1].strip() for ln in etext.splitlines() if ":" in ln}
            r = {"tree": tree, "zckpt_s": doc["seconds"], "wall_s": wall,
                 "rss_mib": int(tv["Maximum resident set size (kbytes)"]) / 1024,
                 "user_s": float(tv["User time (seconds)"]), "sys_s": float(tv["System time (seconds)"]),
                 "time_v": etext[-1800:], "bytes": sum(p.stat().st_size for p in files_of(out)),
                 "files": len(files_of(out)), "stats": doc.get("stats")}
            r["flush_s"] = sync()
            c = {}
            if tree == first:
                for name, fn in [(f"{kind}{'' if n == threads[-1] else n}",
                                  lambda n=n, kind=kind: parallel_copy(out, copy, n, kernel=kind == "cfr"))
                                 for n in threads for kind in ("pcopy", "cfr")] + [("cp", lambda: cp_r(out, copy))]:
                    rm(copy)
                    sync()
                    c[name] = fn()
                rm(copy)
                sync()
                r["copies"] = c
            res["runs"].append(r)
            print(f"  {tree}: reshard --ep {args.to_ep} -w {args.to_world_size} run {rep}: zckpt {r['zckpt_s']:.3f}s "
                  f"wall {wall:.2f}s peak RSS {r['rss_mib']:.0f} MiB cpu {r['user_s'] + r['sys_s']:.1f}s, "
                  f"{r['bytes'] / 1e9:.2f} GB in {r['files']} files | " + " ".join(f"{k} {v:.3f}s" for k, v in c.items()),
                  flush=True)
            if args.json_out:
                Path(args.json_out).write_text(json.dumps(res, indent=1))
    v = subprocess.run([sys.executable, "-m", "zckpt", "verify", str(out)], env=env_for(trees[first]),
                       capture_output=True, text=True)
    res["verify"] = {"rc": v.returncode, "out": (v.stdout + v.stderr)[-3000:]}
    print(f"  zckpt verify OUT: rc {v.returncode}\n{res['verify']['out'][-1500:]}", flush=True)
    best = {k: min(r["copies"][k] for r in res["runs"] if "copies" in r) for k in res["runs"][0]["copies"]}
    res["best"] = dict(best)
    for tree in trees:
        runs = [r for r in res["runs"] if r["tree"] == tree]
        z = min(r["zckpt_s"] for r in runs)
        res["best"][tree] = {"zckpt_s": z, "over_pcopy": z / best["pcopy"], "rss_mib": max(r["rss_mib"] for r in runs)}
        raw = ", ".join(f"{r['zckpt_s']:.3f}" for r in runs)
        print(f"best {tree}: zckpt {z:.3f}s ({raw}), "
              f"{threads[-1]}-thread pcopy {best['pcopy']:.3f}s ({z / best['pcopy']:.2f}x), cfr {best['cfr']:.3f}s, "
              + "".join(f"{n}-thread pcopy {best[f'pcopy{n}']:.3f}s ({z / best[f'pcopy{n}']:.2f}x), cfr "
                        f"{best[f'cfr{n}']:.3f}s, " for n in threads[:-1])
              + f"cp -r {best['cp']:.2f}s; peak RSS {res['best'][tree]['rss_mib']:.0f} MiB")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1))
    rm(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
