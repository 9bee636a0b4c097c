#!/usr/bin/env bash
# Remote-merge benchmark on the lent host, one visit: a real DeepSpeed ZeRO-2 bf16 checkpoint generated there, put
# in a SeaweedFS S3 server on loopback, then benchmarks/bench_remote.py (zckpt merge s3:// end to end and its data
# phase beside a 16-thread boto3 download of the same byte ranges, in-process and as a command, alternating).
#
#   [CODE=DIR] [WHL=DIR] [SITE=DIR] [WEED_XZ=FILE] [SIZES="12 40"] [REPEAT=3] [BUDGET_S=250] \
#       bash benchmarks/device_remote.sh OUTDIR
#
# CODE: the tree whose zckpt/, benchmarks/, tests/ and fixtures/ to run (default: here); WHL: deepspeed 0.19.8 and
# its small deps as wheels (the ones for this python are installed); SITE: pure-python packages put first on the
# path (boto3 and its deps, pytest for tests/s3server.py); WEED_XZ: the SeaweedFS binary, xz-compressed.
# SIZES: model layers (hidden 1024, ffn 4096, vocab 32000, 2 ranks): 12 = 146M parameters, a 2.0 GB checkpoint,
# 0.58 GB of fp32 masters to fetch; 40 = 411M, 5.8 GB, 1.6 GB. A size starts only while less than BUDGET_S
# seconds have passed (HIDDEN, FFN, VOCAB override the widths: a tiny run to test this script). NO_S3_OUT=1 skips
# the s3:// -> s3:// merge. Writes OUTDIR/host.log, remote-L<layers>.json and .log.
set -euo pipefail
out=${1:?outdir}
code=$(cd "${CODE:-$PWD}" && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
for v in WHL SITE WEED_XZ; do [ -n "${!v:-}" ] && export "$v=$(realpath "${!v}")"; done
t0=$SECONDS
{
  python3 --version; nproc; free -g | head -2; df -h /tmp | tail -1
  python3 -c "import torch; print('torch', torch.__version__)"
} 2>&1 | tee "$out/host.log"
py=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
extra=/tmp/zr-site
if [ -n "${WHL:-}" ] && ! python3 -c "import deepspeed" 2>/dev/null; then
  wheels=$(ls "$WHL"/*.whl | grep -v -- '-cp3[0-9]*-' || true)
  wheels="$wheels $(ls "$WHL"/*.whl | grep -- "-$py-" || true)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$extra" $wheels \
    2>&1 | tail -3 | tee -a "$out/host.log"
fi
export PYTHONPATH=$code:${SITE:+$SITE:}$extra:${PYTHONPATH:-} DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1
if [ -n "${WEED_XZ:-}" ]; then
  xz -dc "$WEED_XZ" > /tmp/zr-weed && chmod +x /tmp/zr-weed && export WEED=/tmp/zr-weed
fi
(cd "$code" && python3 -c "import deepspeed, boto3, zckpt; print('deepspeed', deepspeed.__version__, 'boto3', boto3.__version__, zckpt.__file__)") \
  2>&1 | tee -a "$out/host.log"
echo "setup done in $((SECONDS - t0))s" | tee -a "$out/host.log"
work=${WORK:-/tmp/zr}
mkdir -p "$work"
cd "$code"  # (the current folder comes first on sys.path: python -m zckpt must find CODE's zckpt)
for layers in ${SIZES:-12 40}; do
  if [ $((SECONDS - t0)) -ge "${BUDGET_S:-250}" ]; then
    echo "skipping L$layers: $((SECONDS - t0))s spent" | tee -a "$out/host.log"; continue
  fi
  python3 "$code/benchmarks/bench_remote.py" --workdir "$work" --layers "$layers" --world-size 2 \
    --hidden "${HIDDEN:-1024}" --ffn "${FFN:-4096}" --vocab "${VOCAB:-32000}" \
    --repeat "${REPEAT:-3}" ${NO_S3_OUT:+--no-s3-out} --json-out "$out/remote-L$layers.json" 2>&1 \
    | tee "$out/remote-L$layers.log"
  rm -rf "$work"/z2_* "$work"/zckpt-remote-*
  echo "L$layers done at $((SECONDS - t0))s" | tee -a "$out/host.log"
done
