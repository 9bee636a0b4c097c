#!/usr/bin/env bash
# Scaling benchmark on the lent 16-core host (run from the repo root; deepspeed and its small deps as wheels in .whl/,
# carried). Usage: bash benchmarks/device_scale.sh OUTDIR
# A ~1.05B-parameter ZeRO-2 bf16 checkpoint (4 ranks) made by real DeepSpeed on CPU ranks, then
# benchmarks/bench_scale.py for P = 1, 2, 4, 8: merge fp32 (warm and cold page cache), reshard to 8 ranks and merge
# bf16 (warm), each beside P parallel copies of the same byte ranges.
set -euo pipefail
out=${1:?outdir}
if ! python3 -c "import deepspeed" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1
work=${WORK:-/tmp/zbench}
mkdir -p "$work" "$out"
{ nproc; free -g | head -2; df -h /tmp | tail -1; python3 -c "import torch, deepspeed; print(torch.__version__, deepspeed.__version__)"; } 2>&1 | tee "$out/host.log"
dims="--layers 26 --hidden 2048 --ffn 8192 --world-size 4"
run() { name=$1; shift; python3 benchmarks/bench_scale.py --workdir "$work" $dims "$@" --json-out "$out/scale-$name.json" \
  2>&1 | tee "$out/scale-$name.log"; }
run merge-fp32-warm --cases merge-fp32 --repeat 2
run merge-fp32-cold --cases merge-fp32 --repeat 1 --cold-only
run reshard-ws8 --cases reshard-ws8 --repeat 1
run merge-bf16 --cases merge-bf16 --repeat 1
