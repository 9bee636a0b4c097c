# Sixteenth session, call 5: read-ahead hints (ZCKPT_READ_HINTS=1) against none, warm (every job, ROUNDS_WARM
# rounds) then cold (JOBS_COLD, ROUNDS_COLD rounds, with the disk's rate read each round), one tree, the settings
# alternated. The checkpoint and its DCP made first if the host is fresh.
#   OUT=$OUT bash benchmarks/results/2026-12-07-bar-host/call5.sh   (carry .whl)
set -u
S=$SECONDS
export PYC=1
JOBS=merge-bf16,convert-ds REPEAT=0 PROFILE=0 COPIES=pcopy VARIANTS=";" TREES=head=. bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "checkpoint ready at $((SECONDS-S)) s"
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pyc
ck=/tmp/zbench/z2_bf16_ws4_L26_H2048_V32000_F8192
WARM=1 ROUNDS=${ROUNDS_WARM:-3} JOBS=convert-ds,merge-fp32-1GB,merge-bf16,reshard-ws8,convert-dcp \
  python3 benchmarks/results/2026-12-07-bar-host/probe_cold.py $ck $OUT/warm.json 2>&1 | tee $OUT/warm.log | grep "^|"
echo "warm done at $((SECONDS-S)) s"
ROUNDS=${ROUNDS_COLD:-2} JOBS=${JOBS_COLD:-merge-bf16,merge-fp32-1GB,convert-dcp} \
  python3 benchmarks/results/2026-12-07-bar-host/probe_cold.py $ck $OUT/cold.json 2>&1 | tee $OUT/cold.log | grep -v "^|"
grep "^|" $OUT/cold.log
echo "done at $((SECONDS-S)) s"
