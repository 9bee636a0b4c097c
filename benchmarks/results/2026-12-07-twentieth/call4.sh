# Twentieth session, call 4: every job cold, COLD_ROUNDS (3) rounds, each run against the 16-thread read of its
# source after it (bench_copybar.py --cold-rounds): the cold bar as medians, not single runs.
#   OUT=$OUT bash benchmarks/results/2026-12-07-twentieth/call4.sh   (carry .whl)
S=$SECONDS; export PYC=1
MOE=0 COLD_ROUNDS=${COLD_ROUNDS:-3} TREES=head=. bash benchmarks/device_copybar.sh $OUT cold > $OUT/c.out 2>&1
grep -E "cold|ready" $OUT/cold.log | tail -20; echo "done at $((SECONDS-S)) s"
