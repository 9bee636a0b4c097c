# item 1 on the lent host, second call: HEAD (pieces deferred + adopted states settled at the load's end) against
# .bench/mid (5612eca: pieces deferred only) and .bench/old (eeaf477), the same saves, alternated, two rounds
set -u
S=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1
find . .bench -name __pycache__ -prune -exec rm -rf {} + 2>/dev/null
{ date -u; nproc; grep -m1 "model name" /proc/cpuinfo; uname -r
  python3 -c "import sys, torch, numpy; print(sys.version.split()[0], torch.__version__, numpy.__version__)"; } 2>&1 | tee $OUT/host.log
for run in 1 2; do
  for tree in new mid old; do
    root=$PWD; [ $tree != new ] && root=$PWD/.bench/$tree
    python3 benchmarks/bench_metadata.py --chunks '' --ds-world-sizes '' --info-chunks '' \
      --megatron-chunks ${MC:-100000,1000000} --keep /tmp/bm --zckpt-root $root \
      --json-out $OUT/meta_${tree}_$run.json 2>&1 | grep --line-buffered -v -E "Warn|warn|Evict" \
      | sed "s/^/$tree $run: /" | tee -a $OUT/meta.log
  done
  [ $((SECONDS-S)) -gt 420 ] && break
done
echo "done at $((SECONDS-S)) s"
