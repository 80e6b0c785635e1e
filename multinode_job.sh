#!/bin/bash
# Train with DDP on several nodes in NVIDIA's PyTorch container (guide part 3): one srun
# task per node runs torchrun, which starts one process per GPU; the nodes meet at a c10d
# rendezvous whose store this script runs on the first node for the whole job. The host's
# libfabric, NCCL and aws-ofi-nccl are bound into the container so NCCL can use Slingshot.
# Submit from the directory that holds train_ddp.py; arguments are passed on to
# train_ddp.py and override the defaults below:
#
#   sbatch --account=nnXXXXk multinode_job.sh
#   sbatch --account=nnXXXXk --nodes=4 multinode_job.sh --epochs 10
#   sbatch --account=nnXXXXk multinode_job.sh --dataset fashion-mnist
#   sbatch --account=nnXXXXk multinode_job.sh --model my_net.py:Net --dataset folder --data-dir my_images
#   (paths among the arguments are relative to the directory you submit from)
#
# The global batch is PER_GPU_BATCH x nodes x GPUs per node (256 x 2 x 4 = 2048, the
# guide's). Environment overrides: CONTAINER_PATH, CHECKPOINT_DIR, PROJECT_DIR, NPROC_PER_NODE,
# PER_GPU_BATCH, BASE_LR, RDZV_HOST, RDZV_PORT, TORCHRUN_PATH (empty: tools/torchrun.py, which
# ends in the ranks' own error lines, not torchrun's traceback), the HOST_*_PATH library paths,
# GPU_LOG_INTERVAL, GPU_LOG_PREFIX, STOP_FILE, REQUEUE_MIN_S, OMP_NUM_THREADS (default: the
# task's cores / NPROC_PER_NODE, each rank's CPU threads), every network setting in NETWORK_DEFAULTS
# below (on a cluster other than Olivia: docs/network.md, "On another cluster"), and:
#   HOST_BINDS=1          1 (default): bind the host's libfabric, NCCL and aws-ofi-nccl (HOST_*_PATH) into
#                         the container; 0: use the container's own NCCL (InfiniBand, Ethernet)
#   NCCL_NET="AWS Libfabric"  with HOST_BINDS=1: the network NCCL must use (the plugin) or stop
#   NCCL_NET_PLUGIN=      NAME: NCCL loads lib/libnccl-net-NAME.so of HOST_NCCL_PATH, not libnccl-net.so
# and for the network check (export them before sbatch):
#   NETWORK_CHECK=1       1 (default): run check_network.py on every node before training; 0: skip it
#   NETWORK_MIN_BUSBW=    GB/s the check's largest all-reduce must reach (--min-busbw); empty: no minimum
#   NETWORK_CHECK_ARGS=   more check_network.py flags, e.g. "--max-size 1G --iters 50" (docs/network.md)
# Before training, check_network.py all-reduces 1 KiB to 256 MiB on every GPU over the same
# path (seconds), checks every result exactly, prints a table of busbw and the network NCCL
# chose, and warns when that is plain TCP sockets instead of Slingshot. If it fails (a wrong
# result, busbw below NETWORK_MIN_BUSBW, a rank lost), the job stops with its status before
# training starts and is not requeued.
# Training checkpoints into its checkpoint folder (CHECKPOINT_DIR, or --checkpoint-dir among
# the arguments; on a shared file system); 300 s before the time limit it is stopped with a
# checkpoint, the job requeues itself and the requeued job resumes from that folder (see
# README). The final weights are written to weights.pt in the same folder.
#SBATCH --job-name=resnet_multinode
#SBATCH --output=multinode_%j.out
#SBATCH --error=multinode_%j.err
#SBATCH --time=01:00:00
#SBATCH --partition=accel
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=72
#SBATCH --mem=440G
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
# A job that cannot run here (a difference between this cluster and Olivia, a port in use):
# exit 1, not requeued, since the same job would fail again.
fail() { echo "error: $*" >&2; exit 1; }
site_error() { fail "$*; see docs/network.md, \"On another cluster\""; }

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
TORCHRUN_PATH="${TORCHRUN_PATH:-}"  # empty: tools/torchrun.py (torchrun ending in the ranks' lines, not its traceback)
GPU_LOG_INTERVAL="${GPU_LOG_INTERVAL:-5}"
GPU_LOG_PREFIX="${GPU_LOG_PREFIX:-multinode_${SLURM_JOB_ID:-local}_gpu}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-checkpoints/multinode_${SLURM_JOB_ID:-local}}"
STOP_FILE="${STOP_FILE:-$PWD/.multinode_${SLURM_JOB_ID:-local}.stop}"  # shared: rank 0 may be on any node
REQUEUE_MIN_S="${REQUEUE_MIN_S:-300}"  # a job that ran less is not requeued: see requeue() below
EXIT_STOPPED=75  # train_ddp.py's status after a stop on a signal, its checkpoint written (engine/errors.py)
GPU_QUERY="timestamp,index,name,utilization.gpu,utilization.memory,memory.total,memory.used"
HOST_LIBFABRIC_LIB_PATH="${HOST_LIBFABRIC_LIB_PATH:-/opt/cray/libfabric/1.22.0/lib64}"
HOST_LIBFABRIC_INCLUDE_PATH="${HOST_LIBFABRIC_INCLUDE_PATH:-/opt/cray/libfabric/1.22.0/include}"
HOST_NCCL_PATH="${HOST_NCCL_PATH:-/cluster/work/support/nccl}"
HOST_NVIDIA_HPC_LIB_PATH="${HOST_NVIDIA_HPC_LIB_PATH:-/opt/nvidia/hpc_sdk/Linux_aarch64/24.11/compilers/lib}"
HOST_CXI_LIB_PATH="${HOST_CXI_LIB_PATH:-/usr/lib64}"  # holds libcxi.so.1
HOST_BINDS="${HOST_BINDS:-1}"
NETWORK_CHECK="${NETWORK_CHECK:-1}"
NETWORK_MIN_BUSBW="${NETWORK_MIN_BUSBW:-}"
NETWORK_CHECK_ARGS="${NETWORK_CHECK_ARGS:-}"

