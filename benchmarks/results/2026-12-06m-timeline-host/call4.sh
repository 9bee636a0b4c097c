# call 4 (calls 2 and 3 found no machine; the device budget left for one short call): the split of threads and the input check's entries: head (this process 4 threads growing to 12 once the
# child is done, the child 12), s5 (5 here, 11 in the child), s5b (s5 and the entries learned on a side thread once
# the imports are done), b (head with that side thread); alternated, RUNS each, a 16-thread pcopy per round
set -u
S=$SECONDS
export PYC=1
[ "${SKIP_SETUP:-0}" = 1 ] || JOBS=convert-ds COPIES=pcopy REPEAT=1 PROFILE=0 VARIANTS=";" TREES=head=. bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "setup done at $((SECONDS-S)) s"; grep -E "^\|" $OUT/w.out
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONPYCACHEPREFIX=/tmp/pyc
unset PYTHONDONTWRITEBYTECODE  # (the image sets it: every tree's bytecode compiled once into /tmp/pyc, below)
for v in head s5 s5b b; do mkdir -p .bench/$v && rm -rf .bench/$v/zckpt && cp -r zckpt .bench/$v/; done
for v in s5 s5b; do
  sed -i 's|return min(workers, max(2, workers // 3))|return min(workers, max(2, workers // 3 + 1))|; s|^    return workers$|    return max(1, workers - 1)|' .bench/$v/zckpt/engine/forked.py; done
for v in s5b b; do sed -i 's|^PREPARE_BESIDE = False|PREPARE_BESIDE = True|' .bench/$v/zckpt/engine/forked.py; done
for v in s5 s5b b; do echo "$v: $(grep -c 'workers // 3 + 1))\|return max(1, workers - 1)\|^PREPARE_BESIDE = True' .bench/$v/zckpt/engine/forked.py)"; done
for v in head s5 s5b b; do python3 -m compileall -q .bench/$v/zckpt >/dev/null; done
python3 -m compileall -q zckpt >/dev/null; ls /tmp/pyc | head -3
W=${W:-/tmp/zbench}; mkdir -p $W
CK=${CK:-$W/z2_bf16_ws4_L26_H2048_V32000_F8192}
trees=(head=.bench/head s5b=.bench/s5b b=.bench/b)
mkdir -p $OUT/tl
for r in $(seq ${RUNS:-4}); do
  n=${#trees[@]}; k=$(( (r - 1) % n ))
  for t in "${trees[@]:$k}" "${trees[@]:0:$k}"; do name=${t%%=*}; dir=${t#*=}
    rm -rf $W/tl-out; sync
    PYTHONPATH=/tmp/site:$dir python3 benchmarks/timeline_forked.py --json-out $OUT/tl/$name-$r.json -- convert $CK-dcp \
      --to deepspeed -w 4 --stage 2 --dtype bf16 --buffers scale,idx -o $W/tl-out --json > $OUT/tl/$name-$r.txt 2>&1
  done
  rm -rf $W/tl-out $W/pc; sync
  python3 - <<PY >> $OUT/pcopy.txt
import sys; sys.path.insert(0, "benchmarks")
from pathlib import Path
import bench_copybar as b, shutil, subprocess
src = Path("$W/pc-src")
if not src.exists():
    subprocess.run(["python3", "-m", "zckpt", "convert", "$CK-dcp", "--to", "deepspeed", "-w", "4", "--stage", "2", "--dtype", "bf16", "--buffers", "scale,idx", "-o", str(src), "-q"], check=True)
print("pcopy round $r", b.parallel_copy(src, Path("$W/pc"), 16))
shutil.rmtree("$W/pc", ignore_errors=True)
PY
done
echo "runs done at $((SECONDS-S)) s"
cat $OUT/pcopy.txt
python3 - <<'PY'
import json, glob, os, re
out = os.environ["OUT"]
rows = {}
for f in sorted(glob.glob(f"{out}/tl/*.json")):
    name, r = os.path.basename(f)[:-5].rsplit("-", 1)
    d = json.load(open(f))
    txt = open(f[:-5] + ".txt").read()
    m = re.search(r'"seconds": ([0-9.]+)', txt)
    ev = d["events"]
    def span(n, who=None):
        xs = [(e[3], e[4]) for e in ev if e[2] == n and e[1] == "step"]
        return xs
    main_pid = [e[0] for e in ev if e[2] == "command"][0]
    wf = [(e[0] == main_pid, e[3], e[4]) for e in ev if e[2] == "lanes._write_files"]
    fork = span("forked.write_apart")
    plan = span("to_deepspeed.plan_to_deepspeed")
    imp = span("casting.prepare")
    fin = span("checked.InputCheck.finish")
    com = span("publish.Publisher.commit")
    ends = {("main" if m else "child"): (s, e) for m, s, e in wf}
    jobs = d["jobs"]
    firstjob = min(j[3] for j in jobs)
    rows.setdefault(name, []).append(
        f"{name} run {r}: seconds {m.group(1) if m else '?'}  end-fork {d['end'] - (fork[0][0] if fork else 0):.3f}  end {d['end']:.3f}  plan end {plan[0][1] if plan else 0:.3f}"
        f"  fork {fork[0][0] if fork else 0:.3f}  first job {firstjob:.3f}  imports {imp[0][1]-imp[0][0] if imp else 0:.3f}"
        f"  main writes {ends.get('main', (0,0))[0]:.3f}-{ends.get('main', (0,0))[1]:.3f}  child {ends.get('child', (0,0))[0]:.3f}-{ends.get('child', (0,0))[1]:.3f}"
        f"  check.finish {fin[0][0] if fin else 0:.3f}+{fin[0][1]-fin[0][0] if fin else 0:.3f}  commit end {com[0][1] if com else 0:.3f}")
for name, rs in rows.items():
    print("\n".join(rs))
PY
tar -czf $OUT/tl.tgz -C $OUT tl && rm -rf $OUT/tl
