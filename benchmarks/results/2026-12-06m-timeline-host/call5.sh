# the session's final code, convert --to deepspeed only (the device budget left: about 320 s), best of 3 beside
# a 16-thread pcopy, as device_copybar.sh's warm step gives it
set -u
S=$SECONDS
export PYC=1
JOBS=convert-ds COPIES=pcopy REPEAT=${REPEAT:-3} PROFILE=0 VARIANTS=";" TREES=head=. \
  bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "done at $((SECONDS-S)) s"
grep -E "run [0-9]|^\|" $OUT/w.out | cut -c1-300
