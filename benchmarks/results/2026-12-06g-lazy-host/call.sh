set -u
S=$SECONDS
R=benchmarks/results/2026-12-06g-lazy-host
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
python3 benchmarks/bench_metadata.py --chunks '' --ds-world-sizes '' --megatron-chunks 100000,1000000 --keep /tmp/bm \
  --json-out $OUT/meta.json 2>&1 | grep -v -E "Warn|warn|Evict" | tee $OUT/meta.log
for n in 100000 1000000; do P=/tmp/bm/megatron_${n}_tp8_pp4_h16
  for i in 1 2; do for m in eager lazy; do python3 $R/tlazy.py $P $m 2>/dev/null; done; python3 $R/tplain2.py $P gc 2>/dev/null; python3 $R/tplain2.py $P nogc 2>/dev/null; done
done 2>&1 | tee $OUT/lazy.log
echo "done at $((SECONDS-S)) s"
