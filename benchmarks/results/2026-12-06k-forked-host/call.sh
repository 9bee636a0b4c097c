# issue 49 item 3 on the lent host: convert --to deepspeed with its copies forked (head, the default) against the
# same tree with ZCKPT_FORK_COPIES=0 and against .bench/old (git archive eeaf477 zckpt: d02ae80's code, one
# process), beside a 16-thread copy, best of REPEAT, page cache warm; then convert --to dcp and merge bf16 (no fork
# expected: no copy-only file / every file cast) head against old; then phases of convert --to deepspeed.
set -u
S=$SECONDS
export PYC=1
JOBS=convert-ds COPIES=pcopy REPEAT=${REPEAT:-5} PROFILE=0 VARIANTS="nofork:ZCKPT_FORK_COPIES=0" TREES=old=.bench/old,head=. \
  bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "warm convert-ds done at $((SECONDS-S)) s"
grep -E "^\||variant|run [0-9]" $OUT/w.out
JOBS=convert-dcp,merge-bf16 COPIES=pcopy REPEAT=3 PROFILE=0 VARIANTS=";" TREES=old=.bench/old,head=. \
  bash benchmarks/device_copybar.sh $OUT/w2 warm > $OUT/w2.out 2>&1
echo "warm others done at $((SECONDS-S)) s"
grep -E "^\|" $OUT/w2.out
