#!/usr/bin/env python
"""Megatron-Core benchmark: zckpt merge / convert against megatron-core's own loader, on one real torch_dist save.

Generates once (cached under ``--workdir``, default ``.bench/megatron/``) a real megatron-core 0.16 checkpoint with
``fixtures/megatron/generate.py --spec ... --no-oracle`` (GPTModel, DDP + distributed optimizer, ``--iters``
training iterations on CPU ranks, ``dist_checkpointing.save`` with the fully parallel torch_dist strategy,
``fully_reshardable`` optimizer layout so that convert carries the optimizer state), then runs, alternately and
``--repeat`` times each, every command in its own process, warm page cache:

* ``zckpt merge SAVE --dtype fp32 -o OUT``       fp32 masters -> Hugging Face Llama names (q/k/v, gate/up split)
* megatron ``masters``                            ``dist_checkpointing.load`` of the ``optimizer.state.param.*``
                                                  tensors at full shape (``load_tensors_metadata``, as
                                                  ``load_plain_tensors`` does) + ``safetensors`` ``save_file``
* ``cp`` of zckpt's fp32 output
* ``zckpt merge SAVE --dtype bf16 -o OUT``       masters cast to bf16
* megatron ``weights``                            ``dist_checkpointing.load`` of the saved (bf16) model tensors +
                                                  ``save_file``
* ``cp`` of zckpt's bf16 output
* ``zckpt convert SAVE --to dcp --groups megatron-default -o OUT``   masters + both moments + steps + groups
* megatron ``dcp``                                ``dist_checkpointing.load_plain_tensors`` + ``torch.distributed.
                                                  checkpoint.save`` (Megatron names, stacked layers: not a
                                                  resumable FSDP2 state; time and memory only)
* ``cp -r`` of zckpt's DCP output
* megatron ``startup`` (group ``startup``): imports + the process group, nothing read: the fixed part of the
  megatron routes' time

The megatron routes (``benchmarks/mcore_route.py``) run under ``--mcore-python`` (the megatron-core venv), one
process, a world-size-1 gloo group, no model built. Peak RSS: the largest process (``wait4``) and the process
tree (psutil, every 50 ms). After the timed runs, untimed: zckpt's fp32 output is compared with Megatron's loaded
masters and zckpt's bf16 output with Megatron's loaded bf16 weights, every tensor bit for bit after the name map
(stacked layers, q/k/v per query group, gate/up), and every tensor of each side must be used.

    python benchmarks/bench_megatron.py --repeat 2 --json-out benchmarks/results/DATE/megatron.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

DEFAULT_SPEC = "layers=8,hidden=1024,heads=8,groups=4,ffn=4096,vocab=32000,dp=2,sharding=fully_reshardable"


def du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def count_params(s: dict) -> int:
    h, f, kv = s["hidden"], s["ffn"], s["hidden"] // s["heads"]
    qkv = h * (s["heads"] + 2 * s["groups"]) * kv
    per_layer = qkv + s["heads"] * kv * h + (2 if s["swiglu"] else 1) * f * h + f * h + 2 * h
    return s["vocab"] * h * (1 if s["tied"] else 2) + s["layers"] * per_layer + h


def ensure_checkpoint(work: Path, spec_text: str, iters: int, mcore_py: str) -> tuple[Path, float | None]:
    key = "mc_" + spec_text.replace("=", "").replace(",", "_").replace("sharding", "").replace("_reshardable", "")
    key += f"_it{iters}"
    save = work / key
    if (save / "latest_checkpointed_iteration.txt").exists():
        return save, None
    print(f"generating {key} with megatron-core on CPU ranks ...", flush=True)
    t0 = time.time()
    subprocess.run([mcore_py, str(ROOT / "fixtures/megatron/generate.py"), "--spec", spec_text, "--iters",
                    str(iters), "--no-oracle", "--name", key, "--out", str(work)], check=True)
    dt = time.time() - t0
    print(f"  generated in {dt:.0f}s", flush=True)
    return save, dt


def _split_back(spec: dict, st_path: Path) -> dict:
    """zckpt's Hugging Face Llama tensors put back into Megatron's saved layout (stacked layers, q/k/v interleaved
    per query group, [gate; up]), consuming every tensor of the file."""
    import torch
    from safetensors.torch import load_file

    z = {}
    for f in sorted(st_path.glob("*.safetensors")):
        z.update(load_file(str(f)))
    used = set()

    def take(name):
        used.add(name)
        return z[name]

    L, G, kv = spec["layers"], spec["groups"], spec["hidden"] // spec["heads"]
    hpg = spec["heads"] // G
    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight"),
           "decoder.final_layernorm.weight": take("model.norm.weight")}
    if not spec["tied"]:
        out["output_layer.weight"] = take("lm_head.weight")
    per = {"self_attention.linear_qkv.layer_norm_weight": [], "self_attention.linear_qkv.weight": [],
           "self_attention.linear_proj.weight": [], "mlp.linear_fc1.layer_norm_weight": [],
           "mlp.linear_fc1.weight": [], "mlp.linear_fc2.weight": []}
    for i in range(L):
        p = f"model.layers.{i}."
        q, k, v = (take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
        h = q.shape[1]
        qkv = torch.cat([q.reshape(G, hpg * kv, h), k.reshape(G, kv, h), v.reshape(G, kv, h)], dim=1)
        per["self_attention.linear_qkv.weight"].append(qkv.reshape(-1, h))
        per["self_attention.linear_qkv.layer_norm_weight"].append(take(p + "input_layernorm.weight"))
        per["self_attention.linear_proj.weight"].append(take(p + "self_attn.o_proj.weight"))
        per["mlp.linear_fc1.layer_norm_weight"].append(take(p + "post_attention_layernorm.weight"))
        fc1 = [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")] if spec["swiglu"] else \
            [take(p + "mlp.up_proj.weight")]
        per["mlp.linear_fc1.weight"].append(torch.cat(fc1, dim=0))
        per["mlp.linear_fc2.weight"].append(take(p + "mlp.down_proj.weight"))
    for name, ts in per.items():
        out[f"decoder.layers.{name}"] = torch.stack(ts)
    left = set(z) - used
    assert not left, f"zckpt wrote tensors the check does not map: {sorted(left)}"
    return out


def check_equal(spec: dict, zckpt_out: Path, mcore_file: Path) -> dict:
    """Every tensor equal bit for bit (same dtype, shape and bytes) after the name map; both sides fully used."""
    import torch
    from safetensors.torch import load_file

    z = _split_back(spec, zckpt_out)
    m = load_file(str(mcore_file))
    if set(z) != set(m):
        raise AssertionError(f"names differ: {sorted(set(z) ^ set(m))}")
    bad = []
    for k in sorted(m):
        a, b = z[k], m[k]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.contiguous().view(torch.uint8),
                                                                       b.contiguous().view(torch.uint8)):
            bad.append(k)
    if bad:
        raise AssertionError(f"zckpt != megatron for {bad}")
    return {"tensors": len(m), "elements": sum(t.numel() for t in m.values()),
            "dtypes": sorted({str(t.dtype).replace("torch.", "") for t in m.values()}), "bit_equal": True}


def main(argv=None) -> int:
    from bench_reshard import run_measured
    from fixtures.megatron.generate import BASE, parse_spec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=str(ROOT / ".bench" / "megatron"))
    ap.add_argument("--spec", default=DEFAULT_SPEC, help="generate.py --spec (fp32: fully_reshardable only)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--mcore-python", default="/work/venv-mcore/bin/python")
    ap.add_argument("--workers", type=int, default=None, help="zckpt --workers")
    ap.add_argument("--only", default="fp32,bf16,dcp,startup", help="which of fp32, bf16, dcp, startup to run")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--_check", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._check:
        print(json.dumps(check_equal(json.loads(args._check[0]), Path(args._check[1]), Path(args._check[2]))))
        return 0

    spec = {**BASE, **parse_spec(args.spec)}
    if "fp32" in args.only.split(",") and spec["sharding"] != "fully_reshardable":
        raise SystemExit("--only fp32 compares with Megatron's masters in model space: fully_reshardable only "
                         "(a dp_reshardable save keeps them in flat buckets; run --only bf16,dcp)")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    save, gen_s = ensure_checkpoint(work, args.spec, args.iters, args.mcore_python)
    it_dir = save / f"iter_{int((save / 'latest_checkpointed_iteration.txt').read_text()):07d}"
    py, mpy = sys.executable, args.mcore_python
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.update(PYTHONSAFEPATH="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    menv = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "VIRTUAL_ENV")}
    menv["PYTHONWARNINGS"] = "ignore"
    subprocess.run([py, "-m", "compileall", "-q", str(ROOT / "zckpt")], check=True, stdout=subprocess.DEVNULL)
    route = str(ROOT / "benchmarks" / "mcore_route.py")
    zm = [py, "-m", "zckpt", "merge", str(save), "--quiet"]
    zc = [py, "-m", "zckpt", "convert", str(save), "--to", "dcp", "--groups", "megatron-default", "--quiet"]
    if args.workers:
        zm += ["--workers", str(args.workers)]
        zc += ["--workers", str(args.workers)]
    o = {n: work / f"out-{n}" for n in ("z32", "m32", "c32", "z16", "m16", "c16", "zdcp", "mdcp", "cdcp")}
    groups = {
        "fp32": [("zckpt merge --dtype fp32", zm + ["--dtype", "fp32", "-o", str(o["z32"])], env, o["z32"]),
                 ("megatron load (masters) + save_file", [mpy, route, "masters", str(it_dir), str(o["m32"])], menv,
                  o["m32"]),
                 ("cp (zckpt's fp32 output)", lambda: ["cp", "-r", str(o["z32"]), str(o["c32"])], None, o["c32"])],
        "bf16": [("zckpt merge --dtype bf16", zm + ["--dtype", "bf16", "-o", str(o["z16"])], env, o["z16"]),
                 ("megatron load (bf16 weights) + save_file", [mpy, route, "weights", str(it_dir), str(o["m16"])],
                  menv, o["m16"]),
                 ("cp (zckpt's bf16 output)", lambda: ["cp", "-r", str(o["z16"]), str(o["c16"])], None, o["c16"])],
        "dcp": [("zckpt convert --to dcp (masters + moments)", zc + ["-o", str(o["zdcp"])], env, o["zdcp"]),
                ("megatron load_plain_tensors + dcp.save (everything)", [mpy, route, "dcp", str(it_dir),
                                                                         str(o["mdcp"])], menv, o["mdcp"]),
                ("cp -r (zckpt's DCP output)", lambda: ["cp", "-r", str(o["zdcp"]), str(o["cdcp"])], None,
                 o["cdcp"])],
        "startup": [("megatron startup only (imports + process group)", [mpy, route, "startup", str(it_dir), "-"],
                     menv, work / "out-none")],
    }
    wanted = args.only.split(",")
    for p in o.values():
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    subprocess.run(["cat"] + [str(p) for p in it_dir.iterdir() if p.is_file()], stdout=subprocess.DEVNULL,
                   check=True)  # warm page cache
    raw: dict[str, dict[str, list]] = {g: {name: [] for name, *_ in groups[g]} for g in wanted}
    sizes: dict[str, int] = {}
    checks = {}
    for i in range(args.repeat):
        for g in wanted:
            for name, cmd, cenv, dst in groups[g]:
                shutil.rmtree(dst, ignore_errors=True) if dst.is_dir() else dst.unlink(missing_ok=True)
                subprocess.run(["sync"], check=True)
                dt, rss, tree = run_measured(cmd() if callable(cmd) else cmd, cenv)
                sizes[name] = du(dst) if dst.exists() else 0
                raw[g][name].append({"seconds": dt, "peak_rss_bytes": rss, "tree_rss_bytes": tree})
                print(f"[{i + 1}/{args.repeat}] {name:<52} {dt:7.2f}s  peak RSS {rss / 2**20:7.0f} MiB  "
                      f"tree {tree / 2**20:7.0f} MiB  out {sizes[name] / 1e9:.3f} GB", flush=True)
            if i == args.repeat - 1 and g in ("fp32", "bf16"):  # untimed: zckpt's output against megatron's
                z, m = (o["z32"], o["m32"]) if g == "fp32" else (o["z16"], o["m16"])
                # in a child process: torch imported here would inflate every later child's ru_maxrss (Linux
                # keeps the pre-exec high-water mark of a forked child)
                r = subprocess.run([py, str(Path(__file__).resolve()), "--_check", json.dumps(spec), str(z), str(m)],
                                   env=env, check=True, capture_output=True, text=True)
                checks[g] = json.loads(r.stdout.strip().splitlines()[-1])
                print(f"  {g}: zckpt == megatron, {checks[g]['tensors']} tensors bit for bit", flush=True)
            for _, _, _, dst in groups[g]:  # outputs removed once measured (and checked)
                shutil.rmtree(dst, ignore_errors=True) if dst.is_dir() else dst.unlink(missing_ok=True)

    rows = []
    for g in wanted:
        full = len(groups[g]) == 3  # zckpt, megatron, cp
        base = statistics.median(r["seconds"] for r in raw[g][groups[g][2][0]]) if full else None
        zt = [r["seconds"] for r in raw[g][groups[g][0][0]]] if full else None
        for name, rs in raw[g].items():
            t = statistics.median(r["seconds"] for r in rs)
            rows.append({"group": g, "command": name, "median_s": round(t, 2),
                         "x_copy": round(t / base, 2) if full else None,
                         "over_zckpt": round(statistics.median(r["seconds"] / z for r, z in zip(rs, zt)), 2)
                         if full else None,
                         "peak_rss_mib": round(max(r["peak_rss_bytes"] for r in rs) / 2**20),
                         "tree_rss_mib": round(max(r["tree_rss_bytes"] for r in rs) / 2**20),
                         "output_bytes": sizes[name]})
    versions = {"python": sys.version.split()[0]}
    for label, exe, mod in (("torch", py, "torch"), ("torch (megatron venv)", mpy, "torch"),
                            ("megatron-core", mpy, "megatron.core"), ("safetensors (megatron venv)", mpy,
                                                                      "safetensors")):
        r = subprocess.run([exe, "-c", f"import {mod} as m; print(m.__version__)"], capture_output=True, text=True,
                           env=menv if exe == mpy else env)
        versions[label] = r.stdout.strip() or r.stderr.strip()[-200:]
    summary = {"checkpoint": str(save), "iteration_dir": it_dir.name, "spec": {**spec, "iters": args.iters},
               "params": count_params(spec), "checkpoint_bytes": du(it_dir),
               "checkpoint_files": len([p for p in it_dir.iterdir() if p.is_file()]),
               "generation_s": gen_s, "repeat": args.repeat, "cpus": os.cpu_count(), "versions": versions,
               "rows": rows, "equality": checks, "raw": raw}
    print(f"\ncheckpoint {save.name}: {count_params(spec) / 1e6:.1f}M params, {du(it_dir) / 1e9:.2f} GB, "
          f"tp{spec['tp']} pp{spec['pp']} dp{spec['dp']} {spec['dtype']}, median of {args.repeat}, warm page cache, "
          f"{os.cpu_count()} CPUs")
    print("| command | seconds | / zckpt | x cp of zckpt's output | peak RSS (MiB) | tree RSS (MiB) | output (GB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['command']} | {r['median_s']} | {r['over_zckpt']} | {r['x_copy']} | {r['peak_rss_mib']} | "
              f"{r['tree_rss_mib']} | {r['output_bytes'] / 1e9:.3f} |")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
