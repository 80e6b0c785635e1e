"""What ends a run with one line instead of a traceback: a mistake (UserError, exit 2), a run
that must stop without saving (RunAborted, exit 3), out of memory (OutOfMemory, exit 1), a stop
request after its checkpoint (TrainingStopped); and the line of a write that failed because the
disk or the quota is full, with the space it needed and the space free, so the user knows what
to clear.
engine/cli.py turns each into its line and exit status; before that, quiet_interrupt keeps
Ctrl-C during the entry point's imports from ending in a traceback, hold_stop_request keeps a
SIGUSR1 for training to take, and stop_request_held keeps it from the processes a run starts.
No torch import (tools/report.py uses it on any machine, and the entry points import it before
torch).
"""

import errno
import re
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path


def quiet_interrupt():
    """Ctrl-C while an entry point imports torch (seconds; more on a busy shared file system)
    ends the process at once, as SIGINT ends a program that does not catch it, where Python
    would print the traceback of an import. engine.cli.run_cli takes Ctrl-C over. A process
    that ignores SIGINT (started in the background by a shell) goes on ignoring it."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def hold_stop_request():
    """A SIGUSR1, the stop request (engine/stopping.py; scancel --signal=USR1 reaches every
    process of a job step), that comes before training can take it (while torch imports or
    the data is read and decoded: minutes for a large image folder) is held: blocked, it
    waits instead of killing the process with its default action, which lost the run's
    requeue. release_stop_request hands it on, once StopRequests' handler is in place: the run
    then stops after its first step, with a checkpoint. The threads started meanwhile (torch's,
    the process group's) inherit the block, so the signal goes to the main thread, where Python
    runs its handlers."""
    if hasattr(signal, "pthread_sigmask"):  # not on Windows, which has no SIGUSR1 either
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})


def release_stop_request():
    """Deliver a SIGUSR1 held by hold_stop_request to the handler in place now, and take any
    later one as it comes. A no-op where nothing blocked it."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})


@contextmanager
def stop_request_held():
    """SIGUSR1 blocked inside, so that the processes started there inherit the block: a
    DataLoader's workers, and the forkserver and resource tracker of multiprocessing (Python
    3.14's default start method), which would die of a SIGUSR1 sent to the whole job step and
    leave a screen of tracebacks after a correct stop. One that comes meanwhile is delivered
    to this process as the block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class UserError(Exception):
    """A mistake in the command line, the environment or the data: the entry points print it
    as one line and exit with status ``exit_code`` (2), without a traceback.

    ``same_on_every_rank``: every process hits the same error (a bad flag, say), so only
    global rank 0 prints it. Errors that may strike one node alone (a file missing on its
    disk) set it to False and are printed by every rank that hits them.

    ``silent``: another process printed the line already (a rank that ended with an error of
    its own, which its peers then lost): this one exits with its status and prints nothing.
    """

    exit_code = 2

    def __init__(self, message, same_on_every_rank=True, silent=False):
        super().__init__(message)
        self.same_on_every_rank = same_on_every_rank
        self.silent = silent


class RunAborted(UserError):
    """Training must stop and nothing from its current state may be saved: a non-finite
    loss, ranks whose parameters differ, or ranks that stopped responding. One line, exit
    status 3."""

    exit_code = 3


class ResourceProblem(UserError):
    """The run cannot go on because of what surrounds it, not its command line: a full disk,
    a checkpoint folder another run holds. One line naming the cause and what is kept, exit
    status 1 (the job scripts do not requeue it: it would fail again until the cause is gone)."""

    exit_code = 1


class OutOfMemory(UserError):
    """A step or an evaluation that did not fit in memory (engine/out_of_memory.py words it).
    Any rank may hit it, often all at once: a rank other than 0 prints its line only if rank 0
    has not ended the job first. Exit status 1, not requeued: the same job would run out of
    memory again."""

    exit_code = 1
    rank0_first = True


class DatasetError(UserError):
    """Data missing, not downloadable, truncated or corrupted; an image folder that is none."""


EXIT_STOPPED = 75  # stopped by a signal after writing a checkpoint: run again with --resume


class TrainingStopped(Exception):
    """Raised after the stop checkpoint is written; the entry point prints the message and
    exits with ``exit_code``: EXIT_STOPPED after a signal, 0 after --stop-file."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


def type_named(value):
    """The type of ``value`` with its article, for error lines: "an int", "a list"."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def first_line(err):
    """The first line of an exception's message (libraries go on with advice and stacks), or
    its type's name when it has none."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def first_sentences(err, limit=160):
    """The first line of ``err``'s message (first_line) cut after its last whole sentence within
    ``limit`` characters, the first sentence at least: never in the middle of a number, as
    "... you tried to allocate 17179869184 bytes." cut at a fixed width would be."""
    sentences = re.split(r"(?<=\.) ", first_line(err))
    kept = sentences[0]
    for sentence in sentences[1:]:
        if len(kept) + 1 + len(sentence) > limit:
            break
        kept += " " + sentence
    return kept


# ---------------------------------------------------------------------------------------------
# Disk space for people.

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk, or the user's quota on it


def size_text(nbytes):
    """Bytes for people: 12.3 kB, 620.3 MB, 2.41 GB, 80 GB."""
    if nbytes < 1e6:
        return f"{nbytes / 1e3:.1f} kB"
    if nbytes < 1e9:
        return f"{nbytes / 1e6:.1f} MB"
    return f"{nbytes / 1e9:.{2 if nbytes < 1e10 else 0}f} GB"


def free_bytes(path):
    """Bytes free to this user on the file system that holds (or will hold) ``path``."""
    existing = Path(path).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def space_problem(what, path, err, needed=None):
    """The one line for a write of ``what`` to ``path`` that failed with OSError ``err``: with the
    space it needed and the space free when the disk or the quota is full."""
    why = err.strerror or str(err)
    if err.errno in NO_SPACE:
        why += (f": needs {'about ' + size_text(needed) if needed else 'more'}, "
                f"{size_text(free_bytes(path))} free there")
    return ResourceProblem(f"cannot write {what} {path} ({why})")


def space_warning(what, path, err, then):
    """The warning for a diagnostic output (a TensorBoard event, a profiler trace) that could
    not be written: training goes on without it, ``then`` says what happens instead."""
    return f"WARNING: {space_problem(what, path, err)}; {then}"
