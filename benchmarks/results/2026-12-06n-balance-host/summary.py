"""One line per timeline run (benchmarks/timeline_forked.py --json-out): the op's seconds, fork, both processes'
writing spans, the input check's finish; then per tree the means of end - fork and seconds."""
import glob
import json
import os
import re
import sys
from statistics import mean

d_ = sys.argv[1]
rows: dict = {}
for f in sorted(glob.glob(f"{d_}/*.json")):
    name, r = os.path.basename(f)[:-5].rsplit("-", 1)
    d = json.load(open(f))
    txt = open(f[:-5] + ".txt").read()
    m = re.search(r'"seconds": ([0-9.]+)', txt)
    ev = d["events"]
    main_pid = [e[0] for e in ev if e[2] == "command"][0]

    def span(n):
        return [(e[3], e[4]) for e in ev if e[2] == n and e[1] == "step"]
    wf = {("main" if e[0] == main_pid else "child"): (e[3], e[4]) for e in ev if e[2] == "lanes._write_files"}
    fork = span("forked.write_apart")[0][0]
    fin = span("checked.InputCheck.finish")
    com = span("publish.Publisher.commit")
    busy = re.findall(r"busy\s+([\d.]+) /", txt)
    secs = float(m.group(1)) if m else float("nan")
    end = com[0][1] - fork if com else float("nan")
    rows.setdefault(name, []).append((secs, end, wf.get("main", (0, 0))[1] - fork, wf.get("child", (0, 0))[1] - fork,
                                      fin[0][1] - fin[0][0] if fin else 0, max(map(float, busy[:-3] or [0]))))
    print(f"{name} run {r}: seconds {secs:.3f}  commit-fork {end:.3f}  main end-fork {rows[name][-1][2]:.3f}  "
          f"child end-fork {rows[name][-1][3]:.3f}  finish {rows[name][-1][4]:.3f}  most busy here {rows[name][-1][5]}")
print()
for name, rs in rows.items():
    print(f"{name}: n={len(rs)} seconds best {min(r[0] for r in rs):.3f} mean {mean(r[0] for r in rs):.3f} | "
          f"commit-fork mean {mean(r[1] for r in rs):.3f} | main end {mean(r[2] for r in rs):.3f} child end "
          f"{mean(r[3] for r in rs):.3f} | finish {mean(r[4] for r in rs):.3f}")
