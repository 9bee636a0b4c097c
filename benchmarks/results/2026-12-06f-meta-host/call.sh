set -u
S=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1
mkdir -p $OUT/meta
{ date -u; nproc; grep -m1 "model name" /proc/cpuinfo; uname -r
  python3 -c "import sys, torch, numpy; print(sys.version.split()[0], torch.__version__, numpy.__version__)"
  python3 -c "import megatron.core as m; print('megatron-core', m.__version__, m.__file__)"; } 2>&1 | tee $OUT/meta/host.log
python3 benchmarks/bench_metadata.py --chunks '' --ds-world-sizes '' --info-chunks '' --megatron-chunks ${MC:-100000,1000000} \
  --json-out $OUT/meta/meta.json 2>&1 | grep --line-buffered -v -E "UserWarning|warnings.warn" | tee $OUT/meta/meta.log
echo "done at $((SECONDS-S)) s"
