#!/usr/bin/env bash
# A preset through the four scripts on one GPU (TP=1, ENGINES co-located engines under CUDA MPS, default 4), by
# default the learn preset (the SmolLM2-135M model) as measured on one H200: 01_train.py, 02_export.py, 03_eval.py
# of the trained model and of the base model on the learn task's held-out additions, 04_replay.py; then (learn
# preset) bench/learning.py on the same run folder, which prints its own held-out figure (128 problems x 8 samples)
# beside 03_eval.py's (the preset's 64 problems x 16 samples). Run on the GPU machine after the install of vLLM
# 0.26.0, with the README's NVLink-multicast variables exported:
#   bash bench/learn_stages_h200.sh OUT_DIR [RUN_SEED] [SECONDS]
# Every stage runs under what is left of SECONDS (default 540, inside a device call's 600 s) and stops cleanly
# (SIGINT) when it runs out; the same command again on the warm machine goes on from there: training resumes from
# its history, a finished export, evaluation or replay is not run again, an evaluation resumes its finished episodes.
# The run folder lives outside OUT_DIR (RUN_ROOT, default /tmp/learn-stages), so that it survives between calls.
# OUT_DIR gets at most 8 files (the device tool brings back 8): the stages' console log, the run's history and reward
# curve, both evaluations' metrics, the replay's report and learning.py's report (learn preset), or one tar.gz of
# both evaluations' eval16 and episodes files of every set (other presets: bench/compute_stages_summary.py reads them).
# Other presets and settings (environment variables; the defaults are the learn preset's run):
#   PRESET=strict                the preset (default learn); files are named PRESET_stages_seedS_*
#   MODEL=NAME                   --model (default: smollm2-135m for the learn preset, else the preset's own)
#   GPU_UTIL=0.18                --gpu_memory_utilization of each training engine (default 0.1)
#   EXTRA="--learn_digits=6 ..." more settings for every stage (e.g. the tier, cut generations)
#   EVAL_ENGINES=1 EVAL_UTIL=0.5 engines and memory of export, evaluations and replay (default: ENGINES, GPU_UTIL)
#   BASE_UTIL=0.2                03_eval.py of the base model runs beside training (one engine with this memory,
#                                started once training's engines hold theirs: the history exists), not after it;
#                                unset: after the trained model's evaluation. It needs the memory the training
#                                engines leave free (one H100: GPU_UTIL=0.13 x 4 engines left room for 0.2, 0.16 x 4
#                                did not); where it fails, the driver stops after the trained model's evaluation
#                                (exit 4) and the same command without BASE_UTIL goes on from there
#   LEARNING=0                   no bench/learning.py (default 1 for the learn preset, 0 for others)
#   RETRIES=1                    run a failed stage (not one stopped at the time limit) again once (default 0)
set -uo pipefail
out=${1:?usage: learn_stages_h200.sh OUT_DIR [RUN_SEED] [SECONDS]}; seed=${2:-4243}; seconds=${3:-540}
engines=${ENGINES:-4}; root=${RUN_ROOT:-/tmp/learn-stages}; preset=${PRESET:-learn}
if [ "$preset" = learn ]; then model=${MODEL:-smollm2-135m}; learning=${LEARNING:-1}
else model=${MODEL:-}; learning=${LEARNING:-0}; fi
util=${GPU_UTIL:-0.1}; eval_engines=${EVAL_ENGINES:-$engines}; eval_util=${EVAL_UTIL:-$util}
base_util=${BASE_UTIL:-}; retries=${RETRIES:-0}
run=$root/seed-$seed  # bench/learning.py's folder of this seed under --run_root
mkdir -p "$out" "$root"
log=$out/${preset}_stages_seed${seed}_log.txt
settings="--preset=$preset ${model:+--model=$model} --tensor_parallel_size=1 --run_seed=$seed ${EXTRA:-}"
train_settings="$settings --engines=$engines --gpu_memory_utilization=$util"
eval_settings="$settings --engines=$eval_engines --gpu_memory_utilization=$eval_util"
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
pgrep -f nvidia-cuda-mps-control >/dev/null || nvidia-cuda-mps-control -d

