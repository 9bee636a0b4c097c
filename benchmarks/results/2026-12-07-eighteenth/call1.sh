# Eighteenth session, call 1: where merge fp32's time goes on the lent host, and which write path beats a copy's.
# 1. the checkpoint (made by DeepSpeed if the host is fresh); merge fp32 (1 GB shards) and merge bf16 outputs kept
#    as the probe's sources;
# 2. benchmarks/probe_writepath.py on each: pread + pwrite (64 MiB, 4 MiB ranges), the output's pages put in the page
#    cache first (WILLNEED), pwrite from a map of the source, no fallocate; 16 threads;
# 3. benchmarks/timeline_merge.py: merge fp32's timeline (its fixed costs step by step) beside pcopy and pcopy4,
#    variants base (.bench/before: `git archive f89712f zckpt`), sbs (this tree: large files allocated side by side),
#    prefill (sbs + ZCKPT_OUT_PREFILL=1: the output's pages put in the page cache before each pwrite), nofa (sbs +
#    ZCKPT_FALLOCATE=0); then merge bf16's, sbs and prefill.
#   (carry .whl and .bench)
#   OUT=$OUT bash benchmarks/results/2026-12-07-eighteenth/call1.sh
set -u
S=$SECONDS
export PYC=1
JOBS=merge-fp32-1GB REPEAT=0 PROFILE=0 COPIES=pcopy VARIANTS=";" TREES=head=. bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "checkpoint ready at $((SECONDS-S)) s"
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pyc
unset PYTHONDONTWRITEBYTECODE
python3 -m compileall -q zckpt .bench/before/zckpt
ck=/tmp/zbench/z2_bf16_ws4_L26_H2048_V32000_F8192
for d in fp32 bf16; do
  [ -d /tmp/zbench/src-$d ] || python3 -m zckpt merge $ck --dtype $d $([ $d = fp32 ] && echo --max-shard-size 1GB) -o /tmp/zbench/src-$d -q
done
ls -la /tmp/zbench/src-fp32 /tmp/zbench/src-bf16; grep . /sys/block/*/queue/read_ahead_kb /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null
echo "sources ready at $((SECONDS-S)) s"
python3 benchmarks/probe_writepath.py /tmp/zbench/src-fp32 --work /tmp/zbench/wp --rounds ${PROBE_ROUNDS:-3} --methods pcopy,pcopy4,hint,srcmap,nofalloc 2>&1 | tee $OUT/probe-fp32.log
echo "probe fp32 done at $((SECONDS-S)) s"
[ "${PROBE_BF16:-1}" = 0 ] || python3 benchmarks/probe_writepath.py /tmp/zbench/src-bf16 --work /tmp/zbench/wp --rounds ${PROBE_ROUNDS:-3} --methods pcopy,pcopy4,hint,srcmap,nofalloc 2>&1 | tee $OUT/probe-bf16.log
echo "probe bf16 done at $((SECONDS-S)) s"
python3 benchmarks/timeline_merge.py bench --ck $ck --work /tmp/zbench/tl --rounds ${TL_ROUNDS:-4} \
  --variants "base:PYTHONPATH=/tmp/site:$PWD/.bench/before;sbs:;prefill:ZCKPT_OUT_PREFILL=1;nofa:ZCKPT_FALLOCATE=0" --copies pcopy,pcopy4 \
  -- --max-shard-size 1GB 2>&1 | tee $OUT/timeline.log | grep -v "^  marks"
echo "timeline fp32 done at $((SECONDS-S)) s"
python3 benchmarks/timeline_merge.py bench --ck $ck --work /tmp/zbench/tl --rounds ${TL_BF16_ROUNDS:-4} \
  --variants "base:;prefill:ZCKPT_OUT_PREFILL=1" --copies pcopy -- --dtype bf16 2>&1 \
  | tee $OUT/timeline-bf16.log | grep -v "^  marks"
echo "done at $((SECONDS-S)) s"
