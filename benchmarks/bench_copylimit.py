#!/usr/bin/env python
"""zckpt against the copy limit: merge fp32, reshard and convert --to dcp, each beside ``cp -r`` of its own output.

For each case, on one checkpoint with the page cache warm: ``zckpt`` at P = 1 (the plain command) and P > 1
(``torchrun --nproc-per-node P -m zckpt``), then ``cp -r`` of the output it wrote (the same bytes written once more,
read from the page cache: what the disk and kernel allow for that output), and the outputs of every P compared
with P = 1's (every file; in torch zips every entry but torch's random ``serialization_id``). With ``--before DIR``
the zckpt of another tree (the version before a change) runs too, alternating with this one, at P = 1.

Reported (medians of ``--repeat`` runs): zckpt's own seconds (``--json``: open to publish), the wall seconds of the
command (interpreter start and, under torchrun, torch's import included), ``cp -r``'s seconds, zckpt / cp, the
efficiency T1 / (P * TP) on zckpt's seconds, and the peak RSS of the command's largest process (wait4). With
``--peers``, DeepSpeed's own merge and its consolidation + ``dcp.save`` run on the same files, timed the same way.

    python benchmarks/bench_copylimit.py --layers 26 --hidden 2048 --ffn 8192 --procs 1,4,8 --json-out r.json
    python benchmarks/bench_copylimit.py --ckpt fixtures/z2_bf16_ws4/checkpoint --procs 1,2 --repeat 1  # smoke
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
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_scale import free_port  # noqa: E402

CASES = {
    "merge-fp32": lambda ck, out: ["merge", ck, "--dtype", "fp32", "-o", out],
    "reshard-ws8": lambda ck, out: ["reshard", ck, "--world-size", "8", "-o", out],
    "convert-dcp": lambda ck, out: ["convert", ck, "--to", "dcp", "-o", out],
    "merge-fp32-1GB": lambda ck, out: ["merge", ck, "--dtype", "fp32", "--max-shard-size", "1GB", "-o", out],
}
# The user's alternatives on the same files (``--peers``), each in its own process: DeepSpeed's own merge (the
# zero_to_torch.py it saves beside the checkpoint, as a user runs it) and DeepSpeed's consolidation into RAM +
# torch's ``dcp.save`` (the model only: no optimizer state).
NAIVE_DCP = """
import sys
import torch.distributed.checkpoint as dcp
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
sd = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1])
dcp.save({"model": sd}, checkpoint_id=sys.argv[2], no_dist=True)
"""
PEERS = {
    "merge-fp32": ("deepspeed zero_to_torch.py --dtype fp32",
                   lambda ck, out: [sys.executable, str(ck / "zero_to_torch.py"), str(ck), str(out), "--dtype", "fp32"]),
    "convert-dcp": ("deepspeed consolidation + dcp.save (model only)",
                    lambda ck, out: [sys.executable, "-c", NAIVE_DCP, str(ck), str(out)]),
}


def command(procs: int, args: list[str]) -> list[str]:
    if procs == 1:
        return [sys.executable, "-m", "zckpt", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(procs),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "zckpt", *args]


def run_measured(cmd: list[str], env: dict) -> tuple[float, str, int]:
    """(wall s, stdout, peak RSS in KiB of the process: wait4's rusage, its reaped children included)."""
    import tempfile
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{err.read().decode(errors='replace')[-3000:]}")
        return wall, out.read().decode(errors="replace"), usage.ru_maxrss


def run(procs: int, args: list[str], env: dict) -> tuple[float, float, dict, int]:
    """(wall s, zckpt s, --json result, peak RSS in KiB of the command's largest process)."""
    wall, stdout, rss = run_measured(command(procs, [*args, "--json"]), env)
    doc = json.loads([ln for ln in stdout.splitlines() if ln.startswith("{")][-1])
    return wall, doc["seconds"], doc, rss


def cp_r(src: Path, dst: Path) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    return time.perf_counter() - t0


def digest(path: Path) -> str:
    """sha256 of a file; of a torch zip: of every entry but the serialization id, in order."""
    h = hashlib.sha256()
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        zf = None
    if zf is None:
        with open(path, "rb") as f:
            while block := f.read(16 << 20):
                h.update(block)
        return h.hexdigest()
    with zf:
        for info in zf.infolist():
            if info.filename.endswith("serialization_id"):
                continue
            h.update(info.filename.encode())
            with zf.open(info) as f:
                while block := f.read(16 << 20):
                    h.update(block)
    return h.hexdigest()


def dcp_digest(folder: Path) -> str:
    """A DCP folder's content: its .metadata but the random save_id, and every item's zip entries but their
    serialization ids (DCP's save_id and torch.save's ids are random: two saves of one state differ there)."""
    import io
    import pickle
    with open(folder / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own output, made in this run
    h = hashlib.sha256()
    h.update(repr(sorted((k, repr(v)) for k, v in md.state_dict_metadata.items())).encode())
    h.update(repr(md.planner_data).encode())
    items = sorted((repr(k), v) for k, v in md.storage_data.items())
    for key, info in items:
        h.update(f"{key} {info.relative_path} {info.offset} {info.length}".encode())
        with open(folder / info.relative_path, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        with zipfile.ZipFile(io.BytesIO(blob)) as zf:
            for entry in zf.infolist():
                if not entry.filename.endswith("serialization_id"):
                    h.update(entry.filename.encode() + hashlib.sha256(zf.read(entry)).digest())
    return h.hexdigest()


def tree_digest(out: Path) -> dict[str, str]:
    """Every output file's digest (a DCP folder's as one), hashed by a thread per CPU (hashlib drops the GIL)."""
    from concurrent.futures import ThreadPoolExecutor
    dcp = {p.parent for p in out.rglob(".metadata")}
    files = [p for p in sorted(out.rglob("*")) if p.is_file() and p.name != ".zckpt.json" and p.parent not in dcp]
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        got = dict(zip((str(p.relative_to(out)) for p in files), pool.map(digest, files)))
    return got | {str(d.relative_to(out)) + "/": dcp_digest(d) for d in sorted(dcp)}


def tree_digest_apart(out: Path) -> dict[str, str]:
    """:func:`tree_digest` in a process of its own: reading .metadata imports torch, and a parent grown by it would
    count in the peak RSS of every command it starts later (Linux carries the RSS high-water mark over exec)."""
    res = subprocess.run([sys.executable, __file__, "--digest", str(out)], check=True, capture_output=True, text=True)
    return json.loads(res.stdout)


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--digest"]:
        print(json.dumps(tree_digest(Path(sys.argv[2]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=str(ROOT / ".bench"))
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--procs", default="1,4,8")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--before", default=None, help="another tree (holding zckpt/) run beside this one at P = 1")
    ap.add_argument("--peers", action="store_true", help="run DeepSpeed's merge and consolidation + dcp.save too")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if args.ckpt:
        ckpt, params = Path(args.ckpt).resolve(), None
    else:
        from benchmarks.bench_merge import count_params, ensure_checkpoint, model_dims
        dims = model_dims(args.layers, args.hidden, args.vocab, args.ffn)
        params = count_params(dims)
        ckpt = ensure_checkpoint(work, dims, args.world_size)
    trees = {"after": ROOT} | ({"before": Path(args.before).resolve()} if args.before else {})
    import compileall  # each tree's bytecode written first, as `pip install` does for the wheel (where
    for t in trees.values():  # PYTHONDONTWRITEBYTECODE is set, every command would compile zckpt again)
        compileall.compile_dir(str(t / "zckpt"), quiet=1)
    envs = {k: dict(os.environ, DS_ACCELERATOR="cpu", ZCKPT_DISABLE_PROGRESS_BARS="1", PYTHONSAFEPATH="1",
                    PYTHONPATH=os.pathsep.join([str(t), os.environ.get("PYTHONPATH", "")]))
            for k, t in trees.items()}
    procs = [int(p) for p in args.procs.split(",")]
    src_bytes = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    results = {"checkpoint": str(ckpt), "params": params, "checkpoint_bytes": src_bytes, "cpus": os.cpu_count(),
               "procs": procs, "repeat": args.repeat, "cases": {},
               "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE")}
    print(f"checkpoint {ckpt} ({(params or 0) / 1e9:.2f}B params, {src_bytes / 1e9:.2f} GB), "
          f"{os.cpu_count()} CPUs", flush=True)
    out, copy = work / "cl-out", work / "cl-copy"
    for case in args.cases.split(","):
        argv_ = lambda o: [str(a) for a in CASES[case](ckpt, o)]  # noqa: E731
        rows: dict = {}
        run(1, argv_(out) + ["--overwrite"], envs["after"])  # warm the page cache
        ref = None
        for tree in trees:
            for p in (procs if tree == "after" else [1]):
                rec = {"wall": [], "zckpt": [], "cp": [], "stats": [], "rss_kib": 0}
                for _ in range(args.repeat):
                    shutil.rmtree(out, ignore_errors=True)
                    os.sync()
                    wall, secs, doc, rss = run(p, argv_(out), envs[tree])
                    rec["wall"].append(wall)
                    rec["zckpt"].append(secs)
                    rec["stats"].append(doc.get("stats", {}))
                    rec["rss_kib"] = max(rec["rss_kib"], rss)
                    rec["cp"].append(cp_r(out, copy))
                    rec["bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
                if tree == "after":
                    d = tree_digest_apart(out)
                    ref = ref or d
                    rec["same_as_p1"] = d == ref
                med = {k: statistics.median(rec[k]) for k in ("wall", "zckpt", "cp")}
                rows[f"{tree}-P{p}"] = {"median_s": med, "raw": rec, "over_cp": med["zckpt"] / med["cp"]}
                print(f"  {case} {tree} P={p}: zckpt {med['zckpt']:.2f}s wall {med['wall']:.2f}s "
                      f"cp -r {med['cp']:.2f}s ({med['zckpt'] / med['cp']:.2f}x) "
                      f"{rec['bytes'] / 1e9:.2f} GB same={rec.get('same_as_p1')} stats={rec['stats'][-1]}",
                      flush=True)
        if args.peers and case in PEERS:
            name, peer_cmd = PEERS[case]
            rec = {"wall": [], "rss_kib": 0}
            env = {k: v for k, v in envs["after"].items() if k != "PYTHONSAFEPATH"}
            for _ in range(args.repeat):
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                wall, _, rss = run_measured(peer_cmd(ckpt, out), env)
                rec["wall"].append(wall)
                rec["rss_kib"] = max(rec["rss_kib"], rss)
                rec["bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
            med = statistics.median(rec["wall"])
            z = rows["after-P1"]
            results.setdefault("peers", {})[case] = {
                "route": name, "median_s": med, "raw": rec, "over_zckpt_wall": med / z["median_s"]["wall"],
                "zckpt_rss_kib": z["raw"]["rss_kib"], "zckpt_bytes": z["raw"]["bytes"]}
            print(f"  {case} peer {name}: {med:.2f}s wall (zckpt P=1 wall {z['median_s']['wall']:.2f}s), peak RSS "
                  f"{rec['rss_kib'] / 2**20:.2f} GiB (zckpt {z['raw']['rss_kib'] / 1024:.0f} MiB), "
                  f"{rec['bytes'] / 1e9:.2f} GB written (zckpt {z['raw']['bytes'] / 1e9:.2f} GB)", flush=True)
        base = rows["after-P1"]["median_s"]["zckpt"]
        for key, r in rows.items():
            p = int(key.split("-P")[1])
            r["efficiency"] = base / (p * r["median_s"]["zckpt"])
        results["cases"][case] = rows
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(results, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(copy, ignore_errors=True)
    print()
    print("| case | tree | P | zckpt s | wall s | cp -r s | zckpt / cp | efficiency | peak RSS (MiB) | same as P=1 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case, rows in results["cases"].items():
        for key, r in rows.items():
            tree, p = key.split("-P")
            m = r["median_s"]
            print(f"| {case} | {tree} | {p} | {m['zckpt']:.2f} | {m['wall']:.2f} | {m['cp']:.2f} | "
                  f"{r['over_cp']:.2f} | {r['efficiency']:.2f} | {r['raw']['rss_kib'] / 1024:.0f} | "
                  f"{r['raw'].get('same_as_p1', '-')} |")
    for case, r in results.get("peers", {}).items():
        print(f"| {case} | {r['route']} | 1 | - | {r['median_s']:.2f} | - | - | - | {r['raw']['rss_kib'] / 1024:.0f} | "
              f"- ({r['raw']['bytes'] / 1e9:.2f} GB written, zckpt {r['zckpt_bytes'] / 1e9:.2f} GB) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
