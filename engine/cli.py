"""How every entry point ends: ``run_cli(main)`` turns a user's mistake, an aborted run, a
stop request and Ctrl-C into one line and an exit status, never a traceback, and makes
sure rank 0's line is the one the user sees; ``OneLineParser`` does the same for a bad
command line. Which rank this is comes from torchrun's variables, read here without
torch: tools/demo_data.py and tools/report.py use the parser where torch costs seconds, or
is not installed.
"""

import argparse
import difflib
import os
import re
import signal
import sys
import sysconfig
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

from engine.errors import TrainingStopped, UserError, first_line

RANK0_FIRST_S = 10  # the longest a silent rank waits for rank 0 to print its line and exit (let_rank0_fail_first)
PROJECT = Path(__file__).resolve().parents[1]  # the folder of the scripts
RECIPE = PROJECT / "recipe.py"  # the file users edit most: a bug there is their mistake, named in one line
# What other training scripts call some of the flags, which no spelling distance finds.
OTHER_NAMES = {"--lr": "--base-lr", "--learning-rate": "--base-lr", "--wd": "--weight-decay", "--bs": "--batch-size",
               "--workers": "--num-workers", "--data": "--data-dir", "--amp": "--precision"}


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line, printed by global rank 0 only
    (every rank parses the same flags, so the others would only repeat it). Abbreviated flags
    are refused: --out taken for --output, or --epoch for --epochs, is a typo acted on."""

    def __init__(self, *positional, settled=None, **kwargs):
        super().__init__(*positional, **{"allow_abbrev": False, **kwargs})
        self.words = []  # the command line being parsed
        self.settled = settled or {}  # {flag of train.py's: where this script takes it from instead}

    def parse_known_args(self, argv=None, namespace=None):  # argparse passes both by position
        self.words = list(sys.argv[1:] if argv is None else argv)
        return super().parse_known_args(argv, namespace)

    def error(self, message):
        if message.startswith("the following arguments are required"):
            # argparse says a required flag is missing before it says which were not recognized:
            # a typo of that very flag (--weight) is the mistake to name.
            words = list(map(str, self.words))
            options = words[:words.index("--")] if "--" in words else words  # after "--": positional arguments
            unknown = [word for word in options if word.startswith("--")
                       and word.split("=")[0] not in self._option_string_actions]
            message = f"unrecognized arguments: {' '.join(unknown)}" if unknown else message
        if rank_or_zero() == 0:
            print(f"{self.prog}: error: {message}{self.did_you_mean(message)} (see --help)", file=sys.stderr)
        elif launcher_pid() is not None:  # torchrun would stop rank 0 before its line were this rank first
            let_rank0_fail_first()
        sys.exit(2)

    def did_you_mean(self, message):
        """'; did you mean --epochs?' for a mistyped flag; '(for --bach-size)' after each guess
        when several flags were not recognized."""
        if not message.startswith("unrecognized arguments: "):
            return ""
        known = [flag for flag in self._option_string_actions if flag.startswith("--")]
        typed = dict.fromkeys(word.split("=")[0] for word in message.split(": ", 1)[1].split() if word.startswith("--"))
        guesses = {flag: difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
                   or [name for name in [OTHER_NAMES.get(flag)] if name in known] for flag in typed}
        named = [f"{guess[0]} (for {flag})" if len(typed) > 1 else guess[0] for flag, guess in guesses.items() if guess]
        settled = "".join(f"; {flag}: {self.settled[flag]}" for flag in typed if flag in self.settled)
        return (f"; did you mean {' and '.join(named)}?" if named else "") + settled


def env_int(name, default):
    """An integer variable of torchrun's (RANK, WORLD_SIZE, LOCAL_RANK), ``default`` when unset."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def rank_or_zero():
    """Global rank from the environment, 0 when it is unset or unreadable (for messages only)."""
    try:
        return env_int("RANK", 0)
    except UserError:
        return 0


def world_size_or_one():
    """WORLD_SIZE from the environment, 1 when it is unset or unreadable."""
    try:
        return env_int("WORLD_SIZE", 1)
    except UserError:
        return 1


