# shellcheck shell=bash
# What the three job scripts share, sourced by each from PROJECT_DIR (Slurm runs a copy of
# the script, not the file beside this one). The functions read and set the job script's
# own variables, named in each one's comment. The checks (check_*, read_arguments) end the
# job with one line and status 2 on a setting it cannot use, before anything runs; the rest
# is the life of the job: its stop before the time limit, Ctrl-C and the requeue.

die() { echo "error: $*" >&2; exit 2; }

# A variable one slip (a letter missing, extra, wrong, or two swapped) from a setting of the
# script is ignored without a word: PER_GPU_BACTH=128 would train at 256. It gets a warning.
warn_misspelt() {  # warn_misspelt SETTING...: one warning per exported variable one slip from a SETTING
    local variable setting
    while read -r variable setting; do
        echo "warning: $variable is set, but this script has no such setting; did you mean $setting?" >&2
    done < <(compgen -e | awk -v known="$*" '
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
        !($0 in is) { for (i = 1; i <= n; i++) if (slip($0, names[i])) { print $0, names[i]; break } }')
}

recipe_settings() {  # recipe_settings NAME...: recipe_env=(NAME=value ...) of those set, for requeue's line
    local name
    recipe_env=()
    for name in "$@"; do
        [[ -z "${!name:-}" ]] || recipe_env+=("$name=${!name}")
    done
}

whole_number() {  # whole_number NAME UNIT: NAME's value is a whole number of UNIT above zero
    [[ "${!1}" =~ ^[1-9][0-9]*$ ]] || die "$1=${!1} is not a positive whole number of $2"
}

decimal_re='^([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][-+]?[0-9]+)?$'  # a non-negative decimal, as Python's float() reads it
zero_re='^0*[.]?0*([eE].*)?$'  # 0, 0.0, 0e5: nothing would train

# PER_GPU_BATCH, BASE_LR, GPU_LOG_INTERVAL, CONTAINER_PATH (and apptainer to run it, and
# TORCHRUN_PATH in it), REQUEUE_MIN_S and STOP_FILE, and the
# GPU log: the folder of GPU_LOG_VARIABLE's value (GPU_LOG_FILE, or GPU_LOG_PREFIX for a file per
# node), since nvidia-smi appends to it in the background, where a failure is silent, and the
# GPU_LOG files known now (check_gpu_log).
check_job_settings() {  # check_job_settings GPU_LOG_VARIABLE [GPU_LOG...]
    whole_number PER_GPU_BATCH images
    [[ -z "$BASE_LR" || ( "$BASE_LR" =~ $decimal_re && ! "$BASE_LR" =~ $zero_re ) ]] ||
        die "BASE_LR=$BASE_LR is not a positive number (e.g. 0.01 or 1e-2)"
    whole_number GPU_LOG_INTERVAL seconds
    # Each rank's CPU threads reach the container with the rest of the environment: libgomp
    # would print "Invalid value" per process and go on with its default.
    [[ -z "${OMP_NUM_THREADS:-}" ]] || whole_number OMP_NUM_THREADS threads
    local gpu_log_dir
    gpu_log_dir="$(dirname -- "${!1}")"
    [[ -d "$gpu_log_dir" && -w "$gpu_log_dir" ]] ||
        die "$1=${!1}: its folder $gpu_log_dir does not exist or cannot be written"
    local gpu_log
    for gpu_log in "${@:2}"; do
        check_gpu_log "$gpu_log" "$1"
    done
    [[ -f "$CONTAINER_PATH" ]] || die "container image $CONTAINER_PATH not found (set CONTAINER_PATH)"
    command -v apptainer >/dev/null ||
        die "apptainer not found on this node's PATH: the job runs training with it, in CONTAINER_PATH=$CONTAINER_PATH"
    # TORCHRUN_PATH is a program inside the container (the guide's /usr/local/bin/torchrun). Status
    # 97 is the container's "not a program" (dash's command -v also finds folders); any other
    # failure is apptainer's, which has said why.
    if [[ -n "$TORCHRUN_PATH" ]]; then
        local found=0
        # shellcheck disable=SC2016  # $1 and $p are the container shell's: TORCHRUN_PATH, passed as its argument
        apptainer exec "$CONTAINER_PATH" sh -c \
            'p="$(command -v "$1")" || exit 97; case "$p" in /*) [ -f "$p" ] && [ -x "$p" ] || exit 97 ;; esac' \
            sh "$TORCHRUN_PATH" || found=$?
        ((found != 97)) || die "TORCHRUN_PATH=$TORCHRUN_PATH is not a program in the container $CONTAINER_PATH" \
            "(apptainer exec $CONTAINER_PATH which torchrun shows its own)"
        ((found == 0)) || die "apptainer could not run the container CONTAINER_PATH=$CONTAINER_PATH (status $found)"
    fi
    [[ "$REQUEUE_MIN_S" =~ ^[0-9]+$ ]] || die "REQUEUE_MIN_S=$REQUEUE_MIN_S is not a whole number of seconds"
    # STOP_FILE is the job's own: created empty, removed when training stops on it and when the
    # job ends, left behind only by a job killed before its EXIT trap ran. So on a requeued job's
    # start an empty file there is that job's request, and is removed (start_monitor_and_traps);
    # anything else, and any file at a first start (an empty __init__.py too), is someone's: refused.
    if [[ -e "$STOP_FILE" || -L "$STOP_FILE" ]]; then
        [[ "${SLURM_RESTART_COUNT:-0}" != 0 && -f "$STOP_FILE" && ! -L "$STOP_FILE" && ! -s "$STOP_FILE" ]] ||
            die "STOP_FILE=$STOP_FILE exists, and the job removes its stop file: set STOP_FILE to a path of its" \
                "own (or remove the file, if a killed run of this job left it)"
    elif ! { : >>"$STOP_FILE" && rm -f "$STOP_FILE"; } 2>/dev/null; then
        die "STOP_FILE=$STOP_FILE cannot be created, and the stop before the time limit needs it (set STOP_FILE)"
    fi
}

# nvidia-smi appends to the GPU log: a file of other content, a user's own named by mistake, is
# refused rather than appended to. A requeued job's is its own, whatever nvidia-smi wrote there.
check_gpu_log() {  # check_gpu_log FILE VARIABLE: FILE, made from VARIABLE's value, is empty or a GPU log
    local file="$1" variable="$2" named=""
    [[ "$file" == "${!variable}" ]] || named=": $file"
    if [[ "${SLURM_RESTART_COUNT:-0}" == 0 ]] &&
        [[ -s "$file" || ( -e "$file" && ! -f "$file" ) ]] &&
        [[ ! -f "$file" || "$(head -c 22 -- "$file")" != "timestamp, index, name" ]]; then
        die "$variable=${!variable}$named exists and is not a GPU log (nvidia-smi's CSV); set $variable to a" \
            "path of its own"
    fi
}

check_project() {  # check_project SCRIPT...: each is a file of PROJECT_DIR
    local script
    for script in "$@"; do
        [[ -f "$PROJECT_DIR/$script" ]] ||
            die "no $script in $PROJECT_DIR (submit from the project directory or set PROJECT_DIR)"
    done
}

# NPROC_PER_NODE (one process per GPU, Slurm's count by default) and TORCH_NCCL_ASYNC_ERROR_HANDLING.
check_ddp_settings() {
    if [[ ! "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]]; then
        [[ -z "$NPROC_PER_NODE" ]] ||
            die "NPROC_PER_NODE=$NPROC_PER_NODE is not a positive whole number of processes (one per GPU)"
        die "GPUs per node unknown: SLURM_GPUS_ON_NODE is unset (request --gpus-per-node) and NPROC_PER_NODE is not set"
    fi
    # PyTorch's values: 0 (no handling), 1 (abort the communicator, then tear down), 2 (clean up
    # only), 3 (tear down without aborting). PyTorch reads it only where a NCCL group is made: a slip
    # would pass a CPU trial run unnoticed and be met on the GPUs.
    [[ "${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}" =~ ^[0-3]$ ]] ||
        die "TORCH_NCCL_ASYNC_ERROR_HANDLING=$TORCH_NCCL_ASYNC_ERROR_HANDLING is not one of PyTorch's 0, 1, 2 or 3" \
            "(unset: 3, a hung NCCL collective ends the job)"
}

# The job's settings for the processes it starts, exported with APPTAINERENV_ (apptainer passes
# APPTAINERENV_X as X, over whatever the container sets):
# - TORCH_NCCL_ASYNC_ERROR_HANDLING: a hung NCCL collective (a frozen GPU or node, a dead link)
#   tears the process down with an error instead of holding the allocation until the time limit:
#   3 = tear down without aborting the communicator first (1 would call ncclCommAbort, which can
#   hang on a hung communicator itself). PyTorch's default today, set so that it holds whatever
#   the container's PyTorch defaults to. train_ddp.py writes each rank's NCCL flight recorder
#   into the checkpoint folder when a collective times out (docs/checkpoints.md).
# - OMP_NUM_THREADS, each rank's CPU threads (PyTorch's intra-op pool): the task's cores shared
#   by this node's ranks, 72 / 4 = 18 on Olivia. torchrun would set 1 and print a warning in
#   every job log.
export_ddp_settings() {
    export APPTAINERENV_TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}"
    if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
        local cpus
        cpus="${SLURM_CPUS_PER_TASK:-$(nproc)}"
        [[ "$cpus" =~ ^[1-9][0-9]*$ ]] || die "SLURM_CPUS_PER_TASK=$cpus is not a positive whole number of cores"
        OMP_NUM_THREADS=$(( cpus / NPROC_PER_NODE > 0 ? cpus / NPROC_PER_NODE : 1 ))
    fi  # (one the user set: checked by check_job_settings)
    export APPTAINERENV_OMP_NUM_THREADS="$OMP_NUM_THREADS"
}

# The folder training really uses: a --checkpoint-dir among the arguments overrides
# CHECKPOINT_DIR (the training scripts accept no abbreviation of it); the --optimizer, whose
# default LR a DDP job scales; a --stop-file is refused, as training would watch it, not the
# file the USR1 trap creates. A CHECKPOINT_DIR that training could not use is refused here,
# naming the variable: training's own check would name --checkpoint-dir, a flag the user did
# not type.
# shellcheck disable=SC2034  # optimizer: for the DDP job scripts
read_arguments() {  # read_arguments "$@": sets args, CHECKPOINT_DIR and optimizer
    local i given="" existing
    args=("$@")
    optimizer=sgd
    for i in "${!args[@]}"; do
        case "${args[i]}" in
            --checkpoint-dir) CHECKPOINT_DIR="${args[i + 1]:-$CHECKPOINT_DIR}"; given=1 ;;
            --checkpoint-dir=*) CHECKPOINT_DIR="${args[i]#--checkpoint-dir=}"; given=1 ;;
            --optimizer) optimizer="${args[i + 1]:-sgd}" ;;
            --optimizer=*) optimizer="${args[i]#--optimizer=}" ;;
            --stop-file | --stop-file=*)
                die "--stop-file: this script gives training its own, STOP_FILE=$STOP_FILE, which the time" \
                    "limit's USR1 creates; set STOP_FILE instead" ;;
        esac
    done
    [[ -z "$given" ]] || return 0
    existing="$CHECKPOINT_DIR"  # the folder, or the nearest of its parents that exists
    while [[ ! -e "$existing" && ! -L "$existing" && "$existing" != "$(dirname -- "$existing")" ]]; do
        existing="$(dirname -- "$existing")"
    done
    if [[ -e "$CHECKPOINT_DIR" && ! -d "$CHECKPOINT_DIR" ]]; then
        die "CHECKPOINT_DIR=$CHECKPOINT_DIR is a file, not a folder (set CHECKPOINT_DIR to a folder)"
    elif [[ ! -d "$existing" || ! -w "$existing" ]]; then
        die "CHECKPOINT_DIR=$CHECKPOINT_DIR cannot be written: $existing is not a writable folder (set CHECKPOINT_DIR)"
    fi
}

