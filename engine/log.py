"""What a run prints and writes for people to follow and compare, but for the loop's own lines
(the progress, epoch and summary lines are train_utils.py's): the run's clock, the start-up
block's pieces (train_utils.py composes it), each epoch's metrics record, and the metrics file.

Only global rank 0 prints and writes (``enabled``).

No torch import: tools/report.py reads metrics files with these functions on any machine.
"""

import json
import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from engine.errors import space_problem


@dataclass
class RunClock:
    """This process's wall time (seconds of ``now``), for the epoch lines' elapsed time and ETA."""
    now: Callable = time.perf_counter
    start: float = None
    epoch_walls: list = field(default_factory=list)  # seconds per whole epoch, from the training loop's start
    last: float = None
    first_step_s: float = None  # this process's first training step, its batch included (the loop's to set)

    def __post_init__(self):
        self.start = self.now() if self.start is None else self.start

    def loop_started(self):
        """The training loop starts now: the first epoch's wall leaves out the start-up before it
        (the data, the model, a checkpoint read), which is no epoch's pace."""
        self.last = self.now()

    def epoch_done(self, fraction=1.0):
        """An epoch ended; this process trained ``fraction`` of it (less in an epoch resumed
        midway), so its wall scales to a whole one. An epoch of no steps here adds nothing."""
        now = self.now()
        wall = now - (self.start if self.last is None else self.last)
        if fraction > 0:
            self.epoch_walls.append(wall / fraction)
        self.last = now

    def elapsed(self):
        return self.now() - self.start


class RunLogger:
    """Prints (global rank 0) and appends one JSON line per epoch to --metrics-file.

    A metrics line that cannot be written (disk full, quota, a vanished folder) is a warning,
    not the end of hours of training: the line is kept and written with the next one that
    can be, and every record is also in the checkpoints (a resume writes what a file lacks).
    """

    def __init__(self, enabled, metrics_file=None, stream=None, checkpointed=False):
        self.enabled = enabled
        self.checkpointed = checkpointed  # the records are in --checkpoint-dir's checkpoints too
        self.metrics_path = Path(metrics_file) if (enabled and metrics_file) else None
        self.stream = stream
        self.pending = []  # JSON lines not written yet

    def info(self, message=""):
        if self.enabled:
            print(message, file=self.stream or sys.stdout, flush=True)

    def record(self, record):
        """Append one JSON line; earlier lines (and earlier runs) are never rewritten."""
        if not self.metrics_path:
            return
        self.pending.append(json.dumps(record) + "\n")
        try:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)  # created on first use
            with locked_metrics(self.metrics_path) as f:
                torn = f.tell() > 0 and f.seek(-1, os.SEEK_END) >= 0 and f.read(1) != b"\n"
                f.write(("\n" if torn else "").encode() + "".join(self.pending).encode())  # a line of its own
        except OSError as err:
            self.info(f"WARNING: cannot append to --metrics-file {self.metrics_path} ({err.strerror or err}); "
                      f"{count(len(self.pending), 'line', 'lines')} kept in memory for the next epoch"
                      + (", and in the checkpoints" if self.checkpointed else ""))
            return
        self.pending = []


# Another run's append or rewrite holds a metrics file for milliseconds; past this (a run stopped
# while holding it, a hung NFS lock daemon) the append goes on unlocked rather than stall training.
METRICS_LOCK_WAIT_S = 30.0
METRICS_REOPENS = 100  # a file replaced this often while waiting, or names that disagree with handles: go on


@contextmanager
def locked_metrics(path, wait_s=METRICS_LOCK_WAIT_S):
    """``path`` opened for appending (a+b) at its end, under an exclusive flock: several runs
    may share one metrics file (the job scripts' example), and a resume's rewrite
    (reconcile_metrics) must not replace the file between another run's reading of its end and
    its append. An appender that waited while the file was replaced opens the new one. On a
    file system without flock (Lustre mounted noflock), or after ``wait_s`` seconds, unlocked:
    an append alone is safe."""
    import fcntl  # POSIX; imported here, as tools/report.py reads metrics files with this module anywhere
    deadline = time.monotonic() + wait_s
    for _ in range(METRICS_REOPENS):
        f = open(path, "a+b")
        try:
            if not _flocked(f, fcntl, deadline):
                break
            if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
                break
        except FileNotFoundError:  # removed meanwhile: created again
            pass
        except BaseException:
            f.close()
            raise
        f.close()  # replaced meanwhile: append to the new file
    else:  # replaced that often meanwhile: unlocked
        f = open(path, "a+b")
    with f:
        f.seek(0, os.SEEK_END)
        yield f


