"""Checkpoints, weights files, resume and stop requests: what a run needs to continue exactly
where it stopped, on any number of GPUs, without losing or overwriting anything already
written.

- A checkpoint folder belongs to one run. A new run refuses a folder that holds
  checkpoints; ``--resume`` continues the run in it; ``--resume=auto`` (the job scripts)
  continues it when there is a checkpoint and starts a new run otherwise.
- Global rank 0 writes every checkpoint atomically, keeps the newest two of its own run
  (pruning never touches a file this run did not write) and chooses the checkpoint a resume
  starts from; every rank loads exactly that file, or the run stops with one error.
- Checkpoints are written at the end of an epoch at most every ``--checkpoint-interval``
  minutes (0 = every epoch), and always on a stop request and at the end of training.
- Stop requests: SIGUSR1, SIGTERM and SIGINT (Ctrl-C; a second one quits at once), the
  appearance of ``--stop-file``, and the exit of the torchrun that started the ranks. All
  ranks agree on them after every step.
- ``--metrics-file`` keeps every epoch of a run exactly once across resumes.
- Weights files (``--save-weights``) are the plain state_dict (the guide's layout), with the
  data's class names and image size in its metadata, so an evaluation maps labels the same way.

Only ``train_utils`` calls this module; ``run`` arguments are its ``train_utils.Run``.
"""

import itertools
import json
import os
import pickle
import signal
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dataset_utils import derived_seed
from device_utils import (PendingMax, UserError, any_rank, from_rank0, gather_objects, group_active, launcher_gone,
                          max_over_ranks)

EXIT_STOPPED = 75  # stopped by a signal after writing a checkpoint: run again with --resume
CHECKPOINT_PREFIX, CHECKPOINT_FORMAT, KEEP_CHECKPOINTS = "checkpoint_", 1, 2
UNREADABLE_SUFFIX = ".unreadable"  # an unreadable checkpoint is renamed aside, never deleted
# Flags that define the run: a resumed run must keep them, or it would not be the same run.
# --epochs is not among them: a larger one extends the run (see check_resumable).
RECIPE_FLAGS = ("batch_size", "base_lr", "lr_schedule", "warmup_epochs", "momentum", "nesterov", "weight_decay",
                "label_smoothing", "precision", "seed", "limit_batches", "synthetic", "augment")
WEIGHTS_METADATA = "task"  # the key of a weights file's metadata (state_dict._metadata[""])
STOP_FILE_POLL_S = 1.0  # rank 0's thread looks for --stop-file this often (a metadata call on a shared FS)


@dataclass
class TrainState:
    """Where the run is. Saved in every checkpoint; the loop updates it in place."""
    run_id: str                                      # tags this run's lines in --metrics-file
    epoch: int = 1                                   # the epoch in progress (1-based)
    step: int = 0                                    # optimizer steps done in it
    partial: tuple = (0.0, 0, 0.0)                   # loss sum, images, seconds of those steps (all ranks)
    history: list = field(default_factory=list)      # validation accuracy of each finished epoch
    records: list = field(default_factory=list)      # --metrics-file record of each finished epoch
    checkpoints: list = field(default_factory=list)  # file names of this run's kept checkpoints, oldest first
    lr_cycles: list = field(default_factory=list)    # the LR schedule's cycles (lr_schedule.Cycle as lists)


def new_run_id():
    return uuid.uuid4().hex[:12]


# ---------------------------------------------------------------------------------------------
# Files that are never half-written.

def atomic_save(obj, path):
    """torch.save to a temporary file, fsync, rename: a crash never leaves a truncated file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # the first write creates the folder
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # disk full, Ctrl-C: leave no partial file behind
        tmp.unlink(missing_ok=True)
        raise


def check_outputs(args, ctx):
    """Every output path of the command line, checked by global rank 0 before any data is read
    or any step trained: a folder that cannot be written (someone else's project area, a
    read-only mount) is one line and exit status 2 at start, not a traceback after hours of
    training that loses the model. Every rank gets rank 0's verdict."""
    def check():
        for flag, path in (("--metrics-file", args.metrics_file), ("--save-weights", args.save_weights)):
            if path:
                check_writable(path, flag)
        for flag, directory in (("--checkpoint-dir", args.checkpoint_dir), ("--tensorboard", args.tensorboard),
                                ("--profile-dir", args.profile_dir)):
            if directory:
                check_writable_dir(directory, flag)

    from_rank0(check, ctx.control_group)


