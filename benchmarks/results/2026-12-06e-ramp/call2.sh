set -u
S=$SECONDS
export PYC=1
T=head=.bench/head,s500=.bench/s500,s200=.bench/s200
JOBS=merge-fp32-1GB,reshard-ws8,convert-ds COPIES=pcopy REPEAT=3 PROFILE=0 VARIANTS=";" TREES=$T bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "warm done at $((SECONDS-S)) s"
grep -E "^\|" $OUT/w.out
if [ $((SECONDS-S)) -lt 420 ]; then
JOBS=merge-fp32-1GB,convert-ds PHASE_RUNS=2 TREES=head=.bench/head,s200=.bench/s200 bash benchmarks/device_copybar.sh $OUT/p phases > $OUT/p.out 2>&1
echo "phases done at $((SECONDS-S)) s"
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob('/tmp/zbench/prof/phases-*.json')):
    d = json.load(open(f))
    print(os.path.basename(f), d['argv'][0], 'cmd %.3f before %.3f writing %.3f after %.3f' % (d['command_s'], d['before_first_job_s'], d['writing_s'], d['after_last_job_s']))
    print('   busy', d['busy_10ms'][:8], 'GB/s', d['gb_per_s_100ms'][:3])
PY
fi
