#!/usr/bin/env bash
# Issue 49 on the lent 16-core host (run from the repo root): bash benchmarks/device_castmeta.sh OUTDIR STEP
# STEP cast: benchmarks/bench_castmerge.py (merge fp32 and bf16 of one ~1B-parameter fp32 DCP checkpoint, into one
# file and into 4, this tree beside .bench/before's, each beside a 16-thread copy and cp -r of its output; the cast
# alone in 1, 8, 16 threads; the merges into 4 files at --workers 4, 8, 16, and with torch imported: its cast);
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
    | tee "$out/castmerge.log"
  python3 benchmarks/bench_cast_threads.py --threads 1,8,16 --mib 256 --before .bench/before 2>&1 \
    | tee "$out/cast_threads.log"
  src=$work/dcp_fp32_L14_H2048_F8192_V32000
  s=$(( $(cat $src/*.distcp | wc -c) / 8 + 1048576 ))  # bf16 into 4 files, as bench_castmerge
  for w in 4 8 16; do for dt in fp32 bf16; do rm -rf "$work/zo"; shard=$([ $dt = bf16 ] && echo $s || echo $((2 * s)))
    /usr/bin/time -f "merge $dt into 4 files, --workers $w: wall %e s, user %U, sys %S" python3 -m zckpt merge \
      "$src" --dtype $dt --max-shard-size ${shard}B --workers $w -o "$work/zo" -q; done; done 2>&1 \
    | tee "$out/merge_workers.log"
  for dt in fp32 bf16; do rm -rf "$work/zo"; shard=$([ $dt = bf16 ] && echo $s || echo $((2 * s)))
    python3 -c "import sys, time, torch; from zckpt.ops.merge import merge; t = time.perf_counter()
merge(sys.argv[1], sys.argv[2], dtype=sys.argv[3], max_shard_size=sys.argv[4] + 'B')
print(f'merge {sys.argv[3]} into 4 files, torch imported (its cast): {time.perf_counter() - t:.2f} s')" \
      "$src" "$work/zo" $dt $shard; done 2>&1 | tee "$out/merge_torch.log" ;; esac
case $step in meta)
  python3 benchmarks/bench_metadata.py --chunks '' --ds-world-sizes '' --info-chunks ${CHUNKS:-100000,1000000} \
    --info-files 64 --keep "$work/meta" --json-out "$out/metadata.json" 2>&1 | tee "$out/metadata.log"
  python3 benchmarks/bench_metadata.py --chunks '' --ds-world-sizes '' --info-chunks ${BEFORE_CHUNKS:-100000} \
    --info-files 64 --keep "$work/meta" --zckpt-root .bench/before --json-out "$out/metadata-before.json" 2>&1 \
    | tee "$out/metadata-before.log" ;; esac
