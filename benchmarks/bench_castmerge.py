#!/usr/bin/env python
"""Merge with a down-cast against merge at the source's dtype, each beside a parallel copy of its own output.

One fp32 checkpoint (``--src``, or generated: a ``dcp.save`` of a Llama-shaped model of ``--layers`` x ``--hidden``
x ``--ffn`` and a ``--vocab`` embedding, fp32, made with torch alone), page cache warm. For every case and tree
(this one, and ``--before DIR``'s zckpt), alternating, ``--repeat`` times:

* ``zckpt merge SRC --dtype D [--max-shard-size S] -o OUT --json`` (P = 1): zckpt's own seconds and the wall seconds;
* a 16-thread copy of the output it wrote (``--copy-threads``): every file's bytes in 64 MiB ranges, dealt to the
  threads round robin, ``pread`` / ``pwrite`` into files created at their size (the bytes a merge writes, written
  as fast as this host's threads can: the baseline of issue 49), and ``cp -r`` of it;
* the outputs of both trees compared byte for byte (the cast is torch's, whichever kernel ran it).

The cases: ``fp32`` and ``bf16`` into one file, and into ``--files`` files each (``--max-shard-size`` of a
``--files``-th of the output), so that a down-cast is compared with a copy of the same number of files.

    python benchmarks/bench_castmerge.py --layers 14 --hidden 2048 --ffn 8192 --before .bench/before --json-out r.json
    python benchmarks/bench_castmerge.py --layers 2 --hidden 512 --ffn 1024 --repeat 1                # a smoke test
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_copylimit import cp_r, run  # noqa: E402

COPY_RANGE = 64 << 20


def generate(out: Path, layers: int, hidden: int, ffn: int, vocab: int) -> Path:
    """A DCP folder of an fp32 Llama-shaped model (torch's own dcp.save, one process, 8 data files)."""
    if (out / ".metadata").exists():
        return out
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    torch.manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.randn(vocab, hidden) * 0.02}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{name}.weight"] = torch.randn(hidden, hidden) * 0.02
        sd[p + "mlp.gate_proj.weight"] = torch.randn(ffn, hidden) * 0.02
        sd[p + "mlp.up_proj.weight"] = torch.randn(ffn, hidden) * 0.02
        sd[p + "mlp.down_proj.weight"] = torch.randn(hidden, ffn) * 0.02
        sd[p + "input_layernorm.weight"] = torch.ones(hidden)
    sd["lm_head.weight"] = torch.randn(vocab, hidden) * 0.02
    sd["model.layers.0.mlp.up_proj.weight"][0, :4] = torch.tensor([65520.0, -1e-7, 6e-8, float("inf")])
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    dcp.save({"model": sd}, storage_writer=FileSystemWriter(str(tmp), thread_count=8), no_dist=True)
    tmp.rename(out)
    return out


