#!/usr/bin/env bash
# Issue 49 item 3 and issue 47 item 5 on the lent 16-core host (run from the repo root), one device call per step:
#   bash benchmarks/device_copybar.sh OUTDIR warm    # the 1.05B ZeRO-2 checkpoint (made by DeepSpeed if missing),
#        every job beside a 16-thread copy of its output, cp -r and copy_file_range, best of REPEAT, each tree of
#        TREES; the --workers 16 variant; then benchmarks/profile_lanes.py of each job in each tree
#   bash benchmarks/device_copybar.sh OUTDIR cold    # each job (COLD_ROUNDS times, default once) with the page cache
#        dropped, beside a 16-thread read of its source; then the ~1B native-MoE checkpoint (DeepSpeed, ep 2, 4 ranks) and
#        zckpt reshard --ep 4 -w 8 beside a copy of its output, peak RSS (benchmarks/bench_moe_ep.py)
#   bash benchmarks/device_copybar.sh OUTDIR meta    # issue 49 item 1: zckpt info of a DCP folder and of a
#        Megatron-Core save of META_CHUNKS chunks (default 100000,1000000) against pickle.load of each .metadata
#        (benchmarks/bench_metadata.py; the Megatron cases only where megatron-core imports: carry its cp312 wheel
#        in .whl/, `pip download megatron-core --no-deps --only-binary=:all: --python-version 3.12 -d .whl`)
#   bash benchmarks/device_copybar.sh OUTDIR phases  # each job of JOBS, its writing threads by phase (profile_lanes.py
#        --phases: reads, crc32, casts, pwrite; no cProfile), PHASE_RUNS (2) times, the trees of TREES alternated
#   bash benchmarks/device_copybar.sh OUTDIR moe     # the MoE part alone (MAX_GROUP: DeepSpeed's max_group_size),
#        then merge --dtype bf16 of it profiled with and without bytecode for numpy (PYTHONPYCACHEPREFIX)
# Variants of the warm step: w16 (--workers 16), pyc (bytecode cached in /tmp/pyc: the image's numpy may have none,
# and PYTHONDONTWRITEBYTECODE=1 here; its first run writes it). PROFILE=0: no profiles. PYC=1: every run with the
# bytecode cache (/tmp/pyc). MOE=0: the cold step without the MoE checkpoint. COPIES (pcopy,cfr,cp): which copies the
# warm step runs beside zckpt (COPIES=pcopy saves a third of a visit's time).
# .whl/ (made by benchmarks/device_wheels.sh): cp312 wheels of deepspeed 0.19.8 (py3-none-any) and what the host lacks (isal, hjson, pydantic,
# pydantic-core, annotated-types, typing-inspection, typing-extensions); ml_dtypes as pip serves it (0.7.0 on
# 2026-12-05: the runs use it, not the image's; host.log gives both versions and their import times). TREES (default
# before=.bench/before,fix=.bench/fix): `git archive OLD zckpt | tar -x -C .bench/before`, and the same with the
# change. Raw logs under OUTDIR, tarred by the caller.
set -euo pipefail
out=${1:?outdir}
step=${2:?warm or cold}
if ! python3 -c "import deepspeed, isal" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if [ "${PYC:-0}" = 1 ]; then  # bytecode kept in /tmp/pyc for every run (a pip-installed numpy has its own; the
  export PYTHONPYCACHEPREFIX=/tmp/pyc; unset PYTHONDONTWRITEBYTECODE  # image's has none), written once here
  python3 -c "import numpy, ml_dtypes, isal, safetensors, zckpt.cli" 2>/dev/null || true; fi
