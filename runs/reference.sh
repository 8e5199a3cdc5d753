#!/usr/bin/env bash
# The reference run, start to end: Qwen3-30B-A3B trained by ES at TP=2 on 2 GPUs with the paper's settings (the
# defaults of common.Config), exported, evaluated beside its base model, and both evaluations replayed.
#
#   bash runs/reference.sh                               # the reference run on 2 GPUs -> runs/es (~24 h, projected)
#   PRESET=smoke bash run_cpu.sh bash runs/reference.sh  # the same flow on the CPU, smoke preset -> runs/smoke
#
# PRESET=NAME adds --preset=NAME to every stage and skips 00_data.py (each preset makes its own problems).
# RUN_DIR=DIR puts the run in DIR. After a stop run it again: training and evaluation resume where they stopped,
# an export already made is kept, the replays run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# NVLink multicast stays off, as on the H200 machines everything here was measured on.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0

PRESET=${PRESET:-}
ARGS=()
[ -n "$PRESET" ] && ARGS+=("--preset=$PRESET")
[ -n "${RUN_DIR:-}" ] && ARGS+=("--run_dir=$RUN_DIR")
RUN=${RUN_DIR:-runs/${PRESET:-es}}

if [ -z "$PRESET" ]; then
  python 00_data.py                              # data/: 400 + 100 DAPO problems and AIME 2026 (needs the hub)
fi
python 01_train.py "${ARGS[@]}"                  # 20 generations x 16 members x 16 problems -> runs/es
if [ -d "$RUN/export" ]; then
  echo "[reference] $RUN/export exists: not exported again"
else
  python 02_export.py "${ARGS[@]}"               # runs/es/export: the exact TP=2 sharded_state
fi
python 03_eval.py "${ARGS[@]}"                   # runs/es/eval: 16 samples per problem, Mean4/Pass4 at 12-15
python 03_eval.py "${ARGS[@]}" --export= --out="$RUN/eval-base"   # the base model, for the before/after table
python 04_replay.py "${ARGS[@]}"                 # rebuild theta, re-run samples 12-15: digests, scores, transcripts
python 04_replay.py "${ARGS[@]}" --eval="$RUN/eval-base"          # the same for the base model's evaluation
echo "[reference] done: $RUN (metrics: $RUN/eval/metrics.json and $RUN/eval-base/metrics.json)"
