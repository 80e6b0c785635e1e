#!/bin/bash
# Train on one GPU in NVIDIA's PyTorch container (guide part 1). Submit from the directory
# that holds train.py; arguments are passed on to train.py and override the defaults below:
#
#   sbatch --account=nnXXXXk singlegpu_job.sh
#   sbatch --account=nnXXXXk singlegpu_job.sh --epochs 10 --metrics-file metrics.jsonl
#   sbatch --account=nnXXXXk singlegpu_job.sh --dataset mnist     # or cifar10, fashion-mnist
#   sbatch --account=nnXXXXk singlegpu_job.sh --model my_net.py:Net --dataset folder --data-dir my_images
#   (paths among the arguments are relative to the directory you submit from)
#
# Environment overrides: CONTAINER_PATH, CHECKPOINT_DIR, PROJECT_DIR (where train.py is), PER_GPU_BATCH
# (images), BASE_LR, GPU_LOG_INTERVAL (seconds), GPU_LOG_FILE, STOP_FILE, REQUEUE_MIN_S (seconds),
# TORCHRUN_PATH (empty, the default: tools/torchrun.py, torchrun ending in train.py's own error
# line instead of its traceback; /usr/local/bin/torchrun: PyTorch's own).
# Training checkpoints into its checkpoint folder (CHECKPOINT_DIR, or --checkpoint-dir among
# the arguments); 300 s before the time limit it is stopped with a checkpoint, the job
# requeues itself and the requeued job resumes from that folder (see README). The final
# weights are written to weights.pt in the same folder.
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
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail

# What the three job scripts share: tools/job_common.sh of the project (Slurm runs a copy of this script).
[[ -n "${PROJECT_DIR:-}" ]] || unset_project=" (PROJECT_DIR is not set: the folder the job started in)"
PROJECT_DIR="${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}"
[[ -f "$PROJECT_DIR/tools/job_common.sh" ]] || {
    echo "error: no tools/job_common.sh in $PROJECT_DIR${unset_project:-}; submit from the project directory," \
        "or set PROJECT_DIR to it" >&2
    exit 2
}
# shellcheck source=tools/job_common.sh
source "$PROJECT_DIR/tools/job_common.sh"
warn_misspelt CONTAINER_PATH PROJECT_DIR PER_GPU_BATCH BASE_LR GPU_LOG_INTERVAL GPU_LOG_FILE CHECKPOINT_DIR \
    STOP_FILE REQUEUE_MIN_S TORCHRUN_PATH
recipe_settings PER_GPU_BATCH BASE_LR  # as given: a job continued by hand needs them (requeue)
CONTAINER_PATH="${CONTAINER_PATH:-/cluster/work/support/container/pytorch_nvidia_25.06_arm64.sif}"
PER_GPU_BATCH="${PER_GPU_BATCH:-256}"
BASE_LR="${BASE_LR:-}"  # empty: recipe.py's default for the --optimizer (0.01 for SGD, the guide's)
GPU_LOG_INTERVAL="${GPU_LOG_INTERVAL:-5}"
GPU_LOG_FILE="${GPU_LOG_FILE:-singlegpu_${SLURM_JOB_ID:-local}_gpu.csv}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-checkpoints/singlegpu_${SLURM_JOB_ID:-local}}"
STOP_FILE="${STOP_FILE:-$PWD/.singlegpu_${SLURM_JOB_ID:-local}.stop}"
REQUEUE_MIN_S="${REQUEUE_MIN_S:-300}"  # a job that ran less is not requeued (job_common.sh's requeue)
GPU_QUERY="timestamp,index,name,utilization.gpu,utilization.memory,memory.total,memory.used"
TORCHRUN_PATH="${TORCHRUN_PATH:-}"
choose_launcher

check_job_settings GPU_LOG_FILE "$GPU_LOG_FILE"
check_project train.py tools/torchrun.py
read_arguments "$@"  # CHECKPOINT_DIR as training will use it

apptainer exec --nv "$CONTAINER_PATH" python -c \
    'import torch; print(f"CUDA available: {torch.cuda.is_available()}, GPUs: {torch.cuda.device_count()}")'

# The GPU monitor into GPU_LOG_FILE, and the traps: the time limit's USR1 and a Ctrl-C stop
# training with a checkpoint, and the job requeues itself after the USR1 (job_common.sh).
start_monitor_and_traps

# What training runs with (job_common.sh's training_args), printed for reading (not quoted): the
# job log shows the flags an error may name.
training_args "$PER_GPU_BATCH" "$@"
echo "Running train.py ${train_args[*]}"
apptainer exec --nv "$CONTAINER_PATH" "${launcher[@]}" --standalone --nnodes=1 --nproc_per_node=1 \
    "$PROJECT_DIR/train.py" "${train_args[@]}" &
training_pid=$!
finish_one_node_job singlegpu_job.sh  # its status; after the time limit's stop, requeued
