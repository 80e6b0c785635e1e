"""Shared helpers: tiny data sets in the real on-disk formats, and subprocess runners.

Every test runs on the CPU; nothing is downloaded. The training scripts are run as users
run them (python ..., torchrun ..., bash job.sh), so their exit codes and output are tested.
"""

import json
import os
import re
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # sibling imports, exactly as the scripts use them
# The writers of tiny data sets in every real format (the product's tools/demo_data.py).
from tools.demo_data import (idx_bytes, learnable_images, write_cifar10, write_cifar100, write_dataset,  # noqa: E402,F401
                       write_idx, write_image_folder)
from tools.gpu_report import descendants, kill_tree  # noqa: E402,F401 - processes below a pid (torchrun's ranks)

# Variables a launcher may have left in the environment; each test sets its own.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "GROUP_RANK")

# Small and fast on 2 CPU cores: no loader workers, a few images per step.
FAST = ("--num-workers", "0")
# For the machinery around training (checkpoints, stops, resume), not the model: tests/tiny_net.py.
TINY_MODEL = ("--model", f"{REPO / 'tests' / 'tiny_net.py'}:Net")
# For a run that must learn in a few steps, in seconds (the Wide ResNet takes minutes on a CPU).
SMALL_MODEL = ("--model", f"{REPO / 'tests' / 'oom_net.py'}:Net")
# For torch.compile: compiled in seconds, and nothing to recompile for.
PLAIN_MODEL = ("--model", f"{REPO / 'tests' / 'plain_net.py'}:Net")


# Under `pytest -n 3 --dist loadgroup` (pytest-xdist: README's command) each of these files runs
# whole in one worker: what its tests share would otherwise be built twice or collide. Listed
# largest first (the seconds of their tests, 2026-12-02 on 2 cores: 333, 266, 235, 180, 106, 89,
# 45, 23), the order they start in. A test of theirs with an xdist_group of its own (it shares
# nothing) runs apart.
ONE_WORKER = {
    "test_job_scripts.py": "one job ID, and the rendezvous port derived from it",
    "test_resilience.py": "the uninterrupted reference run", "test_slurm.py": "one Slurm cluster for the module",
    "test_recipe.py": "the project copy and its reference runs", "test_memory.py": "the accumulate runs, trained once",
    "test_predict.py": "the trained project", "test_photos.py": "the photo runs, trained once",
    "test_report.py": "the metrics of two runs",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "oldest_torch: guards what differs between PyTorch versions (gloo, "
                            "torchrun, DDP, the process group's store, TF32 switches, library variables); .ci/run "
                            "runs these again under the oldest PyTorch users run (2.7.1)")
    config.addinivalue_line("markers", "xdist_group(name): tests pytest-xdist's --dist loadgroup runs in one worker")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which writes the groups into the test IDs
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in ONE_WORKER and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(item.path.name))
    # The grouped files first, largest first: one started last would run alone at the end while
    # the other worker idles. The other files keep their order (the sort is stable).
    order = list(ONE_WORKER)
    items.sort(key=lambda item: order.index(item.path.name) if item.path.name in ONE_WORKER else len(order))


def pytest_collection_finish(session):
    """In a pytest-xdist worker under --dist loadgroup: the groups are in the test IDs, where
    xdist reads them. Before this check a hook order left them out and every file above ran in
    both workers, its shared runs built twice."""
    if getattr(session.config.option, "loadgroup", False):
        ungrouped = [item.nodeid for item in session.items if item.path.name in ONE_WORKER and "@" not in item.nodeid]
        if ungrouped:
            raise pytest.UsageError(
                f"--dist loadgroup: {len(ungrouped)} tests lost their xdist_group ({ungrouped[0]} first); pytest 9.2 "
                "and newer ignore the test IDs pytest-xdist 3.8 rewrites: pip install 'pytest<9.2' (requirements-dev.txt)")


@pytest.fixture
def cifar_dir(tmp_path):
    return write_cifar100(tmp_path / "data")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(PYTHONUNBUFFERED="1", **{k: str(v) for k, v in extra.items()})
    return env


def run(cmd, cwd, env=None, timeout=300):
    """Run a command; returns the CompletedProcess with text stdout/stderr. Past ``timeout``
    seconds it is killed with every process below it (torchrun starts its ranks in sessions
    of their own: killing torchrun alone would leave them holding the CPU or a GPU), and the
    test fails with subprocess.TimeoutExpired."""
    cmd = [str(c) for c in cmd]
    with subprocess.Popen(cmd, cwd=cwd, env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process)
            raise
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)


_BACKGROUND = []  # processes of ``start``, killed when their test ends


def start(cmd, cwd, log, env=None):
    """Start a command in the background, its output going to ``log``, in a session of its own:
    whatever it leaves running when its test ends (passed or failed) is killed then. Ctrl-C
    (SIGINT) is at its default there, as for a command typed at a terminal, even when the suite
    itself runs in the background (``&``), which ignores SIGINT and passes that on."""
    process = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env or clean_env(), stdout=open(log, "w"),
                               stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _BACKGROUND.append(process)
    return process


