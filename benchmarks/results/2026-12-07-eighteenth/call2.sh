# Eighteenth session, call 2: why merge fp32 writes at the pace of a 64 MiB-range copy and not of a 4 MiB one
# (call 1: pcopy4 0.25 s against pcopy 0.33 s; merge's writing 0.345 s).
# 1. the checkpoint (made by DeepSpeed if the host is fresh); a merge fp32 output (1 GB shards) as the source;
# 2. probe_writepath.py: 64, 4, 2 and 1 MiB ranges; 4 MiB on 12 threads; 4 MiB with each range's CRC-32 (isal);
# 3. timeline_merge.py: merge fp32 of the tree before (.bench/before: `git archive 296ba61 zckpt`) and of this one (the
#    pool's threads woken at once at its end, an entry's spans that tile it chained directly), this one with
#    --workers 16, with 2 MiB jobs (ZCKPT_CHUNK_KIB=2048), with 2 MiB jobs on 16 workers; beside pcopy and pcopy4.
#   OUT=$OUT bash benchmarks/results/2026-12-07-eighteenth/call2.sh   (carry .whl and .bench)
set -u
S=$SECONDS
export PYC=1
JOBS=merge-fp32-1GB REPEAT=0 PROFILE=0 COPIES=pcopy VARIANTS=";" TREES=head=. bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "checkpoint ready at $((SECONDS-S)) s"
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pyc
unset PYTHONDONTWRITEBYTECODE
python3 -m compileall -q zckpt .bench/before/zckpt
ck=/tmp/zbench/z2_bf16_ws4_L26_H2048_V32000_F8192
[ -d /tmp/zbench/src-fp32 ] || python3 -m zckpt merge $ck --dtype fp32 --max-shard-size 1GB -o /tmp/zbench/src-fp32 -q
echo "source ready at $((SECONDS-S)) s"
python3 benchmarks/probe_writepath.py /tmp/zbench/src-fp32 --work /tmp/zbench/wp --rounds ${PROBE_ROUNDS:-2} \
  --methods ${METHODS:-pcopy,pcopy4,pcopy4-t12,pcopy4-crc,pcopy4-t12-crc,pcopy2,pcopy1} 2>&1 | tee $OUT/probe-fp32.log
echo "probe done at $((SECONDS-S)) s"
python3 benchmarks/timeline_merge.py bench --ck $ck --work /tmp/zbench/tl --rounds ${TL_ROUNDS:-3} \
  --variants "${TL_VARIANTS:-before:PYTHONPATH=/tmp/site:$PWD/.bench/before;now:;w16:|--workers 16;chunk2:ZCKPT_CHUNK_KIB=2048;chunk2w16:ZCKPT_CHUNK_KIB=2048|--workers 16}" \
  --copies pcopy,pcopy4 -- --max-shard-size 1GB 2>&1 | tee $OUT/timeline.log | grep -v "^  marks"
echo "done at $((SECONDS-S)) s"
