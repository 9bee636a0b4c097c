# item 3 at the session's end: every job, head (this tree) against .bench/old (git archive eeaf477 zckpt: d02ae80's
# code), beside a 16-thread copy, best of REPEAT, page cache warm; the fork confirmed on this host (-vv); then
# convert --to deepspeed cold (head) beside a 16-thread read of its source
set -u
S=$SECONDS
export PYC=1
JOBS=merge-fp32-1GB,merge-bf16,reshard-ws8,convert-dcp,convert-ds COPIES=pcopy REPEAT=${REPEAT:-3} PROFILE=0 VARIANTS=";" \
  TREES=old=.bench/old,head=. bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "warm done at $((SECONDS-S)) s"
grep -E "^\|" $OUT/w.out
CK=/tmp/zbench/z2_bf16_ws4_L26_H2048_V32000_F8192
rm -rf /tmp/fk; PYTHONPATH=/tmp/site:$PWD python3 -m zckpt convert $CK-dcp --to deepspeed -w 4 --stage 2 --dtype bf16 \
  --buffers scale,idx -o /tmp/fk -vv 2>&1 | grep -E "forked|casts' imports|wrote" | head -8; rm -rf /tmp/fk
MOE=0 JOBS=convert-ds TREES=head=. bash benchmarks/device_copybar.sh $OUT/c cold > $OUT/c.out 2>&1
echo "cold done at $((SECONDS-S)) s"
grep -E "^\|" $OUT/c.out
