# Nineteenth session, call 5: do the masters' files as DeepSpeed wrote them read slower from the page cache than copies
# of them written with 64 MiB writes (the 2-core box: 13-15 against 22-23 GB/s, one thread)?
#   OUT=$OUT bash benchmarks/results/2026-12-07-nineteenth/call5.sh   (carry .whl)
set -u
S=$SECONDS
JOBS=merge-fp32-1GB REPEAT=0 PROFILE=0 COPIES=pcopy VARIANTS=";" TREES=head=. bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "checkpoint ready at $((SECONDS-S)) s"
ck=/tmp/zbench/z2_bf16_ws4_L26_H2048_V32000_F8192
python3 benchmarks/probe_pagecache.py $ck/global_step*/*optim_states.pt --work /tmp/zbench/ppc --rounds 3 2>&1 | tee $OUT/pagecache.log
echo "done at $((SECONDS-S)) s"
