# Seventeenth session, call 3: the first jobs' reads advised before the casts' imports (lanes primes its deal;
# merge's numpy / ml_dtypes imports moved into the lanes' prepare) against before (.bench/before: `git archive
# 64bd9a5 zckpt | tar -x -C .bench/before`), the two trees alternated in each round (probe_cold.py SETTINGS):
# cold ROUNDS_COLD (6) rounds of merge bf16, merge fp32 and convert --to deepspeed with the disk's 16-thread rate
# read each round, then warm ROUNDS_WARM (3). The checkpoint and its DCP made first if the host is fresh.
#   OUT=$OUT bash benchmarks/results/2026-12-07-seventeenth/call2.sh   (carry .whl and .bench)
set -u
S=$SECONDS
export PYC=1
JOBS=merge-bf16,convert-ds REPEAT=0 PROFILE=0 COPIES=pcopy VARIANTS=";" TREES=head=. bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "checkpoint ready at $((SECONDS-S)) s"
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pyc
python3 -m compileall -q .bench/before/zckpt zckpt
ck=/tmp/zbench/z2_bf16_ws4_L26_H2048_V32000_F8192
export SETTINGS="before=PYTHONPATH=$PWD/.bench/before:/tmp/site;primed=PYTHONPATH=$PWD:/tmp/site" READS=16x64
ROUNDS=${ROUNDS_COLD:-6} JOBS=${JOBS_COLD:-merge-bf16,merge-fp32-1GB,convert-ds} \
  python3 benchmarks/results/2026-12-07-bar-host/probe_cold.py $ck $OUT/cold.json 2>&1 | tee $OUT/cold.log | grep -v "^|"
grep "^|" $OUT/cold.log
echo "cold done at $((SECONDS-S)) s"
WARM=1 ROUNDS=${ROUNDS_WARM:-3} JOBS=${JOBS_COLD:-merge-bf16,merge-fp32-1GB,convert-ds} \
  python3 benchmarks/results/2026-12-07-bar-host/probe_cold.py $ck $OUT/warm.json 2>&1 | tee $OUT/warm.log | grep "^|"
echo "done at $((SECONDS-S)) s"
