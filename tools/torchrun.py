"""torchrun, ending in the ranks' own lines: PyTorch's launcher itself (torch.distributed.run:
the same flags, rendezvous, supervision and log lines), except that a failed rank, a signal or
an unreachable rendezvous does not end in torchrun's traceback.

Plain torchrun raises ChildFailedError when a rank fails, and Python prints its traceback and a
30-line report under the rank's own one-line error (a mistyped flag, out of memory, a lost
rank): the line the user needs is then the one they do not see. Here torchrun's own log line
("failed (exitcode: 2) local_rank: 0 (pid: P) of binary: ...") stays, and the launcher exits
with the status of the rank that failed first (128 + N for a rank killed by signal N, as a
shell reports it), so a job's status says why, as with one process. The job scripts run it in
place of torchrun; from an interactive allocation it takes torchrun's arguments:

    python tools/torchrun.py --standalone --nproc_per_node=4 train_ddp.py --epochs 5
    apptainer exec --nv "$CONTAINER" python3 tools/torchrun.py --standalone --nproc_per_node=4 train_ddp.py
    sbatch multigpu_job.sh       # runs it (TORCHRUN_PATH=torchrun runs PyTorch's own instead)
"""

import socket
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError


def exit_status(exitcode):
    """A rank's exit status as a shell reports it: torchrun gives -N for a rank killed by signal N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def root_cause(err):
    """The first line of the innermost exception that ``err`` was raised from."""
    while err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__):
        err = err.__cause__ or err.__context__
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or ['?'])[0].rstrip('.')}"


def rendezvous_problem(args, err):
    """The one line for a rendezvous this node's torchrun could not join."""
    where = "its own store (--standalone)" if args.standalone else f"{args.rdzv_endpoint} ({args.rdzv_backend})"
    return (f"torchrun on {socket.gethostname()} could not join the rendezvous at {where}: {root_cause(err)}; "
            "check that the head node is reachable from here and its port free (RDZV_HOST and RDZV_PORT in "
            "multinode_job.sh)")


def main(argv=None):
    """torchrun with ``argv`` (default: this command's arguments); returns the exit status."""
    args = torchrun.parse_args(argv)
    try:
        torchrun.run(args)
    except ChildFailedError as err:  # each rank has said why (or its traceback has); torchrun logged which
        _, failure = err.get_first_failure()
        return exit_status(failure.exitcode)
    except SignalException as err:  # Ctrl-C, scancel: passed on to the ranks, which print their stop lines
        return 128 + int(err.sigval)
    except RendezvousError as err:
        print(f"error: {rendezvous_problem(args, err)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
