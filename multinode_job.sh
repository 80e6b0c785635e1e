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
# A job that cannot run here (a difference between this cluster and Olivia, a port in use):
# exit 1, not requeued, since the same job would fail again.
fail() { echo "error: $*" >&2; exit 1; }
site_error() { fail "$*; see docs/network.md, \"On another cluster\""; }
warn_misspelt CONTAINER_PATH PROJECT_DIR NPROC_PER_NODE PER_GPU_BATCH BASE_LR GPU_LOG_INTERVAL GPU_LOG_PREFIX \
    CHECKPOINT_DIR STOP_FILE REQUEUE_MIN_S TORCHRUN_PATH OMP_NUM_THREADS TORCH_NCCL_ASYNC_ERROR_HANDLING RDZV_HOST \
    RDZV_PORT HOST_BINDS HOST_LIBFABRIC_LIB_PATH HOST_LIBFABRIC_INCLUDE_PATH HOST_NCCL_PATH HOST_NVIDIA_HPC_LIB_PATH \
    HOST_CXI_LIB_PATH NCCL_NET NCCL_NET_PLUGIN NETWORK_CHECK NETWORK_MIN_BUSBW NETWORK_CHECK_ARGS
recipe_settings PER_GPU_BATCH BASE_LR NPROC_PER_NODE  # as given: a job continued by hand needs them (requeue)

CONTAINER_PATH="${CONTAINER_PATH:-/cluster/work/support/container/pytorch_nvidia_25.06_arm64.sif}"
NPROC_PER_NODE="${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"
PER_GPU_BATCH="${PER_GPU_BATCH:-256}"
BASE_LR="${BASE_LR:-}"  # empty: 0.04 (the guide's) for SGD, recipe.py's default for another --optimizer
TORCHRUN_PATH="${TORCHRUN_PATH:-}"  # empty: tools/torchrun.py (torchrun ending in the ranks' lines, not its traceback)
GPU_LOG_INTERVAL="${GPU_LOG_INTERVAL:-5}"
GPU_LOG_PREFIX="${GPU_LOG_PREFIX:-multinode_${SLURM_JOB_ID:-local}_gpu}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-checkpoints/multinode_${SLURM_JOB_ID:-local}}"
STOP_FILE="${STOP_FILE:-$PWD/.multinode_${SLURM_JOB_ID:-local}.stop}"  # shared: rank 0 may be on any node
REQUEUE_MIN_S="${REQUEUE_MIN_S:-300}"  # a job that ran less is not requeued (job_common.sh's requeue)
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

check_job_settings GPU_LOG_PREFIX
[[ "$HOST_BINDS" == 0 || "$HOST_BINDS" == 1 ]] ||
    die "HOST_BINDS=$HOST_BINDS is neither 1 (bind the host's network libraries) nor 0 (the container's own)"
[[ "$NETWORK_CHECK" == 0 || "$NETWORK_CHECK" == 1 ]] ||
    die "NETWORK_CHECK=$NETWORK_CHECK is neither 1 (check the network before training) nor 0 (skip the check)"
[[ -z "$NETWORK_MIN_BUSBW" || "$NETWORK_MIN_BUSBW" =~ $decimal_re ]] ||
    die "NETWORK_MIN_BUSBW=$NETWORK_MIN_BUSBW is not a number of GB/s"
flags_only='^[-A-Za-z0-9_.=+ ]*$'  # check_network.py checks the flags; no quotes, globs or shell syntax
[[ "$NETWORK_CHECK_ARGS" =~ $flags_only ]] ||
    die "NETWORK_CHECK_ARGS=$NETWORK_CHECK_ARGS may hold only check_network.py flags and their values"
read -r -a network_check_args <<<"$NETWORK_CHECK_ARGS"
[[ -z "$NETWORK_MIN_BUSBW" ]] || network_check_args+=(--min-busbw "$NETWORK_MIN_BUSBW")
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
check_project train_ddp.py check_network.py tools/torchrun.py
check_ddp_settings
[[ -n "${SLURM_JOB_NODELIST:-}" && -n "${SLURM_JOB_NUM_NODES:-}" && -n "${SLURM_JOB_ID:-}" ]] ||
    die "not inside a Slurm allocation (SLURM_JOB_NODELIST, SLURM_JOB_NUM_NODES, SLURM_JOB_ID); submit with sbatch"

# The first node of the allocation hosts the rendezvous. The port comes from the job ID
# (29500..32499, below Linux's ephemeral range) so two jobs sharing a node don't collide.
nodes="$(scontrol show hostnames "$SLURM_JOB_NODELIST")" ||
    die "scontrol could not expand SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
for node in $nodes; do  # each node appends to its own GPU_LOG_PREFIX_NODE.csv
    check_gpu_log "${GPU_LOG_PREFIX}_${node}.csv" GPU_LOG_PREFIX
done
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

read_arguments "$@"  # CHECKPOINT_DIR as training will use it, and the optimizer
[[ -n "$BASE_LR" || "$optimizer" != sgd ]] || BASE_LR=0.04  # the guide's LR is an SGD one

export_ddp_settings  # TORCH_NCCL_ASYNC_ERROR_HANDLING (a hung collective ends the job) and OMP_NUM_THREADS

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
# shellcheck disable=SC2329  # run by the EXIT trap and by requeue_job
stop_store() {  # the rendezvous store below, once no torchrun needs it; waits until it is gone
    [[ -n "$store_pid" ]] || return 0
    kill -USR2 "$store_pid" 2>/dev/null || true
    wait "$store_pid" 2>/dev/null || true
    store_pid=""
}
trap 'rm -f "$STOP_FILE" "$store_ready" "$STATUS_DIR"/check.* "$STATUS_DIR"/train.*; rmdir "$STATUS_DIR" 2>/dev/null
stop_store' EXIT
trap_stop_request  # USR1: stop_requested, and the stop file that training watches

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
choose_launcher
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

# The requeue (job_common.sh) stops the rendezvous store first: the requeued job's store takes the
# same port, and this one ignores the requeue's SIGTERM.
requeue_job() { requeue "--nodes=$SLURM_JOB_NUM_NODES multinode_job.sh" stop_store; }

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
        requeue_job
        exit 0
    fi
fi

terminated=""
trap 'terminated=1' TERM  # scancel: wait_for (below) waits while srun stops the tasks, then the store stops (EXIT)
# What training runs with (job_common.sh's training_args), printed for reading (not quoted): the
# job log shows the flags an error may name.
training_args "$((PER_GPU_BATCH * SLURM_JOB_NUM_NODES * NPROC_PER_NODE))" "$@"
echo "Running train_ddp.py ${train_args[*]} on $SLURM_JOB_NUM_NODES x $NPROC_PER_NODE GPUs" \
    "(batch: PER_GPU_BATCH x GPUs)"
"${on_every_node[@]}" bash -c "$node_task" node-task train "${in_container[@]}" --rdzv_id="$SLURM_JOB_ID" \
    "$PROJECT_DIR/train_ddp.py" "${train_args[@]}" &
training_pid=$!
wait_for "$training_pid"
status=$(task_status train "$status")
if [[ "$status" -eq "$EXIT_STOPPED" && -z "$terminated" ]]; then
    # The ranks stopped on a signal of their own, after their checkpoint: USR1 sent to the job's
    # steps rather than this shell (scancel --signal=USR1 without --batch). The job continues
    # from it, as after the time-limit warning; a scancel (TERM, here too) ends it.
    requeue_job
    status=0
else
    after_stop_request requeue_job
fi
exit "$status"
