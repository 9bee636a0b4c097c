# Nineteenth session, call 3: the grid cuts (this tree) against cuts from each tensor's start (ZCKPT_ALIGN_JOBS=0),
# more runs: call 2 found them 5-8% apart either way, job by job.
# 1. every job of bench_copybar beside a 16-thread copy of its output, best of REPEAT (5), the variant after;
# 2. timeline_merge.py: merge fp32 (1 GB shards) and merge bf16, the two cuts alternated run by run.
#   OUT=$OUT bash benchmarks/results/2026-12-07-nineteenth/call3.sh   (carry .whl)
set -u
S=$SECONDS
export PYC=1
REPEAT=${REPEAT:-5} PROFILE=0 COPIES=pcopy VARIANTS="tensor:ZCKPT_ALIGN_JOBS=0" TREES=grid=. bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
grep -E "^\\|" $OUT/w/warm.log | tail -30
echo "copybar done at $((SECONDS-S)) s"
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pyc
unset PYTHONDONTWRITEBYTECODE
ck=/tmp/zbench/z2_bf16_ws4_L26_H2048_V32000_F8192
python3 benchmarks/timeline_merge.py bench --ck $ck --work /tmp/zbench/tl --rounds ${TL_ROUNDS:-6} \
  --variants "grid:;tensor:ZCKPT_ALIGN_JOBS=0" --copies pcopy4 -- --max-shard-size 1GB 2>&1 | tee $OUT/timeline.log | grep -v "^  marks\|^  copies"
python3 benchmarks/timeline_merge.py bench --ck $ck --work /tmp/zbench/tlb --rounds ${TL_BF16_ROUNDS:-4} \
  --variants "grid:;tensor:ZCKPT_ALIGN_JOBS=0" --copies pcopy4 -- --dtype bf16 2>&1 | tee $OUT/timeline-bf16.log | grep -v "^  marks\|^  copies"
echo "done at $((SECONDS-S)) s"
