# threads of each side: nf (no fork), fork (12 + 12, the default), p4 (this process 4 threads for its casts, the
# child 12), p4c16 (4 + 16); trees are copies of this zckpt with the defaults changed; alternated, REPEAT runs each
set -u
S=$SECONDS
mk() { mkdir -p .bench/$1 && rm -rf .bench/$1/zckpt && cp -r zckpt .bench/$1/; }
mk nf; sed -i 's/"ZCKPT_FORK_COPIES", "1"/"ZCKPT_FORK_COPIES", "0"/' .bench/nf/zckpt/engine/forked.py
mk p4; sed -i 's/"ZCKPT_FORK_PARENT_WORKERS", "0"/"ZCKPT_FORK_PARENT_WORKERS", "4"/' .bench/p4/zckpt/engine/forked.py
mk p4c16; sed -i 's/"ZCKPT_FORK_PARENT_WORKERS", "0"/"ZCKPT_FORK_PARENT_WORKERS", "4"/; s/"ZCKPT_FORK_CHILD_WORKERS", "0"/"ZCKPT_FORK_CHILD_WORKERS", "16"/' .bench/p4c16/zckpt/engine/forked.py
grep -n 'environ.get("ZCKPT_FORK' .bench/*/zckpt/engine/forked.py
export PYC=1
JOBS=convert-ds COPIES=pcopy REPEAT=${REPEAT:-6} PROFILE=0 VARIANTS=";" TREES=nf=.bench/nf,fork=.,p4=.bench/p4,p4c16=.bench/p4c16 \
  bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "done at $((SECONDS-S)) s"
grep -E "^\||run [0-9]" $OUT/w.out