@pytest.fixture(autouse=True)
def cpu_only(request, monkeypatch):
    """The CPU suite stays on the CPU on a GPU machine too: CUDA is hidden from every test but
    tests/test_gpu.py, in this process (torch.cuda.is_available) and in the processes it
    starts (CUDA_VISIBLE_DEVICES, which clean_env copies). Otherwise a GPU node would run the
    2-process tests on one GPU, compare GPU runs bit for bit, and expect "Device: cpu"."""
    if request.path.name != "test_gpu.py":
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    yield


@pytest.fixture(autouse=True)
def kill_background_processes():
    """A test that fails while a torchrun or a job script runs must not leave it training."""
    yield
    while _BACKGROUND:
        kill_tree(_BACKGROUND.pop())  # the launcher and its ranks


def spawn(worker, args, nprocs=2, timeout=120):
    """torch.multiprocessing.spawn with a deadline (spawn's join has none): a hang fails the test
    and its processes are killed, instead of blocking CI."""
    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.time() + timeout
    try:
        while not context.join(timeout=1):
            assert time.time() < deadline, f"the {nprocs} processes hang (still running after {timeout} s)"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def wait_for(path, text, process, timeout=120):
    """Wait until ``text`` appears in the file ``path`` while ``process`` runs."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if Path(path).exists() and text in Path(path).read_text():
            return
        assert process.poll() is None, f"exited before {text!r}:\n" + Path(path).read_text()
        time.sleep(0.1)
    raise AssertionError(f"{text!r} did not appear in {path}")


def unavailable(switch, reason):
    """A test whose tier this machine cannot run: skipped, or failed where the environment
    variable ``switch`` is "required" (.ci/run sets SLURM_TESTS and MOUNT_TESTS so)."""
    if os.environ.get(switch) == "required":
        pytest.fail(f"{switch}=required, but {reason}")
    pytest.skip(reason)


def wait_for_path(path, process=None, timeout=60):
    """Wait until ``path`` exists (a stop file a job script's signal handler writes, say),
    failing if ``process`` exits first."""
    deadline = time.time() + timeout
    while not Path(path).exists():
        assert process is None or process.poll() is None, f"exited before {path} appeared"
        assert time.time() < deadline, f"{path} did not appear in {timeout} s"
        time.sleep(0.05)


def wait_held(go, process=None, rank=0, timeout=120):
    """Wait until a run started with HOLD_AT=N:GO (tests/tiny_net.py) is held at its N-th
    training step: rank ``rank`` wrote GO.held<rank>. Then act on it, and create GO."""
    wait_for_path(f"{go}.held{rank}", process, timeout)


def python_cmd(script, *args):
    return [sys.executable, REPO / script, *args]


def torchrun_cmd(nproc, script, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            REPO / script, *args]


def run_main(script, *args):
    """Run ``script``'s __main__ block in this process, as ``python script args`` would, for
    runs that end in an error (no interpreter start-up: seconds saved per test). Returns the
    exit status; use capsys for the output."""
    saved = sys.argv
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the entry point holds SIGUSR1 (hold_stop_request)
    sys.argv = [str(REPO / script), *map(str, args)]
    try:
        runpy.run_path(str(REPO / script), run_name="__main__")
    except SystemExit as exit_:
        return exit_.code
    finally:
        sys.argv = saved
        for sig, handler in handlers.items():  # a stopped run leaves its own (engine.cli.leave) for its exit
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return 0


def read_metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def error_lines(text):
    """Our one-line errors: 'error: ...', 'train.py: error: ...' (argparse's program name: '-c' in
    a pytest-xdist worker) or '[rank 1] error: ...'."""
    return [line for line in text.splitlines() if re.match(r"^(\[rank \d+\] |[\w.-]+: )?error: ", line)]


def host_libraries(root):
    """Stand-ins for the host folders multinode_job.sh binds into the container (HOST_*_PATH),
    with the aws-ofi-nccl plugin in NCCL's: {variable: folder}."""
    folders = {"HOST_LIBFABRIC_LIB_PATH": "libfabric/lib", "HOST_LIBFABRIC_INCLUDE_PATH": "libfabric/include",
               "HOST_NCCL_PATH": "nccl", "HOST_CXI_LIB_PATH": "cxi", "HOST_NVIDIA_HPC_LIB_PATH": "hpc_sdk/lib"}
    for folder in folders.values():
        (Path(root) / "host" / folder).mkdir(parents=True, exist_ok=True)
    (Path(root) / "host" / "nccl" / "lib").mkdir(exist_ok=True)
    (Path(root) / "host" / "nccl" / "lib" / "libnccl-net.so").touch()
    return {variable: str(Path(root) / "host" / folder) for variable, folder in folders.items()}

