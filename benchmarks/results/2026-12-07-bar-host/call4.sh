# Sixteenth session, call 4: probe_cold.py on the lent host (the checkpoint made first if the host is fresh).
#   OUT=$OUT bash benchmarks/results/2026-12-07-bar-host/call4.sh   (carry .whl)
set -u
S=$SECONDS
export PYC=1
JOBS=merge-bf16 REPEAT=0 PROFILE=0 COPIES=pcopy VARIANTS=";" TREES=head=. bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "checkpoint ready at $((SECONDS-S)) s"
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pyc
ROUNDS=${ROUNDS:-2} python3 benchmarks/results/2026-12-07-bar-host/probe_cold.py /tmp/zbench/z2_bf16_ws4_L26_H2048_V32000_F8192 $OUT/probe.json 2>&1 | tee $OUT/probe.log
echo "done at $((SECONDS-S)) s"
