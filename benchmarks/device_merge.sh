#!/usr/bin/env bash
# Merge benchmark on a bigger host (run from the repo root; wheels for deepspeed and its small deps in .whl/).
# Usage: [PROBE=1] [RESHARD=1] bash benchmarks/device_merge.sh OUTDIR [SIZES...]
#   SIZES: 230m 920m 2500m (default: 230m 920m). 2500m needs ~35 GB for the checkpoint plus 2 x 10 GB of outputs.
# PROBE=1 also runs benchmarks/probe_merge.py (time breakdown, worker variants) on the 230m checkpoint;
# RESHARD=1 runs benchmarks/bench_reshard.py on it.
set -euo pipefail
out=${1:?outdir}; shift || true
sizes=${*:-230m 920m}
if ! python3 -c "import deepspeed" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1
work=${WORK:-/tmp/zbench}
mkdir -p "$work" "$out"
nproc; free -g | head -2; df -h /tmp | tail -1; python3 -c "import torch, deepspeed; print(torch.__version__, deepspeed.__version__)"
for s in $sizes; do
  case $s in
    230m) args="--layers 21 --world-size 4 --repeat 3" ;;
    920m) args="--layers 94 --world-size 4 --repeat 2" ;;
    2500m) args="--layers 64 --hidden 2048 --ffn 8192 --world-size 4 --repeat 1" ;;
  esac
  python3 benchmarks/bench_merge.py --workdir "$work" $args ${DTYPES:+--dtypes $DTYPES} --json-out "$out/merge-$s.json" 2>&1 | tee "$out/merge-$s.log"
  if [ "$s" = 230m ] && [ -n "${PROBE:-}" ]; then
    for d in fp32 bf16; do
      python3 benchmarks/probe_merge.py "$work"/z2_bf16_ws4_L21_* --dtype $d --rounds 3 \
        --variants default,w1,streams2 --json-out "$out/probe-$d.json" 2>&1 | tee "$out/probe-$d.log"
    done
  fi
  if [ "$s" = 230m ] && [ -n "${RESHARD:-}" ]; then  # the reshard benchmark reuses the same checkpoint
    python3 benchmarks/bench_reshard.py --workdir "$work" --repeat 3 --json-out "$out/reshard-$s.json" 2>&1 \
      | tee "$out/reshard-$s.log"
  fi
  rm -rf "$work"/z2_* "$work"/out-*
done
