# Where item 3 stands at this session's last code: every job, best of 3, beside a 16-thread pcopy of its output
# (merge bf16 also beside rwcopy), one tree (the repository's own), in one device_copybar.sh warm run.
set -u
S=$SECONDS
export PYC=1
COPIES=pcopy REPEAT=${REPEAT:-3} PROFILE=0 VARIANTS=";" TREES=head=. \
  bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "bar done at $((SECONDS-S)) s"
grep -E "^\|" $OUT/w.out | tail -12
