#!/usr/bin/env bash
# Co-located engines on one GPU machine (TP=1): the reference-shaped generation (bench/reference_generation.py)
# with K engines on the same GPU, under CUDA MPS ("K:mps") or without ("K"). Run on the GPU machine after the
# install of vLLM 0.26.0:
#   bash bench/colocation_h200.sh OUT_DIR 1 4 2:mps 4:mps
# The workload is the reference's scripted one scaled down (BENCH_ARGS) so that each K fits one device call.
set -uo pipefail
out=${1:?usage: colocation_h200.sh OUT_DIR K[:mps] ...}; shift
mkdir -p "$out"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
BENCH_ARGS=${BENCH_ARGS:---qwen3_30b=true --layers=12 --tensor_parallel_size=1 --gpu_memory_utilization=0.2 \
--members=16 --episodes=16 --token_scale=0.1 --tool_scale=0.1}
for run in "$@"; do
  k=${run%%:*}
  tag=k${k}; [ "$run" != "$k" ] && tag=${tag}_mps
  if [ "$run" != "$k" ]; then
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && echo "[colocation] MPS started"
  fi
  # shellcheck disable=SC2086
  python bench/reference_generation.py $BENCH_ARGS --engines="$k" --out="$out/reference_generation_h200x1_$tag.json" \
    2>&1 | grep -v -E "^\s*$|it/s\]|s/it\]" | tail -n 40
  if [ "$run" != "$k" ]; then
    echo quit | nvidia-cuda-mps-control && echo "[colocation] MPS stopped"
  fi
done