# HPE's recommended Slingshot settings, which the site's NCCL module sets on the host but a
# container does not get unless passed in, and NCCL_PROTO=^LL128: recent NCCL versions can
# silently corrupt data between GH200 nodes in the LL128 protocol (NVIDIA/nccl issue 2001).
# GLOO_SOCKET_IFNAME puts the gloo control group (the per-step stop agreement, checkpoint
# decisions) on Slingshot too: by default gloo binds to the address the host name resolves
# to, which may be loopback (then the group cannot form and hangs) or the slow management
# Ethernet.
NETWORK_DEFAULTS=(
    FI_PROVIDER=cxi
    FI_CXI_RX_MATCH_MODE=hybrid
    FI_MR_CACHE_MONITOR=userfaultfd
    FI_CXI_DISABLE_HOST_REGISTER=1
    FI_CXI_DEFAULT_CQ_SIZE=131072
    FI_CXI_DEFAULT_TX_SIZE=2048
    FI_CXI_RDZV_PROTO=alt_read
    FI_CXI_RDZV_EAGER_SIZE=0
    FI_CXI_RDZV_THRESHOLD=0
    FI_CXI_RDZV_GET_MIN=0
    NCCL_CROSS_NIC=1
    NCCL_NET_GDR_LEVEL=PHB
    "NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3"
    GLOO_SOCKET_IFNAME=hsn0
    NCCL_PROTO=^LL128
)
# APPTAINERENV_X becomes X inside the container. (apptainer --env would cut values at
# commas in some versions, e.g. NCCL_SOCKET_IFNAME.) A value exported before sbatch wins.
for setting in "${NETWORK_DEFAULTS[@]}"; do
    name="${setting%%=*}"
    export "APPTAINERENV_${name}=${!name:-${setting#*=}}"
done
while read -r variable setting; do
    echo "warning: $variable is set, but this script has no such setting; did you mean $setting?" >&2
done < <(misspelt CONTAINER_PATH PROJECT_DIR NPROC_PER_NODE PER_GPU_BATCH BASE_LR GPU_LOG_INTERVAL GPU_LOG_PREFIX \
    CHECKPOINT_DIR STOP_FILE REQUEUE_MIN_S TORCHRUN_PATH OMP_NUM_THREADS TORCH_NCCL_ASYNC_ERROR_HANDLING RDZV_HOST \
    RDZV_PORT HOST_BINDS HOST_LIBFABRIC_LIB_PATH HOST_LIBFABRIC_INCLUDE_PATH HOST_NCCL_PATH HOST_NVIDIA_HPC_LIB_PATH \
    HOST_CXI_LIB_PATH NCCL_NET NCCL_NET_PLUGIN NETWORK_CHECK NETWORK_MIN_BUSBW NETWORK_CHECK_ARGS)

