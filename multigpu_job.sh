#!/bin/bash
# Train with DDP on all GPUs of one node in NVIDIA's PyTorch container (guide part 2).
# Submit from the directory that holds train_ddp.py; arguments are passed on to
# train_ddp.py and override the defaults below:
#
#   sbatch --account=nnXXXXk multigpu_job.sh
#   sbatch --account=nnXXXXk multigpu_job.sh --epochs 10 --metrics-file metrics.jsonl
#   sbatch --account=nnXXXXk multigpu_job.sh --dataset cifar10
#   sbatch --account=nnXXXXk multigpu_job.sh --model my_net.py:Net --dataset folder --data-dir my_images
#   (paths among the arguments are relative to the directory you submit from)
#
# The global batch is PER_GPU_BATCH x GPUs (256 x 4 = 1024, the guide's). Environment
# overrides: CONTAINER_PATH, CHECKPOINT_DIR, PROJECT_DIR (where train_ddp.py is),
# NPROC_PER_NODE (default: the GPUs Slurm gave this node), PER_GPU_BATCH (images), BASE_LR,
# GPU_LOG_INTERVAL (seconds), GPU_LOG_FILE, STOP_FILE, REQUEUE_MIN_S (seconds), OMP_NUM_THREADS
# (default: the task's cores / NPROC_PER_NODE, each rank's CPU threads), TORCHRUN_PATH (empty,
# the default: tools/torchrun.py, torchrun ending in the ranks' own error lines instead of its
# traceback; /usr/local/bin/torchrun: PyTorch's own).
# Training checkpoints into its checkpoint folder (CHECKPOINT_DIR, or --checkpoint-dir among
# the arguments); 300 s before the time limit it is stopped with a checkpoint, the job
# requeues itself and the requeued job resumes from that folder (see README). The final
# weights are written to weights.pt in the same folder.
#SBATCH --job-name=resnet_multigpu
#SBATCH --output=multigpu_%j.out
#SBATCH --error=multigpu_%j.err
#SBATCH --time=01:00:00
#SBATCH --partition=accel
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=72
#SBATCH --mem=440G
#SBATCH --gpus-per-node=4
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
warn_misspelt CONTAINER_PATH PROJECT_DIR NPROC_PER_NODE PER_GPU_BATCH BASE_LR GPU_LOG_INTERVAL GPU_LOG_FILE \
    CHECKPOINT_DIR STOP_FILE REQUEUE_MIN_S TORCHRUN_PATH OMP_NUM_THREADS TORCH_NCCL_ASYNC_ERROR_HANDLING
recipe_settings PER_GPU_BATCH BASE_LR NPROC_PER_NODE  # as given: a job continued by hand needs them (requeue)
CONTAINER_PATH="${CONTAINER_PATH:-/cluster/work/support/container/pytorch_nvidia_25.06_arm64.sif}"
NPROC_PER_NODE="${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"
PER_GPU_BATCH="${PER_GPU_BATCH:-256}"
BASE_LR="${BASE_LR:-}"  # empty: 0.04 (the guide's) for SGD, recipe.py's default for another --optimizer
GPU_LOG_INTERVAL="${GPU_LOG_INTERVAL:-5}"
GPU_LOG_FILE="${GPU_LOG_FILE:-multigpu_${SLURM_JOB_ID:-local}_gpu.csv}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-checkpoints/multigpu_${SLURM_JOB_ID:-local}}"
STOP_FILE="${STOP_FILE:-$PWD/.multigpu_${SLURM_JOB_ID:-local}.stop}"
REQUEUE_MIN_S="${REQUEUE_MIN_S:-300}"  # a job that ran less is not requeued (job_common.sh's requeue)
GPU_QUERY="timestamp,index,name,utilization.gpu,utilization.memory,memory.total,memory.used"
TORCHRUN_PATH="${TORCHRUN_PATH:-}"
choose_launcher

check_job_settings GPU_LOG_FILE "$GPU_LOG_FILE"
check_project train_ddp.py tools/torchrun.py
check_ddp_settings
read_arguments "$@"  # CHECKPOINT_DIR as training will use it, and the optimizer
[[ -n "$BASE_LR" || "$optimizer" != sgd ]] || BASE_LR=0.04  # the guide's LR is an SGD one
export_ddp_settings  # TORCH_NCCL_ASYNC_ERROR_HANDLING (a hung collective ends the job) and OMP_NUM_THREADS

# The GPU monitor into GPU_LOG_FILE, and the traps: the time limit's USR1 and a Ctrl-C stop
# training with a checkpoint, and the job requeues itself after the USR1 (job_common.sh).
start_monitor_and_traps

# What training runs with (job_common.sh's training_args), printed for reading (not quoted): the
# job log shows the flags an error may name.
training_args "$((PER_GPU_BATCH * NPROC_PER_NODE))" "$@"
echo "Running train_ddp.py ${train_args[*]} on $NPROC_PER_NODE GPUs (batch: PER_GPU_BATCH x GPUs)"
# --standalone: torchrun runs its own rendezvous on a free local port.
apptainer exec --nv "$CONTAINER_PATH" "${launcher[@]}" --standalone --nnodes=1 --nproc_per_node="$NPROC_PER_NODE" \
    "$PROJECT_DIR/train_ddp.py" "${train_args[@]}" &
training_pid=$!
finish_one_node_job multigpu_job.sh  # its status; after the time limit's stop, requeued