def launcher_pid():
    """The PID of the torchrun that started this process, or None. torchrun starts each rank
    in a session of its own, so a signal that kills torchrun (a user's kill, a misdirected
    signal) does not reach its ranks: they must notice that their parent is gone."""
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None


def let_rank0_fail_first():
    """On a rank that prints nothing for an error or a stop that rank 0 prints: wait (at most
    RANK0_FIRST_S) for torchrun to end this process. torchrun stops every rank as soon as one
    fails; were that this rank, rank 0 could be stopped before its line, and the user would
    see only torchrun's report. torchrun's SIGTERM must end the wait: the training loop left
    it ignored, so that it cannot cut a line on the way out (engine/stopping.py)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(RANK0_FIRST_S)


def run_cli(main):
    """Run an entry point. A UserError becomes one line on stderr and its exit status (2, or 3
    for an aborted run); a stop request ends with one line on stdout after its checkpoint."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_DFL:  # errors.quiet_interrupt's, for the imports
        signal.signal(signal.SIGINT, signal.default_int_handler)  # from here Ctrl-C is KeyboardInterrupt again
    rank = rank_or_zero()
    for stream in (sys.stdout, sys.stderr):  # a file name that is not UTF-8 is printed escaped, not a traceback
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        try:
            main()
        except Exception as err:
            mistake = user_code_error(err, [RECIPE])  # an edit of recipe.py with a bug in it: one line
            if mistake is None:
                raise
            raise mistake from None
    except TrainingStopped as stop:
        if rank == 0:
            print(stop, flush=True)
        elif stop.exit_code:
            let_rank0_fail_first()
        leave(stop.exit_code, stopped=True)
    except UserError as err:
        prints = not err.silent and (rank == 0 or not err.same_on_every_rank)
        if prints and rank and getattr(err, "rank0_first", False):
            let_rank0_fail_first()  # rank 0 likely hit it too: then its line alone is seen (torchrun ends this one)
        if prints:
            say(f"{f'[rank {rank}] ' if rank else ''}error: {err}")
        if not prints and not getattr(err, "exit_at_once", False):
            let_rank0_fail_first()
        leave(err.exit_code)
    except KeyboardInterrupt as err:  # outside training (data, model, start-up), or a second Ctrl-C in it
        if rank == 0:
            say(f"Interrupted ({str(err) or 'Ctrl-C'})")
        leave(130)
    leave(0)


@contextmanager
def recipe_imported():
    """``with recipe_imported(): from train_utils import ...``: an entry point's imports, which
    import recipe.py, the file users edit. A mistake there (a SyntaxError, an import that fails)
    is one line and exit 2, printed by rank 0, as one in its functions is during a run (run_cli):
    these imports come before run_cli."""
    try:
        yield
    except Exception as err:
        mistake = user_code_error(err, [RECIPE])
        if mistake is None:
            raise
        if rank_or_zero() == 0:
            say(f"error: {mistake}")
        elif launcher_pid() is not None:
            let_rank0_fail_first()
        leave(2)


def user_code_error(err, files):
    """A UserError naming the line where ``err`` was raised, when the innermost file it passed
    through below the libraries is one of the user's ``files`` (recipe.py: a NameError in
    make_loss, a v2 transform given a bad argument; the --model file during training: a forward
    that fails on the training batch); None for any other exception, which keeps its traceback
    (a bug of ours, torch.compile's generated code, a CUDA fault that surfaced there). Printed
    by each rank that hits it, rank 0's first when all do."""
    worker = worker_error(err)
    if worker:  # raised in a DataLoader worker: its traceback is the text of this one
        kind, frames, line = worker
        kind_of = user_error_class(kind)
        if kind_of:  # one of ours, e.g. the loader's own check of an image (dataset_utils.loader_mistake)
            mistake = UserError(line, same_on_every_rank=False)
            mistake.exit_code = kind_of.exit_code  # an OutOfMemory's 1, a RunAborted's 3
            return rank0_first(mistake)
        frames, what = [frame for frame in frames if not is_library(frame[0])], f"{kind}: {line}"
    elif isinstance(err, (UserError, TrainingStopped)) or "CUDA error" in str(err):
        return None
    elif isinstance(err, SyntaxError) and err.filename and not is_library(err.filename):  # no frame in the file
        frames, what = [(err.filename, err.lineno, None)], f"{type(err).__name__}: {err.msg}"
    else:
        frames = [(frame.filename, frame.lineno, frame.name) for frame in traceback.extract_tb(err.__traceback__)
                  if not is_library(frame.filename)]
        what = f"{type(err).__name__}: {first_line(err)}"
    if not frames or Path(frames[-1][0]).resolve() not in {Path(file).resolve() for file in files}:
        return None
    filename, lineno, name = frames[-1]
    path = Path(filename).resolve()
    shown = path.relative_to(PROJECT) if path.is_relative_to(PROJECT) else path
    where = f", in {name}" if name else ""
    return rank0_first(UserError(f"{shown}, line {lineno}{where}: {what}", same_on_every_rank=False))


