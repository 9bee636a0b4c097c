#!/usr/bin/env bash
# The copy-limit benchmark on the lent 16-core host, one visit per step (run from the repo root). Usage:
#   bash benchmarks/device_copylimit.sh OUTDIR [STEP]
# STEP: merge (merge fp32 into one 3.8 GB file and into 1 GB shards), state (reshard 4 -> 8 and convert --to dcp),
# resume (zckpt.deepspeed.load_checkpoint 4 -> 6 ranks beside DeepSpeed's own load, the tree before and the
# 4 KiB-page variant), probe (the host's raw pread + CRC + pwrite and copy_file_range limits by processes x
# threads x files: benchmarks/probe_io.py), crc, or all. Environment: PROCS, REPEAT, PEERS= (no peers),
# PROBE_GB, PROBE_REPEAT, PROBE_CONFIGS (P:T:F[:MiB[:crc[:prealloc]]],...: every run), RESUME_WORKERS, BEFORE,
# WORK, MERGE_CASES / STATE_CASES (the cases of a step).
# .whl/: wheels of deepspeed 0.19.8 and the small packages the host lacks (isal, zlib-ng, hjson, pydantic,
# pydantic-core, annotated-types, typing-inspection, typing-extensions, py-cpuinfo, msgpack, ninja, psutil, einops;
# cp312 manylinux: `pip download --no-deps --python-version 3.12 --only-binary=:all: ...`, deepspeed built with
# `DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation deepspeed==0.19.8`). .bench/before/zckpt: the tree
# before a change (`git archive OLD zckpt | tar -x -C .bench/before`), run beside this one at P = 1.
# The merge and state steps make a ~1.05B-parameter ZeRO-2 bf16 checkpoint of 4 ranks with real DeepSpeed on CPU
# ranks (13.2 GB, cached in $WORK while the machine stays up), then run benchmarks/bench_copylimit.py: zckpt at
# P = 1, 2, 4, 8 (torchrun) beside cp -r of each output, outputs compared with P = 1's, DeepSpeed's own merge and its
# consolidation + dcp.save on the same files (--peers), peak RSS of every command.
set -euo pipefail
out=${1:?outdir}
step=${2:-all}
if ! python3 -c "import deepspeed, isal, zlib_ng" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1
work=${WORK:-/tmp/zbench}
mkdir -p "$work" "$out"
{ date -u; nproc; free -g | head -2; uname -r; df -hT /tmp | tail -1
  cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || true
  python3 -c "import sys, torch, deepspeed; print(sys.version.split()[0], torch.__version__, deepspeed.__version__)"
  echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE-unset}"
  git log --oneline -1 2>/dev/null || true; } 2>&1 | tee -a "$out/host.log"
before=()
[ -d "${BEFORE:-.bench/before}/zckpt" ] && before=(--before "${BEFORE:-.bench/before}")
copylimit() {  # $1: name of the run, $2: cases
  python3 benchmarks/bench_copylimit.py --workdir "$work" --layers 26 --hidden 2048 --ffn 8192 --world-size 4 \
    --procs ${PROCS:-1,2,4,8} --repeat ${REPEAT:-2} --cases "$2" ${PEERS---peers} "${before[@]}" \
    --json-out "$out/copylimit-$1.json" 2>&1 | tee "$out/copylimit-$1.log"
}
case $step in all|probe)
  { mount | grep -E " / | /tmp " || true; grep -m1 "model name" /proc/cpuinfo; } 2>&1 | tee -a "$out/host.log"
  python3 benchmarks/probe_io.py --dir "$work/probe" --gb ${PROBE_GB:-4} --repeat ${PROBE_REPEAT:-2} \
    ${PROBE_CONFIGS:+--configs "$PROBE_CONFIGS" --all-runs} 2>&1 | tee "$out/probe.jsonl"
  rm -rf "$work/probe" ;; esac
case $step in all|crc) python3 benchmarks/bench_crc.py --threads 1,8,16 2>&1 | tee "$out/crc.log" ;; esac
case $step in all|merge) copylimit merge ${MERGE_CASES:-merge-fp32,merge-fp32-1GB} ;; esac
case $step in all|state) copylimit state ${STATE_CASES:-reshard-ws8,convert-dcp} ;; esac
case $step in all|resume)
  python3 benchmarks/bench_resume.py --workdir "$work/resume" --layers 16 --hidden 1024 --ffn 4096 --vocab 32000 \
    --source-ws 4 --world-size 6 --repeat ${REPEAT:-2} --zckpt-workers ${RESUME_WORKERS:-0,2,4} "${before[@]}" \
    --env-route 4k:ZCKPT_HUGEPAGES=0 \
    --json-out "$out/resume.json" 2>&1 | tee "$out/resume.log" ;; esac
