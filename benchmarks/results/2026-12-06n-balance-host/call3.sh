# The last of the session's device budget: convert --to deepspeed, best of 3, head (the caster: engine/caster) and
# old (the twelfth session's code: the fork after the plan, no _Balance, no side thread), beside a 16-thread pcopy
# of the output, in one bench_copybar run (device_copybar.sh warm: the checkpoint made by DeepSpeed first)
set -u
S=$SECONDS
F=zckpt/engine/forked.py; C=zckpt/engine/caster.py
mkdir -p .bench/old && rm -rf .bench/old/zckpt && cp -r zckpt .bench/old/
sed -i 's/^BALANCE = True/BALANCE = False/; s/^PREPARE_BESIDE = True/PREPARE_BESIDE = False/' .bench/old/$F
sed -i 's/"ZCKPT_CASTS_AHEAD", "1"/"ZCKPT_CASTS_AHEAD", "0"/' .bench/old/$C
grep -H "^BALANCE =\|^PREPARE_BESIDE" $F .bench/old/$F; grep -H '"ZCKPT_CASTS_AHEAD", "' $C .bench/old/$C
export PYC=1
JOBS=convert-ds COPIES=pcopy REPEAT=${REPEAT:-3} PROFILE=0 VARIANTS=";" TREES=head=.,old=.bench/old \
  bash benchmarks/device_copybar.sh $OUT/w warm > $OUT/w.out 2>&1
echo "bar done at $((SECONDS-S)) s"
grep -E "convert-ds|^\|" $OUT/w.out | tail -12
