#!/usr/bin/env bash
# Merge benchmark on a bigger host (run from the repo root; wheels for deepspeed and its small deps in .whl/).
# Usage: [RESHARD=1] bash benchmarks/device_merge.sh OUTDIR [SIZES...]   SIZES: 230m 920m 2500m (default: 230m 920m)
# RESHARD=1 also runs benchmarks/bench_reshard.py on the 230m checkpoint.
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
    2500m) args="--layers 128 --hidden 1280 --ffn 5120 --world-size 8 --repeat 1" ;;
  esac
  python3 benchmarks/bench_merge.py --workdir "$work" $args --json-out "$out/merge-$s.json" 2>&1 | tee "$out/merge-$s.log"
  if [ "$s" = 230m ] && [ -n "${RESHARD:-}" ]; then  # the reshard benchmark reuses the same checkpoint
    python3 benchmarks/bench_reshard.py --workdir "$work" --repeat 3 --json-out "$out/reshard-$s.json" 2>&1 \
      | tee "$out/reshard-$s.log"
  fi
  rm -rf "$work"/z2_* "$work"/out-*
done
