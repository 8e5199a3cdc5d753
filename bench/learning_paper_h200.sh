#!/usr/bin/env bash
# The paper's constants (sigma 1e-3 -> 5e-4, alpha 5e-4) for GENERATIONS (default 60), two run seeds trained at once on one
# GPU machine (TP=1, ENGINES co-located engines each, default 4, under CUDA MPS). Run on the GPU machine after the
# install of vLLM 0.26.0, once per device call until both reports exist:
#   ROUNDING=stochastic bash bench/learning_paper_h200.sh OUT_DIR SECONDS
# Each seed stops (SIGINT, between history writes) when SECONDS run out and resumes from its history in the next
# call; a finished history goes straight to the held-out evaluation. The two processes' engine starts take turns
# (engine.gpu_memory_lock, held around every engine start, restore copy and shutdown): starts that overlapped
# another process's start or shutdown on one GPU failed ("No available memory for the cache blocks").
# DELAY seconds between the two processes' launches stay settable (default 0).
# A fresh machine resumes from the histories of earlier calls: RESUME=DIR, a folder in the working tree holding the
# learning_gpu_paper_<tag>_seed<seed>_history.json files an earlier call left in its OUT_DIR (tag: ROUNDING, plus
# _<n>gen when GENERATIONS is not 60). For 200 generations at round-to-nearest, call after call:
#   ROUNDING=nearest GENERATIONS=200 RESUME=bench/results bash bench/learning_paper_h200.sh $OUT 540
# OUT_DIR is kept current while the runs train (histories and curves every COPY_EVERY s, default 20, each file written
# whole), so that a call stopped early still carries them back; bench/learning_paper_detached.sh reads it across calls.
# OUT_DIR holds at most 8 files (the device tool's limit): per seed its report, history, curve and log.
set -uo pipefail
out=${1:?usage: learning_paper_h200.sh OUT_DIR SECONDS}; seconds=${2:?SECONDS}
rounding=${ROUNDING:-stochastic}; delay=${DELAY:-0}; engines=${ENGINES:-4}; seeds=${SEEDS:-"20260627 20260628"}
generations=${GENERATIONS:-60}; resume=${RESUME:-}
tag=$rounding; [ "$generations" = 60 ] || tag="${rounding}_${generations}gen"
root=${RUN_ROOT:-/tmp/lrp-$tag}  # outside OUT_DIR: it must survive between device calls
mkdir -p "$out" "$root"
for seed in $seeds; do  # a fresh machine: the run goes on from the history an earlier call carried back
  carried="$resume/learning_gpu_paper_${tag}_seed${seed}_history.json"
  if [ -n "$resume" ] && [ -f "$carried" ] && [ ! -f "$root/seed-$seed/es_history.json" ]; then
    mkdir -p "$root/seed-$seed" && cp "$carried" "$root/seed-$seed/es_history.json"
    echo "[learning_paper] seed $seed resumes from $carried"
  fi
done
export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
pgrep -f nvidia-cuda-mps-control >/dev/null || nvidia-cuda-mps-control -d

train_and_evaluate() {  # seed, seconds left
  timeout -s INT "$2" python bench/learning.py --out="$out/learning_gpu_paper_${tag}_seed$1.json" --seeds=1 \
    --run_seed="$1" --alpha=5e-4 --sigma_start=1e-3 --sigma_end=5e-4 --generations="$generations" --rounding="$rounding" \
    --engines="$engines" --tensor_parallel_size=1 --gpu_memory_utilization=0.1 --run_root="$root" \
    >> "$out/log_${tag}_$1.txt" 2>&1
  echo "[learning_paper] seed $1 exit $?"
}
copy_whole() {  # FROM TO: a reader of TO never sees half a file
  [ -f "$1" ] && cp "$1" "$2.part" && mv "$2.part" "$2"
}
copy_results() {  # the histories travel back, so that a fresh machine can resume them
  for seed in $seeds; do
    copy_whole "$root/seed-$seed/es_history.json" "$out/learning_gpu_paper_${tag}_seed${seed}_history.json"
    copy_whole "$root/seed-$seed/reward_curve.png" "$out/learning_gpu_paper_${tag}_seed$seed.png"
  done
}
(while sleep "${COPY_EVERY:-20}"; do copy_results; done) & keeper=$!
i=0; trainers=()
for seed in $seeds; do
  [ $i -gt 0 ] && sleep "$delay"
  train_and_evaluate "$seed" $((seconds - i * delay)) & trainers+=($!)
  i=$((i + 1))
done
wait "${trainers[@]}"
kill $keeper 2>/dev/null; wait $keeper 2>/dev/null
copy_results