# What training runs with: the job's settings as flags, then the script's arguments, which
# override them (of a flag given twice the last counts). BASE_LR empty: no --base-lr, the
# --optimizer's own default. The guide's early stop (--target-accuracy 0.95 --patience 2) is
# the default on its data sets; your own data (--dataset folder) trains all --epochs. Either
# is one flag after the script's name.
# shellcheck disable=SC2034  # train_args: for the job scripts
training_args() {  # training_args BATCH "$@": sets train_args (BATCH: images per step, all GPUs)
    local batch="$1" lr_flags=()
    shift
    [[ -z "$BASE_LR" ]] || lr_flags=(--base-lr "$BASE_LR")
    train_args=(--batch-size "$batch" --epochs 100 "${lr_flags[@]}" --checkpoint-dir "$CHECKPOINT_DIR"
        --resume=auto --stop-file "$STOP_FILE" --save-weights "$CHECKPOINT_DIR/weights.pt" "$@")
}

# The launcher: TORCHRUN_PATH, or (empty) tools/torchrun.py, torchrun ending in training's own
# error line instead of its traceback.
# shellcheck disable=SC2034  # launcher: for the job scripts
choose_launcher() {  # sets launcher
    launcher=(python3 "$PROJECT_DIR/tools/torchrun.py")
    [[ -z "$TORCHRUN_PATH" ]] || launcher=("$TORCHRUN_PATH")
}