[[ "$PER_GPU_BATCH" =~ ^[1-9][0-9]*$ ]] || die "PER_GPU_BATCH=$PER_GPU_BATCH is not a positive whole number of images"
number='^([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][-+]?[0-9]+)?$'  # a non-negative decimal, as Python's float() reads it
zero='^0*[.]?0*([eE].*)?$'  # 0, 0.0, 0e5: nothing would train
[[ -z "$BASE_LR" || ( "$BASE_LR" =~ $number && ! "$BASE_LR" =~ $zero ) ]] ||
    die "BASE_LR=$BASE_LR is not a positive number (e.g. 0.01 or 1e-2)"
[[ "$GPU_LOG_INTERVAL" =~ ^[1-9][0-9]*$ ]] || die "GPU_LOG_INTERVAL=$GPU_LOG_INTERVAL is not a positive whole number of seconds"
gpu_log_dir="$(dirname -- "$GPU_LOG_PREFIX")"  # nvidia-smi appends to it in the background: a failure there is silent
[[ -d "$gpu_log_dir" && -w "$gpu_log_dir" ]] ||
    die "GPU_LOG_PREFIX=$GPU_LOG_PREFIX: its folder $gpu_log_dir does not exist or cannot be written"
[[ "$HOST_BINDS" == 0 || "$HOST_BINDS" == 1 ]] ||
    die "HOST_BINDS=$HOST_BINDS is neither 1 (bind the host's network libraries) nor 0 (the container's own)"
[[ "$NETWORK_CHECK" == 0 || "$NETWORK_CHECK" == 1 ]] ||
    die "NETWORK_CHECK=$NETWORK_CHECK is neither 1 (check the network before training) nor 0 (skip the check)"
[[ -z "$NETWORK_MIN_BUSBW" || "$NETWORK_MIN_BUSBW" =~ $number ]] ||
    die "NETWORK_MIN_BUSBW=$NETWORK_MIN_BUSBW is not a number of GB/s"
flags_only='^[-A-Za-z0-9_.=+ ]*$'  # check_network.py checks the flags; no quotes, globs or shell syntax
[[ "$NETWORK_CHECK_ARGS" =~ $flags_only ]] ||
    die "NETWORK_CHECK_ARGS=$NETWORK_CHECK_ARGS may hold only check_network.py flags and their values"
read -r -a network_check_args <<<"$NETWORK_CHECK_ARGS"
[[ -z "$NETWORK_MIN_BUSBW" ]] || network_check_args+=(--min-busbw "$NETWORK_MIN_BUSBW")
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
# The host's network libraries (Olivia's paths by default), checked here on the first node:
# apptainer would refuse a missing one once per task, in its own words.
binds=()
if [[ "$HOST_BINDS" == 1 ]]; then
    for variable in HOST_LIBFABRIC_LIB_PATH HOST_LIBFABRIC_INCLUDE_PATH HOST_NCCL_PATH HOST_CXI_LIB_PATH \
        HOST_NVIDIA_HPC_LIB_PATH; do
        [[ -d "${!variable}" ]] || site_error "$variable=${!variable}: no such folder on $(hostname) (a host" \
            "library bound into the container); set $variable to this cluster's path, or HOST_BINDS=0 to use the" \
            "container's own NCCL"
    done
    # The plugin file NCCL opens: libnccl-net.so, or libnccl-net-NAME.so with NCCL_NET_PLUGIN=NAME.
    plugin="libnccl-net${NCCL_NET_PLUGIN:+-$NCCL_NET_PLUGIN}.so"
    named="${NCCL_NET_PLUGIN:+, as NCCL_NET_PLUGIN=$NCCL_NET_PLUGIN names it}"
    [[ -e "$HOST_NCCL_PATH/lib/$plugin" ]] || site_error "HOST_NCCL_PATH=$HOST_NCCL_PATH: no lib/$plugin (the" \
        "aws-ofi-nccl plugin NCCL needs for Slingshot$named) on $(hostname); set HOST_NCCL_PATH to the folder" \
        "holding it, or HOST_BINDS=0 (NCCL then uses its own transports)"
    # With the plugin bound in, NCCL uses it or stops: unset, NCCL falls back to TCP sockets
    # without a word when the plugin does not load (~5 instead of ~100 GB/s between nodes).
    # "AWS Libfabric": the plugin's name up to aws-ofi-nccl 1.11, still accepted by the later
    # ones that call themselves "Libfabric". A value exported before sbatch wins.
    export APPTAINERENV_NCCL_NET="${NCCL_NET:-AWS Libfabric}"
    binds=(--bind "$HOST_LIBFABRIC_LIB_PATH:/opt/libfabric/lib"
        --bind "$HOST_LIBFABRIC_INCLUDE_PATH:/opt/libfabric/include"
        --bind "$HOST_NCCL_PATH:/opt/nccl"
        --bind "$HOST_CXI_LIB_PATH:/usr/lib64"
        --bind "$HOST_NVIDIA_HPC_LIB_PATH:/opt/nvidia/hpc_sdk/lib")
