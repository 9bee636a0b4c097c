# The default path alone after the caster's removal: convert --to deepspeed, best of 3, beside a 16-thread pcopy
# (what fits the session's last device time; call2.sh, every job, did not).
set -u
S=$SECONDS
export PYC=1
JOBS=convert-ds COPIES=pcopy REPEAT=${REPEAT:-3} PROFILE=0 VARIANTS=";" TREES=head=. \
  bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "bar done at $((SECONDS-S)) s"
grep -E "convert-ds|^\|" $OUT/w.out | tail -8
