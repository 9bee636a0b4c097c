#!/usr/bin/env python
"""Resume-at-another-size benchmark: ``zckpt.deepspeed.load_checkpoint`` vs a plain ``engine.load_checkpoint``.

Generates (once, cached under ``--workdir``) a ZeRO-2 bf16 checkpoint at N ranks with real DeepSpeed on CPU ranks,
and ``zckpt reshard``s it to M ranks (the native checkpoint of the same size at M: what a plain load reads).
Then, alternately and ``--repeat`` times each, one torchrun job at M ranks per run:

* ``native``: every rank builds the engine and calls ``engine.load_checkpoint(<the M-rank checkpoint>)``;
* ``zckpt``:  every rank builds the engine and calls ``zckpt.deepspeed.load_checkpoint(engine, <the N-rank source>)``.

Per rank: wall time of the load call alone (engine construction excluded), bytes read during it (``rchar`` of
``/proc/self/io``: every read, metadata included, page cache or not) and, for zckpt, the tensor bytes it read
from the source, peak RSS of the process (``ru_maxrss``, after the load), and the most bytes the scratch folder
held (polled every 5 ms). Reports medians as a table and JSON (``--json-out``). Page cache is warm for both.

    python benchmarks/bench_resume.py                        # ~8.5M params, 2 -> 3 ranks (a 2-core box)
    python benchmarks/bench_resume.py --layers 16 --hidden 1024 --source-ws 4 --world-size 8 --workdir /big
    python benchmarks/bench_resume.py --before .bench/before --env-route 4k:ZCKPT_HUGEPAGES=0   # A/B in one run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def _du(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


class ScratchWatch:
    """The most bytes any zckpt-resume-* folder under ``root`` held while running."""

    def __init__(self, root: str):
        self.root, self.peak, self.stop = root, 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            for name in os.listdir(self.root):
                if name.startswith("zckpt-resume-"):
                    self.peak = max(self.peak, _du(os.path.join(self.root, name)))
            time.sleep(0.005)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def worker(job_path: str) -> None:
    import resource
    import deepspeed
    import deepspeed.comm as dist
    import resume_worker

    import fixtures.generate as G
    job = json.loads(Path(job_path).read_text())
    if job.get("zckpt_path"):  # the tree before a change (--before): its zckpt, this tree's tests and fixtures
        sys.path.insert(0, job["zckpt_path"])
    spec = job["spec"]
    deepspeed.init_distributed(dist_backend="gloo")
    engine, _, _ = resume_worker.build_engine(G, spec)
    import zckpt.ops.resume  # noqa: F401 - imported up front, as a training script would
    import zckpt.ops.reshard  # noqa: F401
    scratch = tempfile.mkdtemp(prefix="bench-scratch-")
    dist.barrier()
    r0, t0 = _rchar(), time.perf_counter()
    with ScratchWatch(scratch) as watch:
        if job["route"] == "native":
            path, _ = engine.load_checkpoint(job["native"])
            tensor_bytes = phases = None
        else:
            import zckpt.deepspeed as zd
            path, _ = zd.load_checkpoint(engine, job["source"], scratch_dir=scratch,
                                         workers=job.get("workers") or None)
            tensor_bytes = engine.zckpt_resume_info.bytes_read
            phases = engine.zckpt_resume_info.seconds
    dt, r1 = time.perf_counter() - t0, _rchar()
    assert path is not None
    stats = {"rank": dist.get_rank(), "seconds": dt, "rchar": r1 - r0, "tensor_bytes": tensor_bytes,
             "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "scratch_peak": watch.peak,
             "phases": phases}
    os.rmdir(scratch)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stats)
    if dist.get_rank() == 0:
        Path(job["out"]).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def run_job(job: dict, ws: int) -> list[dict]:
    import fixtures.generate as G
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        jp, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        jp.write_text(json.dumps(dict(job, out=str(out))))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(ws),
               "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()), __file__, "--_worker", str(jp)]
        env = dict(job.get("env") or {}, TMPDIR=tmp, PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        proc = subprocess.run(cmd, env=G.rank_env(env), cwd=str(ROOT),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise RuntimeError(proc.stdout.decode(errors="replace")[-5000:])
        return json.loads(out.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "zckpt-bench-resume"))
    ap.add_argument("--source-ws", type=int, default=2)
    ap.add_argument("--world-size", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--zckpt-workers", default="0",
                    help="comma-separated thread counts per rank for zckpt's reads, one route each (0: the default)")
    ap.add_argument("--json-out")
    ap.add_argument("--before", help="a tree holding zckpt/ before a change: route zckpt-before runs its zckpt")
    ap.add_argument("--env-route", action="append", default=[], metavar="NAME:VAR=VALUE[,VAR=VALUE]",
                    help="route zckpt-NAME: zckpt with these environment variables (repeatable)")
    ap.add_argument("--_worker")
    a = ap.parse_args(argv)
    if a._worker:
        worker(a._worker)
        return 0
    import fixtures.generate as G
    from zckpt.ops.reshard import reshard
    model = {"vocab": a.vocab, "hidden": a.hidden, "ffn": a.ffn, "layers": a.layers}
    spec = G.make_spec(stage=2, dtype="bf16", world_size=a.source_ws, model=model, steps=1, scheduler=False,
                       client_state={})
    work = Path(a.workdir)
    src = work / f"src-{a.layers}x{a.hidden}-ws{a.source_ws}"
    if not (src / "latest").exists():
        G.generate(spec, src, expected=False, oracle=False)
    native = work / f"native-{a.layers}x{a.hidden}-ws{a.world_size}"
    if not (native / "latest").exists():
        reshard(str(src), str(native), world_size=a.world_size, overwrite=True)
    tspec = dict(spec, world_size=a.world_size)
    size = sum(f.stat().st_size for f in (src / (src / "latest").read_text().strip()).iterdir())
    wlist = [int(w) for w in a.zckpt_workers.split(",")]
    routes = {"native": {}} | {("zckpt" if w == 0 else f"zckpt-w{w}"): {"workers": w} for w in wlist}
    for spec_ in a.env_route:
        name, _, assigns = spec_.partition(":")
        routes[f"zckpt-{name}"] = {"env": dict(kv.split("=", 1) for kv in assigns.split(",") if kv)}
    if a.before:
        routes["zckpt-before"] = {"zckpt_path": str(Path(a.before).resolve())}
    runs = {route: [] for route in routes}
    for _ in range(a.repeat):
        for route in runs:
            job = {"spec": tspec, "route": "native" if route == "native" else "api", "native": str(native),
                   "source": str(src)} | routes[route]
            runs[route].append(run_job(job, a.world_size))
    med = statistics.median
    from zckpt import open_checkpoint
    params = sum(r.numel for r in open_checkpoint(str(src)).records if r.kind in ("trainable", "frozen"))
    result = {"params": params, "checkpoint_bytes": size, "source_world_size": a.source_ws,
              "world_size": a.world_size, "repeat": a.repeat, "routes": {}}
    for route, reps in runs.items():
        per_rank = []
        for r in range(a.world_size):
            rows = [rep[r] for rep in reps]
            per_rank.append({k: med([row[k] for row in rows]) if rows[0][k] is not None else None
                             for k in ("seconds", "rchar", "tensor_bytes", "peak_rss", "scratch_peak")})
        result["routes"][route] = per_rank
        if route != "native":
            for r, row in enumerate(per_rank):
                row["phases"] = {k: med([rep[r]["phases"][k] for rep in reps]) for k in reps[0][r]["phases"]}
    nat = result["routes"]["native"]
    print(f"{params / 1e6:.1f}M params; checkpoint {size / 1e6:.1f} MB at {a.source_ws} ranks -> "
          f"{a.world_size} ranks; medians of {a.repeat}")
    for route in [r for r in runs if r != "native"]:
        z = result["routes"][route]
        ratios = [z[r]['seconds'] / nat[r]['seconds'] for r in range(a.world_size)]
        print(f"route {route}: zckpt / native per rank " + " ".join(f"{x:.2f}" for x in ratios)
              + f"  (median {med(ratios):.2f}, worst {max(ratios):.2f}; zckpt s median "
              f"{med(z[r]['seconds'] for r in range(a.world_size)):.3f}, native {med(n['seconds'] for n in nat):.3f})")
    z = result["routes"][next(r for r in runs if r != "native")]
    print(f"{'rank':>4} {'native s':>9} {'zckpt s':>8} {'ratio':>6} {'native read MB':>15} {'zckpt read MB':>14} "
          f"{'zckpt tensor MB':>16} {'native RSS MB':>14} {'zckpt RSS MB':>13} {'scratch B':>10}")
    for r in range(a.world_size):
        ratio = z[r]["seconds"] / nat[r]["seconds"]
        print(f"{r:>4} {nat[r]['seconds']:>9.3f} {z[r]['seconds']:>8.3f} {ratio:>6.2f} "
              f"{nat[r]['rchar'] / 1e6:>15.1f} {z[r]['rchar'] / 1e6:>14.1f} {z[r]['tensor_bytes'] / 1e6:>16.1f} "
              f"{nat[r]['peak_rss'] / 2**20:>14.0f} {z[r]['peak_rss'] / 2**20:>13.0f} {z[r]['scratch_peak']:>10}")
    print("zckpt phases (s, rank 0):", {k: round(v, 3) for k, v in z[0]["phases"].items()})
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