fi
for script in train_ddp.py check_network.py tools/torchrun.py; do
    [[ -f "$PROJECT_DIR/$script" ]] ||
        die "no $script in $PROJECT_DIR (submit from the project directory or set PROJECT_DIR)"
done
if [[ ! "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]]; then
    [[ -z "$NPROC_PER_NODE" ]] ||
        die "NPROC_PER_NODE=$NPROC_PER_NODE is not a positive whole number of processes (one per GPU)"
    die "GPUs per node unknown: SLURM_GPUS_ON_NODE is unset (request --gpus-per-node) and NPROC_PER_NODE is not set"
fi
[[ -n "${SLURM_JOB_NODELIST:-}" && -n "${SLURM_JOB_NUM_NODES:-}" && -n "${SLURM_JOB_ID:-}" ]] ||
    die "not inside a Slurm allocation (SLURM_JOB_NODELIST, SLURM_JOB_NUM_NODES, SLURM_JOB_ID); submit with sbatch"

# The first node of the allocation hosts the rendezvous. The port comes from the job ID
# (29500..32499, below Linux's ephemeral range) so two jobs sharing a node don't collide.
nodes="$(scontrol show hostnames "$SLURM_JOB_NODELIST")" ||
    die "scontrol could not expand SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
# nvidia-smi appends to each node's GPU_LOG_PREFIX_NODE.csv: a file of other content, a user's
# own named by mistake, is refused rather than appended to. A requeued job's are its own.
if [[ "${SLURM_RESTART_COUNT:-0}" == 0 ]]; then
    for node in $nodes; do
        gpu_log="${GPU_LOG_PREFIX}_${node}.csv"
        if [[ -s "$gpu_log" || ( -e "$gpu_log" && ! -f "$gpu_log" ) ]] &&
            [[ ! -f "$gpu_log" || "$(head -c 22 -- "$gpu_log")" != "timestamp, index, name" ]]; then
            die "GPU_LOG_PREFIX=$GPU_LOG_PREFIX: $gpu_log exists and is not a GPU log (nvidia-smi's CSV); set" \
                "GPU_LOG_PREFIX to a path of its own"
        fi
    done
fi
RDZV_HOST="${RDZV_HOST:-${nodes%%$'\n'*}}"
[[ -n "$RDZV_HOST" ]] || die "could not resolve the head node from SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
# A name that does not resolve would leave the store below retrying it until its 120 s are up.
if command -v getent >/dev/null && ! getent hosts "$RDZV_HOST" >/dev/null; then
    die "RDZV_HOST=$RDZV_HOST does not resolve to an address; it names the head node, where this script runs" \
        "(default: the first node of SLURM_JOB_NODELIST)"
fi
RDZV_PORT="${RDZV_PORT:-$((29500 + SLURM_JOB_ID % 3000))}"
[[ "$RDZV_PORT" =~ ^[1-9][0-9]*$ && "$RDZV_PORT" -lt 65536 ]] || die "RDZV_PORT=$RDZV_PORT is not a port number"
echo "Head node: $RDZV_HOST, rendezvous port $RDZV_PORT, nodes: $SLURM_JOB_NUM_NODES, GPUs per node: $NPROC_PER_NODE"

# Runs once per node (host side), as `node-task STEP COMMAND...`: for training (STEP train),
# sample this node's GPUs into its own file; run the container, stop exactly this monitor by
# its PID, and record the status the task ended with by itself in STATUS_DIR (a task that srun
# stops dies with its shell and records nothing: see task_status below).
node_task=$(cat <<'EOF'
step="$1"
shift
# USR1 sent to the job's steps (scancel --signal=USR1 without --batch) reaches this shell, the
# container, torchrun and the ranks at once. It is the ranks' stop request (a checkpoint, then
# status 75): this shell and what it starts ignore it (tools/torchrun.py passes it on).
trap '' USR1
monitor_pid=""
if [[ "$step" == train ]]; then
    monitor_log="${GPU_LOG_PREFIX}_${SLURMD_NODENAME:-$(hostname)}.csv"
    nvidia-smi --query-gpu="$GPU_QUERY" --format=csv -l "$GPU_LOG_INTERVAL" >>"$monitor_log" &
    monitor_pid=$!
fi
status=0
"$@" || status=$?
[[ -z "$monitor_pid" ]] || kill "$monitor_pid" 2>/dev/null || true
echo "$status" >"$STATUS_DIR/$step.${SLURM_NODEID:-0}" || true
exit "$status"
EOF
)
# Runs inside the container: find the bound host libraries first.
# shellcheck disable=SC2016
container_task='
host_libs="$LIBFABRIC_HOME/lib:$NCCL_HOME/lib:$NVIDIA_HPC_HOME/lib:/usr/lib64"
export LD_LIBRARY_PATH="$host_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CPATH="$LIBFABRIC_HOME/include${CPATH:+:$CPATH}"
exec "$@"'
export GPU_LOG_PREFIX GPU_LOG_INTERVAL GPU_QUERY
export APPTAINERENV_LIBFABRIC_HOME=/opt/libfabric APPTAINERENV_NCCL_HOME=/opt/nccl \
    APPTAINERENV_NVIDIA_HPC_HOME=/opt/nvidia/hpc_sdk

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
export APPTAINERENV_TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}"

# Each rank's CPU threads (PyTorch's intra-op pool): the task's cores shared by this node's
# ranks, 72 / 4 = 18 on Olivia. torchrun would set 1 and print a warning in every job log.
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    cpus="${SLURM_CPUS_PER_TASK:-$(nproc)}"
    [[ "$cpus" =~ ^[1-9][0-9]*$ ]] || die "SLURM_CPUS_PER_TASK=$cpus is not a positive whole number of cores"
    OMP_NUM_THREADS=$(( cpus / NPROC_PER_NODE > 0 ? cpus / NPROC_PER_NODE : 1 ))
fi
[[ "$OMP_NUM_THREADS" =~ ^[1-9][0-9]*$ ]] || die "OMP_NUM_THREADS=$OMP_NUM_THREADS is not a positive whole number of threads"
export APPTAINERENV_OMP_NUM_THREADS="$OMP_NUM_THREADS"  # (the prefix: over whatever the container sets)

# Slurm sends USR1 to this shell 300 s before the time limit (--signal=B:USR1@300). Training
# runs in the background so the trap fires at once. It creates STOP_FILE: global rank 0
# sees it, all ranks checkpoint and exit 0 (no signal reaches srun or torchrun, which would
# report a crash). The job is then requeued, and training continues from the checkpoint
# (--resume=auto).
rm -f "$STOP_FILE"
# node_task's statuses: a new folder beside the stop file, where every node sees it.
STATUS_DIR="$(mktemp -d "$(dirname "$STOP_FILE")/.multinode_${SLURM_JOB_ID}.statuses.XXXXXX")" ||
    die "cannot create a folder beside STOP_FILE=$STOP_FILE (for the nodes' exit statuses)"
export STATUS_DIR
store_pid=""
store_ready="$(mktemp)"  # the store server writes "ready" here once it listens
stop_store() {  # the rendezvous store below, once no torchrun needs it; waits until it is gone
    [[ -n "$store_pid" ]] || return 0
    kill -USR2 "$store_pid" 2>/dev/null || true
    wait "$store_pid" 2>/dev/null || true
    store_pid=""
}
trap 'rm -f "$STOP_FILE" "$store_ready" "$STATUS_DIR"/check.* "$STATUS_DIR"/train.*; rmdir "$STATUS_DIR" 2>/dev/null
stop_store' EXIT
stop_requested=""
trap 'stop_requested=1; touch "$STOP_FILE" || echo "warning: cannot create $STOP_FILE" >&2' USR1

# The rendezvous store runs here, on the first node (the default RDZV_HOST), from before the
# first torchrun starts until after the last one has exited; every torchrun is its client
# (is_host=false), and so are the training processes. When a torchrun hosts the store
# (c10d or static rendezvous), the head node's torchrun can exit while the others still
# wait in torchrun's exit barrier or close the rendezvous, and they print a traceback
# ("Error waiting on exit barrier", RendezvousConnectionError) at the end of a good run
# (pytorch/pytorch#118891, #128096; seen in tests/test_slurm.py). scancel's SIGTERM reaches
# every process of the job at once, the store too: it ignores it and serves the torchruns while
# they stop their ranks (else they print C++ stack traces of their lost store into the .err
# file); this script stops it with SIGUSR2 once training has ended (Slurm's SIGKILL, KillWait
# later, at the latest).
# shellcheck disable=SC2016
store_server='
import signal, sys
from datetime import timedelta
import torch.distributed as dist
signal.signal(signal.SIGTERM, signal.SIG_IGN)
try:
    store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, wait_for_workers=False,
                          timeout=timedelta(days=7))