# The GPU monitor and the stop requests of a one-node job (multinode_job.sh has its own, per node):
# - nvidia-smi samples the GPUs into GPU_LOG_FILE in the background (appending: a requeued job
#   keeps the first run's samples); on any exit this stops exactly that monitor (by PID) and
#   drops the stop file.
# - Slurm sends USR1 to this shell 300 s before the time limit (--signal=B:USR1@300). Training
#   runs in the background so the trap fires at once. It creates STOP_FILE: global rank 0 sees
#   it, every rank checkpoints and exits 0 (no signal reaches torchrun, which would report a
#   crash). The job is then requeued (after_stop_request), and training continues from the
#   checkpoint (--resume=auto).
# - Ctrl-C where the script runs at a terminal (bash singlegpu_job.sh): on_interrupt.
start_monitor_and_traps() {  # sets monitor_pid, stop_requested, training_pid (empty) and interrupted
    rm -f "$STOP_FILE"
    nvidia-smi --query-gpu="$GPU_QUERY" --format=csv -l "$GPU_LOG_INTERVAL" >>"$GPU_LOG_FILE" &
    monitor_pid=$!
    trap 'kill "$monitor_pid" 2>/dev/null || true; rm -f "$STOP_FILE"' EXIT
    trap_stop_request
    training_pid=""
    interrupted=""
    trap on_interrupt INT
}

