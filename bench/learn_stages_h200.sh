#!/usr/bin/env bash
# The learn preset through the four scripts on one H200 (TP=1, ENGINES co-located engines under CUDA MPS, default 4):
# 01_train.py, 02_export.py, 03_eval.py of the trained model and of the base model on the learn task's held-out
# additions, 04_replay.py; then bench/learning.py on the same run folder, which prints its own held-out figure (128
# problems x 8 samples) beside 03_eval.py's (the preset's 64 problems x 16 samples). Run on the GPU machine after the
# install of vLLM 0.26.0, with the README's NVLink-multicast variables exported:
#   bash bench/learn_stages_h200.sh OUT_DIR [RUN_SEED] [SECONDS]
# Every stage runs under what is left of SECONDS (default 540, inside a device call's 600 s) and stops cleanly
# (SIGINT) when it runs out; the same command again on the warm machine goes on from there: training resumes from
# its history, a finished export, evaluation or replay is not run again, an evaluation resumes its finished episodes.
# The run folder lives outside OUT_DIR (RUN_ROOT, default /tmp/learn-stages), so that it survives between calls.
# OUT_DIR gets at most 7 files (the device tool brings back 8): the stages' console log, the run's history and reward
# curve, both evaluations' metrics, the replay's report and learning.py's report.
set -uo pipefail
out=${1:?usage: learn_stages_h200.sh OUT_DIR [RUN_SEED] [SECONDS]}; seed=${2:-4243}; seconds=${3:-540}
engines=${ENGINES:-4}; root=${RUN_ROOT:-/tmp/learn-stages}
run=$root/seed-$seed  # bench/learning.py's folder of this seed under --run_root
mkdir -p "$out" "$root"
log=$out/learn_stages_seed${seed}_log.txt
settings="--preset=learn --model=smollm2-135m --tensor_parallel_size=1 --engines=$engines \
--gpu_memory_utilization=0.1 --run_seed=$seed"
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
pgrep -f nvidia-cuda-mps-control >/dev/null || nvidia-cuda-mps-control -d

copy_results() {
  local from to
  for pair in "es_history.json:history.json" "reward_curve.png:reward_curve.png" \
              "eval/metrics.json:eval_metrics.json" "eval-base/metrics.json:eval_base_metrics.json" \
              "eval/aligned_history_replay_eval4.json:replay.json" "learning.json:learning.json"; do
    from=$run/${pair%%:*}; to=$out/learn_stages_seed${seed}_${pair#*:}
    [ -f "$from" ] && cp "$from" "$to"
  done
  return 0
}

stage() {  # NAME FINISHED_FILE COMMAND...: the command, unless its FINISHED_FILE is there, under the time left
  local name=$1 finished=$2 left=$((seconds - SECONDS)) start=$SECONDS status
  shift 2
  if [ -n "$finished" ] && [ -e "$finished" ]; then
    echo "[learn_stages] $name: finished in an earlier call ($finished)" | tee -a "$log"
    return 0
  fi
  if [ "$left" -le 10 ]; then
    echo "[learn_stages] no time left for $name: run the same command again on this machine" | tee -a "$log"
    copy_results
    exit 3
  fi
  echo "[learn_stages] $name, $left s left: $*" | tee -a "$log"
  timeout -s INT "$left" "$@" 2>&1 | grep --line-buffered -v -E "it/s\]|s/it\]" | tee -a "$log"
  status=${PIPESTATUS[0]}
  echo "[learn_stages] $name: exit $status after $((SECONDS - start)) s" | tee -a "$log"
  [ "$status" = 130 ] && echo "[learn_stages] stopped at the time limit: run the same command again on this machine" \
    | tee -a "$log"
  if [ "$status" != 0 ]; then
    copy_results
    exit "$status"
  fi
}

# shellcheck disable=SC2086  # $settings: one --key=value per word
{
  stage train "" python 01_train.py $settings --run_dir="$run"
  stage export "$run/export" python 02_export.py $settings --run_dir="$run"
  stage eval "$run/eval/metrics.json" python 03_eval.py $settings --run_dir="$run"
  stage eval-base "$run/eval-base/metrics.json" python 03_eval.py $settings --run_dir="$run" --export=
  stage replay "$run/eval/aligned_history_replay_eval4.json" python 04_replay.py $settings --run_dir="$run"
  stage learning "$run/learning.json" python bench/learning.py $settings --seeds=1 --run_root="$root" \
    --out="$run/learning.json"
}
copy_results
python - "$run" <<'EOF' | tee -a "$log"
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
EOF
