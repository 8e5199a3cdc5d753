#!/usr/bin/env bash
# The compute preset's evidence on one GPU (issue 66), as run through the device tool after vLLM's install
# (../shared/GPU.md): the base model's strict score per level of the compute task (bench/strict_base.py, 64 held-out
# problems x 8 samples each), the level chosen from it, then one or more run seeds through the four scripts at once
# (bench/learn_stages_h200.sh each: 4 co-located training engines under CUDA MPS, the base's evaluation beside
# training), detached so that later calls collect them:
#   bash bench/compute_stages_h200.sh start SEED [SEED ...]   # tiers, then the runs in the background
#   bash bench/compute_stages_h200.sh wait SECONDS            # their progress, for at most SECONDS
#   bash bench/compute_stages_h200.sh collect OUT_DIR         # their files as bench/results keeps them
#   bash bench/compute_stages_h200.sh dapo SEED               # what carries over: trained and base on DAPO
# `dapo` evaluates a finished run's export and its base model on DAPO test-100's first 32 problems x 16 samples
# (10 turns x 2048 tokens, the preset's temperature 0.7), into the run folder's eval-dapo and eval-base-dapo; it
# needs data/dapo_test100.jsonl (00_data.py, or a copy of the reference file carried with the tree).
# The level: the first (lowest) whose base strict score is between 0.1 and 0.6, else the best above 0.03, else 1;
# LEVEL=L skips the measurement. A run whose history a past session brought back
# (bench/results/compute_partial_seedS_history.json) resumes from it where this GPU draws its noise
# (agentic_es/history.py, device_differences): 01_train.py goes on from its last generation. On another GPU model
# bench/noise_across_devices.py replays it first and, where every digest is equal, records the pair
# (agentic_es/same_noise.json, brought back by collect) and the run resumes; elsewhere it starts anew.
# The base's evaluation of a seed that a past session brought back (bench/results/compute_base_seedS_eval.tar.gz) is
# not run again.
set -uo pipefail
root=${ROOT:-/tmp/compute-stages}
mkdir -p "$root"
without_bars() { grep --line-buffered -v -E "it/s\]|s/it\]"; }  # tqdm's bars: one line per update in a log
share() {  # GIB: that much of this GPU's memory as a --gpu_memory_utilization (the same engines on an H100 or H200)
  awk -v gib="$1" -v mib="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)" \
    'BEGIN { printf "%.3f\n", gib * 1024 / mib }'
}
same_noise_here() {  # HISTORY: exit 0 where this GPU draws its noise (the same model, or one measured to draw it)
  python - "$1" <<'EOF'
import json, sys, torch
from agentic_es.history import describe_devices, device_differences
props = torch.cuda.get_device_properties(0)
here = [{"name": props.name, "sm_count": props.multi_processor_count}]
recorded = json.load(open(sys.argv[1])).get("devices")
same = not device_differences(recorded and recorded[:1], here)
print(f"[compute] {sys.argv[1]} was made on {describe_devices(recorded or [])}, this is {describe_devices(here)}: "
      + ("the same noise" if same else "another noise, or not measured yet"))
sys.exit(0 if same else 1)
EOF
}
case ${1:?start|wait|collect|dapo} in
start)
  shift; [ $# -ge 1 ] || { echo "start needs at least one run seed" >&2; exit 2; }
  [ -z "${LEVEL:-}" ] && python bench/strict_base.py --preset=compute --tiers=compute1,compute2,compute3 \
    --problems=64 --samples=8 --tensor_parallel_size=1 --engines=1 --gpu_memory_utilization=0.5 \
    --out="$root/compute_base.json" --episodes="$root/compute_base_episodes.jsonl" 2>&1 \
    | without_bars \
    | tee "$root/compute_base_log.txt" | grep -E "^tier|^compute|Error|error" | tail -n 8
  level=${LEVEL:-$(python - "$root/compute_base.json" <<'EOF'
import json, sys
tiers = {int(t["tier"].removeprefix("compute")): t["strict"] for t in json.load(open(sys.argv[1]))["tiers"]}
inside = [level for level, s in sorted(tiers.items()) if 0.1 <= s <= 0.6]
above = sorted((s, level) for level, s in tiers.items() if s > 0.03)
print(inside[0] if inside else above[-1][1] if above else 1)
EOF
)}
  echo "[compute] level $level" | tee "$root/level.txt"
  for seed in "$@"; do
    partial=bench/results/compute_partial_seed${seed}_history.json
    if [ -f "$partial" ] && [ ! -f "$root/seed-$seed/es_history.json" ]; then
      # another GPU model: replay the history here digest by digest; where every one is equal, it resumes here
      if same_noise_here "$partial" || { python bench/noise_across_devices.py --history="$partial" \
           --tensor_parallel_size=1 --gpu_memory_utilization="$(share 12)" --record=1 2>&1 | without_bars \
           | tee "$root/noise_across_devices_seed$seed.txt" | grep -E '^[{|]|^\[noise\]|Error'
           same_noise_here "$partial"; }; then
        mkdir -p "$root/seed-$seed" && cp "$partial" "$root/seed-$seed/es_history.json"
        echo "[compute] seed $seed resumes from $partial"
      else
        echo "[compute] seed $seed starts anew: this GPU does not draw the noise of $partial"
      fi
    fi
    base=bench/results/compute_base_seed${seed}_eval.tar.gz  # the base's evaluation a past session made
    if [ -f "$base" ] && [ ! -e "$root/seed-$seed/eval-base" ]; then
      mkdir -p "$root/seed-$seed" && tar xzf "$base" -C "$root/seed-$seed" && echo "[compute] seed $seed: the base's evaluation from $base"
    fi
    # 11 GiB a training engine, 42 for the evaluations, 12.5 for the base's beside training (0.08, 0.3, 0.09 of an H200)
    PRESET=compute GPU_UTIL=${GPU_UTIL:-$(share 11)} EVAL_ENGINES=1 EVAL_UTIL=${EVAL_UTIL:-$(share 42)} \
      BASE_UTIL=${BASE_UTIL:-$(share 12.5)} \
      RETRIES=1 RUN_ROOT="$root" EXTRA="--compute_level=$level ${EXTRA:-}" \
      setsid nohup bash bench/learn_stages_h200.sh "$root/out-$seed" "$seed" 5000 >"$root/driver-$seed.txt" 2>&1 &
    sleep 20  # the second run's engines start after the first's hold their memory
  done
  ;;
wait)
  end=$((SECONDS + ${2:-540}))
  while [ $SECONDS -lt $end ] && pgrep -f learn_stages_h200.sh >/dev/null; do sleep 10; done
  for f in "$root"/out-*/compute_stages_seed*_log.txt; do
    echo "== $f"; grep -E "^\[stages\]|mean fitness|generation [0-9]+ |Mean4|Error" "$f" | tail -n 12
  done
  pgrep -f learn_stages_h200.sh >/dev/null && echo "[compute] still running" || echo "[compute] all done"
  ;;
