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

die() { echo "error: $*" >&2; exit 2; }

# A variable one slip (a letter missing, extra, wrong, or two swapped) from a setting of this
# script is ignored without a word: PER_GPU_BACTH=128 would train at 256. It gets a warning.
misspelt() {  # the exported variables one slip from a name among the arguments: "VARIABLE SETTING" lines
    compgen -e | awk -v known="$*" '
        function slip(a, b,    t, i, d, p) {
            if (length(a) < length(b)) { t = a; a = b; b = t }
            if (length(a) == length(b)) {
                for (i = 1; i <= length(a); i++) if (substr(a, i, 1) != substr(b, i, 1)) { if (!d++) p = i }
                return d == 1 || (d == 2 && substr(a, p, 1) == substr(b, p + 1, 1) &&
                                  substr(a, p + 1, 1) == substr(b, p, 1))
            }
            if (length(a) != length(b) + 1) return 0
            for (i = 1; i <= length(a); i++) if (substr(a, 1, i - 1) substr(a, i + 1) == b) return 1
            return 0
        }
        BEGIN { n = split(known, names, " "); for (i = 1; i <= n; i++) is[names[i]] = 1 }
        !($0 in is) { for (i = 1; i <= n; i++) if (slip($0, names[i])) { print $0, names[i]; break } }'
}

while read -r variable setting; do
    echo "warning: $variable is set, but this script has no such setting; did you mean $setting?" >&2
done < <(misspelt CONTAINER_PATH PROJECT_DIR NPROC_PER_NODE PER_GPU_BATCH BASE_LR GPU_LOG_INTERVAL GPU_LOG_FILE \
    CHECKPOINT_DIR STOP_FILE REQUEUE_MIN_S TORCHRUN_PATH OMP_NUM_THREADS TORCH_NCCL_ASYNC_ERROR_HANDLING)

# The variables that shape the recipe, as given: a job continued by hand needs them (requeue()).
recipe_env=()
for name in PER_GPU_BATCH BASE_LR NPROC_PER_NODE; do
    [[ -z "${!name:-}" ]] || recipe_env+=("$name=${!name}")
done
CONTAINER_PATH="${CONTAINER_PATH:-/cluster/work/support/container/pytorch_nvidia_25.06_arm64.sif}"
PROJECT_DIR="${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}"
NPROC_PER_NODE="${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"
PER_GPU_BATCH="${PER_GPU_BATCH:-256}"
BASE_LR="${BASE_LR:-}"  # empty: 0.04 (the guide's) for SGD, recipe.py's default for another --optimizer
GPU_LOG_INTERVAL="${GPU_LOG_INTERVAL:-5}"
GPU_LOG_FILE="${GPU_LOG_FILE:-multigpu_${SLURM_JOB_ID:-local}_gpu.csv}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-checkpoints/multigpu_${SLURM_JOB_ID:-local}}"
STOP_FILE="${STOP_FILE:-$PWD/.multigpu_${SLURM_JOB_ID:-local}.stop}"
REQUEUE_MIN_S="${REQUEUE_MIN_S:-300}"  # a job that ran less is not requeued: see requeue() below
GPU_QUERY="timestamp,index,name,utilization.gpu,utilization.memory,memory.total,memory.used"
TORCHRUN_PATH="${TORCHRUN_PATH:-}"
launcher=(python3 "$PROJECT_DIR/tools/torchrun.py")
[[ -z "$TORCHRUN_PATH" ]] || launcher=("$TORCHRUN_PATH")

[[ "$PER_GPU_BATCH" =~ ^[1-9][0-9]*$ ]] || die "PER_GPU_BATCH=$PER_GPU_BATCH is not a positive whole number of images"
# A non-negative decimal as Python's float() reads it, and not zero (0, 0.0, 0e5): nothing would train.
[[ -z "$BASE_LR" || ( "$BASE_LR" =~ ^([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][-+]?[0-9]+)?$ &&
   ! "$BASE_LR" =~ ^0*[.]?0*([eE].*)?$ ) ]] || die "BASE_LR=$BASE_LR is not a positive number (e.g. 0.01 or 1e-2)"