trap_stop_request() {  # sets stop_requested, on the USR1 that creates STOP_FILE
    stop_requested=""
    trap 'stop_requested=1; touch "$STOP_FILE" || echo "warning: cannot create $STOP_FILE" >&2' USR1
}

# Ctrl-C: torchrun passes the SIGINT on, and training stops after its current step with a
# checkpoint; the script waits for that instead of returning to the prompt with training still
# printing. The stop file asks the same of a launcher that ignores SIGINT. The job is not
# requeued: the same command continues from the checkpoint. A second Ctrl-C ends training at
# once (SIGTERM: a checkpoint too, if it can).
on_interrupt() {
    [[ -n "$training_pid" ]] || exit 130  # training has not started: nothing to stop
    if [[ -n "$interrupted" ]]; then
        kill -TERM "$training_pid" 2>/dev/null || true
        return 0  # a bare return gives the interrupted wait's 130, which set -e takes for a failure: exit
    fi
    interrupted=1
    touch "$STOP_FILE" 2>/dev/null || true
    echo "Ctrl-C: training stops after its current step and writes a checkpoint (Ctrl-C again: at once)" >&2 || true
}

# The end of a one-node job: training's status, after a Ctrl-C 130 with how to continue, and
# after the time limit's stop the requeue.
finish_one_node_job() {  # finish_one_node_job SBATCH_WORDS: reads training_pid; exits
    wait_for "$training_pid"
    if [[ -n "$interrupted" ]]; then
        echo "Interrupted (Ctrl-C): the same command continues from $CHECKPOINT_DIR (--resume=auto)" >&2
        exit 130
    fi
    after_stop_request requeue "$1"
    exit "$status"
}