except (RuntimeError, OSError):  # the port is taken: the script says so in one line
    sys.exit(1)
open(sys.argv[3], "w").write("ready")
signal.pause()  # until SIGUSR2 (its default action ends the process, without a traceback)'
apptainer exec "$CONTAINER_PATH" python3 -c "$store_server" "$RDZV_HOST" "$RDZV_PORT" "$store_ready" &
store_pid=$!
for _ in $(seq 1200); do  # up to 120 s: the container starts and imports torch
    [[ -s "$store_ready" ]] && break
    kill -0 "$store_pid" 2>/dev/null ||
        fail "the rendezvous store did not start on port $RDZV_PORT of $RDZV_HOST (in use by another job?); set" \
            "RDZV_PORT to a free port (1024-65535) before sbatch"
    sleep 0.1
done
[[ -s "$store_ready" ]] || die "the rendezvous store did not start within 120 s"
# What each node runs, up to the Python script: the container with the host's libfabric,
# NCCL and aws-ofi-nccl bound in and found first, and torchrun as a client of the store.
launcher=(python3 "$PROJECT_DIR/tools/torchrun.py")
[[ -z "$TORCHRUN_PATH" ]] || launcher=("$TORCHRUN_PATH")
in_container=(
    apptainer exec --nv "${binds[@]}" "$CONTAINER_PATH"
    bash -c "$container_task" container-task
    "${launcher[@]}" --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$NPROC_PER_NODE"
        --rdzv_backend=c10d --rdzv_endpoint="$RDZV_HOST:$RDZV_PORT" --rdzv_conf=is_host=false
)
on_every_node=(srun --ntasks-per-node=1 --kill-on-bad-exit=1)

