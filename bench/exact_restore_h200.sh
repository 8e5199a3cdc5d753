#!/usr/bin/env bash
# Exact restore without a weight copy, measured on one H200 (TP=1, the Qwen3-30B-A3B layout cut to 24 layers, the
# depth where the copy limits co-location; weights redrawn N(0, 0.02), norms 1). Run on the GPU machine after the
# vLLM install, one step per device call:
#   bash bench/exact_restore_h200.sh OUT_DIR restore          # bench/exact_restore.py: patch against copy_device
#   bash bench/exact_restore_h200.sh OUT_DIR patch:3:0.28     # the reference workload, K engines under MPS
#   bash bench/exact_restore_h200.sh OUT_DIR copy_device:2:0.28 copy_host:3:0.32
# A workload step is RESTORE:K:GPU_MEMORY_UTILIZATION: the largest K the memory plan admits for that restore mode
# (bench/exact_restore.py's "plan") at the largest utilization admitting it. The workload is the reference's scripted
# one scaled down (BENCH_ARGS) so that each step fits one device call.
set -uo pipefail
out=${1:?usage: exact_restore_h200.sh OUT_DIR restore | RESTORE:K:UTILIZATION ...}; shift
mkdir -p "$out"
MODEL_ARGS="--qwen3_30b=true --layers=24 --tensor_parallel_size=1"
BENCH_ARGS=${BENCH_ARGS:---normal_weights=true --members=6 --episodes=16 --token_scale=0.1 --tool_scale=0.1 \
--plain=false --cudagraph_mode=FULL_DECODE_ONLY}
quiet() { grep -v -E "^\s*$|it/s\]|s/it\]| INFO |^\(EngineCore" | tail -n 40; }
for step in "$@"; do
  if [ "$step" = restore ]; then
    # shellcheck disable=SC2086
    python bench/exact_restore.py $MODEL_ARGS --cuda_graphs=false --gpu_memory_utilization=0.5 \
      --out="$out/exact_restore_h200x1_24layers.json" 2>&1 | quiet
    continue
  fi
  IFS=: read -r restore k utilization <<< "$step"
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "[exact_restore] MPS started"
  # shellcheck disable=SC2086
  python bench/reference_generation.py $MODEL_ARGS $BENCH_ARGS --restore="$restore" --engines="$k" \
    --gpu_memory_utilization="$utilization" --out="$out/reference_generation_h200x1_24layers_${restore}_k${k}.json" \
    2>&1 | quiet
  echo quit | nvidia-cuda-mps-control && echo "[exact_restore] MPS stopped"
done
