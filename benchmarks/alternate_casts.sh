#!/usr/bin/env bash
# merge fp32 and bf16 (and fp16) of SRC into FILES+1 files, this tree and BEFORE's zckpt alternating, REPEAT times,
# outputs under OUTDIR (a tmpfs keeps the disk out of it); one line per run: tree, dtype, wall, user, sys (/usr/bin/time).
#   bash benchmarks/alternate_casts.sh SRC BEFORE OUTDIR [REPEAT] [FILES] [DTYPES]
set -euo pipefail
src=${1:?src} before=$(realpath ${2:?before}) outdir=${3:?outdir} repeat=${4:-5} files=${5:-4} dtypes=${6:-fp32 bf16}
here=$(realpath "$(dirname "$0")/..")
fp32=$(cat "$src"/*.distcp | wc -c)
for r in $(seq "$repeat"); do for dt in $dtypes; do for tree in "$here" "$before"; do
  case $dt in fp32) shard=$(( fp32 / files + 1048576 ));; *) shard=$(( fp32 / 2 / files + 1048576 ));; esac
  rm -rf "$outdir/zo"
  name=$([ "$tree" = "$here" ] && echo after || echo before)
  ( cd "$outdir" && PYTHONPATH=$tree /usr/bin/time -f "$name $dt wall %e user %U sys %S" \
      "$here/.venv/bin/python" -m zckpt merge "$src" --dtype $dt --max-shard-size ${shard}B -o "$outdir/zo" -q )
done; done; done 2>&1