# The interfaces GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name, on every node, before any
# torchrun: on a node without them gloo and NCCL would fail in a traceback per rank. Every
# node says the same in its own words (its name, its interfaces): the job prints the first
# node's line, with how many more failed, not one line per node and srun's own on top.
# Without --kill-on-bad-exit: every node finishes its check (a second), so the count is exact.
if ! interfaces="$(srun --ntasks-per-node=1 apptainer exec --nv "${binds[@]}" "$CONTAINER_PATH" \
    python3 "$PROJECT_DIR/check_network.py" --interfaces 2>&1)"; then
    mapfile -t problems < <(grep '^error: ' <<<"$interfaces" || true)
    # No line of the check's: srun or the container failed first, and says why in its words.
    [[ "${#problems[@]}" -gt 0 ]] || fail "the interface check did not run on every node:"$'\n'"$interfaces"
    more=""
    [[ "${#problems[@]}" -eq 1 ]] || more=" (and the same check failed on $((${#problems[@]} - 1)) more node(s))"
    fail "${problems[0]#error: }$more"
fi
echo "$interfaces"

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
            "${env}sbatch --time=HH:MM:SS --nodes=$SLURM_JOB_NUM_NODES multinode_job.sh$again" >&2
        return
    fi
    echo "Requeueing job $SLURM_JOB_ID before its time limit: it continues from $CHECKPOINT_DIR"
    stop_store  # before: the requeued job's store takes the same port, and this one ignores the requeue's SIGTERM
    scontrol requeue "$SLURM_JOB_ID"
}

