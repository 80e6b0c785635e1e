"""tools/torchrun.py, the launcher the job scripts run: PyTorch's torchrun, ending in the ranks'
own lines and the failed rank's exit status, not in torchrun's ChildFailedError traceback."""

import signal
import socket
import sys
import time

import pytest
import torch
from torch.distributed import DistNetworkError
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

from conftest import REPO, error_lines, run, start
from tools import torchrun as launcher

pytestmark = pytest.mark.oldest_torch  # torchrun's exceptions and their fields differ between versions


def launch(tmp_path, *args):
    return run([sys.executable, REPO / "tools" / "torchrun.py", "--standalone", "--nproc_per_node=2", *args],
               cwd=tmp_path, timeout=120)


def start_ranks(script, tmp_path):
    """The launcher running ``script`` on 2 ranks, once both have written their startedRANK file."""
    process = start([sys.executable, REPO / "tools" / "torchrun.py", "--standalone", "--nproc_per_node=2", script],
                    tmp_path, tmp_path / "log")
    deadline = time.time() + 60
    while not ((tmp_path / "started0").exists() and (tmp_path / "started1").exists()):
        assert process.poll() is None and time.time() < deadline, (tmp_path / "log").read_text()
        time.sleep(0.05)
    return process


def test_a_rank_s_mistake_ends_in_its_line_and_status_not_torchruns_traceback(tmp_path):
    result = launch(tmp_path, REPO / "train_ddp.py", "--epochs", "0")
    assert result.returncode == 2, result.stderr  # train_ddp.py's status for a bad flag; plain torchrun: 1
    assert "train_ddp.py: error: argument --epochs: '0' is not a positive integer" in result.stderr
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
    assert "failed (exitcode: 2) local_rank: " in result.stderr  # torchrun's own log line of it stays


def test_a_rank_killed_by_a_signal_is_128_plus_the_signal(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text("import os, signal, time\n"
                      "if os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(5)\n")
    result = launch(tmp_path, script)
    assert result.returncode == 128 + 9 and "Traceback" not in result.stderr, result.stderr
    assert launcher.exit_status(-15) == 143 and launcher.exit_status(3) == 3


# SIGTERM: scancel or Ctrl-C reaching the launcher while the ranks run (torchrun's
# SignalException): the launcher exits 128 + 15. SIGUSR1: the ranks' stop request, which Slurm
# sends every process of a step and apptainer passes on; plain torchrun dies of it, leaving
# its ranks orphaned. Here the ranks stop (75, after their checkpoint) and the launcher ends
# with their status.
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGUSR1, 75)],
                         ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_to_the_launcher_reaches_every_rank(tmp_path, signum, status):
    """Each rank gets the signal and says so, and the launcher exits without a traceback."""
    script = tmp_path / "ranks.py"
    script.write_text("import os, signal, sys, time\n"
                      "def stop(signum, frame):\n"
                      "    print(f'rank {os.environ[\"RANK\"]} stopped by {signal.Signals(signum).name}', flush=True)\n"
                      "    sys.exit(75)\n"
                      "signal.signal(signal.SIGTERM, stop)\n"
                      "signal.signal(signal.SIGUSR1, stop)\n"
                      "open(f'started{os.environ[\"RANK\"]}', 'w').close()\n"
                      "time.sleep(120)\n")
    process = start_ranks(script, tmp_path)
    process.send_signal(signum)
    assert process.wait(timeout=60) == status, (tmp_path / "log").read_text()
    log = (tmp_path / "log").read_text()
    for rank in (0, 1):
        assert log.count(f"rank {rank} stopped by {signum.name}") == 1, log
    assert "Traceback" not in log and "SignalException" not in log


def test_more_signals_do_not_leave_the_ranks_behind(tmp_path):
    """A second Ctrl-C in a job script: SIGINT to every process, then the script's SIGTERM to
    the launcher, while the ranks finish their step. torchrun's wait for its ranks is cut short
    by each further signal, and the launcher exited with them still running behind the
    prompt. It now returns once they have ended."""
    script = tmp_path / "ranks.py"
    script.write_text("import os, signal, sys, time\n"
                      "signals = []\n"
                      "signal.signal(signal.SIGINT, lambda signum, frame: signals.append(signum))\n"
                      "signal.signal(signal.SIGTERM, lambda signum, frame: signals.append(signum))\n"
                      "open(f'started{os.environ[\"RANK\"]}', 'w').close()\n"
                      "while not signals:\n    time.sleep(0.05)\n"
                      "time.sleep(4)  # the step in flight, then the stop\n"
                      "open(f'done{os.environ[\"RANK\"]}', 'w').close()\n")
    process = start_ranks(script, tmp_path)
    for signum in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):
        process.send_signal(signum)
        time.sleep(0.5)
    assert process.wait(timeout=60) == 128 + signal.SIGTERM, (tmp_path / "log").read_text()
    assert (tmp_path / "done0").exists() and (tmp_path / "done1").exists(), "the launcher ended before its ranks"
    assert "Traceback" not in (tmp_path / "log").read_text()


