#!/usr/bin/env bash
# Pack one run fetched from the GPU host: its raw files to the `results` branch, its summary to
# benchmarks/results on main.
#
#   bash benchmarks/pack_results.sh SRC DEST [lean]
#
# SRC is a folder that gpu_session.sh wrote under $OUT (results.tar.xz, env.txt, pytest.log,
# summary.json, summary.md); DEST the run's folder, benchmarks/results/<session>/<run>. Packed
# into DEST: the run's env, log, summaries, session.json, stage JUnit, wall time and host CPU
# samples (host_load.txt), and per workload its stage logs. Unless `lean`, also its
# workload_summary.json, validation_report.json, and gzipped (`name.gz`, as summarize.py reads
# them) its profiles, optimizations.json and backend_selection.json. Traces, plots and
# generated code stay out.
#
# Where DEST is under this repository's benchmarks/results/, the packed run is then committed to
# the orphan `results` branch at that path (publish_results.sh; main's index is not touched),
# and DEST keeps only what main commits: summary.md, summary.json.gz, env.txt, wall_seconds.txt
# (and a README.md written there). OPPROF_PUBLISH=0 leaves DEST packed and publishes nothing.
set -euo pipefail
src=$1
dest=$2
lean=${3:-}
for f in results.tar.xz env.txt pytest.log summary.json summary.md; do
  if [ ! -f "$src/$f" ]; then
    echo "$src: no $f; pass the folder gpu_session.sh wrote under \$OUT" >&2
    exit 2
  fi
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar -C "$tmp" -xJf "$src/results.tar.xz"
work=$(find "$tmp" -mindepth 1 -maxdepth 1 -type d | head -1)
mkdir -p "$dest"
for f in env.txt pytest.log summary.json summary.md; do cp "$src/$f" "$dest/"; done
for f in opprof-junit.xml session.json wall_seconds.txt host_load.txt; do
  if [ -f "$work/$f" ]; then cp "$work/$f" "$dest/"; fi
done
for d in "$work"/*/; do
  name=$(basename "$d")
  [ -d "$d/profiler_output" ] || continue
  mkdir -p "$dest/$name/profiler_output"
  cp "$d"/profiler_output/*.log "$dest/$name/profiler_output/" 2>/dev/null || true
  [ -z "$lean" ] || continue
  for f in workload_summary.json profiler_output/validation_report.json; do
    if [ -f "$d/$f" ]; then cp "$d/$f" "$dest/$name/$f"; fi
  done
  for f in profile.json profile_optimized.json optimizations.json \
      profiler_output/backend_selection.json; do
    if [ -f "$d/$f" ]; then gzip -9 -n -c "$d/$f" > "$dest/$name/$f.gz"; fi
  done
done
echo "packed $src into $dest"

results=$(cd "$(dirname "$0")" && pwd -P)/results
abs=$(cd "$dest" && pwd -P)
case "$abs/" in
  "$results"/?*/) ;;
  *) exit 0 ;;  # a scratch folder: nothing to publish
esac
[ "${OPPROF_PUBLISH:-1}" = 0 ] && exit 0
bash "$(dirname "$0")/publish_results.sh" "$dest"
# What main keeps of the run (docs/results.md): its summary.
find "$dest" -type f ! \( -name README.md -o -name summary.md -o -name summary.json \
  -o -name env.txt -o -name wall_seconds.txt \) -delete
find "$dest" -mindepth 1 -type d -empty -delete
gzip -9 -n -f "$dest/summary.json"
echo "kept in $dest: $(cd "$dest" && ls | tr '\n' ' ')"
