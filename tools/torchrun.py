"""torchrun, ending in the ranks' own lines: PyTorch's launcher itself (torch.distributed.run:
the same flags, rendezvous, supervision and log lines), except that a failed rank, a signal, a
rendezvous that fails or a mistyped --nnodes or --nproc_per_node does not end in torchrun's
traceback, and that SIGUSR1, the ranks' stop request, is passed on to them instead of ending the
launcher.

Plain torchrun raises ChildFailedError when a rank fails, and Python prints its traceback and a
30-line report under the rank's own one-line error (a mistyped flag, out of memory, a lost
rank): the line the user needs is then the one they do not see. Here torchrun's own log line
("failed (exitcode: 2) local_rank: 0 (pid: P) of binary: ...") stays, and the launcher exits
with the status of the rank that failed first, or of one killed by signal N (128 + N, as a
shell reports it), so a job's status says why, as with one process. The job scripts run it in
place of torchrun; from an interactive allocation it takes torchrun's arguments:

    python tools/torchrun.py --standalone --nproc_per_node=4 train_ddp.py --epochs 5
    apptainer exec --nv "$CONTAINER" python3 tools/torchrun.py --standalone --nproc_per_node=4 train_ddp.py
    sbatch multigpu_job.sh       # runs it (TORCHRUN_PATH=torchrun runs PyTorch's own instead)
"""

import logging
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

if __package__ in (None, ""):  # run as python tools/torchrun.py: the project's modules are one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.errors import first_line  # noqa: E402


def exit_status(exitcode):
    """A rank's exit status as a shell reports it: torchrun gives -N for a rank killed by signal N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def root_cause(err):
    """The type and first line of the innermost exception that ``err`` was raised from."""
    while err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__):
        err = err.__cause__ or err.__context__
    return f"{type(err).__name__}: {first_line(err).rstrip('.')}"


def failed_rank_status(err):
    """The job's status for a ChildFailedError: that of the rank that failed first, preferring,
    among those that failed in the same second (torchrun's timestamps are whole seconds), one
    killed by a signal other than SIGTERM: the others then exit 3 after naming it, and SIGTERM
    is what torchrun sends the ranks left once one has failed."""
    failures = list(err.failures.values())
    first = min(failure.timestamp for failure in failures)
    killed = [f for f in failures if f.timestamp == first and f.exitcode < 0 and f.exitcode != -signal.SIGTERM]
    return exit_status(killed[0].exitcode if killed else err.get_first_failure()[1].exitcode)


def rendezvous_problem(args, err):
    """The one line for a rendezvous this node's torchrun could not complete."""
    where = "its own store (--standalone)" if args.standalone else f"{args.rdzv_endpoint} ({args.rdzv_backend})"
    host = socket.gethostname()
    if isinstance(err, RendezvousTimeoutError):
        return (f"torchrun on {host}: not every node joined the rendezvous at {where} in time ({root_cause(err)}); "
                "a node whose task failed to start (its lines above), or --nnodes more than the allocation's nodes")
    if args.standalone:
        return f"torchrun on {host} could not start its own rendezvous store (--standalone): {root_cause(err)}"
    return (f"torchrun on {host} could not join the rendezvous at {where}: {root_cause(err)}; check that the head "
            "node is reachable from here and its port free (RDZV_HOST and RDZV_PORT in multinode_job.sh)")


def launch_mistake(args):
    """The one line for --nnodes, --nproc_per_node or --max-restarts that torchrun would end on
    in a traceback (ValueError, AssertionError) once started, or None. Checked with torchrun's
    own parsers, so that what they accept (--nproc_per_node=gpu where there is a GPU) passes."""
    try:
        min_nodes, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        return f"--nnodes={args.nnodes} is not a number of nodes (N, or MIN:MAX for an elastic job)"
    if not 0 < min_nodes <= max_nodes:
        return f"--nnodes={args.nnodes}: at least 1 node (MIN:MAX with MIN no more than MAX)"
    if args.max_restarts < 0:
        return f"--max-restarts={args.max_restarts}: 0 or more restarts"
    try:
        nproc = torchrun.determine_local_world_size(args.nproc_per_node)
    except ValueError as err:  # not a number, or gpu where CUDA is not
        words = "" if args.nproc_per_node in ("gpu", "cpu", "auto") else " (a number of processes, or gpu, cpu, auto)"
        return f"--nproc_per_node={args.nproc_per_node}: {first_line(err).rstrip('.')}{words}"
    return None if nproc > 0 else f"--nproc_per_node={args.nproc_per_node}: at least 1 process"


def unresolved_endpoint(args):
    """The one line for a --rdzv_endpoint whose host name does not resolve, or None. torchrun
    would retry it until its join timeout (a minute and more), logging a C++ stack of 30 frames
    each time, before its own error."""
    if args.standalone or not args.rdzv_endpoint:
        return None
    try:
        host, _ = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)  # torchrun's default port
        socket.getaddrinfo(host, None)
    except ValueError:  # no valid port: torchrun's own error
        return None
    except socket.gaierror as err:
        return (f"torchrun on {socket.gethostname()}: the rendezvous host {host} (--rdzv_endpoint "
                f"{args.rdzv_endpoint}) does not resolve ({err.strerror}); check the name (RDZV_HOST in "
                "multinode_job.sh)")
    return None


