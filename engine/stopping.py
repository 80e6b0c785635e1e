"""Stop requests: signals, --stop-file and a vanished torchrun set a flag; the ranks agree
after every step, and the loop stops after the same step on every rank, checkpoints and
exits (EXIT_STOPPED after a signal, 0 after the stop file).
"""

import os
import signal
import threading
from pathlib import Path

from engine.errors import EXIT_STOPPED, TrainingStopped, UserError, release_stop_request
from engine.processes import PendingMax, group_active, max_over_ranks


STOP_FILE_POLL_S = 1.0  # rank 0's thread looks for --stop-file this often (a metadata call on a shared FS)


# What a rank saw, ordered so that the all-reduced maximum is what every rank acts on.
NO_STOP, STOP_FILE, STOP_SIGNAL = 0, 1, 2


class StopRequests:
    """SIGUSR1 (Slurm's warning before the time limit), SIGTERM (scancel, preemption, torchrun
    passing either on) and SIGINT (Ctrl-C) only set a flag, and so do ``stop_file`` appearing
    (seen by global rank 0) and the death of the torchrun that started this rank: the loop
    stops after the next step (the current one in one process), checkpoints, and exits. A
    second Ctrl-C quits at once.

    Exit status: EXIT_STOPPED after a signal; 0 after the stop file, which the job scripts
    use to stop training before the time limit without signalling torchrun (it would report
    the stop as a crash, with a traceback); the file is then removed, which tells the script
    that training stopped rather than finished.

    Nothing of this waits in a training step: a thread looks for the stop file (a stat on
    Lustre can take 50 ms), and the ranks agree asynchronously (``after_step``): the
    agreement started after one step is read after the next, so all ranks stop after the
    same step, one step after the request was seen.
    """

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)

    def __init__(self, ctx, stop_file=None, checkpoint_dir=None):
        self.ctx = ctx
        self.checkpoint_dir = checkpoint_dir
        self.stop_file = Path(stop_file) if stop_file and ctx.is_main else None
        self.received = None  # the name of the first signal
        self.file_seen = False
        self._previous = {}
        self._pending = None  # the agreement started after the last step (PendingMax)
        self._agree = group_active()  # with other ranks, after every step; the group outlives the loop
        self._done = threading.Event()

    def __enter__(self):
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        release_stop_request()  # one that came during the imports or the data's read is handled now
        if self.stop_file is not None:
            threading.Thread(target=self._watch_stop_file, name="stop-file", daemon=True).start()
        return self

    def __exit__(self, exc_type, *exc_info):
        self._done.set()  # the thread ends after its current look (not joined: a hung stat must not hang us)
        for sig, handler in self._previous.items():
            # Stopping after a signal: a repeat (Slurm signals every process of the step, and torchrun passes
            # its own on) must not turn exit status 75 into 143 while the process tears down. Leaving with an
            # error: torchrun's SIGTERM, sent as soon as a rank dies, must not cut this rank's line (or the
            # one naming a lost rank). Ctrl-C stays a way out, but for a stop whose checkpoint is written: a
            # second Ctrl-C then would only turn its status 75 into 130. A handler that does nothing, not
            # SIG_IGN, which children would inherit.
            if sig == signal.SIGINT:
                repeat_ignored = exc_type is not None and issubclass(exc_type, TrainingStopped)
            else:
                repeat_ignored = self.received or exc_type is not None
            signal.signal(sig, _repeat_ignored if repeat_ignored else handler)

    def _watch_stop_file(self):
        while not self._done.is_set():
            if self.stop_file.exists():
                self.file_seen = True
                return
            self._done.wait(STOP_FILE_POLL_S)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.received == "SIGINT":
            # Ctrl-C twice: the user does not want to wait.
            raise KeyboardInterrupt(f"a second Ctrl-C: {self.what_is_kept()}")
        self.received = self.received or signal.Signals(signum).name

    def what_is_kept(self):
        """What a run that quits now leaves behind, for the line that says it quit."""
        if not self.checkpoint_dir:
            return "the model is lost (no --checkpoint-dir)"
        newest = newest_checkpoint(self.checkpoint_dir)
        if newest is None:
            return f"no checkpoint was written yet (--checkpoint-dir {self.checkpoint_dir})"
        return f"nothing saved since {newest}"

    def _local(self):
        if not self.received and launcher_gone(self.ctx.launcher_pid):  # an orphan: nobody would see its output
            self.received = "torchrun, its launcher, has exited"
        if self.received:
            return STOP_SIGNAL
        return STOP_FILE if self.file_seen else NO_STOP

    def after_step(self):
        """After each training step: the stop every rank acts on now (NO_STOP, STOP_FILE or
        STOP_SIGNAL), from the agreement started after the previous step, which has finished
        meanwhile (a one-element gloo all-reduce on the CPU: tens of microseconds, no GPU sync);
        then the next one starts with this rank's flag. Every rank reads the same results in
        the same order, so all stop after the same step."""
        if not self._agree:
            return self._local()
        agreed = self.drain()
        if agreed == NO_STOP:
            self._pending = PendingMax(self._local(), self.ctx.control_group)
        return agreed

    def drain(self):
        """Finish the agreement under way, if any, and return it (NO_STOP if none). The flags
        stay set, so a stop it carried is seen again by the next ``agreed``."""
        pending, self._pending = self._pending, None
        return pending.result() if pending else NO_STOP

    def agreed(self):
        """The stop every rank acts on, now: the maximum over ranks (blocking; between epochs)."""
        self.drain()
        return max_over_ranks(self._local(), self.ctx.control_group)

    def stopped(self, kind, where, path):
        """The exception that ends training after the stop checkpoint ``path``. The stop file
        it acted on is removed (global rank 0): a job script that finds it gone knows training
        stopped on it rather than finished, and a later run is not stopped by it."""
        if kind == STOP_FILE and self.stop_file is not None:
            try:
                if is_empty_file(self.stop_file):  # a request (touch); a file with data in it is never removed
                    self.stop_file.unlink()
            except OSError:  # a folder no longer writable: the file stays, and says nothing new
                pass
        cause = {STOP_FILE: f"--stop-file {self.stop_file}" if self.stop_file else "--stop-file",
                 STOP_SIGNAL: self.received or "a stop request on another rank"}[kind]
        saved = f"checkpoint {path}: continue with --resume" if path else "nothing saved (no --checkpoint-dir)"
        return TrainingStopped(f"Stopped {where} ({cause}); {saved}", 0 if kind == STOP_FILE else EXIT_STOPPED)


