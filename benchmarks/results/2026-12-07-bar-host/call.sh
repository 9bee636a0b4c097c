# Fifteenth session: where item 3 stands at the final code (8906d92), every job, best of REPEAT (3), beside a
# 16-thread pcopy of its output (merge bf16 also beside rwcopy), one tree (the repository's own), one warm run of
# device_copybar.sh (call2.sh of the fourteenth session, which never ran). Run from the repo root:
#   OUT=$OUT bash benchmarks/results/2026-12-07-bar-host/call.sh   (carry .whl)
# convert --to deepspeed first: a call cut at its limit still returns the job that is not yet at the bar.
set -u
S=$SECONDS
export PYC=1
JOBS=${JOBS:-convert-ds,merge-fp32-1GB,merge-bf16,reshard-ws8,convert-dcp} COPIES=pcopy REPEAT=${REPEAT:-3} PROFILE=0 VARIANTS=";" TREES=head=. \
  bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "bar done at $((SECONDS-S)) s"
grep -E "^\|" $OUT/w.out | tail -14
