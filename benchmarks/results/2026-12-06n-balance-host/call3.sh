# Not run yet (no device time left in the thirteenth session): convert --to deepspeed, best of 3, three trees in one
# bench_copybar run (device_copybar.sh warm: the checkpoint made by DeepSpeed first), beside a 16-thread pcopy:
#   ahead  the caster (engine/caster) turned on: ZCKPT_CASTS_AHEAD's default flipped to 1 in the tree's copy
#   head   the default (the fork after the plan, with _Balance)
#   old    the twelfth session's code (the fork after the plan, no _Balance)
set -u
S=$SECONDS
F=zckpt/engine/forked.py; C=zckpt/engine/caster.py
for v in ahead old; do mkdir -p .bench/$v && rm -rf .bench/$v/zckpt && cp -r zckpt .bench/$v/; done
sed -i 's/"ZCKPT_CASTS_AHEAD", "0") == "1"/"ZCKPT_CASTS_AHEAD", "1") == "1"/' .bench/ahead/$C
sed -i 's/^BALANCE = True/BALANCE = False/' .bench/old/$F
grep -H "^BALANCE =" $F .bench/*/$F; grep -H '"ZCKPT_CASTS_AHEAD", "' $C .bench/*/$C
export PYC=1
JOBS=convert-ds COPIES=pcopy REPEAT=${REPEAT:-3} PROFILE=0 VARIANTS=";" TREES=ahead=.bench/ahead,head=.,old=.bench/old \
  bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "bar done at $((SECONDS-S)) s"
grep -E "convert-ds|^\|" $OUT/w.out | tail -16
