#!/usr/bin/env bash
# Evaluation without restore memory, measured on one H200 in one device call (TP=1, the Qwen3-30B-A3B layout cut
# to 24 layers: per GPU the bytes of the reference's 48 layers at TP=2; weights redrawn N(0, 0.02), norms 1): the
# largest K the memory plan admits for evaluation with a restore copy per engine and without, and the same
# evaluation's episodes/s at each K under CUDA MPS (bench/eval_memory.py). Run on the GPU machine after the vLLM
# install:
#   bash bench/eval_memory_h200.sh OUT_DIR [NAME [eval_memory.py arguments ...]]
# (NAME: the report's file name under OUT_DIR; the arguments, e.g. --ks_after=2,3, go to bench/eval_memory.py)
# The evaluation is the reference's scripted episodes scaled down (BENCH_ARGS) so that both pools' starts and runs
# fit one call; LIMIT_S stops it cleanly before the device tool's limit (each phase's result is written as it ends).
set -uo pipefail
out=${1:?usage: eval_memory_h200.sh OUT_DIR [NAME [eval_memory.py arguments ...]]}
name=${2:-eval_memory_h200x1_24layers.json}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out"
BENCH_ARGS=${BENCH_ARGS:---problems=8 --samples=16 --token_scale=0.1 --tool_scale=0.1}
export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "[eval_memory] MPS started"
# shellcheck disable=SC2086
timeout -s INT "${LIMIT_S:-520}" python bench/eval_memory.py --qwen3_30b=true --layers=24 --tensor_parallel_size=1 \
  --cudagraph_mode=FULL_DECODE_ONLY $BENCH_ARGS --out="$out/$name" "$@" 2>&1 \
  | grep -v -E "^\s*$|it/s\]|s/it\]| INFO |^\(EngineCore" | tail -n 60
status=${PIPESTATUS[0]}
echo quit | nvidia-cuda-mps-control && echo "[eval_memory] MPS stopped"
exit "$status"