wait_for() {  # wait_for PID: sets status to PID's exit status, through the traps that interrupt wait
    status=0
    wait "$1" || status=$?
    while kill -0 "$1" 2>/dev/null; do  # wait returned early to run a trap
        status=0
        wait "$1" || status=$?
    done
}

# A job that ran less than REQUEUE_MIN_S (300 s, the signal's margin) is not requeued: its time
# limit leaves so little past the margin that each requeued run would stop soon after starting.
# It says how to continue: the variables that shape the recipe (recipe_env), this job's own
# arguments (args) and its checkpoint folder. Outside Slurm (bash singlegpu_job.sh, then a USR1)
# there is no job to requeue: the same command continues.
requeue() {  # requeue SBATCH_WORDS [COMMAND...]: SBATCH_WORDS follow "sbatch --time=HH:MM:SS"; COMMAND runs first
    local words="$1"
    shift
    if [[ -z "${SLURM_JOB_ID:-}" ]]; then
        echo "Not requeueing: this is not a Slurm job (no SLURM_JOB_ID); the same command continues from" \
            "$CHECKPOINT_DIR (--resume=auto)"
        return
    fi
    if ((SECONDS < REQUEUE_MIN_S)); then
        local again="" env=""
        ((${#args[@]} == 0)) || again="$(printf ' %q' "${args[@]}")"
        [[ " ${args[*]}" == *" --checkpoint-dir"* ]] || again+=" --checkpoint-dir $(printf '%q' "$CHECKPOINT_DIR")"
        ((${#recipe_env[@]} == 0)) || env="$(printf '%q ' "${recipe_env[@]}")"  # the checkpoint refuses another recipe
        echo "Not requeueing job $SLURM_JOB_ID: it ran $SECONDS s, less than REQUEUE_MIN_S=$REQUEUE_MIN_S, as" \
            "its time limit leaves little past the 300 s stop margin; continue it with a longer --time:" \
            "${env}sbatch --time=HH:MM:SS $words$again" >&2
        return
    fi
    echo "Requeueing job $SLURM_JOB_ID before its time limit: it continues from $CHECKPOINT_DIR"
    (($# == 0)) || "$@"
    scontrol requeue "$SLURM_JOB_ID"
}

# After the time limit's USR1 (stop_requested) and a good exit: requeue, unless training finished
# first (training removes the stop file it stops on, so one still there was never acted on).
after_stop_request() {  # after_stop_request COMMAND...: COMMAND requeues the job (requeue and its arguments)
    [[ -n "$stop_requested" && "$status" -eq 0 ]] || return 0
    if [[ -e "$STOP_FILE" ]]; then
        echo "Training finished before the stop request took effect: the job is done, not requeued"
    else
        "$@"
    fi
}
