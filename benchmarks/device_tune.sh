#!/usr/bin/env bash
# One visit to the lent 16-core host for the engine's knobs (run from the repo root): bash benchmarks/device_tune.sh
# OUTDIR. .whl/: deepspeed 0.19.8, isal, zlib-ng and DeepSpeed's small deps (see device_copylimit.sh).
# benchmarks/tune_copylimit.py on the 1.05B-parameter ZeRO-2 bf16 checkpoint of 4 ranks (made here): every case at
# P = 1, 4, 8 with the engine's knobs varied (ZCKPT_FALLOCATE, ZCKPT_WRITE_STREAMS, --workers). Environment: CASES,
# REPEAT, VARIANTS (tune_copylimit.py --variants: P[:WORKERS[:VAR=VALUE]],...), WORK.
set -euo pipefail
out=${1:?outdir}
if ! python3 -c "import deepspeed, isal" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1
work=${WORK:-/tmp/zbench}
mkdir -p "$work" "$out"
{ nproc; free -g | head -2; uname -r; cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || true
  python3 -c "import sys, torch, deepspeed; print(sys.version.split()[0], torch.__version__, deepspeed.__version__)"; } 2>&1 | tee -a "$out/host.log"
python3 benchmarks/tune_copylimit.py --workdir "$work" --layers 26 --hidden 2048 --ffn 8192 --world-size 4 \
  --cases ${CASES:-reshard-ws8,convert-dcp,merge-fp32,merge-fp32-1GB} --repeat ${REPEAT:-1} ${VARIANTS:+--variants "$VARIANTS"} \
  --out "$out/tune.jsonl" 2>&1 | tee "$out/tune.log"
