#!/usr/bin/env python
"""DCP merge benchmark: ``zckpt merge`` of an FSDP2 DCP checkpoint vs torch's ``dcp_to_torch_save`` + safetensors.

Generates (once, cached under the work dir) a DCP checkpoint with real FSDP2 on CPU ranks (``tests/fsdp2_job.py``:
``fully_shard`` per block, AdamW, one step, ``dcp.save`` of ``get_state_dict``: model + both Adam moments), then
runs each route in its own process, ``--repeat`` times, alternately:

* ``zckpt merge DCP -o OUT``                         streaming: pieces of the .distcp items through the engine
* ``dcp_to_torch_save(DCP, tmp.pt)``, then ``torch.load`` + ``safetensors.torch.save_file`` of its ``model``
                                                     torch's own route (format_utils; Accelerate's merge-weights
                                                     is built on it): the whole checkpoint in RAM, then written
* ``cp OUT/model.safetensors COPY``                  a plain copy of the output: the disk's speed for those bytes

Peak RSS from ``wait4``'s rusage of each process; medians reported as a table and JSON (``--json-out``).

    python benchmarks/bench_dcp_merge.py                          # ~60M params, 4 ranks
    python benchmarks/bench_dcp_merge.py --layers 24 --hidden 1024 --workdir /big/disk
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

TORCH_ROUTE = """
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
src, tmp, out = sys.argv[1:4]
dcp_to_torch_save(src, tmp)
sd = torch.load(tmp, weights_only=False)["model"]
save_file({k: v.contiguous() for k, v in sd.items()}, out)
"""


def run_measured(cmd: list[str], env=None) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of one command in its own process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr.read().decode(errors='replace')[-3000:]}")
    proc.stderr.close()
    return dt, usage.ru_maxrss * 1024


def ensure_checkpoint(workdir: Path, dims: dict, world_size: int) -> Path:
    tag = f"dcp-l{dims['layers']}-h{dims['hidden']}-ws{world_size}"
    out = workdir / tag
    if (out / "dcp" / ".metadata").exists():
        return out / "dcp"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size),
                    str(ROOT / "tests" / "fsdp2_job.py"), str(out), "1", "2", "fp32", json.dumps(dims), "nofull"],
                   env=env, check=True, cwd=ROOT)
    return out / "dcp"


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--ffn", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default=str(ROOT / ".bench"))
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    dims = {"layers": args.layers, "hidden": args.hidden, "ffn": args.ffn, "vocab": args.vocab}
    work = Path(args.workdir)
    src = ensure_checkpoint(work, dims, args.world_size)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    runs: dict[str, list] = {"zckpt": [], "torch": [], "cp": []}
    zout, tout, tmp, copy = work / "zout", work / "tout.safetensors", work / "tmp.pt", work / "copy.safetensors"
    for _ in range(args.repeat):
        for p in (zout, tout, tmp, copy):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        subprocess.run(["sync"], check=False)
        runs["zckpt"].append(run_measured([sys.executable, "-m", "zckpt", "merge", str(src), "-o", str(zout),
                                           "--quiet"], env))
        runs["torch"].append(run_measured([sys.executable, "-c", TORCH_ROUTE, str(src), str(tmp), str(tout)], env))
        runs["cp"].append(run_measured(["cp", str(zout / "model.safetensors"), str(copy)]))
    from safetensors import safe_open
    with safe_open(str(tout), "pt") as a, safe_open(str(zout / "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(a.get_tensor(k).equal(b.get_tensor(k)) for k in a.keys()), "outputs differ"
    med = {k: (statistics.median(t for t, _ in v), max(r for _, r in v)) for k, v in runs.items()}
    res = {"checkpoint": str(src), "dcp_bytes": du(src), "output_bytes": (zout / "model.safetensors").stat().st_size,
           "world_size": args.world_size, "dims": dims, "repeat": args.repeat,
           "seconds": {k: round(v[0], 3) for k, v in med.items()},
           "peak_rss_mib": {k: round(v[1] / 2**20) for k, v in med.items()},
           "torch_over_zckpt": round(med["torch"][0] / med["zckpt"][0], 2),
           "zckpt_over_cp": round(med["zckpt"][0] / med["cp"][0], 2), "outputs_equal": True}
    print(f"DCP {res['dcp_bytes'] / 2**30:.2f} GiB ({args.world_size} ranks) -> fp32 safetensors "
          f"{res['output_bytes'] / 2**30:.2f} GiB, median of {args.repeat}")
    print("| route | seconds | peak RSS |\n|---|---:|---:|")
    for k in runs:
        print(f"| {k} | {res['seconds'][k]:.2f} | {res['peak_rss_mib'][k]} MiB |")
    print(f"torch / zckpt {res['torch_over_zckpt']}x, zckpt / cp {res['zckpt_over_cp']}x; outputs bit-equal")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