work=${WORK:-/tmp/zbench}
trees=${TREES:-before=.bench/before,fix=.bench/fix}
mkdir -p "$work" "$out"
{ date -u; nproc; free -g | head -2; uname -r; df -hT /tmp | tail -1; grep -m1 "model name" /proc/cpuinfo
  cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || true
  sysctl vm.dirty_ratio vm.dirty_background_ratio 2>/dev/null || true
  python3 -c "import sys, torch, deepspeed, numpy; print(sys.version.split()[0], torch.__version__, deepspeed.__version__, numpy.__version__)"
  git log --oneline -1 2>/dev/null || true
  python3 -c "import numpy, os; d = os.path.join(os.path.dirname(numpy.__file__), '__pycache__'); print('numpy', numpy.__file__, 'pycache', os.path.isdir(d) and len(os.listdir(d)))"
  for i in 1 2; do /usr/bin/time -f "python3 -c 'import numpy': %e s" python3 -c "import numpy"; done
  for i in 1 2 3; do for v in unset 1; do env $([ $v = 1 ] && echo OPENBLAS_NUM_THREADS=1) python3 -c "import time
t = time.perf_counter(); import numpy; print('import numpy, OPENBLAS_NUM_THREADS=$v: %.4f s' % (time.perf_counter() - t))"
  done; done
  python3 -c "import ml_dtypes; print('ml_dtypes (the runs):', ml_dtypes.__version__, ml_dtypes.__file__)" || true
  for i in 1 2; do /usr/bin/time -f "import numpy, ml_dtypes: %e s" python3 -c "import numpy, ml_dtypes"; done || true
  PYTHONPATH= python3 -c "import ml_dtypes; print('the image ml_dtypes:', ml_dtypes.__version__)" || true
  PYTHONPATH= /usr/bin/time -f "the image: import numpy, ml_dtypes: %e s" python3 -c "import numpy, ml_dtypes" || true
  python3 -X importtime -c "import numpy" 2>&1 | sort -t'|' -k2 -n | tail -2; } 2>&1 | tee -a "$out/host.log"
dims=(${DIMS:---layers 26 --hidden 2048 --ffn 8192 --world-size 4})  # DIMS, CK, MOE_ARGS: smaller for a smoke test
ck=${CK:-$work/z2_bf16_ws4_L26_H2048_V32000_F8192}
names=(merge-fp32-1GB merge-bf16 reshard-ws8 convert-dcp convert-ds)  # bench_copybar's names of profiled's jobs
profiled=("merge $ck --dtype fp32 --max-shard-size 1GB" "merge $ck --dtype bf16" "reshard $ck -w 8"
          "convert $ck --to dcp" "convert $ck-dcp --to deepspeed -w 4 --stage 2 --dtype bf16 --buffers scale,idx")
