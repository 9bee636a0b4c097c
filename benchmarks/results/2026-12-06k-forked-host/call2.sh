# the same tree with the fork (fork=.) and without it (nf: this tree's zckpt with ZCKPT_FORK_COPIES defaulting to 0),
# alternated, convert --to deepspeed only, REPEAT runs each, beside a 16-thread copy
set -u
S=$SECONDS
mkdir -p .bench/nf && rm -rf .bench/nf/zckpt && cp -r zckpt .bench/nf/
sed -i 's/"ZCKPT_FORK_COPIES", "1"/"ZCKPT_FORK_COPIES", "0"/' .bench/nf/zckpt/engine/forked.py
grep -n 'FORK_COPIES = ' .bench/nf/zckpt/engine/forked.py zckpt/engine/forked.py
export PYC=1
JOBS=convert-ds COPIES=pcopy REPEAT=${REPEAT:-8} PROFILE=0 VARIANTS=";" TREES=nf=.bench/nf,fork=. \
  bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "done at $((SECONDS-S)) s"
grep -E "^\||run [0-9]" $OUT/w.out
