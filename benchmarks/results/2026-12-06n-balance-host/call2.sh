# convert --to deepspeed across both processes (benchmarks/timeline_forked.py), four trees alternated, RUNS rounds:
#   head      the caster: a process forked before the plan imports numpy and writes the casts, this one the copies
#             (engine/forked.casts_ahead), the input check's entries learned on a side thread
#   nobeside  head without that side thread
#   late      ZCKPT_CASTS_AHEAD off: the fork after the plan, with _Balance and the side thread (call1's head)
#   old       the twelfth session's code (fork after the plan, no _Balance, no side thread)
# then bench_copybar's convert-ds, best of 3, head, late and old, beside a 16-thread pcopy of the output
set -u
S=$SECONDS
export PYC=1
[ "${SKIP_SETUP:-0}" = 1 ] || JOBS=convert-ds COPIES=pcopy REPEAT=1 PROFILE=0 VARIANTS=";" TREES=head=. bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "setup done at $((SECONDS-S)) s"; grep -E "^\|" $OUT/w.out | tail -1
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cpu PYTHONPYCACHEPREFIX=/tmp/pyc
unset PYTHONDONTWRITEBYTECODE
for v in old late nobeside; do mkdir -p .bench/$v && rm -rf .bench/$v/zckpt && cp -r zckpt .bench/$v/; done
F=zckpt/engine/forked.py; C=zckpt/engine/caster.py
sed -i 's/^BALANCE = True/BALANCE = False/; s/^PREPARE_BESIDE = True/PREPARE_BESIDE = False/' .bench/old/$F; sed -i 's/"ZCKPT_CASTS_AHEAD", "1"/"ZCKPT_CASTS_AHEAD", "0"/' .bench/old/$C
sed -i 's/"ZCKPT_CASTS_AHEAD", "1"/"ZCKPT_CASTS_AHEAD", "0"/' .bench/late/$C
sed -i 's/^PREPARE_BESIDE = True/PREPARE_BESIDE = False/' .bench/nobeside/$F
grep -H "^BALANCE =\|^PREPARE_BESIDE" $F .bench/*/$F; grep -H '"ZCKPT_CASTS_AHEAD", "' $C .bench/*/$C
for d in . .bench/old .bench/late .bench/nobeside; do python3 -m compileall -q $d/zckpt >/dev/null; done
W=${W:-/tmp/zbench}; mkdir -p $W
CK=${CK:-$W/z2_bf16_ws4_L26_H2048_V32000_F8192}
trees=(head=. old=.bench/old late=.bench/late nobeside=.bench/nobeside)
mkdir -p $OUT/tl
for r in $(seq ${RUNS:-8}); do
  n=${#trees[@]}; k=$(( (r - 1) % n ))
  for t in "${trees[@]:$k}" "${trees[@]:0:$k}"; do name=${t%%=*}; dir=${t#*=}
    rm -rf $W/tl-out; sync
    PYTHONPATH=/tmp/site:$dir python3 benchmarks/timeline_forked.py --json-out $OUT/tl/$name-$r.json -- convert $CK-dcp \
      --to deepspeed -w 4 --stage 2 --dtype bf16 --buffers scale,idx -o $W/tl-out --json > $OUT/tl/$name-$r.txt 2>&1
  done
  rm -rf $W/tl-out $W/pc; sync
  python3 - <<PY >> $OUT/pcopy.txt
import sys; sys.path.insert(0, "benchmarks")
from pathlib import Path
import bench_copybar as b, shutil, subprocess
src = Path("$W/pc-src")
if not src.exists():
    subprocess.run(["python3", "-m", "zckpt", "convert", "$CK-dcp", "--to", "deepspeed", "-w", "4", "--stage", "2", "--dtype", "bf16", "--buffers", "scale,idx", "-o", str(src), "-q"], check=True)
print("pcopy round $r", b.parallel_copy(src, Path("$W/pc"), 16))
shutil.rmtree("$W/pc", ignore_errors=True)
PY
done
echo "timelines done at $((SECONDS-S)) s"
rm -rf $W/pc-src
python3 benchmarks/bench_copybar.py --workdir $W --layers 26 --hidden 2048 --ffn 8192 --world-size 4 --repeat 3 \
  --trees ${BAR_TREES:-head=.,late=.bench/late,old=.bench/old} --copies pcopy --jobs convert-ds --variants ";" --json-out $OUT/bar.json > $OUT/bar.log 2>&1
echo "bar done at $((SECONDS-S)) s"
python3 benchmarks/results/2026-12-06n-balance-host/summary.py $OUT/tl > $OUT/summary.txt 2>&1
rm -f $OUT/tl/*.json; tar -czf $OUT/tl.tgz -C $OUT tl && rm -rf $OUT/tl
cat $OUT/pcopy.txt
grep -E "^\||convert-ds" $OUT/bar.log | tail -14
cat $OUT/summary.txt
