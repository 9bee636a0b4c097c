# item 3 on the lent host after this session's changes: convert --to deepspeed and --to dcp, head (this tree) against
# .bench/old (git archive eeaf477 zckpt: d02ae80's code), beside a 16-thread copy, best of 3, page cache warm
set -u
S=$SECONDS
export PYC=1
JOBS=convert-ds,convert-dcp,merge-fp32-1GB COPIES=pcopy REPEAT=3 PROFILE=0 VARIANTS=";" TREES=head=.,old=.bench/old \
  bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "warm done at $((SECONDS-S)) s"
grep -E "^\|" $OUT/w.out
