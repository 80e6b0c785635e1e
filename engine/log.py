"""What a run prints and writes for people to follow and compare: the start-up block's
pieces (train_utils.py composes it, and the progress lines within an epoch), epoch lines
with timestamps and ETA, the final summary, and the metrics file.

Only global rank 0 prints and writes (``enabled``). Every epoch line starts with a timestamp
and ends with the elapsed wall time and an ETA for the run.

No torch import: tools/report.py reads metrics files with these functions on any machine.
"""

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from engine.errors import space_problem


def timestamp(now=None):
    """Local wall-clock time, as a batch log wants it: 2026-11-21 14:03:07."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))


def duration(seconds):
    """H:MM:SS (or D days, H:MM:SS) for elapsed times and ETAs; '?' when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(round(max(seconds, 0)), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return f"{f'{days}d ' if days else ''}{hours}:{minutes:02d}:{secs:02d}"


def eta_seconds(epoch_walls, remaining_epochs):
    """Seconds left for ``remaining_epochs`` at this process's pace: the mean wall time per epoch
    (training, evaluation, checkpoint), leaving out this process's first epoch once there are
    others (it includes cuDNN autotuning, compilation and loader start-up). None if unknown."""
    if remaining_epochs <= 0:
        return 0.0
    steady = epoch_walls[1:] or epoch_walls
    return sum(steady) / len(steady) * remaining_epochs if steady else None


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
            with open(self.metrics_path, "a+b") as f:
                torn = f.tell() > 0 and f.seek(-1, os.SEEK_END) >= 0 and f.read(1) != b"\n"
                f.write(("\n" if torn else "").encode() + "".join(self.pending).encode())  # a line of its own
        except OSError as err:
            self.info(f"WARNING: cannot append to --metrics-file {self.metrics_path} ({err.strerror or err}); "
                      f"{count(len(self.pending), 'line', 'lines')} kept in memory for the next epoch"
                      + (", and in the checkpoints" if self.checkpointed else ""))
            return
        self.pending = []


# ---------------------------------------------------------------------------------------------
# Start-up block, epoch lines, summary.

def describe_length(epochs, target, patience):
    """The start-up block's line on when the run ends: at --epochs, or at the guide's early stop."""
    if target is None:
        return f"Length: {count(epochs, 'epoch', 'epochs')} (no early stop: --target-accuracy off)"
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


def epoch_line(record, epochs, elapsed_s, eta_s):
    """The guide's epoch line, with a timestamp in front, this GPU's peak memory (the headroom
    left), and the run's elapsed time and ETA at the end (ETA: until --epochs; early stopping
    may end the run sooner)."""
    peak = record.get("peak_memory_gib")
    return (f"{timestamp()} Epoch {record['epoch']}/{epochs}: Time={record['epoch_time_s']:.3f}s, "
            f"Train Loss={record['train_loss']:.4f}, Val Loss={record['val_loss']:.4f}, "
            f"Val Accuracy={record['val_accuracy']:.4f}{scores(record)}, "
            f"Throughput={record['images_per_sec']:.1f} img/s, "
            f"LR={record['lr']:.5g}, Eval={record['eval_time_s']:.1f}s"
            + (f", Peak memory={peak:.1f} GiB" if peak is not None else "")
            + f" | elapsed {duration(elapsed_s)}, ETA {duration(eta_s)}")


def scores(record):
    """What the epoch line adds to the guide's Val Accuracy: ', Top-5=0.9812' (more than 5
    classes) and ', EMA Accuracy=0.9120' (--model-ema's average); '' for neither."""
    top5, ema = record.get("val_top5"), record.get("ema_val_accuracy")
    return (f", Top-5={top5:.4f}" if top5 is not None else "") + (f", EMA Accuracy={ema:.4f}" if ema is not None
                                                                  else "")


def validated(record):
    """An epoch's validation accuracy: the better of the model's and its --model-ema average's."""
    return max(record["val_accuracy"], record.get("ema_val_accuracy") or -1.0)


def validated_ema(record):
    """Whether the --model-ema average validated better than the model in ``record`` (None: no record)."""
    return bool(record) and record.get("ema_val_accuracy") is not None and (
        record["ema_val_accuracy"] > record["val_accuracy"])


def which_weights(record):
    """' (the EMA average: ...)' after the weights line, when the run kept one; else ''."""
    if not record or record.get("ema_val_accuracy") is None:
        return ""
    ema, model = record["ema_val_accuracy"], record["val_accuracy"]
    return (f" (the model's EMA average, which validated better: {ema:.4f} against the model's {model:.4f})"
            if validated_ema(record) else
            f" (the model, which validated at least as well as its EMA average: {model:.4f} against {ema:.4f})")


def more_scores(record):
    """[the summary's line of top-5 and --model-ema accuracy] of the final epoch's ``record``, or []."""
    top5, ema, ema_top5 = record.get("val_top5"), record.get("ema_val_accuracy"), record.get("ema_val_top5")
    parts = ([f"Top-5 Accuracy: {top5:.4f}"] if top5 is not None else []) + (
        [f"EMA average: Accuracy {ema:.4f}" + (f", Top-5 {ema_top5:.4f}" if ema_top5 is not None else "")]
        if ema is not None else [])
    return ["; ".join(parts)] if parts else []


def throughput(records):
    """Training images per second over ``records``: total images / total training time."""
    seconds = sum(r["epoch_time_s"] for r in records)
    return sum(r["train_images"] for r in records) / seconds if seconds else math.nan


def accuracy_scope(record, test_size, held_out=False):
    """'on 320 of 10000 test images' (with why, when it is not all of them); 'held-out images'
    for --val-fraction's."""
    seen, images = record.get("val_samples"), "held-out images" if held_out else "test images"
    if seen is None or test_size is None or seen == test_size:
        return f"on all {seen if seen is not None else '?'} {images}"
    return f"on {seen} of {test_size} {images} (--limit-batches)"


def summarize(records, ctx, test_size=None, wall_s=None, resumed=False, held_out=False):
    """The guide's final summary: accuracy and on how many images, training, evaluation and
    wall time apart, and throughput with the warm-up epoch separated from the steady state.
    ``resumed``: this process continued a run, so some epochs ran before it; ``held_out``:
    validation ran on training images held out (--val-fraction), not a test set."""
    if not records:
        return []
    last = records[-1]
    best = max(records, key=validated)
    accel = "GPUs" if ctx.device.type == "cuda" else "CPU processes"
    train_s = sum(r["epoch_time_s"] for r in records)
    eval_s = sum(r.get("eval_time_s", 0.0) for r in records)
    of_best = ", the EMA average's" if validated_ema(best) else ""
    lines = [f"\n{timestamp()} Training complete. Final Accuracy: {last['val_accuracy']:.4f} "
             f"{accuracy_scope(last, test_size, held_out)} (best {validated(best):.4f} at epoch {best['epoch']}"
             f"{of_best})", *more_scores(last),
             f"Time: training {train_s:.1f}s + evaluation {eval_s:.1f}s over the run's "
             f"{count(len(records), 'epoch', 'epochs')}" + (" (those before the resume too)" if resumed else "")
             + (f"; wall time {wall_s:.1f}s (reading the data, start-up and checkpoints included; "
                "Python's imports not)" if wall_s is not None else ""),
             f"Throughput: {throughput(records):.1f} img/s (training images / training time)"]
    if len(records) > 1:
        lines.append(f"Throughput excluding epoch 1 (warm-up): {throughput(records[1:]):.1f} img/s; "
                     f"epoch 1: {throughput(records[:1]):.1f} img/s")
    lines.append(f"Number of nodes: {ctx.num_nodes}, {accel} per node: {ctx.local_world_size}, "
                 f"total {accel}: {ctx.world_size}")
    if "device" in last:  # (records of runs saved before it was recorded lack it)
        peaks = [r["peak_memory_gib"] for r in records if r.get("peak_memory_gib") is not None]
        lines.append(f"Device (rank 0): {last['device']}" + (f", peak memory {max(peaks):.2f} GiB" if peaks else ""))
    return lines

# ---------------------------------------------------------------------------------------------
# The metrics file across resumes.

def reconcile_metrics(path, run_id, records):
    """On resume: make ``path`` hold each finished epoch of run ``run_id`` exactly once, and
    return the warnings to print. Lines of epochs the checkpoint does not have (they run again)
    are dropped, records the file lost are appended; other runs' lines and unparsable lines
    are kept as they are, but for a half-written last line (the node died while writing it),
    which is dropped: its epoch is written again from the checkpoint. A write that fails is a
    ResourceProblem (nothing trained yet: exit 1, with the space needed when the disk is full)."""
    path = Path(path)
    text = path.read_text(errors="surrogateescape") if path.exists() else ""
    lines, warnings = text.splitlines(), []
    if text and not text.endswith("\n") and not _parses(lines[-1]):
        warnings.append(f"WARNING: --metrics-file {path} ends in a half-written line ({lines[-1][:40]!r}...): "
                        "dropped, its epoch is written again from the checkpoint")
        lines = lines[:-1]
    done, seen, kept = {r["epoch"] for r in records}, set(), []
    for line in lines:
        entry = _parses(line)
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
            path.parent.mkdir(parents=True, exist_ok=True)
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
