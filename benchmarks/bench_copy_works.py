#!/usr/bin/env python
"""The files a reshard copies whole (e.g. a native-MoE checkpoint's expert files), written alone through
``zckpt.engine.run.write_works`` with an input check and published: the tree ``PYTHONPATH`` names, best and median
of ``--repeat`` runs (wall and process CPU), so two trees can be compared on the copy step alone.

    PYTHONPATH=TREE python benchmarks/bench_copy_works.py CK_TAG_DIR --glob 'layer_*' --repeat 7 --out /tmp/o
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--glob", default="layer_*_expert_*")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from zckpt.engine import executor, run, torchzip
    from zckpt.engine.checked import InputCheck
    from zckpt.engine.works import FileWork
    from zckpt.io import publish
    srcs = sorted(glob.glob(os.path.join(args.folder, args.glob)))
    works = [FileWork(os.path.basename(p), os.path.getsize(p), src=p) for p in srcs]
    total = sum(w.size for w in works)
    workers = args.workers or min(8, os.cpu_count() or 2)
    walls, cpus = [], []
    for _ in range(args.repeat):
        shutil.rmtree(args.out, ignore_errors=True)
        os.sync()
        t0, c0 = time.perf_counter(), time.process_time()
        check = InputCheck()
        worker, maps = executor.Worker(check=check), torchzip.SourceMaps()
        try:
            with publish.Publisher(args.out, "reshard", None, False) as pub:
                run.write_works(works, pub, workers, worker, maps, lambda n: None, False, None, check)
                check.finish()
                pub.commit()
        finally:
            worker.close()
            maps.close()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    shutil.rmtree(args.out, ignore_errors=True)
    doc = {"files": len(works), "bytes": total, "workers": workers, "wall_s": [round(w, 4) for w in walls],
           "cpu_s": [round(c, 4) for c in cpus], "wall_best": min(walls), "wall_median": statistics.median(walls),
           "cpu_median": statistics.median(cpus), "checked_entries": check.checked}
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