[[ "$GPU_LOG_INTERVAL" =~ ^[1-9][0-9]*$ ]] || die "GPU_LOG_INTERVAL=$GPU_LOG_INTERVAL is not a positive whole number of seconds"
gpu_log_dir="$(dirname -- "$GPU_LOG_FILE")"  # nvidia-smi appends to it in the background: a failure there is silent
[[ -d "$gpu_log_dir" && -w "$gpu_log_dir" ]] ||
    die "GPU_LOG_FILE=$GPU_LOG_FILE: its folder $gpu_log_dir does not exist or cannot be written"
# nvidia-smi appends to GPU_LOG_FILE: a file of other content, a user's own named by mistake, is
# refused rather than appended to. A requeued job's is its own, whatever nvidia-smi wrote there.
if [[ "${SLURM_RESTART_COUNT:-0}" == 0 ]] &&
    [[ -s "$GPU_LOG_FILE" || ( -e "$GPU_LOG_FILE" && ! -f "$GPU_LOG_FILE" ) ]] &&
    [[ ! -f "$GPU_LOG_FILE" || "$(head -c 22 -- "$GPU_LOG_FILE")" != "timestamp, index, name" ]]; then
    die "GPU_LOG_FILE=$GPU_LOG_FILE exists and is not a GPU log (nvidia-smi's CSV); set GPU_LOG_FILE to a" \
        "path of its own"
fi
# PyTorch's values: 0 (no handling), 1 (abort the communicator, then tear down), 2 (clean up
# only), 3 (tear down without aborting). PyTorch reads it only where a NCCL group is made: a slip
# would pass a CPU trial run unnoticed and be met on the GPUs.
[[ "${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}" =~ ^[0-3]$ ]] ||
    die "TORCH_NCCL_ASYNC_ERROR_HANDLING=$TORCH_NCCL_ASYNC_ERROR_HANDLING is not one of PyTorch's 0, 1, 2 or 3" \
        "(unset: 3, a hung NCCL collective ends the job)"
[[ -f "$CONTAINER_PATH" ]] || die "container image $CONTAINER_PATH not found (set CONTAINER_PATH)"
[[ "$REQUEUE_MIN_S" =~ ^[0-9]+$ ]] || die "REQUEUE_MIN_S=$REQUEUE_MIN_S is not a whole number of seconds"
# STOP_FILE is the job's own (removed when training stops on it, and when the job ends): a
# path that holds anything but an empty file (a request left by an earlier run of the job) is
# someone's data, refused.
if [[ -e "$STOP_FILE" || -L "$STOP_FILE" ]]; then
    [[ -f "$STOP_FILE" && ! -L "$STOP_FILE" && ! -s "$STOP_FILE" ]] ||
        die "STOP_FILE=$STOP_FILE exists and is not an empty file, and the job removes its stop file; set" \
            "STOP_FILE to a path of its own"
elif ! { : >>"$STOP_FILE" && rm -f "$STOP_FILE"; } 2>/dev/null; then
    die "STOP_FILE=$STOP_FILE cannot be created, and the stop before the time limit needs it (set STOP_FILE)"
fi
for script in train_ddp.py tools/torchrun.py; do
    [[ -f "$PROJECT_DIR/$script" ]] ||
        die "no $script in $PROJECT_DIR (submit from the project directory or set PROJECT_DIR)"
done
if [[ ! "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]]; then
    [[ -z "$NPROC_PER_NODE" ]] ||
        die "NPROC_PER_NODE=$NPROC_PER_NODE is not a positive whole number of processes (one per GPU)"
    die "GPUs per node unknown: SLURM_GPUS_ON_NODE is unset (request --gpus-per-node) and NPROC_PER_NODE is not set"
fi

# The folder training really uses: a --checkpoint-dir among the arguments overrides
# CHECKPOINT_DIR (the training scripts accept no abbreviation of it); and the optimizer.
optimizer=sgd
args=("$@")
checkpoint_given=""  # set when --checkpoint-dir among the arguments names the folder
for i in "${!args[@]}"; do
    case "${args[i]}" in
        --checkpoint-dir) CHECKPOINT_DIR="${args[i + 1]:-$CHECKPOINT_DIR}"; checkpoint_given=1 ;;
        --checkpoint-dir=*) CHECKPOINT_DIR="${args[i]#--checkpoint-dir=}"; checkpoint_given=1 ;;
        --optimizer) optimizer="${args[i + 1]:-sgd}" ;;
        --optimizer=*) optimizer="${args[i]#--optimizer=}" ;;
        --stop-file | --stop-file=*)  # training would watch it, not the file the USR1 trap creates
            die "--stop-file: this script gives training its own, STOP_FILE=$STOP_FILE, which the time limit's" \
                "USR1 creates; set STOP_FILE instead" ;;
    esac
