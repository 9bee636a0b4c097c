# Twentieth session, calls 2 and 3 (the same warm machine as call 1, its checkpoint): every job warm beside a
# 16-thread copy of its output, best of 3, then every job cold beside a 16-thread read of its source. Call 2 wrote
# under $OUT/w and $OUT/c (its warm.json and warm.log did not come back: their table is in call2/output_tail.txt);
# call 3 under /tmp, copied into $OUT.
#   OUT=$OUT bash benchmarks/results/2026-12-07-twentieth/call2.sh   (carry .whl)
S=$SECONDS; export PYC=1
REPEAT=3 PROFILE=0 COPIES=pcopy VARIANTS=";" TREES=head=. timeout 400 bash benchmarks/device_copybar.sh /tmp/w3 warm > $OUT/w.out 2>&1
cp /tmp/w3/warm.log /tmp/w3/warm.json /tmp/w3/host.log $OUT/
grep -E "^\|" $OUT/warm.log | tail -12; echo "warm done at $((SECONDS-S)) s"
MOE=0 TREES=head=. timeout $((540-(SECONDS-S))) bash benchmarks/device_copybar.sh /tmp/c3 cold > $OUT/c.out 2>&1
cp /tmp/c3/cold.log /tmp/c3/cold.json $OUT/
grep -E "cold" $OUT/cold.log | tail -8; echo "done at $((SECONDS-S)) s"
