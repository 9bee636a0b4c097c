# Twentieth session, call 2 (if call 1 finds ZCKPT_READ_HINTS=read worth it): every job cold with the read hints
# (1) and with side threads reading ahead (read), alternated, COLD_ROUNDS rounds; then every job warm beside a
# 16-thread copy of its output, with the variant read.
#   OUT=$OUT bash benchmarks/results/2026-12-07-twentieth/call2.sh   (carry .whl)
set -u
S=$SECONDS
export PYC=1
JOBS=merge-fp32-1GB REPEAT=0 PROFILE=0 COPIES=pcopy VARIANTS=";" TREES=head=. bash benchmarks/device_copybar.sh $OUT/w0 warm > $OUT/w0.out 2>&1
echo "checkpoint ready at $((SECONDS-S)) s"
ck=/tmp/zbench/z2_bf16_ws4_L26_H2048_V32000_F8192
(export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pyc
 unset PYTHONDONTWRITEBYTECODE
 python3 benchmarks/probe_fill.py --ckpt $ck --workdir /tmp/zbench --fills "" --jobs ${COLD_JOBS:-merge-fp32-1GB,merge-bf16,reshard-ws8,convert-dcp} \
   --cold-ab ${COLD_AB:-1,read} --cold-rounds ${COLD_ROUNDS:-3} --json-out $OUT/cold.json 2>&1 | tee $OUT/cold.log)
echo "cold done at $((SECONDS-S)) s"
timeout $(( ${LIMIT:-570} - (SECONDS-S) )) env REPEAT=${REPEAT:-3} PROFILE=0 COPIES=pcopy VARIANTS="read:ZCKPT_READ_HINTS=read" TREES=head=. \
  bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
grep -E "^\\|" $OUT/w/warm.log | tail -30
echo "done at $((SECONDS-S)) s"