def child_pids(proc=Path("/proc")):
    """The PIDs of this process's children (its ranks), from Linux's /proc; none where unreadable."""
    me, children = os.getpid(), []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()  # after the command's name, which may hold spaces
        except OSError:  # a process that ended meanwhile
            continue
        if len(fields) > 1 and fields[1] == str(me):  # state, then the parent's PID
            children.append(int(stat.parent.name))
    return children


def pass_on_stop_request(signum, frame):
    """Send ``signum`` to the ranks. SIGUSR1 asks them to checkpoint and stop (engine/stopping.py).
    Slurm sends it to every process of a job step (scancel --signal=USR1 without --batch) and
    apptainer passes it on to the process it runs: this launcher, which would die of it, leaving
    its ranks orphaned and the job failed. It passes it on to its ranks instead, as torchrun does
    SIGTERM; a rank that receives it twice stops once."""
    for pid in child_pids():
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


RANKS_GRACE_S = 30  # torchrun's own wait for its ranks after a stop signal, before it kills them


def wait_for_ranks(signum, grace_s=RANKS_GRACE_S):
    """After the stop signal ``signum``: return once every rank has exited. torchrun waits for
    them itself, but a second signal during that wait (Ctrl-C twice; the job script's SIGTERM
    after a second Ctrl-C) ends torchrun's wait early: the launcher would exit, and its script
    return to the prompt, with the ranks still training. That signal, and any later one, is
    passed on (a rank stops once); ranks still there after ``grace_s`` are killed, as torchrun
    would."""
    for caught in (signal.SIGINT, signal.SIGTERM):
        signal.signal(caught, pass_on_stop_request)
    pass_on_stop_request(signum, None)
    deadline = time.monotonic() + grace_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)  # reaps one that has exited
        except ChildProcessError:  # none left
            return
        if pid:
            continue
        if time.monotonic() > deadline:
            pass_on_stop_request(signal.SIGKILL, None)
            deadline = math.inf
        time.sleep(0.1)


def main(argv=None):
    """torchrun with ``argv`` (default: this command's arguments); returns the exit status."""
    args = torchrun.parse_args(argv)
    mistake = launch_mistake(args)
    if mistake:
        print(f"error: {mistake}", file=sys.stderr)
        return 2
    unresolved = unresolved_endpoint(args)
    if unresolved:  # as a rendezvous that cannot be joined: exit 1
        print(f"error: {unresolved}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGUSR1, pass_on_stop_request)
    # torchrun's handler raises SignalException wherever the launcher is when a signal comes. In
    # one of its log calls (a second Ctrl-C, or the job script's SIGTERM, while it logs "Sending
    # process P closing signal S"), logging catches it and prints "--- Logging error ---" and 40
    # lines of torchrun's traceback above the ranks' stop lines. The shutdown goes on the same
    # either way (logging swallows the exception; torchrun's own SIGTERM to the ranks and
    # wait_for_ranks follow): without raiseExceptions, it goes on without those lines.
    logging.raiseExceptions = False
    try:
        torchrun.run(args)
    except ChildFailedError as err:  # each rank has said why (or its traceback has); torchrun logged which
        return failed_rank_status(err)
    except SignalException as err:  # Ctrl-C, scancel: passed on to the ranks, which print their stop lines
        wait_for_ranks(int(err.sigval))
        return 128 + int(err.sigval)
    except KeyboardInterrupt:  # Ctrl-C before torchrun's own handlers (in the rendezvous)
        print("Interrupted (Ctrl-C) before the ranks started", file=sys.stderr)
        return 130
    except RendezvousError as err:
        print(f"error: {rendezvous_problem(args, err)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
