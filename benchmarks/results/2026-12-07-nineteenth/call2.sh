# Nineteenth session, call 2: is merge fp32's writing (0.31 s against a 12-thread 4 MiB copy's 0.21-0.23, call 1)
# lost to jobs cut off the page grid (every tensor of a safetensors file starts after the header, so every 4 MiB job
# of merge begins and ends inside a page, shared with the next job), to the read hints, to the write slots, or to
# the number of jobs?
# 1. the checkpoint (DeepSpeed, if the host is fresh); every job of bench_copybar beside a 16-thread copy of its output,
#    best of 3, with the jobs cut on the files' grid (this tree) and cut from each tensor's start (ZCKPT_ALIGN_JOBS=0);
#    a merge fp32 output (1 GB shards) as the copies' source;
# 2. probe_writepath.py: 4 and 1 MiB ranges on 12 threads with the CRC, on the page grid and off it (-u);
# 3. timeline_merge.py: merge fp32 with its jobs cut on each file's 4 MiB grid and joined inside a cell (this tree)
#    and cut from each tensor's start (ZCKPT_ALIGN_JOBS=0, as before), without read hints, with 16 write slots a
#    file, with 8 MiB jobs.
#   OUT=$OUT bash benchmarks/results/2026-12-07-nineteenth/call2.sh   (carry .whl)
set -u
S=$SECONDS
export PYC=1
REPEAT=${REPEAT:-3} PROFILE=0 COPIES=pcopy VARIANTS="tensor:ZCKPT_ALIGN_JOBS=0" TREES=grid=. bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
grep -E "^\\|" $OUT/w/warm.log | tail -30
echo "checkpoint ready at $((SECONDS-S)) s"
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pyc
unset PYTHONDONTWRITEBYTECODE
python3 -m compileall -q zckpt
ck=/tmp/zbench/z2_bf16_ws4_L26_H2048_V32000_F8192
[ -d /tmp/zbench/src-fp32 ] || python3 -m zckpt merge $ck --dtype fp32 --max-shard-size 1GB -o /tmp/zbench/src-fp32 -q
echo "source ready at $((SECONDS-S)) s"
python3 benchmarks/probe_writepath.py /tmp/zbench/src-fp32 --work /tmp/zbench/wp --rounds ${PROBE_ROUNDS:-3} \
  --methods ${METHODS:-pcopy4-t12-crc,pcopy4-t12-crc-u,pcopy1-t12-crc,pcopy1-t12-crc-u,pcopy4-u} 2>&1 | tee $OUT/probe-fp32.log
echo "probe done at $((SECONDS-S)) s"
python3 benchmarks/timeline_merge.py bench --ck $ck --work /tmp/zbench/tl --rounds ${TL_ROUNDS:-3} \
  --variants "${TL_VARIANTS:-grid:;tensor:ZCKPT_ALIGN_JOBS=0;hints0:ZCKPT_READ_HINTS=0;streams16:ZCKPT_WRITE_STREAMS=16;chunk8:ZCKPT_CHUNK_KIB=8192}" \
  --copies pcopy4 -- --max-shard-size 1GB 2>&1 | tee $OUT/timeline.log | grep -v "^  marks"
echo "done at $((SECONDS-S)) s"
