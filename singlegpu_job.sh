#!/bin/bash
# Train on one GPU in NVIDIA's PyTorch container (guide part 1). Submit from the directory
# that holds train.py; arguments are passed on to train.py and override the defaults below:
#
#   sbatch --account=nnXXXXk singlegpu_job.sh
#   sbatch --account=nnXXXXk singlegpu_job.sh --epochs 10 --metrics-file metrics.jsonl
#
# Environment overrides: CONTAINER_PATH, PROJECT_DIR (where train.py is), PER_GPU_BATCH
# (images), BASE_LR, GPU_LOG_INTERVAL (seconds), GPU_LOG_FILE.
#SBATCH --job-name=resnet_singleGpu
#SBATCH --output=singlegpu_%j.out
#SBATCH --error=singlegpu_%j.err
#SBATCH --time=01:00:00
#SBATCH --partition=accel
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=72
#SBATCH --mem=110G
#SBATCH --gpus-per-node=1
set -euo pipefail

die() { echo "error: $*" >&2; exit 2; }

CONTAINER_PATH="${CONTAINER_PATH:-/cluster/work/support/container/pytorch_nvidia_25.06_arm64.sif}"
PROJECT_DIR="${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}"
PER_GPU_BATCH="${PER_GPU_BATCH:-256}"
BASE_LR="${BASE_LR:-0.01}"
GPU_LOG_INTERVAL="${GPU_LOG_INTERVAL:-5}"
GPU_LOG_FILE="${GPU_LOG_FILE:-singlegpu_${SLURM_JOB_ID:-local}_gpu.csv}"
GPU_QUERY="timestamp,index,name,utilization.gpu,utilization.memory,memory.total,memory.used"

[[ -f "$CONTAINER_PATH" ]] || die "container image $CONTAINER_PATH not found (set CONTAINER_PATH)"
[[ -f "$PROJECT_DIR/train.py" ]] || die "no train.py in $PROJECT_DIR (submit from the project directory or set PROJECT_DIR)"

apptainer exec --nv "$CONTAINER_PATH" python -c \
    'import torch; print(f"CUDA available: {torch.cuda.is_available()}, GPUs: {torch.cuda.device_count()}")'

# Sample GPU utilization in the background; stop exactly this monitor (by PID) on any exit.
nvidia-smi --query-gpu="$GPU_QUERY" --format=csv -l "$GPU_LOG_INTERVAL" >"$GPU_LOG_FILE" &
monitor_pid=$!
trap 'kill "$monitor_pid" 2>/dev/null || true' EXIT

apptainer exec --nv "$CONTAINER_PATH" torchrun --standalone --nnodes=1 --nproc_per_node=1 \
    "$PROJECT_DIR/train.py" --batch-size "$PER_GPU_BATCH" --epochs 100 --base-lr "$BASE_LR" \
    --target-accuracy 0.95 --patience 2 "$@"