def check_writable(path, flag):
    """Fail at start, not after hours of training, when an output file cannot be written.
    Nothing is left behind: folders are made when the file is first written, so a command
    that fails leaves no empty folder. The folder must take new files even when the file
    exists: it is replaced through a temporary file beside it (atomic_save, reconcile_metrics).
    (os.path, not pathlib: a folder that cannot be entered is "not there", not a traceback.)"""
    path = Path(path)
    if os.path.isdir(path):
        raise UserError(f"{flag} {path}: not a writable file path (it is a folder)")
    if os.path.exists(path):
        try:
            open(path, "ab").close()  # opened for appending, nothing written: the file is unchanged
        except OSError as err:
            raise UserError(f"{flag} {path}: cannot write it ({err.strerror or err})") from None
    why = _why_not_creatable(path.parent)
    if why:
        verb = "write in" if os.path.isdir(path.parent) else "create"
        raise UserError(f"{flag} {path}: cannot {verb} {path.parent} ({why})")


def check_writable_dir(directory, flag):
    """The same for a folder that files will be written into (created by the first write)."""
    directory = Path(directory)
    why = _why_not_creatable(directory)
    if why:
        raise UserError(f"{flag} {directory}: cannot {'write in' if os.path.isdir(directory) else 'create'} it "
                        f"({why})")


def _why_not_creatable(directory):
    """Why ``directory`` cannot be (or become) a folder that files can be written into, or None.
    The nearest existing folder is probed with a real file, removed at once: permissions,
    ACLs, a read-only mount and root squash all show, which os.access misses for root."""
    existing = directory.absolute()
    while not os.path.exists(existing) and existing != existing.parent:  # the nearest existing ancestor
        existing = existing.parent
    if not os.path.isdir(existing):
        return f"{existing} is a file" if existing != directory.absolute() else "a file of that name exists"
    try:
        handle, probe = tempfile.mkstemp(dir=existing, prefix=".write-test-")
    except OSError as err:
        return f"{existing}: {err.strerror or err}"
    os.close(handle)
    os.unlink(probe)
    return None


# ---------------------------------------------------------------------------------------------
# Weights files: the plain state_dict, and what it was trained on.

def save_weights(model, path, metadata=None):
    """The model's state_dict, written atomically, with ``metadata`` (the data's classes,
    image size, normalization) in its ``_metadata``: torch.load returns it with the tensors,
    and load_state_dict ignores it, so the file loads strictly into the model as the guide's did."""
    state = model.state_dict()
    if metadata is not None:
        state._metadata[""] = {**state._metadata.get("", {}), WEIGHTS_METADATA: metadata}
    atomic_save(state, path)


def load_weights(model, path, model_name=None, expected=None):
    """Load a state_dict file (or the model of a checkpoint) into ``model``. One line when it
    is not one, does not fit ``model``, or was trained on other classes than ``expected``'s."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"--weights {path}: no such file", same_on_every_rank=False) from None
    except Exception as err:  # not a torch file, truncated, or pickled objects we refuse to run
        if isinstance(err, pickle.UnpicklingError) and "Unsupported global" in str(err):  # weights_only refused a class
            raise UserError(f"--weights {path} holds pickled Python objects (a whole model saved with "
                            "torch.save(model)?), not a state_dict; save one with torch.save(model.state_dict(), PATH)",
                            same_on_every_rank=False) from None
        raise UserError(f"--weights {path} is not a readable state_dict ({type(err).__name__})",
                        same_on_every_rank=False) from None
    saved = {}
    if isinstance(state, dict) and isinstance(state.get("model"), dict):  # a checkpoint
        saved, state = state.get("data") or {}, state["model"]
    if not isinstance(state, dict):
        raise UserError(f"--weights {path} holds a {type(state).__name__}, not a state_dict")
    saved = getattr(state, "_metadata", {}).get("", {}).get(WEIGHTS_METADATA, saved)
    state = _strip_prefixes(state)
    check_state_fits(model, state, f"--weights {path}", model_name)
    classes, wanted = saved.get("classes"), (expected or {}).get("classes")
    if classes is not None and wanted is not None and list(classes) != list(wanted):
        if len(classes) == len(wanted):
            label = next(i for i, (a, b) in enumerate(zip(classes, wanted)) if a != b)
            detail = f"label {label} is {classes[label]!r} there and {wanted[label]!r} here"
        else:
            detail = f"{len(classes)} classes there, {len(wanted)} here"
        raise UserError(f"--weights {path} were trained on other classes ({detail}): their outputs would be "
                        "read as the wrong labels; use the data set they were trained on")
    model.load_state_dict(state)


def _strip_prefixes(state):
    """Accept state_dicts saved from a DDP-wrapped or torch.compile'd model too."""
    def clean(key):
        for prefix in ("module.", "_orig_mod."):
            key = key.removeprefix(prefix)
        return key
    return {clean(key): value for key, value in state.items()}


