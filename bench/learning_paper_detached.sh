#!/usr/bin/env bash
# bench/learning_paper_h200.sh across device calls without restarting it: a call lasts at most 600 s, and a call that
# starts the two runs again spends 4-6 min of it starting their 8 engines one after another. `start` launches the
# script detached from the call (its own session), from a copy of the working tree, and returns; each later call
# `collect`s: waits up to WAIT seconds (or until the runs finish), then copies what the script keeps current in its
# folder (histories, curves, and the reports once evaluated) to OUT_DIR, with one logs.txt: the runs' logs and the
# ends of their vLLM logs (at most 7 files: the device tool brings back 8). It copies the histories and curves all
# along the wait, so a call cut at its time limit still returns the last ones (the logs come only at the end). With
# `stop` it first stops both runs (SIGINT, as at the script's own time limit) and waits up to 120 s for their last
# history writes: the last call's WAIT plus those 120 s must fit in the device time left.
# The runs live only as long as the machine is held: issue the calls back to back, and collect before the device
# time runs out (the last copy is what the next session resumes from: commit it under bench/results).
#   ROUNDING=nearest GENERATIONS=200 RESUME=bench/results bash bench/learning_paper_detached.sh start SECONDS
#   bash bench/learning_paper_detached.sh collect OUT_DIR WAIT [stop]
set -uo pipefail
home=${DETACHED_HOME:-/tmp/learning-paper-detached}
running() {  # any process left in the detached session (its id: the pid of the session's first process)
  [ -f "$home/session" ] && pgrep -s "$(cat "$home/session")" >/dev/null
}
copy_results() {  # each file whole (copy, then rename), all along: a call cut at its time limit still returns the last
  local f name
  for f in "$home/out"/*.json "$home/out"/*.png; do
    [ -f "$f" ] || continue
    name=$(basename "$f")
    [ "$f" -nt "$1/$name" ] && cp "$f" "$1/.$name.part" && mv "$1/.$name.part" "$1/$name"
  done
  return 0
}
case "${1:-}" in
  start)
    seconds=${2:?usage: learning_paper_detached.sh start SECONDS}
    if running; then echo "[detached] already running"; exit 1; fi
    rm -rf "$home" && mkdir -p "$home/out" "$home/tree" || exit 1
    tar c --exclude=./.git --exclude=./.venv --exclude=./runs --exclude=./.gpu . | tar x -C "$home/tree" || exit 1
    cd "$home/tree" || exit 1
    export RUN_ROOT=${RUN_ROOT:-/tmp/learning-paper-runs}  # outside $home: a new start resumes from it
    echo "$RUN_ROOT" > "$home/run_root"
    detached='echo $$ > "$1/session"; bash bench/learning_paper_h200.sh "$1/out" "$2"; touch "$1/finished"'
    setsid nohup bash -c "$detached" _ "$home" "$seconds" > "$home/driver.log" 2>&1 < /dev/null &
    for _ in $(seq 50); do [ -s "$home/session" ] && break; sleep 0.1; done
    echo "[detached] started (session $(cat "$home/session")): $home/out, $seconds s"
    ;;
  collect)
    out=${2:?usage: learning_paper_detached.sh collect OUT_DIR WAIT [stop]}; wait_s=${3:?WAIT}; mkdir -p "$out"
    if ! running && [ ! -f "$home/finished" ]; then
      echo "[detached] no run here: not started on this machine, or ended with an earlier call"; exit 3
    fi
    end=$((SECONDS + wait_s))
    while running && [ $SECONDS -lt "$end" ]; do copy_results "$out"; sleep 1; done
    if [ "${4:-}" = stop ] && running; then
      copy_results "$out"
      pkill -INT -s "$(cat "$home/session")" -x timeout || true  # the script's own time limit, now
      for _ in $(seq 120); do running || break; sleep 1; done
    fi
    copy_results "$out"
    for log in "$home/out"/log_*.txt "$(cat "$home/run_root")"/seed-*/vllm.log; do  # 3 MB each: four under 16 MiB
      [ -f "$log" ] && { echo "==== $log"; tail -c 3000000 "$log"; }
    done > "$out/logs.txt"
    for log in "$home/out"/log_*.txt; do grep -h "\[train\] generation" "$log" | tail -1 | cut -c1-160; done
    running && echo "[detached] still running" || echo "[detached] finished"
    ;;
  *) echo "usage: learning_paper_detached.sh start SECONDS | collect OUT_DIR WAIT [stop]"; exit 2 ;;
esac
