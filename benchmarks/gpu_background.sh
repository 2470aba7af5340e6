#!/usr/bin/env bash
# A benchmark run longer than one call of a lent machine, uncut: start gpu_session.sh in its own
# process session (it outlives the call that started it, while the machine stays held), then
# wait for it from later calls, each returning before the call limit.
#   bash benchmarks/gpu_background.sh start one conv_block gpt2 -- --opprof-ncu=off
#   bash benchmarks/gpu_background.sh wait one 540   # copies the results to $OUT when done,
#                                                    # the stage logs so far when not
#   OPPROF_PARTIAL=1 bash benchmarks/gpu_background.sh wait one 500   # and, when not, what
#                     # has finished: $OUT/one/partial, a folder pack_results.sh takes
#   OPPROF_GRACE=60 ...   # then, if the run packs its archive within 60 s more (it ended while
#                         # the partial one was made), its complete results too
# A lent machine goes back when idle past its release (30 s): a run survives only while each
# `wait` call follows the last at once. A gap loses the run; only the logs that the last call
# brought back remain.
# Environment for `start` (OPPROF_WORK, CUDA_VISIBLE_DEVICES, ...) passes on to gpu_session.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
action=${1:?start or wait}; name=${2:?a name for the run}; shift 2
dir=/tmp/opprof-background/$name
case "$action" in
  start)
    mkdir -p "$dir"
    OUT=$dir OPPROF_CALL_BUDGET=${OPPROF_CALL_BUDGET:-3600} setsid nohup \
      bash benchmarks/gpu_session.sh "$@" > "$dir/session.out" 2>&1 < /dev/null &
    echo $! > "$dir/pid"
    echo "started $name (pid $!): bash benchmarks/gpu_background.sh wait $name SECONDS"
    ;;
  wait)
    limit=${1:-540}
    copy_done() {  # the run's archive and tables, once gpu_session.sh has packed them
      tail -4 "$dir/pytest.log"
      if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT/$name"
        cp "$dir"/results.tar.xz "$dir"/pytest.log "$dir"/summary.md "$dir"/summary.json \
          "$dir"/env.txt "$OUT/$name/" 2>/dev/null
        echo "copied to $OUT/$name"
      fi
    }
    # gpu_session.sh's last line: the archive is complete
    until grep -q "^packed: " "$dir/session.out" 2>/dev/null; do
      if ! kill -0 "$(cat "$dir/pid" 2>/dev/null)" 2>/dev/null; then
        echo "$name ended without its archive:"; tail -5 "$dir/session.out"
        exit 1
      fi
      if [ "$SECONDS" -ge "$limit" ]; then
        echo "still running after ${limit} s:"; tail -3 "$dir/pytest.log" 2>/dev/null
        # Where each workload is: its newest stage log and that log's last line.
        work=${OPPROF_WORK:-/tmp/opprof-results}
        for w in "$work"/*/profiler_output; do
          log=$(ls -t "$w"/*.log 2>/dev/null | head -1)
          [ -n "$log" ] && echo "$(basename "$(dirname "$w")") $(basename "$log"): $(tail -1 "$log" | cut -c1-150)"
        done
        # The stage logs so far and the host's CPU samples (host_load.txt) come back with
        # every call, so a run the machine outlives (released while idle, or out of device
        # time) still tells where its time went.
        # With OPPROF_PARTIAL=1 (a call that may be the run's last), also the table of the
        # workloads finished so far and all their artifacts, as pack_results.sh reads them.
        if [ -n "${OUT:-}" ]; then
          mkdir -p "$OUT/$name"
          (cd "$(dirname "$work")" && find "$(basename "$work")" \
            \( -name '*.log' -o -name host_load.txt \) -print0 \
            | tar --null -T - -cJf "$OUT/$name/logs-so-far.tar.xz") 2>/dev/null
          cp "$dir/session.out" "$OUT/$name/" 2>/dev/null
          if [ "${OPPROF_PARTIAL:-0}" = 1 ]; then
            part=$OUT/$name/partial
            mkdir -p "$part"
            source benchmarks/gpu_env.sh  # pydantic for summarize.py
            # its error kept: the table can then be made from the archive elsewhere
            timeout 60 python3 benchmarks/summarize.py "$work" --json "$part/summary.json" \
              --md "$part/summary.md" > /dev/null 2> "$part/summarize.err" \
              || echo "summarize failed: see summarize.err" > "$part/summary.md"
            tar -C "$(dirname "$work")" -cJf "$part/results.tar.xz" "$(basename "$work")"
            cp "$dir/session.out" "$part/pytest.log"
            cp "$dir/env.txt" "$part/" 2>/dev/null
          fi
        fi
        # A run that ends while the above is made (its last workload finishing meanwhile)
        # would lose that workload with the call; given OPPROF_GRACE seconds, wait for its
        # own archive too.
        grace_end=$(( SECONDS + ${OPPROF_GRACE:-0} ))
        while [ "$SECONDS" -lt "$grace_end" ]; do
          if grep -q "^packed: " "$dir/session.out" 2>/dev/null; then
            echo "ended within the grace"
            copy_done
            break
          fi
          kill -0 "$(cat "$dir/pid" 2>/dev/null)" 2>/dev/null || break
          sleep 2
        done
        exit 0
      fi
      sleep 5
    done
    copy_done
    ;;
  *) echo "usage: gpu_background.sh start|wait NAME ..." >&2; exit 2 ;;
esac