done
# A CHECKPOINT_DIR that training could not use is refused here, naming the variable: training's
# own check would name --checkpoint-dir, a flag the user did not type.
if [[ -z "$checkpoint_given" ]]; then
    existing="$CHECKPOINT_DIR"  # the folder, or the nearest of its parents that exists
    while [[ ! -e "$existing" && ! -L "$existing" && "$existing" != "$(dirname -- "$existing")" ]]; do
        existing="$(dirname -- "$existing")"
    done
    if [[ -e "$CHECKPOINT_DIR" && ! -d "$CHECKPOINT_DIR" ]]; then
        die "CHECKPOINT_DIR=$CHECKPOINT_DIR is a file, not a folder (set CHECKPOINT_DIR to a folder)"
    elif [[ ! -d "$existing" || ! -w "$existing" ]]; then
        die "CHECKPOINT_DIR=$CHECKPOINT_DIR cannot be written: $existing is not a writable folder (set CHECKPOINT_DIR)"
    fi
fi
[[ -n "$BASE_LR" || "$optimizer" != sgd ]] || BASE_LR=0.04  # the guide's LR is an SGD one
lr_flags=()
[[ -z "$BASE_LR" ]] || lr_flags=(--base-lr "$BASE_LR")

# A hung NCCL collective (a frozen GPU or node, a dead link) tears the process down with an
# error instead of holding the allocation until the time limit: 3 = tear down without
# aborting the communicator first (1 would call ncclCommAbort, which can hang on a hung
# communicator itself). PyTorch's default today, set so that it holds whatever the
# container's PyTorch defaults to. train_ddp.py writes each rank's NCCL flight recorder into
# the checkpoint folder when a collective times out (docs/checkpoints.md).
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}"

# Each rank's CPU threads (PyTorch's intra-op pool): the task's cores shared by this node's
# ranks, 72 / 4 = 18 on Olivia. torchrun would set 1 and print a warning in every job log.
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    cpus="${SLURM_CPUS_PER_TASK:-$(nproc)}"
    [[ "$cpus" =~ ^[1-9][0-9]*$ ]] || die "SLURM_CPUS_PER_TASK=$cpus is not a positive whole number of cores"
    OMP_NUM_THREADS=$(( cpus / NPROC_PER_NODE > 0 ? cpus / NPROC_PER_NODE : 1 ))
fi
[[ "$OMP_NUM_THREADS" =~ ^[1-9][0-9]*$ ]] || die "OMP_NUM_THREADS=$OMP_NUM_THREADS is not a positive whole number of threads"
export APPTAINERENV_OMP_NUM_THREADS="$OMP_NUM_THREADS"  # (the prefix: over whatever the container sets)

# Sample GPU utilization in the background (appending: a requeued job keeps the first
# run's samples); on any exit stop exactly this monitor (by PID) and drop the stop file.
rm -f "$STOP_FILE"
nvidia-smi --query-gpu="$GPU_QUERY" --format=csv -l "$GPU_LOG_INTERVAL" >>"$GPU_LOG_FILE" &
monitor_pid=$!
trap 'kill "$monitor_pid" 2>/dev/null || true; rm -f "$STOP_FILE"' EXIT

