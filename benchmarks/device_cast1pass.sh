#!/usr/bin/env bash
# The fp32 -> bf16 cast in few passes, on a lent host (run from the repo root): bash benchmarks/device_cast1pass.sh OUT
# The candidate kernels in 1, 8, 16 threads (bench_cast_kernels.py), then bench_castmerge.py: merge fp32 and bf16
# of one fp32 DCP checkpoint into 1 and into 5 files, this tree beside BEFORE's zckpt (default .bench/t2-before,
# `git archive` of the tree before the change), each beside a 16-thread copy of its output; /usr/bin/time of the
# merges into 5 files (user CPU). .whl/: the isal wheel, as device_castmeta.sh.
set -euo pipefail
out=${1:?outdir}
before=${BEFORE:-.bench/t2-before}
python3 -c "import isal" 2>/dev/null || \
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/isal*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
work=${WORK:-/tmp/zbench}
mkdir -p "$work" "$out"
{ date -u; nproc; uname -r; grep -m1 "model name" /proc/cpuinfo; lscpu | grep -E "L1d|L2|L3"
  python3 -c "import sys, torch, numpy; print(sys.version.split()[0], torch.__version__, numpy.__version__)"; } \
  2>&1 | tee "$out/host.log"
python3 benchmarks/bench_cast_kernels.py --threads ${THREADS:-1,8,16} --repeat 5 2>&1 | tee "$out/cast_kernels.log"
python3 benchmarks/bench_castmerge.py --workdir "$work" --layers ${LAYERS:-14} --hidden 2048 --ffn 8192 \
  --vocab 32000 --files 4 --repeat ${REPEAT:-3} --before "$before" --json-out "$out/castmerge.json" 2>&1 \
  | tee "$out/castmerge.log"
src=$(ls -d "$work"/dcp_fp32_L*)
s=$(( $(cat $src/*.distcp | wc -c) / 8 + 1048576 ))
for tree in . "$before"; do for dt in fp32 bf16; do rm -rf "$work/zo"; shard=$([ $dt = bf16 ] && echo $s || echo $((2 * s)))
  PYTHONPATH=$(realpath $tree):/tmp/site /usr/bin/time -f "$tree merge $dt into 5 files: wall %e s, user %U, sys %S" \
    python3 -m zckpt merge "$src" --dtype $dt --max-shard-size ${shard}B -o "$work/zo" -q; done; done 2>&1 \
  | tee "$out/merge_time.log"