def parallel_copy(src: Path, dst: Path, threads: int) -> float:
    """Seconds to copy every file of ``src`` into ``dst`` with ``threads`` threads: 64 MiB ranges of all files
    dealt round robin, pread / pwrite, the files created at their size first (timed)."""
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    files = [p for p in sorted(src.rglob("*")) if p.is_file()]
    size = min(COPY_RANGE, max([p.stat().st_size for p in files] + [1]))
    bufs = [memoryview(bytearray(size)) for _ in range(threads)]  # allocated (and zeroed) before the clock starts
    t0 = time.perf_counter()
    dst.mkdir(parents=True)
    fds = []
    for p in files:
        size = p.stat().st_size
        rfd = os.open(p, os.O_RDONLY)
        wfd = os.open(dst / p.relative_to(src), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(wfd, size)
        fds.append((rfd, wfd, size))
    jobs = [(r, w, off, min(COPY_RANGE, size - off)) for r, w, size in fds for off in range(0, size, COPY_RANGE)]
    jobs = [jobs[i] for k in range(len(fds)) for i in range(len(jobs)) if i % len(fds) == k]  # files interleaved

    def worker(k: int) -> None:
        view = bufs[k]
        for r, w, off, n in jobs[k::threads]:
            got = os.preadv(r, [view[:n]], off)
            os.pwrite(w, view[:got], off)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    for r, w, _ in fds:
        os.close(r)
        os.close(w)
    return time.perf_counter() - t0


def sha(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.glob("*.safetensors")):
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while block := f.read(16 << 20):
                h.update(block)
        out[p.name] = h.hexdigest()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=str(ROOT / ".bench"))
    ap.add_argument("--src", default=None, help="an fp32 checkpoint (default: generated in --workdir)")
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--copy-threads", type=int, default=16)
    ap.add_argument("--before", default=None, help="another tree (holding zckpt/) run beside this one")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    before = Path(args.before).resolve() if args.before else None  # (both before the chdir below)
    given = Path(args.src).resolve() if args.src else None
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)  # python -m puts the working folder first on sys.path: never this tree's, for --before
    src = given or generate(
        work / f"dcp_fp32_L{args.layers}_H{args.hidden}_F{args.ffn}_V{args.vocab}", args.layers, args.hidden,
        args.ffn, args.vocab)
    fp32 = sum(p.stat().st_size for p in src.glob("*.distcp"))
    cases = {"fp32": ("fp32", None), "bf16": ("bf16", None),
             f"fp32-{args.files}files": ("fp32", f"{fp32 // args.files + (1 << 20)}B"),
             f"bf16-{args.files}files": ("bf16", f"{fp32 // 2 // args.files + (1 << 20)}B")}
    trees = {"after": str(ROOT)}
    if before is not None:
        trees["before"] = str(before)
    print(f"source {src} ({fp32 / 1e9:.2f} GB of fp32 items), {os.cpu_count()} CPUs", flush=True)
    for tree, root in trees.items():  # which zckpt each tree's commands import (a check, not assumed)
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        got = subprocess.run([sys.executable, "-c", "import zckpt; print(zckpt.__file__)"], env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
        print(f"  {tree}: {got}", flush=True)
        if not got.startswith(root):
            raise SystemExit(f"{tree} imports {got}, not the tree {root}")
    for p in src.glob("*"):  # the page cache warm for every run
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass
    rows: dict[tuple, dict] = {}
    for rep in range(args.repeat):
        for case, (dtype, shard) in cases.items():
            for tree, root in trees.items():
                out = work / f"castmerge-{tree}-{case}"
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
                cmd = ["merge", str(src), "--dtype", dtype, "-o", str(out)] + (["--max-shard-size", shard] if shard
                                                                                else [])
                wall, secs, _doc, rss = run(1, cmd, env)
                r = rows.setdefault((case, tree), {"zckpt": [], "wall": [], "pcopy": [], "cp": [], "rss": rss})
                r["zckpt"].append(secs)
                r["wall"].append(wall)
                if tree == "after":
                    r["pcopy"].append(parallel_copy(out, work / "castmerge-copy", args.copy_threads))
                    r["cp"].append(cp_r(out, work / "castmerge-copy"))
                r["bytes"] = sum(p.stat().st_size for p in out.glob("*.safetensors"))
                r["files"] = len(list(out.glob("*.safetensors")))
                if rep == args.repeat - 1:
                    r["sha"] = sha(out)
                print(f"  {case} {tree}: zckpt {secs:.2f}s wall {wall:.2f}s" + (
                    f" {args.copy_threads}-thread copy {r['pcopy'][-1]:.2f}s cp -r {r['cp'][-1]:.2f}s"
                    if tree == "after" else ""), flush=True)
    shutil.rmtree(work / "castmerge-copy", ignore_errors=True)
    med = statistics.median
    print(f"\n| case | tree | files | GB written | zckpt s | wall s | {args.copy_threads}-thread copy s | zckpt / copy | "
          "cp -r s | same as after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    table = []
    for (case, tree), r in rows.items():
        pc = med(r["pcopy"]) if r["pcopy"] else None
        ratio = "-" if pc is None else f"{med(r['zckpt']) / pc:.2f}"
        cp = f"{med(r['cp']):.2f}" if r["cp"] else "-"
        same = r.get("sha") == rows[(case, "after")].get("sha")
        table.append({"case": case, "tree": tree, "files": r["files"], "bytes": r["bytes"], "zckpt": r["zckpt"],
                      "wall": r["wall"], "pcopy": r["pcopy"], "cp": r["cp"], "rss_kib": r["rss"], "same": same})
        print(f"| {case} | {tree} | {r['files']} | {r['bytes'] / 1e9:.2f} | {med(r['zckpt']):.2f} | "
              f"{med(r['wall']):.2f} | {'-' if pc is None else f'{pc:.2f}'} | {ratio} | "
              f"{cp} | {same} |", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"host": os.uname().nodename, "cpus": os.cpu_count(),
                                                   "source": str(src), "source_bytes": fp32, "rows": table},
                                                  indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
