#!/usr/bin/env bash
# Snapshot benchmark: sandgate's layer pack/unpack against `tar | zstd -1`
# and `tar | pigz -1` (Debian's zstd and pigz), measured in the same run on
# the same tree, plus delta pack time after 1% of the tree changed.
# See README.md for what is measured and how to read it.
#
#   bench/snapshot/run.sh            # 650 MB tree, best of 3
#   BENCH_MB=200 BENCH_RUNS=1 bench/snapshot/run.sh
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
MB=${BENCH_MB:-650}
SMALL=${BENCH_SMALL:-40000}
RUNS=${BENCH_RUNS:-3}
WORK=${BENCH_DIR:-$(mktemp -d /var/tmp/sandgate-bench.XXXXXX)}
KEEP=${BENCH_KEEP:-0}
cleanup() { [ "$KEEP" = 1 ] || rm -rf "$WORK"; }
trap cleanup EXIT

# Tools: install the Debian packages if missing.
missing=()
command -v zstd >/dev/null || missing+=(zstd)
command -v pigz >/dev/null || missing+=(pigz)
[ -x /usr/bin/time ] || missing+=(time)
if [ ${#missing[@]} -gt 0 ]; then
	echo "installing ${missing[*]}" >&2
	if [ "$(id -u)" != 0 ]; then echo "run as root or install: ${missing[*]}" >&2; exit 1; fi
	apt-get install -y "${missing[@]}" >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y "${missing[@]}" >/dev/null; }
fi

echo "building sandgate and the tree generator..." >&2
(cd "$ROOT" && go build -o "$WORK/sandgate" ./cmd/sandgate && go build -o "$WORK/gentree" ./bench/snapshot/gentree)
SG="$WORK/sandgate"
TREE="$WORK/tree"
STORE="$WORK/store"
mkdir -p "$STORE"

echo "generating a ${MB} MB tree with ${SMALL} small files in $TREE..." >&2
"$WORK/gentree" -dir "$TREE" -mb "$MB" -small "$SMALL"
BYTES=$(du -sb --apparent-size "$TREE" | cut -f1)
FILES=$(find "$TREE" -type f | wc -l)
find "$TREE" -type f -print0 | xargs -0 cat >/dev/null # warm the page cache
sync

declare -A BEST RSS
# measure LABEL PREP CMD: run CMD (timed) after PREP (not timed) and a sync;
# keep the best wall time and the largest peak RSS over the runs.
measure() {
	local label=$1 prep=$2 cmd=$3
	bash -c "$prep"
	sync
	/usr/bin/time -f "%e %M" -o "$WORK/time.out" bash -c "$cmd" >/dev/null
	read -r wall rss <"$WORK/time.out"
	if [ -z "${BEST[$label]:-}" ] || awk -v a="$wall" -v b="${BEST[$label]}" 'BEGIN{exit !(a<b)}'; then
		BEST[$label]=$wall
	fi
	if [ -z "${RSS[$label]:-}" ] || [ "$rss" -gt "${RSS[$label]}" ]; then RSS[$label]=$rss; fi
}

for run in $(seq 1 "$RUNS"); do
	echo "run $run/$RUNS..." >&2
	measure sg_pack "rm -f $STORE/full.tar.zst*" "$SG snapshot pack $TREE --out file://$STORE/full.tar.zst"
	measure zstd_pack "rm -f $WORK/ref.tar.zst" "tar -C $TREE -cf - . | zstd -1 -q -o $WORK/ref.tar.zst"
	measure pigz_pack "rm -f $WORK/ref.tar.gz" "tar -C $TREE -cf - . | pigz -1 > $WORK/ref.tar.gz"
	measure sg_pack_gz "rm -f $STORE/full.tar.gz*" "$SG snapshot pack $TREE --compression gzip --out file://$STORE/full.tar.gz"
	# Fresh targets, deleted only at the end: ext4 allocates inodes slowly
	# right after tens of thousands were deleted, which would add noise.
	measure sg_unpack ":" "$SG snapshot unpack file://$STORE/full.tar.zst --into $WORK/out/sg$run"
	measure zstd_unpack "mkdir -p $WORK/out/zstd$run" "zstd -dc $WORK/ref.tar.zst | tar -x -C $WORK/out/zstd$run"
	measure pigz_unpack "mkdir -p $WORK/out/pigz$run" "pigz -dc $WORK/ref.tar.gz | tar -x -C $WORK/out/pigz$run"
done
rm -rf "$WORK/out"

echo "delta: packing an indexed base, changing 1% of the tree..." >&2
measure sg_pack_index "rm -f $STORE/base.tar.zst*" "$SG snapshot pack $TREE --index --out file://$STORE/base.tar.zst"
"$WORK/gentree" -dir "$TREE" -mutate 0.01 -seed 7 >&2
for run in $(seq 1 "$RUNS"); do
	measure sg_delta "rm -f $STORE/delta.tar.zst*" "$SG snapshot pack $TREE --base $STORE/base.tar.zst.manifest.json --out file://$STORE/delta.tar.zst"
done

size() { stat -c %s "$1"; }
mbs() { awk -v b="$BYTES" -v t="$1" 'BEGIN{ if (t > 0) printf "%7.0f", b/1048576/t; else print "    inf" }'; }
row() { printf "%-28s %8s %8s %10s %10s\n" "$1" "${BEST[$2]}" "$(mbs "${BEST[$2]}")" "$((RSS[$2] / 1024))" "$3"; }
ratio() { awk -v a="${BEST[$1]}" -v b="${BEST[$2]}" 'BEGIN{ if (b > 0) printf "%.2fx", a/b; else print "inf" }'; }

echo
echo "tree: $FILES files, $((BYTES / 1048576)) MB (apparent); best of $RUNS runs; $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)"
printf "%-28s %8s %8s %10s %10s\n" "" "wall s" "MB/s" "peak MB" "out MB"
row "sandgate pack (zstd)" sg_pack "$(($(size "$STORE/full.tar.zst") / 1048576))"
row "tar | zstd -1" zstd_pack "$(($(size "$WORK/ref.tar.zst") / 1048576))"
row "tar | pigz -1" pigz_pack "$(($(size "$WORK/ref.tar.gz") / 1048576))"
row "sandgate pack (gzip)" sg_pack_gz "$(($(size "$STORE/full.tar.gz") / 1048576))"
row "sandgate unpack (zstd)" sg_unpack ""
row "zstd -dc | tar -x" zstd_unpack ""
row "pigz -dc | tar -x" pigz_unpack ""
row "sandgate pack --index" sg_pack_index "$(($(size "$STORE/base.tar.zst") / 1048576))"
row "sandgate delta pack (1%)" sg_delta "$(($(size "$STORE/delta.tar.zst") / 1048576))"
echo
echo "throughput ratios (baseline time / sandgate time; above 1.00x sandgate is faster):"
echo "  pack   vs tar | zstd -1      $(ratio zstd_pack sg_pack)"
echo "  pack   vs tar | pigz -1      $(ratio pigz_pack sg_pack)"
echo "  pack gzip vs tar | pigz -1   $(ratio pigz_pack sg_pack_gz)"
echo "  unpack vs zstd -dc | tar -x  $(ratio zstd_unpack sg_unpack)"
echo "  unpack vs pigz -dc | tar -x  $(ratio pigz_unpack sg_unpack)"
echo "  delta pack vs full pack      $(ratio sg_pack sg_delta)"
echo
pass() { awk "BEGIN{exit !($1)}" && echo PASS || echo FAIL; }
echo "targets:"
echo "  pack >= 1.0x tar | zstd -1:               $(pass "${BEST[zstd_pack]} >= ${BEST[sg_pack]}")"
echo "  ${MB} MB layer saved to a local store < 5 s: $(pass "${BEST[sg_pack]} < 5") (${BEST[sg_pack]} s)"
echo "notes: sandgate's pack includes sha256 of tar and object, fsync and rename into the store;"
echo "       the pipelines write a plain file without fsync. Pipeline peak MB is the largest process."