case $step in warm)
  python3 benchmarks/bench_copybar.py --workdir "$work" "${dims[@]}" --repeat ${REPEAT:-3} --trees "$trees" --copies ${COPIES:-pcopy,cfr,cp} \
    --jobs ${JOBS:-merge-fp32-1GB,merge-bf16,reshard-ws8,convert-dcp,convert-ds} \
    --variants "${VARIANTS:-w16:|--workers 16;pyc:PYTHONPYCACHEPREFIX=/tmp/pyc,PYTHONDONTWRITEBYTECODE=}" --json-out "$out/warm.json" 2>&1 | tee "$out/warm.log"
  [ "${PROFILE:-1}" = 1 ] || trees=
  mkdir -p "$work/prof"
  for t in ${trees//,/ }; do name=${t%%=*}; dir=${t#*=}; k=0
    for job in "${profiled[@]}"; do
      rm -rf "$work/prof-out"; sync; k=$((k + 1)); echo "== $name: zckpt $job"
      PYTHONPATH=/tmp/site:$dir python3 benchmarks/profile_lanes.py --json-out "$work/prof/$name-$k.json" \
        -- $job -o "$work/prof-out" -q || echo "profile failed: $name $job"
    done; done 2>&1 | tee "$out/profile.log"
  rm -rf "$work/prof-out"; tar -czf "$out/prof.tgz" -C "$work" prof ;; esac
case $step in phases)  # where each job's writing threads spend their time (profile_lanes.py --phases, no cProfile),
  # PHASE_RUNS times each, on the checkpoint and its DCP (made here if missing: one warm run of each job first)
  python3 benchmarks/bench_copybar.py --workdir "$work" "${dims[@]}" --repeat 1 --trees "${trees%%,*}" \
    --jobs ${JOBS:-merge-fp32-1GB,merge-bf16,reshard-ws8,convert-dcp,convert-ds} --variants ";" \
    --json-out "$out/warm1.json" 2>&1 | tee "$out/warm1.log"
  mkdir -p "$work/prof"; k=0
  for job in "${profiled[@]}"; do k=$((k + 1))  # the jobs of JOBS only; the trees alternated run by run
    [[ ",${JOBS:-${names[*]// /,}}," == *",${names[$((k - 1))]},"* ]] || continue
    tl=(${trees//,/ })
    for r in $(seq ${PHASE_RUNS:-2}); do  # each run starts one tree further on (no tree always in one place)
      for t in "${tl[@]:$(( (r - 1) % ${#tl[@]} ))}" "${tl[@]:0:$(( (r - 1) % ${#tl[@]} ))}"; do name=${t%%=*}; dir=${t#*=}
        rm -rf "$work/prof-out"; sync; echo "== $name run $r: zckpt $job"
        PYTHONPATH=/tmp/site:$dir python3 benchmarks/profile_lanes.py --phases \
          --json-out "$work/prof/phases-$name-$k-$r.json" -- $job -o "$work/prof-out" -q || echo "failed: $job"
      done; done; done 2>&1 | tee "$out/phases.log"
  rm -rf "$work/prof-out"; tar -czf "$out/phases.tgz" -C "$work" prof ;; esac
case $step in moe)  # the MoE step alone: DeepSpeed's helper with max_group_size MAX_GROUP (one param group per
  # expert group: zckpt refuses DeepSpeed's default split, see docs/benchmarks.md), then the bf16 merge's first
  # casts profiled with and without numpy's bytecode
  python3 benchmarks/bench_moe_ep.py --workdir "$work" ${MOE_ARGS:-} --repeat ${MOE_REPEAT:-3} --trees "$trees" \
    --max-group-size ${MAX_GROUP:-1e10} --json-out "$out/moe.json" 2>&1 \
    | grep --line-buffered -v -E "^\[rank[0-9]\]:(\[W|  warnings|/)|UserWarning" | tee "$out/moe.log"
  mck=$(ls -d "$work"/moe_z2_* | head -1); fix=${trees##*=}; mkdir -p "$work/prof"
  for v in dontwrite pycwrite pyc; do rm -rf "$work/prof-out"; sync; echo "== $v: zckpt merge $mck --dtype bf16 --max-shard-size 1GB"
    env $([ $v != dontwrite ] && echo PYTHONPYCACHEPREFIX=/tmp/pyc) $([ $v = pycwrite ] && echo PYTHONDONTWRITEBYTECODE=) \
      PYTHONPATH=/tmp/site:$fix python3 benchmarks/profile_lanes.py --json-out "$work/prof/moe-merge-bf16-$v.json" \
      -- merge "$mck" --dtype bf16 --max-shard-size 1GB -o "$work/prof-out" -q | head -4
  done 2>&1 | tee "$out/moe-profile.log"
  rm -rf "$work/prof-out"; tar -czf "$out/prof.tgz" -C "$work" prof ;; esac
case $step in meta)
  chunks=${META_CHUNKS:-100000,1000000}
  mcore=; python3 -c "import megatron.core" 2>/dev/null && mcore="--megatron-chunks $chunks" \
    || echo "megatron-core does not import here: the Megatron cases are left out" | tee -a "$out/host.log"
  python3 benchmarks/bench_metadata.py --chunks '' --ds-world-sizes '' --info-chunks "$chunks" --info-files 64 \
    $mcore --json-out "$out/meta.json" 2>&1 | grep --line-buffered -v -E "UserWarning|warnings.warn" | tee "$out/meta.log" ;; esac
case $step in cold)
  python3 benchmarks/bench_copybar.py --workdir "$work" "${dims[@]}" --repeat 0 --trees "$trees" ${COLD---cold} \
    ${COLD_ROUNDS:+--cold-rounds $COLD_ROUNDS} --jobs ${JOBS:-merge-fp32-1GB,merge-bf16,reshard-ws8,convert-dcp,convert-ds} --json-out "$out/cold.json" 2>&1 \
    | tee "$out/cold.log"
  rm -rf "$work"/*-dcp "$work/cb-out" "$work/cb-copy"
  df -h /tmp | tail -1 | tee -a "$out/host.log"
  [ "${MOE:-1}" = 1 ] || exit 0  # DeepSpeed's default max_group_size unless MAX_GROUP
  python3 benchmarks/bench_moe_ep.py --workdir "$work" ${MOE_ARGS:-} --repeat ${MOE_REPEAT:-3} --trees "$trees" \
    ${MAX_GROUP:+--max-group-size $MAX_GROUP} --json-out "$out/moe.json" 2>&1 \
    | grep --line-buffered -v -E "^\[rank[0-9]\]:(\[W|  warnings|/)|UserWarning" | tee "$out/moe.log" ;; esac