def is_empty_file(path):
    """True for an empty regular file (not a link): what ``touch`` makes of a stop file."""
    return os.path.isfile(path) and not os.path.islink(path) and os.path.getsize(path) == 0


def check_stop_file(path):
    """--stop-file at start: a path that holds something other than an empty file (the user's
    own file, named by mistake) is refused: the run would take it for a stop request after its
    first step. An empty one is a request made before the start: the run stops after that step."""
    if os.path.isdir(path):
        raise UserError(f"--stop-file {path} is a folder: name a file of its own, which need not exist (a stop is "
                        "requested with: touch PATH)")
    if os.path.lexists(path) and not is_empty_file(path):
        raise UserError(f"--stop-file {path} exists and is not an empty file: the run would take it for a stop "
                        "request after its first step; name a path of its own (a stop is requested with: touch PATH)")


def newest_checkpoint(checkpoint_dir):
    """The newest checkpoint file in ``checkpoint_dir`` (a folder, which may not exist yet),
    or None: what a run that ends now leaves to resume from."""
    from engine.checkpoints import checkpoint_paths  # a run that writes checkpoints has imported it
    newest = checkpoint_paths(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []
    return newest[0] if newest else None


def launcher_gone(launcher_pid):
    """True when the torchrun of PID ``launcher_pid`` (None: none) has exited under this rank
    (it is now some other process's child). One system call, cheap enough for every step."""
    return launcher_pid is not None and os.getppid() != launcher_pid


def _repeat_ignored(signum, frame):
    """A stop signal after the stop: the process is already on its way out with its status."""


def ignore_stop_signals():
    """SIGTERM and SIGUSR1 do nothing from now on (SIGINT stays: a user's Ctrl-C): the
    process is on its way out, and a signal (torchrun's, sent as soon as a rank dies) must
    not cut the line it is about to print."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _repeat_ignored)


def ignore_ctrl_c(worker_id):
    """Loader workers leave Ctrl-C (SIGINT to the terminal's whole process group) to the
    training process, which checkpoints and stops; a worker killed by it would fail the
    next batch instead."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
