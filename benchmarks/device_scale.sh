#!/usr/bin/env bash
# Scaling benchmark on the lent 16-core host, one visit (run from the repo root). Usage:
#   bash benchmarks/device_scale.sh OUTDIR [AFTER_TREE]
# WHL (default .bench/whl): wheels of deepspeed 0.19.8 and the deps the host lacks (hjson, pydantic, pydantic-core
# for its Python 3.12, annotated-types, typing-inspection), carried. AFTER_TREE: a copy of the tree under test
# (zckpt/, benchmarks/, fixtures/), carried; the repo root itself is then the version before, run beside it.
# A ~1.05B-parameter ZeRO-2 bf16 checkpoint (4 ranks) is made by real DeepSpeed on CPU ranks, then
# benchmarks/bench_scale.py for P = 1, 2, 4, 8: reshard to 8 ranks (the tree under test; then the tree before at
# P = 1 and 4) and merge fp32 (warm page cache), each beside P parallel copies of the same byte ranges.
# DIMS overrides the model, PROCS / BEFORE_PROCS the process counts (a smoke test on a small machine:
# DIMS="--layers 2 --hidden 64 --vocab 256 --ffn 128 --world-size 4" PROCS=1,2 BEFORE_PROCS=1,2).
set -euo pipefail
out=${1:?outdir}
after=${2:-.}
whl=${WHL:-.bench/whl}
if ! python3 -c "import deepspeed" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$whl"/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:-} DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1
work=${WORK:-/tmp/zbench}
mkdir -p "$work" "$out"
{ nproc; free -g | head -2; df -h /tmp | tail -1; python3 -c "import sys, torch, deepspeed; print(sys.version.split()[0], torch.__version__, deepspeed.__version__)"; } 2>&1 | tee "$out/host.log"
dims=${DIMS:-"--layers 26 --hidden 2048 --ffn 8192 --world-size 4"}
t0=$(date +%s)
run() { name=$1; tree=$2; shift 2; python3 "$after/benchmarks/bench_scale.py" --workdir "$work" $dims --zckpt-root "$tree" "$@" \
  --json-out "$out/scale-$name.json" 2>&1 | tee "$out/scale-$name.log"; echo "[$name done at +$(( $(date +%s) - t0 ))s]" | tee -a "$out/host.log"; }
procs=${PROCS:-1,2,4,8}
run reshard-ws8 "$after" --cases reshard-ws8 --repeat 2 --procs "$procs"     # also generates the checkpoint
run reshard-ws8-before . --cases reshard-ws8 --repeat 1 --procs "${BEFORE_PROCS:-1,4}"
run merge-fp32-warm "$after" --cases merge-fp32 --repeat 1 --procs "$procs"
