"""What ends a run with one line instead of a traceback: a mistake (UserError, exit 2), a run
that must stop without saving (RunAborted, exit 3), a stop request after its checkpoint
(TrainingStopped). engine/cli.py turns each into its line and exit status.
"""

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


class TrainingStopped(Exception):
    """Raised after the stop checkpoint is written; the entry point prints the message and
    exits with ``exit_code``."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


def first_line(err):
    """The first line of an exception's message (libraries go on with advice and stacks), or
    its type's name when it has none."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
