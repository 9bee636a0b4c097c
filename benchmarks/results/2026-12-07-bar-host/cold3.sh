# Sixteenth session, call 3: the cold bar (1.1x the time to read what it reads) at the final code, ROUNDS (3) single
# cold runs of each job of JOBS, each round a separate bench_copybar.py --cold (caches dropped before each job and
# before its 16-thread read of the source). Run from the repo root: OUT=$OUT bash benchmarks/results/2026-12-07-bar-host/cold3.sh (carry .whl)
set -u
S=$SECONDS
export PYC=1 MOE=0 TREES=head=. JOBS=${JOBS:-merge-bf16,convert-dcp,merge-fp32-1GB}
for r in $(seq ${ROUNDS:-3}); do
  bash benchmarks/device_copybar.sh $OUT/c$r cold > $OUT/c$r.out 2>&1
  echo "round $r done at $((SECONDS-S)) s"; grep -E "^  .* cold:" $OUT/c$r.out
done
