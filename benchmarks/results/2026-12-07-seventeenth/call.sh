# Seventeenth session: issue 49 item 3 at the final code (read-ahead hints on, the default), in one call: every
# job warm, best of REPEAT (3), beside a 16-thread pcopy of its output (merge bf16 also beside rwcopy); then cold
# rounds of every job (caches dropped before each job and before its 16-thread read of the source), while the call
# has time (no round started after STOP s). Run from the repo root:
#   OUT=$OUT bash benchmarks/results/2026-12-07-seventeenth/call.sh   (carry .whl)
set -u
S=$SECONDS
export PYC=1
JOBS=${JOBS:-convert-ds,merge-fp32-1GB,merge-bf16,reshard-ws8,convert-dcp} COPIES=pcopy REPEAT=${REPEAT:-3} PROFILE=0 \
  VARIANTS=";" TREES=head=. bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "warm done at $((SECONDS-S)) s"
grep -E "^\|" $OUT/w.out | tail -6
export MOE=0 TREES=head=. JOBS=${COLD_JOBS:-merge-bf16,merge-fp32-1GB,convert-dcp,reshard-ws8,convert-ds}
for r in $(seq ${ROUNDS:-4}); do
  [ $((SECONDS-S)) -lt ${STOP:-440} ] || { echo "round $r not started at $((SECONDS-S)) s"; break; }
  bash benchmarks/device_copybar.sh $OUT/c$r cold > $OUT/c$r.out 2>&1
  echo "cold round $r done at $((SECONDS-S)) s"; grep -E "^  .* cold:" $OUT/c$r.out
done