def _flocked(f, fcntl, deadline):
    """Whether an exclusive flock of ``f`` (released as it closes) was had before ``deadline``."""
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:  # held by another run, for milliseconds
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        except OSError:  # no locks on this file system
            return False


# ---------------------------------------------------------------------------------------------
# The start-up block's pieces, and each epoch's metrics record.

def describe_length(epochs, target, patience):
    """The start-up block's line on when the run ends: at --epochs, or at the guide's early stop."""
    if target is None:
        return f"Length: {count(epochs, 'epoch', 'epochs')} (no early stop: --target-accuracy off)"
    if epochs <= patience:  # a stop after --patience epochs in a row is at --epochs at the soonest
        return (f"Length: {count(epochs, 'epoch', 'epochs')} (no early stop: it takes validation accuracy at least "
                f"{target:g} for {count(patience, 'epoch', 'epochs')} in a row, --patience)")
    return (f"Length: {count(epochs, 'epoch', 'epochs')}, or fewer: early stop once validation accuracy is at least "
            f"{target:g} for {count(patience, 'epoch', 'epochs')} in a row (--target-accuracy, --patience; "
            "--target-accuracy off trains them all)")


def per_process(batch, accumulate):
    """'64 per process', or with --accumulate 4: '16 per micro-batch x 4 accumulated'."""
    if accumulate == 1:
        return f"{batch} per process"
    return f"{batch // accumulate} per micro-batch x {accumulate} accumulated"


def describe_resume(path, state, saved_world_size, world_size, weights=None):
    where = f"epoch {state.epoch}, after step {state.step}" if state.step else f"after epoch {state.epoch - 1}"
    return (f"Resuming from {path}: {where} (saved by {count(saved_world_size, 'process', 'processes')}, now "
            f"{world_size})" + (f"; its weights replace --weights {weights}" if weights else ""))


def count(n, one, many):
    return f"{n} {one if n == 1 else many}"


def flag_value(value):
    """A flag's value as it is typed on the command line: 64x64 for an image size (H, W)."""
    return "x".join(map(str, value)) if isinstance(value, (tuple, list)) else value


def rank_list(ranks) -> str:
    """[0, 1, 2, 3, 8] -> '[0-3, 8]'; [2, 3] -> '[2, 3]'."""
    ranks, parts, start = sorted(ranks), [], 0
    for i in range(1, len(ranks) + 1):
        if i == len(ranks) or ranks[i] != ranks[i - 1] + 1:
            run = ranks[start:i]
            parts += [f"{run[0]}-{run[-1]}"] if len(run) > 2 else [str(r) for r in run]
            start = i
    return "[" + ", ".join(parts) + "]"


def processes(ctx, n):
    """'1 GPU', '4 GPUs', '1 CPU process', '2 CPU processes'."""
    return count(n, "GPU", "GPUs") if ctx.device.type == "cuda" else count(n, "CPU process", "CPU processes")


def describe_device(ctx, name, precision, channels_last, compiled=None):
    """``compiled``: --compile's words for the mode, None without it."""
    return (f"Device: {ctx.device} ({name}), precision {precision.name}, "
            f"{'channels_last' if channels_last else 'contiguous (NCHW)'}{f', {compiled}' if compiled else ''}")


def describe_data(data, train_loader, test_loader):
    """Where the images come from and how many there are: '50000 training / 10000 test images'
    ('held-out' for --val-fraction's)."""
    splits = ((train_loader, "training"), (test_loader, "held-out" if data.held_out else "test"))
    return f"{data.source}, " + " / ".join(f"{len(loader.dataset)} {name}" for loader, name in splits
                                           if loader is not None) + " images"


def size_warning(data):
    """[a warning] when a split of ``data`` (a task.DataInfo), as read, does not have the
    official size (a partial copy, other files under the same name), else []."""
    return sizes_warning(data.title, data.expected_sizes or {}, data.read_sizes or {})


def sizes_warning(title, expected, found):
    """size_warning of a data set called ``title``: images per split ``found`` against ``expected``."""
    unexpected = [f"{found[key]} {name} images instead of {expected[key]}"
                  for key, name in (("train", "training"), ("test", "test"))
                  if key in expected and key in found and found[key] != expected[key]]
    if not unexpected:
        return []
    return [f"WARNING: this {title} has {' and '.join(unexpected)}: a small copy (tools/demo_data.py), an "
            "incomplete one, or other files?"]


# The metrics record's fields from engine/monitor.py (Monitors.end_of_training_phase), as a run
# that watches nothing has them: no GPU utilization or power, no profile.
UNWATCHED = {"gpu_util_percent": None, "gpu_power_w": None, "gpu_power_min_w": None, "profiled": False}