# Slurm sends USR1 to this shell 300 s before the time limit (--signal=B:USR1@300). Training
# runs in the background so the trap fires at once. It creates STOP_FILE: training sees it,
# checkpoints and exits 0 (no signal reaches torchrun, which would report a crash). The
# job is then requeued, and training continues from the checkpoint (--resume=auto).
stop_requested=""
trap 'stop_requested=1; touch "$STOP_FILE" || echo "warning: cannot create $STOP_FILE" >&2' USR1

# Ctrl-C where the script runs at a terminal (bash multigpu_job.sh): torchrun passes the SIGINT on, and
# training stops after its current step with a checkpoint; the script waits for that instead of
# returning to the prompt with training still printing. The stop file asks the same of a launcher
# that ignores SIGINT. The job is not requeued: the same command continues from the checkpoint.
# A second Ctrl-C ends training at once (SIGTERM: a checkpoint too, if it can).
training_pid=""
interrupted=""
# shellcheck disable=SC2329  # run by the trap below
on_interrupt() {
    [[ -n "$training_pid" ]] || exit 130  # training has not started: nothing to stop
    if [[ -n "$interrupted" ]]; then
        kill -TERM "$training_pid" 2>/dev/null || true
        return
    fi
    interrupted=1
    touch "$STOP_FILE" 2>/dev/null || true
    echo "Ctrl-C: training stops after its current step and writes a checkpoint (Ctrl-C again: at once)" >&2
}
trap on_interrupt INT

# A job that ran less than REQUEUE_MIN_S (300 s, the signal's margin) is not requeued: its time
# limit leaves so little past the margin that each requeued run would stop soon after starting.
requeue() {
    if ((SECONDS < REQUEUE_MIN_S)); then
        local again=""  # this job's own arguments, and its checkpoint folder
        ((${#args[@]} == 0)) || again="$(printf ' %q' "${args[@]}")"
        [[ " ${args[*]}" == *" --checkpoint-dir"* ]] || again+=" --checkpoint-dir $(printf '%q' "$CHECKPOINT_DIR")"
        local env=""  # PER_GPU_BATCH=16 and the like: the checkpoint refuses another recipe
        ((${#recipe_env[@]} == 0)) || env="$(printf '%q ' "${recipe_env[@]}")"
        echo "Not requeueing job $SLURM_JOB_ID: it ran $SECONDS s, less than REQUEUE_MIN_S=$REQUEUE_MIN_S, as" \
            "its time limit leaves little past the 300 s stop margin; continue it with a longer --time:" \
            "${env}sbatch --time=HH:MM:SS multigpu_job.sh$again" >&2
        return
    fi
    echo "Requeueing job $SLURM_JOB_ID before its time limit: it continues from $CHECKPOINT_DIR"
    scontrol requeue "$SLURM_JOB_ID"
}

# The guide's early stop (--target-accuracy 0.95 --patience 2) is the default on its data sets; your
# own data (--dataset folder) trains all --epochs. Either is one flag after the script's name.
# --standalone: torchrun runs its own rendezvous on a free local port.
apptainer exec --nv "$CONTAINER_PATH" "${launcher[@]}" --standalone --nnodes=1 --nproc_per_node="$NPROC_PER_NODE" \
    "$PROJECT_DIR/train_ddp.py" --batch-size "$((PER_GPU_BATCH * NPROC_PER_NODE))" --epochs 100 \
    "${lr_flags[@]}" --checkpoint-dir "$CHECKPOINT_DIR" --resume=auto \
    --stop-file "$STOP_FILE" --save-weights "$CHECKPOINT_DIR/weights.pt" "$@" &
training_pid=$!
status=0
wait "$training_pid" || status=$?
while kill -0 "$training_pid" 2>/dev/null; do  # wait returned early to run the trap
    status=0
    wait "$training_pid" || status=$?
done
if [[ -n "$interrupted" ]]; then
    echo "Interrupted (Ctrl-C): the same command continues from $CHECKPOINT_DIR (--resume=auto)" >&2
    exit 130
fi
if [[ -n "$stop_requested" && "$status" -eq 0 ]]; then
    if [[ -e "$STOP_FILE" ]]; then  # training removes the stop file it stops on: it finished first
        echo "Training finished before the stop request took effect: the job is done, not requeued"
    else
        requeue
    fi
fi
exit "$status"
