#!/usr/bin/env bash
# Before/after in one run on a bigger host (run from the repo root; deepspeed and its small deps as wheels in .whl/).
# Usage: bash benchmarks/device_before_after.sh OUTDIR BASEDIR [SIZES...]
#   BASEDIR holds the "before" package: git archive <rev> zckpt | tar -x -C BASEDIR
#   SIZES: 230m 920m (default both). Every command runs alternating before/after on the same files in one run.
set -euo pipefail
out=${1:?outdir}; base=$(realpath "${2:?basedir}"); shift 2 || true
sizes=${*:-230m 920m}
if ! python3 -c "import deepspeed" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1
site=${PYTHONPATH%%:*}
work=${WORK:-/tmp/zbench}
mkdir -p "$work" "$out"
nproc; free -g | head -2; python3 -c "import torch, deepspeed; print(torch.__version__, deepspeed.__version__)"
startup() {  # start-up cost alone: `info` and `merge --dry-run` on the same checkpoint, before/after alternating
  python3 - "$1" "$base" "$site" "$out/startup-$2.json" <<'PY'
import json, os, statistics, subprocess, sys, time
ckpt, base, site, dst = sys.argv[1:]
trees = {"before": f"{site}:{base}", "after": f"{site}:{os.getcwd()}"}
cmds = {"info": ["info", ckpt, "-q"], "merge --dry-run": ["merge", ckpt, "--dry-run", "-q", "-o", "/tmp/zb-dry"]}
res = {(k, c): [] for k in trees for c in cmds}
for _ in range(15):
    for k, pp in trees.items():
        for c, argv in cmds.items():
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "zckpt", *argv], check=True, capture_output=True,
                           env={**os.environ, "PYTHONPATH": pp})
            res[(k, c)].append(time.perf_counter() - t)
rows = {f"{k} {c}": round(statistics.median(v), 4) for (k, c), v in res.items()}
print(json.dumps(rows, indent=1))
json.dump(rows, open(dst, "w"), indent=1)
PY
}
for s in $sizes; do
  case $s in
    230m) args="--layers 21 --world-size 4 --repeat 5" ;;
    920m) args="--layers 94 --world-size 4 --repeat 3" ;;
  esac
  python3 benchmarks/bench_merge.py --workdir "$work" $args --baseline "$base" --json-out "$out/merge-$s.json" 2>&1 \
    | tee "$out/merge-$s.log"
  if [ "$s" = 230m ]; then
    startup "$(ls -d "$work"/z2_bf16_ws4_L21_*)" "$s" 2>&1 | tee "$out/startup-$s.log"
    python3 benchmarks/bench_reshard.py --workdir "$work" --repeat 3 --skip-ds --baseline "$base" \
      --json-out "$out/reshard-$s.json" 2>&1 | tee "$out/reshard-$s.log"
  fi
  rm -rf "$work"/z2_* "$work"/out-*
done