# srun ends with the highest status of its tasks, and --kill-on-bad-exit stops the others with
# SIGTERM as soon as one fails: a mistake that every rank refuses (status 2) would end the job as
# 143, a signal, when one node's ranks refuse it first. The status of an srun step (check or
# train) is the highest that a task of it ended with by itself (node_task records them), or
# srun's own when none failed by itself (scancel, a node lost).
task_status() {  # task_status STEP SRUN_STATUS
    local worst=0 file value
    for file in "$STATUS_DIR/$1".*; do
        [[ -f "$file" ]] || continue
        read -r value <"$file" || continue
        [[ "$value" =~ ^[0-9]+$ ]] || continue
        ((value <= worst)) || worst="$value"
    done
    if [[ "$2" -eq 0 || "$worst" -eq 0 ]]; then
        echo "$2"
    else
        echo "$worst"
    fi
}

# The network check, through the same container, libraries and torchrun as training (a
# rendezvous of its own in the same store), without a GPU monitor: seconds. It runs in the
# foreground, so a USR1 arriving meanwhile is handled once it is done: training is then
# skipped and the job requeued. A failure ends the job now, before training, unrequeued.
if [[ "$NETWORK_CHECK" == 1 ]]; then
    check_status=0
    "${on_every_node[@]}" bash -c "$node_task" node-task check "${in_container[@]}" \
        --rdzv_id="$SLURM_JOB_ID-network" "$PROJECT_DIR/check_network.py" "${network_check_args[@]}" ||
        check_status=$(task_status check "$?")
    if [[ "$check_status" -ne 0 ]]; then
        echo "error: the network check failed (status $check_status; its output is above): training not" \
            "started (NETWORK_CHECK=0 skips the check, docs/network.md)" >&2
        exit "$check_status"
    fi
    if [[ -n "$stop_requested" ]]; then
        requeue
        exit 0
    fi
fi

# The guide's early stop (--target-accuracy 0.95 --patience 2) is the default on its data sets; your
# own data (--dataset folder) trains all --epochs. Either is one flag after the script's name.
terminated=""
trap 'terminated=1' TERM  # scancel: wait (below) for srun to stop the tasks, then stop the store (EXIT)
"${on_every_node[@]}" bash -c "$node_task" node-task train "${in_container[@]}" --rdzv_id="$SLURM_JOB_ID" \
    "$PROJECT_DIR/train_ddp.py" --batch-size "$((PER_GPU_BATCH * SLURM_JOB_NUM_NODES * NPROC_PER_NODE))" \
        --epochs 100 "${lr_flags[@]}" \
        --checkpoint-dir "$CHECKPOINT_DIR" --resume=auto --stop-file "$STOP_FILE" \
        --save-weights "$CHECKPOINT_DIR/weights.pt" "$@" &
training_pid=$!
status=0
wait "$training_pid" || status=$?
while kill -0 "$training_pid" 2>/dev/null; do  # wait returned early to run the trap
    status=0
    wait "$training_pid" || status=$?
done
status=$(task_status train "$status")
if [[ -n "$stop_requested" && "$status" -eq 0 ]]; then
    if [[ -e "$STOP_FILE" ]]; then  # training removes the stop file it stops on: it finished first
        echo "Training finished before the stop request took effect: the job is done, not requeued"
    else
        requeue
    fi
elif [[ "$status" -eq "$EXIT_STOPPED" && -z "$terminated" ]]; then
    # The ranks stopped on a signal of their own, after their checkpoint: USR1 sent to the job's
    # steps rather than this shell (scancel --signal=USR1 without --batch). The job continues
    # from it, as after the time-limit warning; a scancel (TERM, here too) ends it.
    requeue
    status=0
fi
exit "$status"
