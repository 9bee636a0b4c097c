# call 6: call4.sh again, a fresh lease after the final call (benchmarks/results/2026-12-06l-final-host)
# the default now (head: the child 12 threads, this process 4) against no fork (nf: this tree's zckpt with
# ZCKPT_FORK_COPIES defaulting to 0), alternated, REPEAT runs each, convert --to deepspeed beside a 16-thread copy
set -u
S=$SECONDS
mkdir -p .bench/nf && rm -rf .bench/nf/zckpt && cp -r zckpt .bench/nf/
sed -i 's/"ZCKPT_FORK_COPIES", "1"/"ZCKPT_FORK_COPIES", "0"/' .bench/nf/zckpt/engine/forked.py
grep -n 'FORK_COPIES = ' .bench/nf/zckpt/engine/forked.py zckpt/engine/forked.py
export PYC=1
JOBS=convert-ds COPIES=pcopy REPEAT=${REPEAT:-10} PROFILE=0 VARIANTS=";" TREES=nf=.bench/nf,head=. \
  bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "done at $((SECONDS-S)) s"
grep -E "^\||run [0-9]" $OUT/w.out
