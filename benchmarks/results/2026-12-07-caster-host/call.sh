# convert --to deepspeed, best of REPEAT (4), three trees in one bench_copybar run (device_copybar.sh warm: the
# checkpoint made by DeepSpeed first), beside a 16-thread pcopy:
#   ahead   the caster (engine/caster) turned on: ZCKPT_CASTS_AHEAD's default flipped to 1 in the tree's copy
#   ahead5  the same, the caster starting with 5 threads (forked.cast_workers) instead of 4
#   head    the default (the fork after the plan, with _Balance)
set -u
S=$SECONDS
F=zckpt/engine/forked.py; C=zckpt/engine/caster.py
for v in ahead ahead5; do mkdir -p .bench/$v && rm -rf .bench/$v/zckpt && cp -r zckpt .bench/$v/; done
for v in ahead ahead5; do
  sed -i 's/"ZCKPT_CASTS_AHEAD", "0") == "1"/"ZCKPT_CASTS_AHEAD", "1") == "1"/' .bench/$v/$C
done
sed -i 's|return min(workers, max(2, workers // 3))|return min(workers, 5)|' .bench/ahead5/$F
grep -H "^BALANCE =" $F .bench/*/$F; grep -H '"ZCKPT_CASTS_AHEAD", "' $C .bench/*/$C; grep -H "return min(workers" $F .bench/*/$F
export PYC=1
JOBS=convert-ds COPIES=pcopy REPEAT=${REPEAT:-4} PROFILE=0 VARIANTS=";" \
  TREES=ahead=.bench/ahead,ahead5=.bench/ahead5,head=. \
  bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "bar done at $((SECONDS-S)) s"
grep -E "convert-ds|^\|" $OUT/w.out | tail -16
