#!/usr/bin/env bash
# Issue 49 on the lent 16-core host (run from the repo root): bash benchmarks/device_castmeta.sh OUTDIR STEP
# STEP cast: benchmarks/bench_castmerge.py (merge fp32 and bf16 of one ~1B-parameter fp32 DCP checkpoint, into one
# file and into 4, this tree beside .bench/before's, each beside a 16-thread copy and cp -r of its output);
# STEP meta: benchmarks/bench_metadata.py dcp-info cases (zckpt info of a DCP folder of real torch-zip items against
# pickle.load of its .metadata), this tree at 10^5 and 10^6 chunks and .bench/before's at 10^5.
# .whl/: the isal wheel (cp312 manylinux: pip download --no-deps --only-binary=:all: --python-version 3.12 isal).
set -euo pipefail
out=${1:?outdir}
step=${2:?cast or meta}
python3 -c "import isal" 2>/dev/null || \
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
work=${WORK:-/tmp/zbench}
mkdir -p "$work" "$out"
{ date -u; nproc; free -g | head -2; uname -r; df -hT /tmp | tail -1; grep -m1 "model name" /proc/cpuinfo
  python3 -c "import sys, torch, numpy; print(sys.version.split()[0], torch.__version__, numpy.__version__)"
  git log --oneline -1 2>/dev/null || true; } 2>&1 | tee -a "$out/host.log"
case $step in cast)
  python3 benchmarks/bench_castmerge.py --workdir "$work" --layers 14 --hidden 2048 --ffn 8192 --vocab 32000 \
    --files 4 --repeat ${REPEAT:-3} --before .bench/before --json-out "$out/castmerge.json" 2>&1 \
    | tee "$out/castmerge.log" ;; esac
case $step in meta)
  python3 benchmarks/bench_metadata.py --chunks '' --ds-world-sizes '' --info-chunks ${CHUNKS:-100000,1000000} \
    --info-files 64 --keep "$work/meta" --json-out "$out/metadata.json" 2>&1 | tee "$out/metadata.log"
  python3 benchmarks/bench_metadata.py --chunks '' --ds-world-sizes '' --info-chunks ${BEFORE_CHUNKS:-100000} \
    --info-files 64 --keep "$work/meta" --zckpt-root .bench/before --json-out "$out/metadata-before.json" 2>&1 \
    | tee "$out/metadata-before.log" ;; esac
