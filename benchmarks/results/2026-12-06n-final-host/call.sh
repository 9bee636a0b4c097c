# item 3 at the session's end, on the lease of 2026-12-06m's call 2 (the checkpoint and its DCP already in
# /tmp/zbench): every job, the tree TREE (default: this one), REPEAT runs each beside a 16-thread copy, page cache
# warm; then convert --to deepspeed cold beside a 16-thread read of its source
set -u
S=$SECONDS
export PYC=1
JOBS=merge-fp32-1GB,merge-bf16,reshard-ws8,convert-dcp,convert-ds COPIES=pcopy REPEAT=${REPEAT:-3} PROFILE=0 VARIANTS=";" \
  TREES=head=${TREE:-.} bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "warm done at $((SECONDS-S)) s"
grep -E "^\|" $OUT/w.out | cut -c1-400
grep -E "convert-ds .* run" $OUT/w.out
MOE=0 JOBS=convert-ds TREES=head=${TREE:-.} bash benchmarks/device_copybar.sh $OUT/c cold > $OUT/c.out 2>&1
echo "cold done at $((SECONDS-S)) s"
grep -E "^\|" $OUT/c.out