def epoch_record(state, fields, train_loss, result, images, train_time, eval_time, lr, phase, peak_gib, average=None):
    """One line of --metrics-file: ``fields``, what the run is (the same every epoch: world
    size, batch size, data set, model, optimizer...), and what this epoch did. Times in
    seconds; throughput counts training images actually processed on all ranks during the
    training phase (evaluation excluded); ``phase``:
    what the monitors saw of the training phase (GPU utilization %, power W, None on the CPU;
    whether the profiler recorded in it); ``peak_gib``: this GPU's peak memory (None on the CPU);
    ``average``: the --model-ema average's evaluation beside the model's ``result`` (None: none)."""
    ema = ({"ema_val_loss": average.loss, "ema_val_accuracy": average.accuracy, "ema_val_top5": average.top5}
           if average else {})
    return {"epoch": state.epoch, "train_loss": train_loss, "val_loss": result.loss,
            "val_accuracy": result.accuracy, "val_top5": result.top5, **ema, "val_samples": result.samples,
            "epoch_time_s": train_time, "eval_time_s": eval_time,
            "images_per_sec": images / train_time, "train_images": images, "lr": lr,
            **fields, "lr_cycle": len(state.lr_cycles), "peak_memory_gib": peak_gib, **phase,
            "run_id": state.run_id, "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def validated(record):
    """An epoch's validation accuracy: the better of the model's and its --model-ema average's."""
    return max(record["val_accuracy"], record.get("ema_val_accuracy") or -1.0)


def validated_ema(record):
    """Whether the --model-ema average validated better than the model in ``record`` (None: no record)."""
    return bool(record) and record.get("ema_val_accuracy") is not None and (
        record["ema_val_accuracy"] > record["val_accuracy"])


def throughput(records):
    """Training images per second over ``records``: total images / total training time."""
    seconds = sum(r["epoch_time_s"] for r in records)
    return sum(r["train_images"] for r in records) / seconds if seconds else math.nan


# ---------------------------------------------------------------------------------------------
# The metrics file across resumes.

def reconcile_metrics(path, run_id, records, replaces=None):
    """On resume: make ``path`` hold each finished epoch of run ``run_id`` exactly once, and
    return the warnings to print. Lines of epochs the checkpoint does not have (they run again)
    are dropped, records the file lost are appended; the lines of run ``replaces`` go, as
    ``records`` hold them under ``run_id`` (a copied folder's own copy of the file, whose
    run goes on under a new ID: train_utils.resume); other runs' lines and unparsable lines
    are kept as they are, but for a half-written last line (the node died while writing it),
    which is dropped: its epoch is written again from the checkpoint. A write that fails is a
    ResourceProblem (nothing trained yet: exit 1, with the space needed when the disk is full)."""
    path = Path(path)
    if not path.exists() and not records:
        return []
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked_metrics(path) as f:  # another run's append waits, then goes to the rewritten file
            f.seek(0)
            return _reconciled(path, f.read().decode(errors="surrogateescape"), run_id, records, replaces)
    except OSError as err:  # the folder or the file (the rewrite's own failure is _reconciled's line)
        raise space_problem("--metrics-file", path, err) from None


def _reconciled(path, text, run_id, records, replaces=None):
    """reconcile_metrics of the file ``path`` that holds ``text``, locked."""
    lines, warnings = text.splitlines(), []
    if text and not text.endswith("\n") and not _parses(lines[-1]):
        warnings.append(f"WARNING: --metrics-file {path} ends in a half-written line ({lines[-1][:40]!r}...): "
                        "dropped, its epoch is written again from the checkpoint")
        lines = lines[:-1]
    done, seen, kept = {r["epoch"] for r in records}, set(), []
    for line in lines:
        entry = _parses(line)
        if replaces is not None and isinstance(entry, dict) and entry.get("run_id") == replaces:
            continue
        if isinstance(entry, dict) and entry.get("run_id") == run_id:
            if entry.get("epoch") not in done or entry.get("epoch") in seen:
                continue
            seen.add(entry["epoch"])
        kept.append(line)
    kept += [json.dumps(r) for r in records if r["epoch"] not in seen]
    new = "".join(line + "\n" for line in kept)
    if new != text:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            tmp.write_text(new, errors="surrogateescape")
            os.replace(tmp, path)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise space_problem("--metrics-file", path, err, len(new)) from None
    return warnings


def _parses(line):
    """The JSON value of ``line``, or None when it is not JSON."""
    try:
        return json.loads(line)
    except ValueError:
        return None