def test_a_signal_while_torchrun_logs_is_not_a_logging_traceback(tmp_path):
    """A second Ctrl-C, or the job script's SIGTERM after it, that came while torchrun logged
    "Sending process P closing signal S": torchrun's handler raised in logging's formatting,
    and logging printed "--- Logging error ---" and torchrun's traceback into the job log (seen
    in CI). Here that signal comes, for certain, inside such a log call, after a run."""
    (tmp_path / "rank.py").write_text("print('rank ran')\n")
    (tmp_path / "launch.py").write_text(
        "import logging, os, signal, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from tools import torchrun as launcher\n"
        "status = launcher.main(['--standalone', '--nproc_per_node=1', 'rank.py'])\n"
        "class SignalMidLine:\n"
        "    def __str__(self):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)  # to torchrun's handler, still in place\n"
        "        return 'SIGTERM'\n"
        "logging.getLogger('torch.distributed.elastic.multiprocessing.api').warning(\n"
        "    'Sending process %s closing signal %s', os.getpid(), SignalMidLine())\n"
        "print('launcher went on', file=sys.stderr)\n"
        "sys.exit(status)\n")
    result = run([sys.executable, "launch.py"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0 and "rank ran" in result.stdout, result.stderr
    assert "launcher went on" in result.stderr, result.stderr  # not killed: torchrun's handler caught it
    assert "Logging error" not in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_rendezvous_host_that_does_not_resolve_is_one_line_at_once(tmp_path):
    """torchrun retried the name for its join timeout (105 s on the walk), printing 55 lines of
    C++ warnings and stack frames before its error. .invalid never resolves (RFC 6761)."""
    result = launch_multinode(tmp_path, "nosuchhost.invalid:29500", "join_timeout=30")
    assert result.returncode == 1, result.stderr
    assert error_lines(result.stderr) == [
        f"error: torchrun on {socket.gethostname()}: the rendezvous host nosuchhost.invalid (--rdzv_endpoint "
        f"nosuchhost.invalid:29500) does not resolve ({socket_error('nosuchhost.invalid')}); check the name "
        "(RDZV_HOST in multinode_job.sh)"], result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr


def socket_error(host):
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as err:
        return err.strerror
    raise AssertionError(f"{host} resolves here")


def test_a_rendezvous_that_cannot_be_reached_or_completed_is_one_line(tmp_path):
    """torchrun's own exceptions of this PyTorch, not ones the test builds: a store nobody
    listens on (connection refused until read_timeout), and a rendezvous the second node never
    joins (join_timeout)."""
    port, other = free_port(), free_port()
    refused = launch_multinode(tmp_path, f"127.0.0.1:{port}", "is_host=0,read_timeout=3")
    [line] = error_lines(refused.stderr)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert line.startswith("error: torchrun on ") and f"could not join the rendezvous at 127.0.0.1:{port} (c10d): " in (
        line) and line.endswith("check that the head node is reachable from here and its port free (RDZV_HOST and "
                                "RDZV_PORT in multinode_job.sh)")
    alone = launch_multinode(tmp_path, f"127.0.0.1:{other}", "join_timeout=3")
    [line] = error_lines(alone.stderr)
    assert alone.returncode == 1 and "Traceback" not in alone.stderr, alone.stderr
    assert f"not every node joined the rendezvous at 127.0.0.1:{other} (c10d) in time (RendezvousTimeoutError: " in (
        line)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_multinode(tmp_path, endpoint, rdzv_conf):
    """tools/torchrun.py as the first of 2 nodes, with a rendezvous at ``endpoint``."""
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('the rendezvous completed')\n")
    return run([sys.executable, REPO / "tools" / "torchrun.py", "--nnodes=2", "--nproc_per_node=1",
                "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", f"--rdzv_conf={rdzv_conf}", script],
               cwd=tmp_path, timeout=120)


def test_a_finished_run_is_status_0(tmp_path):
    script = tmp_path / "fine.py"
    script.write_text("import os\nopen(f'done{os.environ[\"RANK\"]}', 'w').close()\n")
    result = launch(tmp_path, script)
    assert result.returncode == 0 and (tmp_path / "done0").exists() and (tmp_path / "done1").exists()


def test_an_unreachable_rendezvous_is_one_line_with_its_cause(monkeypatch, capsys):
    """(A host name that resolves: one that does not is refused before torchrun runs.)"""
    def unreachable(args):  # what torchrun raises after its minute of retries
        try:
            raise DistNetworkError("The client socket has failed to connect to [localhost]:29400 (errno: 111 - "
                                   "Connection refused).\nmore detail")
        except DistNetworkError as err:
            raise RendezvousConnectionError("The connection to the C10d store has failed. See inner exception "
                                            "for details.") from err
    monkeypatch.setattr(launcher.torchrun, "run", unreachable)
    status = launcher.main(["--nnodes=2", "--nproc_per_node=4", "--rdzv_backend=c10d",
                            "--rdzv_endpoint=localhost:29400", "train_ddp.py"])
    [line] = capsys.readouterr().err.splitlines()
    assert status == 1 and line.startswith("error: torchrun on ")
    assert line.endswith("could not join the rendezvous at localhost:29400 (c10d): DistNetworkError: The client socket "
                         "has failed to connect to [localhost]:29400 (errno: 111 - Connection refused); check that the "
                         "head node is reachable from here and its port free (RDZV_HOST and RDZV_PORT in "
                         "multinode_job.sh)")


def test_a_killed_rank_s_signal_wins_over_the_others_exit_status():
    def failure(rank, exitcode, timestamp):
        failed = ProcessFailure(rank, 100 + rank, exitcode, "<N/A>")
        failed.timestamp = timestamp  # whole seconds, as torchrun records them
        return failed
    # Rank 1 killed, rank 0 exiting 3 after naming it, in the same second: the job says 137.
    same_second = ChildFailedError("train_ddp.py", {0: failure(0, 3, 100), 1: failure(1, -9, 100)})
    assert launcher.failed_rank_status(same_second) == 137
    assert launcher.failed_rank_status(ChildFailedError("x", {0: failure(0, 2, 100), 1: failure(1, 1, 101)})) == 2
    # Rank 0's mistake, rank 1 then stopped by torchrun's SIGTERM: the mistake's status.
    assert launcher.failed_rank_status(ChildFailedError("x", {0: failure(0, 2, 100), 1: failure(1, -15, 100)})) == 2
    assert launcher.failed_rank_status(ChildFailedError("x", {0: failure(0, -15, 100), 1: failure(1, -9, 131)})) == 143


def test_each_rendezvous_failure_says_what_to_check(monkeypatch, capsys):
    def times_out(args):
        raise RendezvousTimeoutError("The node 'n2_1' has not joined within 900 s.")
    monkeypatch.setattr(launcher.torchrun, "run", times_out)
    assert launcher.main(["--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:29400", "train_ddp.py"]) == 1
    assert capsys.readouterr().err.endswith(
        "not every node joined the rendezvous at localhost:29400 (c10d) in time (RendezvousTimeoutError: The node "
        "'n2_1' has not joined within 900 s); a node whose task failed to start (its lines above), or --nnodes more "
        "than the allocation's nodes\n")

    def refused(args):
        raise RendezvousConnectionError("The connection to the C10d store has failed")
    monkeypatch.setattr(launcher.torchrun, "run", refused)
    assert launcher.main(["--standalone", "--nproc_per_node=2", "train_ddp.py"]) == 1
    err = capsys.readouterr().err
    assert "could not start its own rendezvous store (--standalone)" in err and "RDZV_HOST" not in err

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(launcher.torchrun, "run", interrupted)
    assert launcher.main(["--standalone", "train_ddp.py"]) == 130
    assert capsys.readouterr().err == "Interrupted (Ctrl-C) before the ranks started\n"


@pytest.mark.parametrize("flag, line", [
    ("--nproc_per_node=x", "--nproc_per_node=x: Unsupported nproc_per_node value: x (a number of processes, or gpu, "
                           "cpu, auto)"),
    ("--nproc_per_node=0", "--nproc_per_node=0: at least 1 process"),
    ("--nproc_per_node=-1", "--nproc_per_node=-1: at least 1 process"),
    ("--nnodes=x", "--nnodes=x is not a number of nodes (N, or MIN:MAX for an elastic job)"),
    ("--nnodes=2:1", "--nnodes=2:1: at least 1 node (MIN:MAX with MIN no more than MAX)"),
    ("--max-restarts=-1", "--max-restarts=-1: 0 or more restarts"),
    ("--nproc_per_node=gpu", "--nproc_per_node=gpu: Cuda is not available"),
])
def test_a_mistyped_launcher_argument_is_one_line_before_any_rank_starts(capsys, flag, line):
    """torchrun reads these only once it launches, and ends in a ValueError's or a bare
    AssertionError's traceback (a new user's walk)."""
    if flag.endswith("gpu") and torch.cuda.is_available():
        pytest.skip("--nproc_per_node=gpu is right where there is a GPU")
    assert launcher.main(["--standalone", flag, "train_ddp.py"]) == 2
    assert capsys.readouterr().err == f"error: {line}\n"
