#!/bin/bash
# A real one-machine Slurm cluster for the test tier in tests/test_slurm.py: munged,
# slurmctld and two slurmd daemons ("node1", "node2") on 127.0.0.1, each with 4 fake GPUs
# (character devices) as GRES, in the partition "accel" that the job scripts ask for.
#
#   tests/slurm_cluster.sh start DIR   # writes DIR/slurm.conf; prints "export SLURM_CONF=..."
#   tests/slurm_cluster.sh stop DIR    # stops exactly the daemons started in DIR (by PID)
#
# Needs root (slurmd runs jobs as their user; mknod) and Debian's slurm-wlm and munge
# packages (Slurm 22.05). Nothing outside DIR is written; every daemon listens on loopback.
# Ports: SLURM_TEST_PORT (default 16817) for slurmctld, the next two for the slurmds.
set -euo pipefail

die() { echo "slurm_cluster.sh: $*" >&2; exit 1; }

usage="usage: $0 start|stop DIR"
action="${1:?$usage}"
dir="${2:?$usage}"

stop_cluster() {
    local pidfile pid
    for pidfile in "$dir"/slurmd.node2.pid "$dir"/slurmd.node1.pid "$dir"/slurmctld.pid "$dir"/munged.pid; do
        [[ -f "$pidfile" ]] || continue
        pid="$(cat "$pidfile")"
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do  # up to 5 s, then SIGKILL
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
        rm -f "$pidfile"
    done
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: until COMMAND succeeds
    local seconds="$1" what="$2"
    shift 2
    for _ in $(seq "$((seconds * 10))"); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die "$what did not come up within $seconds s (logs in $dir)"
}

both_nodes_idle() { [[ "$(sinfo -h -t idle -o %D -p accel)" == 2 ]]; }

start_cluster() {
    [[ "$(id -u)" -eq 0 ]] || die "needs root (slurmd, mknod)"
    local tool
    for tool in munged slurmctld slurmd sbatch scontrol; do
        command -v "$tool" >/dev/null || die "$tool not found (apt-get install slurm-wlm munge)"
    done
    local port="${SLURM_TEST_PORT:-16817}" host
    [[ "$port" =~ ^[0-9]+$ ]] || die "SLURM_TEST_PORT=$port is not a port number"
    host="$(hostname -s)"
    mkdir -p "$dir/state" "$dir/spool/node1" "$dir/spool/node2" "$dir/dev"
    dir="$(cd "$dir" && pwd)"
    local i
    for i in 0 1 2 3; do  # what gres.conf's File= points at: /dev/null's device numbers
        [[ -e "$dir/dev/gpu$i" ]] || mknod "$dir/dev/gpu$i" c 1 3
    done

    # munge with its own key and socket, so the system's munge (if any) is left alone.
    [[ -f "$dir/munge.key" ]] || head -c 1024 /dev/urandom >"$dir/munge.key"
    chmod 0400 "$dir/munge.key"
    munged --force --key-file="$dir/munge.key" --socket="$dir/munge.socket" --pid-file="$dir/munged.pid" \
        --log-file="$dir/munged.log" --seed-file="$dir/munge.seed"

    cat >"$dir/slurm.conf" <<EOF
ClusterName=test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge.socket,cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SchedulerParameters=bf_interval=2,sched_interval=2
ReturnToService=2
MpiDefault=none
NodeName=node[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=[$((port + 1))-$((port + 2))] CPUs=72 RealMemory=460000 Gres=gpu:4 State=UNKNOWN
PartitionName=accel Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$dir/gres.conf" <<EOF
AutoDetect=off
NodeName=node[1-2] Name=gpu File=$dir/dev/gpu[0-3]
EOF
    export SLURM_CONF="$dir/slurm.conf"
    slurmctld -i
    wait_for 20 slurmctld scontrol ping
    slurmd -N node1
    slurmd -N node2
    wait_for 30 "the two slurmd" both_nodes_idle
    echo "export SLURM_CONF=$SLURM_CONF"
}

case "$action" in
    start) start_cluster ;;
    stop) stop_cluster ;;
    *) die "$usage" ;;
esac