def user_error_class(name):
    """UserError or the subclass of it named ``name`` (the type of an exception a DataLoader
    worker raised, which reaches this process as text only); None for any other name."""
    classes = [UserError]
    while classes:
        kind = classes.pop()
        if kind.__name__ == name:
            return kind
        classes.extend(kind.__subclasses__())
    return None


def rank0_first(mistake):
    """``mistake``, a line each rank prints, printed by rank 0 first when all hit it."""
    mistake.rank0_first = True
    return mistake


# How torch re-raises an exception of a DataLoader worker in the training process: the worker's
# traceback as the text of a new exception of the same type (torch.utils.data's ExceptionWrapper,
# the same since torch 1.x). That text is the only record of where it was raised.
WORKER_ERROR = re.compile(r"^Caught (\w+) in DataLoader worker process \d+\.\nOriginal Traceback[^\n]*\n(.*)$", re.S)
WORKER_FRAME = re.compile(r'^  File "(.+)", line (\d+), in (.+)$', re.M)


def worker_error(err):
    """(its type's name, [(file, line, function)] innermost last, its message's first line) of
    ``err`` when a DataLoader worker raised it, read from its text (WORKER_ERROR); else None."""
    found = WORKER_ERROR.match(str(err))
    if not found:
        return None
    frames = [(filename, int(lineno), name) for filename, lineno, name in WORKER_FRAME.findall(found[2])]
    lines = found[2].splitlines()
    innermost = max((i for i, line in enumerate(lines) if WORKER_FRAME.match(line)), default=-1)
    # The exception's own line, "module.Type: text", follows the innermost frame's indented ones.
    last = next((line for line in lines[innermost + 1:] if line and not line.startswith(" ")), "")
    return found[1], frames, last.partition(": ")[2]


def is_library(filename):
    """Is ``filename`` (of a traceback's frame) Python's own or an installed package's?"""
    if filename.startswith("<") or "site-packages" in filename or "dist-packages" in filename:
        return True  # <frozen importlib._bootstrap>, pip's and Debian's packages
    stdlib = {sysconfig.get_paths()[name] for name in ("stdlib", "platstdlib")}
    return any(Path(filename).resolve().is_relative_to(Path(folder).resolve()) for folder in stdlib)


def say(line):
    """``line`` on stderr in one write. print() writes the text and its newline apart to the
    unbuffered stderr, so two processes sharing it (the nodes of srun, the ranks of torchrun)
    could interleave into "error: A error: B" on one line."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


def leave(code, stopped=False):
    """Exit with status ``code``. A rank of several that torchrun started leaves with os._exit
    once its output is flushed: its process group is gone by then (or hung: a lost rank), its
    files are closed, and what is left are C++ threads that PyTorch's and gloo's destructors
    may join or abandon ("terminate called without an active exception"), which turned
    finished runs into SIGABRT and torchrun's traceback now and then. Anything else (a test
    calling an entry point in its own process) exits as usual.

    ``stopped``: a stop request ended the run, its checkpoint written. A repeated stop signal
    (Slurm signals every process of the step, torchrun passes its own on, a second Ctrl-C)
    while the process shuts down is ignored: Python gives every signal it handles back its
    default action before it frees its modules (PyTorch's destructors: seconds), and one that
    came then killed the process, turning exit status 75 into 130 or 143. SIG_IGN survives
    that; nothing is started after it to inherit it."""
    if stopped:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
    if launcher_pid() is not None and world_size_or_one() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