dapo)
  seed=${2:?seed}; run=$root/seed-$seed
  dapo=(--preset=compute --tensor_parallel_size=1 --run_seed="$seed" --run_dir="$run" --engines="${EVAL_ENGINES:-2}"
        --gpu_memory_utilization="${EVAL_UTIL:-$(share 42)}" --train_data=data/dapo_train400.jsonl --sets=dapo
        --eval_problems=32 --max_turns=10 --max_new_tokens=2048 --max_model_len=24576)
  python 03_eval.py "${dapo[@]}" --out="$run/eval-dapo" 2>&1 | without_bars | tee "$root/dapo-$seed.txt"
  python 03_eval.py "${dapo[@]}" --export= --out="$run/eval-base-dapo" 2>&1 | without_bars \
    | tee -a "$root/dapo-$seed.txt"
  ;;
collect)
  out=${2:?OUT_DIR}; mkdir -p "$out"
  for history in "$root"/seed-*/es_history.json; do  # also a run the time limit cut: its generations so far
    [ -f "$history" ] && cp "$history" "$out/compute_$(basename "$(dirname "$history")")_history.json"
  done
  tar czf "$out/compute_stages_all.tar.gz" -C "$root" --exclude='seed-*' . 2>/dev/null
  [ -f agentic_es/same_noise.json ] && cp agentic_es/same_noise.json "$out/"  # a pair measured here: commit it
  ls -la "$out"
  ;;
esac
