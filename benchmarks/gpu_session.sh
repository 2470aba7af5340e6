#!/usr/bin/env bash
# The benchmark entry point, one call on a GPU machine: run `pytest --opprof` on the given
# workloads, write the results table ($OUT/summary.json and summary.md, by summarize.py) and pack
# every artifact into $OUT/results.tar.xz, so traces and reports come back in one file.
#   bash benchmarks/gpu_session.sh conv_block resnet18 [-- extra pytest args]
# A name is the folder examples/NAME where there is one, else benchmarks/models/NAME (the
# real-model suite); `examples` and `models` stand for every workload folder of each.
# Back in the repository, `bash benchmarks/pack_results.sh OUT benchmarks/results/<session>/<run>`
# publishes the raw run to the `results` branch and keeps its summary (docs/results.md).
# Needs the pure-Python wheels in .whl/ (../shared/gpu/wheels.sh .whl) where the machine has no
# package index.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
names=(); extra=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; extra=("$@"); break; fi
  names+=("$1"); shift
done
# A workload folder holds NAME/NAME.py; the groups expand to every such folder, sorted.
group() { for d in "$1"/*/; do d=${d%/}; [ -f "$d/$(basename "$d").py" ] && echo "$d"; done; }
paths=()
for n in "${names[@]}"; do
  case $n in
    examples) mapfile -t -O "${#paths[@]}" paths < <(group examples) ;;
    models) mapfile -t -O "${#paths[@]}" paths < <(group benchmarks/models) ;;
    *) if [ -d "examples/$n" ]; then paths+=("examples/$n"); else paths+=("benchmarks/models/$n"); fi ;;
  esac
done
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  command -v ncu && ncu --version | tail -1
  # how quiet measurements kept the host quiet (docs/design-notes.md#pausing-the-compiles)
  echo "OPPROF_QUIET=${OPPROF_QUIET:-pause}"
  # where Inductor's compile workers ran (docs/design-notes.md#compile-workers-on-the-host)
  echo "OPPROF_COMPILE_POOL=${OPPROF_COMPILE_POOL:-slice}"
} > "$OUT/env.txt" 2>&1
# Kept between calls on a machine still warm, so a later call resumes from the stage cache;
# OPPROF_FRESH=1 starts over. OPPROF_WORK names another folder, so that two runs (say -n 2 and
# one GPU, for their wall times) keep their caches apart.
work=${OPPROF_WORK:-/tmp/opprof-results}
[ "${OPPROF_FRESH:-0}" = 1 ] && rm -rf "$work"
mkdir -p "$work"
start=$(date +%s)
# The host's CPUs through the run (benchmarks/host_load.py), beside the stage logs: whether the
# run waited for the GPU or for its compiles (benchmarks/gpu_timeline.py reads it).
python3 benchmarks/host_load.py "$work/host_load.txt" & sampler=$!
# A call on a lent machine has a hard limit: stop pytest (SIGINT: it still writes the summary)
# before it, so the artifacts packed below come back.
# The benchmark always measures the stock baseline (--opprof-stock): the bar beside eager and
# fp32 torch.compile. Its stages get OPPROF_STAGE_TIMEOUT seconds (an extra --opprof-timeout
# wins): max-autotune's compiles of a real model, beside fourteen other workloads on one GPU,
# outlasted the 900 s default (docs/results.md), and the stock task has 90% of its stage's.
timeout --signal=INT "${OPPROF_CALL_BUDGET:-540}" python3 -m pytest -p no:benchmark -p pytest_opprof.plugin --opprof "${paths[@]}" --opprof-out="$work" --opprof-stock \
  --opprof-timeout="${OPPROF_STAGE_TIMEOUT:-1800}" \
  -p no:cacheprovider -v -rA --opprof-junit="$work/opprof-junit.xml" \
  --junitxml="$work/junit.xml" "${extra[@]}" 2>&1 | tee "$OUT/pytest.log"
status=${PIPESTATUS[0]}
kill "$sampler" 2>/dev/null
echo "pytest exit $status after $(( $(date +%s) - start )) s" | tee -a "$OUT/pytest.log"
# Every call's wall time, so a run cut into calls adds up (resumed stages are not re-run).
echo "$(( $(date +%s) - start )) ${extra[*]}" >> "$work/wall_seconds.txt"
echo "wall time of this run's calls so far: $(awk '{s+=$1} END {print s}' "$work/wall_seconds.txt") s" \
  | tee -a "$OUT/pytest.log"
# The benchmark table of what is there so far (benchmarks/summarize.py), beside the log.
python3 benchmarks/summarize.py "$work" --junit "$work/opprof-junit.xml" \
  --json "$OUT/summary.json" --md "$OUT/summary.md" > /dev/null 2>&1 \
  || echo "summarize failed: see the artifacts" | tee -a "$OUT/pytest.log"
# This call's workloads and the session files, in one archive: a lent machine returns at most
# 8 files of 16 MiB (seven workloads' artifacts packed came to ~1.5 MB; one archive each left
# the summary behind).
base=$(basename "$work")
# Artifacts are in a folder named after the workload, the basename of its path.
packed=()
for p in "${paths[@]}"; do n=$(basename "$p"); [ -e "$work/$n" ] && packed+=("$base/$n"); done
for f in "$work"/*; do [ -f "$f" ] && packed+=("$base/$(basename "$f")"); done
tar -C "$(dirname "$work")" -cJf "$OUT/results.tar.xz" "${packed[@]}"
ls -la "$OUT"
# The last line: a caller polling a run started in the background waits for it, not for the
# wall-time line above (the archive is written after that).
echo "packed: $OUT/results.tar.xz"
exit 0
