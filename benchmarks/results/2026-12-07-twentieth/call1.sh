# Twentieth session, call 1: does the way the masters' files came into the page cache change the warm jobs' times?
# 1. the 1.05B ZeRO-2 checkpoint made by DeepSpeed (device_copybar.sh warm, no runs);
# 2. probe_pagecache.py: one thread's reads of the optimizer files as DeepSpeed left them, against copies of them
#    written with 64 MiB writes; then how one of them reads after each way of filling it (--loads, 16 threads);
# 3. probe_fill.py: merge fp32 (1 GB shards) and merge bf16 warm, beside pcopy and rwcopy, after each fill of the
#    source (as written; zckpt cold with read hints; with ZCKPT_READ_HINTS=read; one thread in order); after
#    'written', both merges cold with ZCKPT_READ_HINTS=1, 0 and read in turn (3 rounds).
#   OUT=$OUT bash benchmarks/results/2026-12-07-twentieth/call1.sh   (carry .whl)
# ZCKPT_READ_HINTS=read (and the fill zcold-ahead) was an experiment in zckpt/engine/readahead.py at 30bbd79, reverted
# after this call (no gain); at later commits run it with FILLS=written,zcold,seq1 COLD_AB=1,0.
set -u
S=$SECONDS
export PYC=1
JOBS=merge-fp32-1GB REPEAT=0 PROFILE=0 COPIES=pcopy VARIANTS=";" TREES=head=. bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "checkpoint ready at $((SECONDS-S)) s"; tail -3 $OUT/w.out
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pyc
unset PYTHONDONTWRITEBYTECODE
ck=/tmp/zbench/z2_bf16_ws4_L26_H2048_V32000_F8192
python3 benchmarks/probe_pagecache.py $ck/global_step*/*optim_states.pt --work /tmp/zbench/ppc --rounds 2 2>&1 | tee $OUT/pagecache.log
o0=$(ls $ck/global_step*/*optim_states.pt | head -1)
python3 benchmarks/probe_pagecache.py $o0 --loads --threads 16 --rounds 1 2>&1 | tee $OUT/loads.log
echo "probe_pagecache done at $((SECONDS-S)) s"
timeout $(( ${LIMIT:-570} - (SECONDS-S) )) python3 benchmarks/probe_fill.py --ckpt $ck --workdir /tmp/zbench \
  --jobs merge-fp32-1GB,merge-bf16 --fills ${FILLS:-written,zcold,zcold-ahead,seq1} --repeat ${FILL_REPEAT:-2} \
  --cold-ab ${COLD_AB:-1,0,read} --cold-rounds ${COLD_ROUNDS:-3} \
  --json-out $OUT/fill.json 2>&1 | tee $OUT/fill.log
echo "done at $((SECONDS-S)) s"
