#!/usr/bin/env bash
# The copy-limit benchmark on the lent 16-core host, one visit (run from the repo root). Usage:
#   bash benchmarks/device_copylimit.sh OUTDIR [STEP]
# .whl/: wheels of deepspeed 0.19.8, zlib-ng and the small deps the host lacks (hjson, pydantic, pydantic-core,
# annotated-types, typing-inspection, typing-extensions); .bench/before/zckpt: the tree before a change (e.g.
# `git archive OLD zckpt | tar -x -C .bench/before`), carried. STEP: all (default), crc, copylimit, merge.
# Makes a ~1.05B-parameter ZeRO-2 bf16 checkpoint of 4 ranks with real DeepSpeed on CPU ranks (cached in $WORK),
# then: benchmarks/bench_crc.py (CRC-32 implementations), benchmarks/bench_copylimit.py (merge fp32, reshard
# 4 -> 8, convert --to dcp at P = 1, 4, 8 beside cp -r of each output; the tree before at P = 1) and
# benchmarks/bench_merge.py at 921M params against DeepSpeed's zero_to_torch.py (with the tree before).
set -euo pipefail
out=${1:?outdir}
step=${2:-all}
if ! python3 -c "import deepspeed, zlib_ng" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1
work=${WORK:-/tmp/zbench}
mkdir -p "$work" "$out"
{ nproc; free -g | head -2; df -h /tmp | tail -1; python3 -c "import sys, torch, deepspeed; print(sys.version.split()[0], torch.__version__, deepspeed.__version__)"; } 2>&1 | tee -a "$out/host.log"
before=${BEFORE:-.bench/before}
case $step in all|crc) python3 benchmarks/bench_crc.py --threads 1,8,16 2>&1 | tee "$out/crc.log" ;; esac
case $step in all|copylimit)
  python3 benchmarks/bench_copylimit.py --workdir "$work" --layers 26 --hidden 2048 --ffn 8192 --world-size 4 \
    --procs ${PROCS:-1,4,8} --repeat ${REPEAT:-2} --cases ${CASES:-merge-fp32,reshard-ws8,convert-dcp} \
    --before "$before" --json-out "$out/copylimit.json" 2>&1 | tee "$out/copylimit.log" ;; esac
case $step in all|merge)
  python3 benchmarks/bench_merge.py --workdir "$work" --layers 94 --world-size 4 --repeat 2 --dtypes fp32 \
    --baseline "$before" --json-out "$out/merge-920m.json" 2>&1 | tee "$out/merge-920m.log" ;; esac