def check_state_fits(model, state, source, model_name=None):
    """One clear line instead of load_state_dict's multi-line error for another model shape."""
    own = model.state_dict()
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
    reshaped = [k for k in own.keys() & state.keys() if tuple(own[k].shape) != tuple(state[k].shape)]
    if missing or unexpected or reshaped:
        example = sorted(missing or unexpected or reshaped)[0]
        raise UserError(f"{source} does not fit {model_name or type(model).__name__}: "
                        f"{len(missing)} missing, {len(unexpected)} unexpected and {len(reshaped)} "
                        f"differently shaped tensors (e.g. {example}): weights of another --model or --dataset?")


# ---------------------------------------------------------------------------------------------
# Random-number states: each epoch's are a function of (seed, epoch, rank).

def epoch_seed(seed, epoch, rank):
    """Seed of the global RNG (dropout) for one epoch on one rank, so a run resumed at an epoch
    boundary repeats the uninterrupted one exactly. The loaders seed their augmentation
    themselves, also from (seed, epoch, ...)."""
    return derived_seed(seed, epoch, rank)


def rng_snapshot():
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def restore_rng(snapshot):
    torch.set_rng_state(snapshot["cpu"].cpu())
    if snapshot["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(snapshot["cuda"].cpu())


# ---------------------------------------------------------------------------------------------
# The run's folder: who owns it, and which checkpoint a resume starts from.

def checkpoint_paths(directory):
    """Checkpoints in ``directory``, newest first (the names sort by optimizer step)."""
    return sorted(Path(directory).glob(f"{CHECKPOINT_PREFIX}*.pt"), reverse=True)


def continues_run(directory, resume):
    """Whether this run continues the run in ``directory`` (True) or starts a new one (False).

    ``resume``: None (a new run), "required" (--resume: continue, error if nothing to continue)
    or "auto" (continue when there is a checkpoint). A new run never starts in a folder that
    holds checkpoints: its own would overwrite and prune the other run's, and a later --resume
    would not know which run it continues. Call on global rank 0 (``from_rank0``).
    """
    if resume == "required":
        return True
    existing = checkpoint_paths(directory) if directory else []
    if resume == "auto":
        return bool(existing)
    if existing:
        raise UserError(f"--checkpoint-dir {directory} already holds checkpoints of another run (newest: "
                        f"{existing[0].name}); continue that run with --resume, or give this run another "
                        "--checkpoint-dir")
    return False


def read_checkpoint(path, device):
    checkpoint = torch.load(path, map_location=device, weights_only=True)
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ValueError("not a checkpoint of these scripts")
    return checkpoint


def _why(err):
    """A short, whole reason: the error's type and the first sentence of its message (torch.load's
    messages run to several sentences of advice that do not apply here)."""
    text = " ".join(str(err).split())
    first = text.split(". ", 1)[0].rstrip(".")
    return f"{type(err).__name__}: {first}" if first else f"{type(err).__name__} (empty or truncated file?)"


def _aside(path):
    """Where an unreadable checkpoint goes: NAME.unreadable (.2, .3, ...: never over an earlier one)."""
    for n in itertools.count(1):
        aside = path.with_name(f"{path.name}{UNREADABLE_SUFFIX}{f'.{n}' if n > 1 else ''}")
        if not aside.exists():
            return aside


def choose_checkpoint(directory, device, log):
    """(path, checkpoint): the newest checkpoint in ``directory`` that reads. A newer one that
    does not read is renamed to NAME.unreadable (kept, out of the way) with a warning. Never a
    silent fresh start: nothing readable is an error. Call on global rank 0."""
    problems = []
    for path in checkpoint_paths(directory):
        try:
            return path, read_checkpoint(path, device)
        except Exception as err:  # truncated, corrupted, or foreign
            problems.append(f"{path.name}: {type(err).__name__}")
            aside = _aside(path)
            try:
                os.replace(path, aside)
                kept = f"renamed it to {aside.name}"
            except OSError:
                kept = "left it in place"
            log.info(f"WARNING: checkpoint {path} is unreadable ({_why(err)}); {kept} and trying the previous one")
    found = f" ({'; '.join(problems)})" if problems else ""
    raise UserError(f"--resume: no readable checkpoint in {directory}{found}")


def load_agreed_checkpoint(directory, ctx, log):
    """(path, checkpoint), the same file on every rank: global rank 0 chooses it, every other
    rank reads exactly that file. A rank that cannot read it (a folder that is not shared, a
    file-system error) stops every rank with the same one-line error; no rank falls back to
    another checkpoint on its own, which would resume the ranks at different steps."""
    chosen = {}

    def choose():
        path, chosen["checkpoint"] = choose_checkpoint(directory, ctx.device, log)
        return str(path)

    path = from_rank0(choose, ctx.control_group)
    failure = None
    if not ctx.is_main:
        try:
            chosen["checkpoint"] = read_checkpoint(path, ctx.device)
        except Exception as err:
            failure = _why(err)
    failures = {rank: why for rank, why in enumerate(gather_objects(failure, ctx.control_group)) if why}
    if failures:
        rank, why = next(iter(failures.items()))
        raise UserError(f"--resume: rank(s) {sorted(failures)} cannot read {path}, the checkpoint rank 0 chose "
                        f"(rank {rank}: {why}); every node must see the same --checkpoint-dir, on a "
                        "shared file system")
    return Path(path), chosen["checkpoint"]


def check_resumable(checkpoint, args, fingerprint, model_key, check_fits, defaults):
    """Refuse to continue a run with another model, data set or recipe (it would not be the
    same run). ``check_fits(state_dict, source)`` raises when the model's shape differs. A
    checkpoint written before a flag existed ran with its default (``defaults``: the flags'
    defaults, by name)."""
    saved = {**defaults, **checkpoint["args"]}
    trained_on = checkpoint["data"].get("dataset", defaults["dataset"])
    if trained_on != fingerprint["dataset"]:
        raise UserError(f"the checkpoint was trained on --dataset {trained_on}, this run is --dataset {args.dataset}; "
                        f"resume with --dataset {saved['dataset']}, or start a new run in another --checkpoint-dir")
    if checkpoint.get("model_key", defaults["model"]) != model_key:
        raise UserError(f"the checkpoint was trained with --model {saved['model']}, this run has --model {args.model}; "
                        f"resume with --model {saved['model']}, or start a new run in another --checkpoint-dir")
    check_fits(checkpoint["model"], "the checkpoint")
    old, new = checkpoint["data"], fingerprint
    differ = [key for key in old.keys() & new.keys() if old[key] != new[key]]
    if differ:
        other = {"train_labels_sha256": "different labels", "classes": "other classes",
                 "image_shape": f"images of shape {old.get('image_shape')} then, {new.get('image_shape')} now"}
        raise UserError(f"the checkpoint was trained on other data ({old['train_images']} training images, "
                        f"synthetic={old['synthetic']}; now {new['train_images']}, synthetic={new['synthetic']}"
                        + "".join(f", {other[key]}" for key in other if key in differ) + ")")
    changed = [f"--{name.replace('_', '-')} {saved.get(name)} (now {getattr(args, name)})"
               for name in RECIPE_FLAGS if saved.get(name) != getattr(args, name)]
    if args.epochs < saved["epochs"]:
        changed.append(f"--epochs {saved['epochs']} (now {args.epochs}: a run can be extended with a larger "
                       "--epochs, not shortened)")
    if changed:
        raise UserError("--resume needs the checkpoint's recipe, but it had " + ", ".join(changed)
                        + "; rerun with its values or start a new --checkpoint-dir")


def restore(run, checkpoint):
    """Load model, optimizer, schedule and scaler from ``checkpoint``; returns its TrainState
    and this rank's RNG states (None when it was saved at an epoch boundary or by another
    number of ranks)."""
    run.module.load_state_dict(checkpoint["model"])
    run.optimizer.load_state_dict(checkpoint["optimizer"])
    run.scheduler.load_state_dict(checkpoint["scheduler"])
    run.scaler.load_state_dict(checkpoint["scaler"])
    rng = checkpoint["rng"]
    rng_state = rng[run.ctx.rank] if rng and len(rng) == run.ctx.world_size else None
    return TrainState(**checkpoint["state"]), rng_state


# ---------------------------------------------------------------------------------------------
# Writing checkpoints.

class Checkpointer:
    """Writes one run's checkpoints into its folder: global rank 0 writes, every rank waits
    for the file (so none exits while it is written). Records how often and how long."""

    def __init__(self, directory, interval_minutes, ctx):
        self.directory = Path(directory) if directory else None
        self.interval_s = interval_minutes * 60
        self.ctx = ctx
        self.last_time = time.monotonic()
        self.last_step = None  # optimizer step of the newest checkpoint written or loaded
        self.count, self.seconds = 0, 0.0

    def due(self):
        """At the end of an epoch: is a checkpoint due? Decided by rank 0's clock, so every
        rank agrees (a one-element all-reduce on the CPU)."""
        if self.directory is None:
            return False
        late = time.monotonic() - self.last_time >= self.interval_s
        return any_rank(self.ctx.is_main and late, self.ctx.control_group)

    def save(self, run, state, rng_states=None):
        """Write the checkpoint of the run at ``state`` (unless exactly that one was written
        already) and prune this run's older ones, keeping KEEP_CHECKPOINTS. Returns its path."""
        step = run.scheduler.last_epoch  # optimizer steps so far: the name sorts by progress
        path = self.directory / f"{CHECKPOINT_PREFIX}{step:09d}.pt"
        if step == self.last_step:
            return path
        start = time.perf_counter()
        kept = [name for name in state.checkpoints if name != path.name] + [path.name]
        state.checkpoints, pruned = kept[-KEEP_CHECKPOINTS:], kept[:-KEEP_CHECKPOINTS]

        def write():
            try:
                atomic_save({"format": CHECKPOINT_FORMAT, "state": asdict(state), "model": run.module.state_dict(),
                             "optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(),
                             "scaler": run.scaler.state_dict(), "rng": rng_states, "args": vars(run.args),
                             "data": run.task.data.fingerprint, "model_key": run.task.model_key,
                             "world_size": run.ctx.world_size}, path)
                for name in pruned:  # only this run's own files
                    (self.directory / name).unlink(missing_ok=True)
            except OSError as err:
                raise UserError(f"cannot write checkpoint {path} ({err.strerror or err}); the previous "
                                f"checkpoints are kept") from None

        from_rank0(write, self.ctx.control_group)  # every rank waits until the file is on disk
        self.last_time, self.last_step = time.monotonic(), step
        self.count, self.seconds = self.count + 1, self.seconds + time.perf_counter() - start
        return path


# ---------------------------------------------------------------------------------------------
# Stop requests.

class TrainingStopped(Exception):
    """Raised after the stop checkpoint is written; the entry point prints the message and
    exits with ``exit_code``."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


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
    the stop as a crash, with a traceback).

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
        self._done = threading.Event()

    def __enter__(self):
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        if self.stop_file is not None:
            threading.Thread(target=self._watch_stop_file, name="stop-file", daemon=True).start()
        return self

    def __exit__(self, *exc_info):
        self._done.set()  # the thread ends after its current look (not joined: a hung stat must not hang us)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _watch_stop_file(self):
        while not self._done.is_set():
            if self.stop_file.exists():
                self.file_seen = True
                return
            self._done.wait(STOP_FILE_POLL_S)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.received == "SIGINT":
            # Ctrl-C twice: the user does not want to wait.
            raise KeyboardInterrupt("a second Ctrl-C: " + (f"nothing saved since the last checkpoint in "
                                                           f"{self.checkpoint_dir}" if self.checkpoint_dir
                                                           else "the model is lost (no --checkpoint-dir)"))
        self.received = self.received or signal.Signals(signum).name

    def _local(self):
        if not self.received and launcher_gone(self.ctx):  # an orphan: nobody would see its output or exit
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
        if not group_active():
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
        """The exception that ends training after the stop checkpoint ``path``."""
        cause = {STOP_FILE: f"--stop-file {self.stop_file}" if self.stop_file else "--stop-file",
                 STOP_SIGNAL: self.received or "a signal to another rank"}[kind]
        saved = f"checkpoint {path}: continue with --resume" if path else "nothing saved (no --checkpoint-dir)"
        return TrainingStopped(f"Stopped {where} ({cause}); {saved}", 0 if kind == STOP_FILE else EXIT_STOPPED)


# ---------------------------------------------------------------------------------------------
# The metrics file across resumes.

def reconcile_metrics(path, run_id, records):
    """On resume: make ``path`` hold each finished epoch of run ``run_id`` exactly once.
    Lines of epochs the checkpoint does not have (they run again) are dropped, records the
    file lost are appended; other runs' lines and unparsable lines are kept as they are."""
    path = Path(path)
    lines = path.read_text().splitlines() if path.exists() else []
    done, seen, kept = {r["epoch"] for r in records}, set(), []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if isinstance(entry, dict) and entry.get("run_id") == run_id:
            if entry.get("epoch") not in done or entry.get("epoch") in seen:
                continue
            seen.add(entry["epoch"])
        kept.append(line)
    kept += [json.dumps(r) for r in records if r["epoch"] not in seen]
    if kept != lines:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
