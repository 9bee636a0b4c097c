# Nineteenth session, call 4: does handing each 4 MiB range to a pool as a job of its own (main thread submits, takes
# results in order, 4 x threads in flight: how zckpt's lanes run) cost what merge fp32's writing loses to pcopy4
# (call 3: 289 ms against 238)? And the read hints the main thread gives before each job?
# The source: 4 files of 943 MB of random bytes (merge fp32's 1 GB shards' sizes) made here, no checkpoint needed.
#   OUT=$OUT bash benchmarks/results/2026-12-07-nineteenth/call4.sh   (carry .whl)
set -u
S=$SECONDS
python3 -c "import isal" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/isal-*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
src=/tmp/zbench/rnd; mkdir -p $src
for i in 1 2 3 4; do [ -f $src/f$i ] || head -c 943000000 /dev/urandom > $src/f$i & done; wait
echo "source ready at $((SECONDS-S)) s"; nproc; uname -r
python3 benchmarks/probe_writepath.py $src --work /tmp/zbench/wp4 --rounds ${PROBE_ROUNDS:-4} \
  --methods ${METHODS:-pcopy4-t12-crc,pcopy4-t12-crc-pool,pcopy4-t12-crc-pool-rh,pcopy1-t12-crc,pcopy1-t12-crc-pool} 2>&1 | tee $OUT/probe.log | grep -v "^round"
echo "done at $((SECONDS-S)) s"