copy_results() {
  local from to pairs
  pairs="es_history.json:history.json reward_curve.png:reward_curve.png eval/metrics.json:eval_metrics.json
         eval-base/metrics.json:eval_base_metrics.json eval/aligned_history_replay_eval4.json:replay.json"
  if [ "$learning" = 1 ]; then pairs="$pairs learning.json:learning.json"
  fi
  for pair in $pairs; do
    from=$run/${pair%%:*}; to=$out/${preset}_stages_seed${seed}_${pair#*:}
    [ -f "$from" ] && cp "$from" "$to"
  done
  if [ "$learning" != 1 ]; then  # every set's eval16 and transcripts, both models: bench/compute_stages_summary.py
    (cd "$run" && find eval eval-base -maxdepth 1 \( -name '*_eval16.json' -o -name '*_episodes.jsonl' \) 2>/dev/null \
      | tar czf "$out/${preset}_stages_seed${seed}_evals.tar.gz" -T -)
  fi
  return 0
}

stage() {  # NAME FINISHED_FILE COMMAND...: the command, unless its FINISHED_FILE is there, under the time left
  local name=$1 finished=$2 left start=$SECONDS status try=0
  shift 2
  if [ -n "$finished" ] && [ -e "$finished" ]; then
    echo "[stages] $name: finished in an earlier call ($finished)" | tee -a "$log"
    return 0
  fi
  while :; do
    left=$((seconds - SECONDS))
    if [ "$left" -le 10 ]; then
      echo "[stages] no time left for $name: run the same command again on this machine" | tee -a "$log"
      copy_results
      exit 3
    fi
    echo "[stages] $name, $left s left: $*" | tee -a "$log"
    timeout -s INT "$left" "$@" 2>&1 | grep --line-buffered -v -E "it/s\]|s/it\]" | sed -u "s/^/[$name] /" \
      | tee -a "$log"
    status=${PIPESTATUS[0]}
    echo "[stages] $name: exit $status after $((SECONDS - start)) s" | tee -a "$log"
    [ "$status" = 130 ] && echo "[stages] stopped at the time limit: run the same command again on this machine" \
      | tee -a "$log"
    if [ "$status" != 0 ] && [ "$status" != 130 ] && [ "$try" -lt "$retries" ]; then
      try=$((try + 1)); echo "[stages] $name: again (try $((try + 1)))" | tee -a "$log"; continue
    fi
    if [ "$status" != 0 ]; then
      copy_results
      exit "$status"
    fi
    return 0
  done
}

base_beside_training() {  # 03_eval.py of the base model on one engine, once training has finished a generation
  while [ ! -e "$run/es_history.json" ] && kill -0 "$1" 2>/dev/null; do sleep 5; done
  [ -e "$run/es_history.json" ] || return 0  # the driver stopped first
  stage eval-base "$run/eval-base/metrics.json" python 03_eval.py $settings --engines=1 \
    --gpu_memory_utilization="$base_util" --run_dir="$run" --export=
}

# shellcheck disable=SC2086  # $settings: one --key=value per word
{
  if [ -n "$base_util" ] && [ ! -e "$run/eval-base/metrics.json" ]; then
    base_beside_training $$ &
    base_pid=$!
  fi
  stage train "" python 01_train.py $train_settings --run_dir="$run"
  stage export "$run/export" python 02_export.py $eval_settings --run_dir="$run"
  stage eval "$run/eval/metrics.json" python 03_eval.py $eval_settings --run_dir="$run"
  if [ -n "${base_pid:-}" ]; then
    wait "$base_pid" || { echo "[stages] eval-base beside training failed: exit $?" | tee -a "$log"; copy_results; exit 4; }
  fi
  stage eval-base "$run/eval-base/metrics.json" python 03_eval.py $eval_settings --run_dir="$run" --export=
  stage replay "$run/eval/aligned_history_replay_eval4.json" python 04_replay.py $eval_settings --run_dir="$run"
  if [ "$learning" = 1 ]; then
    stage learning "$run/learning.json" python bench/learning.py $train_settings --seeds=1 --run_root="$root" \
      --out="$run/learning.json"
  fi
}
copy_results
[ "$learning" = 1 ] || exit 0
python - "$run" <<'EOF2' | tee -a "$log"
import json, sys
from pathlib import Path

run = Path(sys.argv[1])
report = json.loads((run / "learning.json").read_text())
stages, reward = report["runs"][0]["stages_eval"], report["runs"][0]["reward"]
print(f"[learn_stages] held-out reward, base -> trained: 03_eval.py ({stages['problems']} problems x "
      f"{stages['samples']} samples) {stages['base']['reward']:.3f} -> {stages['trained']['reward']:.3f}; "
      f"bench/learning.py ({report['heldout_problems']} x {report['eval_samples']}) {reward['base']['mean']:.3f} -> "
      f"{reward['trained']['mean']:.3f}, difference "
      f"{reward['difference']['mean']:+.3f} [{reward['difference']['ci_low']:+.3f}, {reward['difference']['ci_high']:+.3f}]; "
      f"03_eval evaluated the run's weights: {stages['same_weights']}")
EOF2
