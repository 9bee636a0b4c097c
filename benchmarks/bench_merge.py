#!/usr/bin/env python
"""Side-by-side merge benchmark: zckpt vs DeepSpeed's zero_to_torch.py on the same real checkpoint.

Generates (once, cached under .bench/) a ZeRO-2 bf16 checkpoint with real DeepSpeed on CPU ranks, then runs,
alternately and ``--repeat`` times each:

* ``zckpt merge CKPT --dtype D -o OUT``                      (safetensors)
* ``python CKPT/zero_to_torch.py CKPT OUT --dtype D``          (DeepSpeed 0.19.8; .bin: its --safe_serialization
                                                               crashes on the tied embedding)
* ``cp OUT/*.safetensors COPYDIR/``                            (a plain copy of the output, every shard: the
                                                               disk's speed for the same bytes)

No tool fsyncs (zckpt's ``--fsync`` is off by default, like DeepSpeed's and cp's writes); each writes into a
location cleared (and ``sync``-ed, untimed) before the timed run, and outputs are deleted once measured.

Each command runs in its own process; peak RSS comes from ``wait4``'s rusage of that process. Reports medians
and ratios as a table and as JSON (``--json-out``). Page cache is warm for all of them (inputs were just read).

    python benchmarks/bench_merge.py                         # ~230M params, 4 ranks, fp32 and bf16
    python benchmarks/bench_merge.py --layers 88 --world-size 8 --workdir /big/disk   # ~4x (GPU host)
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


def imported_from(env) -> str:
    """The zckpt package a command run with ``env`` imports (checked, so a before/after run cannot compare a tree with
    itself)."""
    return subprocess.run([sys.executable, "-c", "import zckpt; print(zckpt.__file__)"], env=env, check=True,
                          capture_output=True, text=True).stdout.strip()


def run_measured(cmd: list[str], env=None) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of one command in its own process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        err = proc.stderr.read().decode(errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err}")
    proc.stderr.close()
    return dt, usage.ru_maxrss * 1024


def model_dims(layers: int, hidden: int, vocab: int, ffn: int) -> dict:
    return {"vocab": vocab, "hidden": hidden, "ffn": ffn, "layers": layers, "layernorm": True, "frozen": True,
            "tie": True, "buffers": True}


def count_params(d: dict) -> int:
    h, f = d["hidden"], d["ffn"]
    per_layer = (h * f + f) + (f * h + h) + 2 * h + h * h
    return d["vocab"] * h + d["layers"] * per_layer


def ensure_checkpoint(workdir: Path, dims: dict, world_size: int) -> Path:
    import fixtures.generate as G
    key = f"z2_bf16_ws{world_size}_L{dims['layers']}_H{dims['hidden']}_V{dims['vocab']}_F{dims['ffn']}"
    ckpt = workdir / key
    if (ckpt / "latest").exists():
        return ckpt
    print(f"generating {key} ({count_params(dims) / 1e6:.0f}M params) with DeepSpeed on {world_size} CPU ranks ...",
          flush=True)
    t0 = time.time()
    spec = G.make_spec(name=key, stage=2, dtype="bf16", world_size=world_size, model=dims, steps=1,
                       micro_batch=1, seq_len=8, scheduler=False)
    G.generate(spec, ckpt, expected=False, oracle=False, timeout=7200)
    print(f"  generated in {time.time() - t0:.0f}s", flush=True)
    return ckpt


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=str(ROOT / ".bench"))
    ap.add_argument("--layers", type=int, default=21)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--workers", type=int, default=None, help="zckpt --workers")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="a folder holding another zckpt package (e.g. `git archive OLD zckpt | tar -x -C DIR`): "
                         "run it too, alternating, for before/after figures from the same run")
    args = ap.parse_args(argv)

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    dims = model_dims(args.layers, args.hidden, args.vocab, args.ffn)
    ckpt = ensure_checkpoint(workdir, dims, args.world_size)
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    # `python -m` puts the working directory ahead of PYTHONPATH on sys.path: with PYTHONSAFEPATH every run imports
    # exactly the tree its PYTHONPATH names (this one, or --baseline's) wherever it starts (before/after runs until
    # 2026-12-01 morning both imported this tree when started from the repo root)
    env.update(PYTHONSAFEPATH="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    # byte-compile zckpt as an installed wheel would be (pip compiles on install), so no run pays for it
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "zckpt")], check=True,
                   stdout=subprocess.DEVNULL)
    zckpt_cmd = [sys.executable, "-m", "zckpt", "merge", str(ckpt), "--quiet"]
    if args.workers:
        zckpt_cmd += ["--workers", str(args.workers)]
    results = {"checkpoint": str(ckpt), "params": count_params(dims), "world_size": args.world_size,
               "checkpoint_bytes": du(ckpt / open(ckpt / "latest").read().strip()), "cpus": os.cpu_count(),
               "runs": {}}
    print(f"checkpoint {ckpt} ({results['params'] / 1e6:.0f}M params, {results['checkpoint_bytes'] / 2**30:.2f} GiB, "
          f"{args.world_size} ranks), {os.cpu_count()} CPUs, {args.repeat} alternating runs", flush=True)
    base_env = None
    if args.baseline:
        base_env = dict(env, PYTHONPATH=os.pathsep.join([str(Path(args.baseline).resolve()), env.get("PYTHONPATH", "")]))
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(args.baseline) / "zckpt")], check=True,
                       stdout=subprocess.DEVNULL)
        trees = imported_from(env), imported_from(base_env)
        print(f"after: {trees[0]}\nbefore: {trees[1]}", flush=True)
        assert trees[0] != trees[1], trees
    for dtype in args.dtypes.split(","):
        out_z, out_d, out_c = workdir / f"out-zckpt-{dtype}", workdir / f"out-ds-{dtype}", workdir / "copy"
        rows = {"zckpt": [], "deepspeed": [], "copy": []}
        if base_env:
            rows["baseline"] = []
        for i in range(args.repeat):
            if base_env:  # the other zckpt first, into its own fresh folder, cleared untimed
                out_b = workdir / f"out-base-{dtype}"
                shutil.rmtree(out_b, ignore_errors=True)
                os.sync()
                rows["baseline"].append(run_measured(zckpt_cmd + ["--dtype", dtype, "-o", str(out_b)], base_env))
                shutil.rmtree(out_b, ignore_errors=True)
            # every tool writes into a fresh location (cleared untimed); outputs are removed as soon as they
            # are measured, so a multi-billion-parameter run needs disk for the checkpoint plus two outputs
            shutil.rmtree(out_z, ignore_errors=True)
            os.sync()
            rows["zckpt"].append(run_measured(zckpt_cmd + ["--dtype", dtype, "-o", str(out_z)], env))
            srcs = sorted(str(f) for f in out_z.glob("*.safetensors"))  # every weight file (all shards)
            shutil.rmtree(out_c, ignore_errors=True)
            out_c.mkdir()
            os.sync()
            rows["copy"].append(run_measured(["cp", *srcs, str(out_c)]))
            shutil.rmtree(out_c)
            shutil.rmtree(out_d, ignore_errors=True)
            os.sync()
            rows["deepspeed"].append(run_measured(
                [sys.executable, str(ckpt / "zero_to_torch.py"), str(ckpt), str(out_d), "--dtype", dtype],
                {k: v for k, v in env.items() if k != "PYTHONSAFEPATH"}))  # DeepSpeed's script imports its sibling
            shutil.rmtree(out_d, ignore_errors=True)
            print(f"  {dtype} run {i + 1}: zckpt {rows['zckpt'][-1][0]:.2f}s "
                  f"deepspeed {rows['deepspeed'][-1][0]:.2f}s copy {rows['copy'][-1][0]:.2f}s", flush=True)
        copy_bytes = sum(os.path.getsize(f) for f in srcs)
        out_bytes = du(out_z)
        med = {k: statistics.median(t for t, _ in v) for k, v in rows.items()}
        rss = {k: max(r for _, r in v) for k, v in rows.items()}
        ratio_ds = statistics.median(d[0] / z[0] for z, d in zip(rows["zckpt"], rows["deepspeed"]))
        ratio_cp = statistics.median(z[0] / c[0] for z, c in zip(rows["zckpt"], rows["copy"]))
        results["runs"][dtype] = {"median_s": med, "peak_rss_bytes": rss, "deepspeed_over_zckpt": ratio_ds,
                                  "zckpt_over_copy": ratio_cp, "output_bytes": out_bytes,
                                  "copied_file_bytes": copy_bytes, "raw": rows}
        if base_env:
            results["runs"][dtype]["zckpt_over_baseline"] = statistics.median(
                z[0] / b[0] for z, b in zip(rows["zckpt"], rows["baseline"]))
        shutil.rmtree(out_z, ignore_errors=True)

    print()
    print("| output | zckpt s | DeepSpeed s | cp s | DeepSpeed/zckpt | zckpt/cp | zckpt peak RSS | DeepSpeed peak RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, r in results["runs"].items():
        m, p = r["median_s"], r["peak_rss_bytes"]
        print(f"| {dtype} ({r['output_bytes'] / 2**30:.2f} GiB) | {m['zckpt']:.2f} | {m['deepspeed']:.2f} | "
              f"{m['copy']:.2f} | {r['deepspeed_over_zckpt']:.1f}x | {r['zckpt_over_copy']:.2f}x | "
              f"{p['zckpt'] / 2**20:.0f} MiB | {p['deepspeed'] / 2**20:.0f} MiB |")
        if "baseline" in m:
            print(f"  {dtype}: baseline zckpt {m['baseline']:.2f} s ({p['baseline'] / 2**20:.0f} MiB); "
                  f"this / baseline = {r['zckpt_over_baseline']:.2f}x")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
