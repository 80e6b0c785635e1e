"""Tables and a picture from training runs: their --metrics-file outputs and, optionally, the
job scripts' GPU logs (``*_gpu.csv``).

    python tools/report.py metrics.jsonl                                  # one table row per run
    python tools/report.py run1.jsonl run4.jsonl run8.jsonl --plot runs.png   # + the scaling table, a PNG
    python tools/report.py multigpu.jsonl --gpu-log multigpu_123_gpu.csv --plot runs.png

Prints Markdown (paste it into a README or an issue):
- a table with one row per run: epochs, GPUs, nodes, batch, precision, accuracy and on how
  many test images, training and evaluation time, throughput, peak memory, and the GPUs'
  mean utilization and power draw (NVML, training phases after epoch 1);
- for runs of one recipe at different GPU counts, the guide's table: throughput, speedup and
  scaling efficiency against the smallest run. Computed the honest way, and said so: only
  runs with the same per-GPU batch, precision, data and device are compared, and epoch 1
  (cuDNN autotuning, compilation, loader start-up) is left out of the throughput;
- with --gpu-log, each log's mean GPU utilization.

--plot writes a PNG: training and validation loss and validation accuracy per epoch,
throughput per epoch, and GPU utilization over time. It needs matplotlib (only this script
does); without it the tables are still printed, with a one-line hint.

A metrics file may hold several runs (appended): each run ID is a run of its own.
"""

import argparse
import json
import math
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

if __package__ in (None, ""):  # run as python tools/NAME.py: the project's modules are one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cli import OneLineParser  # noqa: E402
from engine.errors import ResourceProblem, space_problem  # noqa: E402
from engine.log import throughput, validated  # noqa: E402

FIGURE_INCHES, FIGURE_DPI = (12, 8), 100  # the PNG is 1200 x 800 pixels
# What must be equal for runs to be compared in the scaling table.
RECIPE_KEYS = ("dataset", "synthetic", "per_process_batch", "precision", "loader", "device")


class ReportError(Exception):
    """Bad input: one line, exit status 2."""


@dataclass
class RunRecords:
    """One run (one run ID) of a metrics file, its epochs in order."""
    label: str
    records: list = field(default_factory=list)

    def value(self, key, default=None):
        return self.records[-1].get(key, default)

    @property
    def world_size(self):
        return self.value("world_size", 1)

    def changes(self, key, default=None):
        """The values ``key`` took over its epochs, in the order they ran: more than one for a run
        resumed on another number of processes (world_size, per_process_batch, nodes)."""
        return list(dict.fromkeys(r.get(key, default) for r in self.records))

    @property
    def processes(self):
        return self.changes("world_size", 1)

    @property
    def is_cpu(self):
        return str(self.value("device", "")).startswith("CPU")

    def steady(self):
        """The epochs whose throughput counts: all but epoch 1 when there are others, and of
        those the ones the profiler did not slow down (--profile-dir) when there are others."""
        later = [r for r in self.records if r["epoch"] > 1] or self.records
        return [r for r in later if not r.get("profiled")] or later

    def gpu_mean(self, key):
        """Mean of a GPU field (utilization %, power W) over the epochs after epoch 1 that have it,
        weighted by training time; None when no epoch has it (CPU runs, no NVML)."""
        timed = [(r[key], r["epoch_time_s"]) for r in self.steady() if r.get(key) is not None]
        seconds = sum(t for _, t in timed)
        return sum(v * t for v, t in timed) / seconds if seconds else None

    def recipe(self):
        """What must be equal for a fair comparison. A CPU's name carries the threads per
        process, which differ with the process count: the CPU model is compared."""
        values = {key: self.value(key) for key in RECIPE_KEYS}
        values["dataset"] = values["dataset"] or "cifar100"  # (lines from before --dataset)
        values["device"] = re.sub(r", \d+ threads?$", "", str(values["device"]))
        return tuple(values.values())


# ---------------------------------------------------------------------------------------------
# Reading.

def read_runs(path):
    """The training runs in one metrics file, in the order they first appear. Lines that are
    not JSON (a line cut by a crash) and evaluation-only records (epoch 0) are skipped."""
    path = Path(path)
    try:
        lines = path.read_text(errors="replace").splitlines()  # a binary file: no line parses
    except OSError as err:
        raise ReportError(f"{path}: {err.strerror or err}") from None
    runs, skipped, evaluations = {}, 0, 0
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if isinstance(record, dict) and record.get("epoch") == 0:
            evaluations += 1  # an --eval-only result
            continue
        if not isinstance(record, dict) or not {"epoch", "epoch_time_s", "train_images"} <= record.keys():
            skipped += 1
            continue
        runs.setdefault(record.get("run_id", "?"), {})[record["epoch"]] = record  # a repeated epoch: the last
    if not runs and evaluations:
        raise ReportError(f"{path} holds --eval-only results only ({evaluations} evaluation(s), epoch 0), no "
                          "training epochs to tabulate")
    if not runs:
        raise ReportError(f"{path} holds no epoch records (is it a --metrics-file of train.py or train_ddp.py?)")
    if skipped:
        print(f"report.py: {path}: skipped {skipped} line(s) that are not epoch records", file=sys.stderr)
    if evaluations:  # beside training epochs: not in the tables, which are per epoch
        print(f"report.py: {path}: left out {evaluations} --eval-only result(s) (epoch 0): the tables are of "
              "training epochs", file=sys.stderr)
    return [RunRecords(f"{path.name}" + (f" ({run_id})" if len(runs) > 1 else ""),
                       [epochs[e] for e in sorted(epochs)]) for run_id, epochs in runs.items()]


@dataclass
class GpuLog:
    """nvidia-smi --query-gpu=timestamp,index,...,utilization.gpu,... --format=csv samples."""
    label: str
    samples: dict  # GPU index -> [(seconds since the log's first sample, utilization %)]


def read_gpu_log(path):
    """Parse a job script's GPU log. The header may repeat (a requeued job appends); samples
    that say [N/A] are skipped."""
    path = Path(path)
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as err:
        raise ReportError(f"--gpu-log {path}: {err.strerror or err}") from None
    columns, rows = None, []
    for line in lines:
        cells = [cell.strip() for cell in line.split(",")]
        if cells and cells[0] == "timestamp":
            columns = cells
            continue
        if columns is None or len(cells) != len(columns):
            continue
        row = dict(zip(columns, cells))
        try:
            when = datetime.strptime(row["timestamp"], "%Y/%m/%d %H:%M:%S.%f")
            utilization = float(row["utilization.gpu [%]"].rstrip(" %"))
            rows.append((when, int(row["index"]), utilization))
        except (KeyError, ValueError):
            continue
    if not rows:
        raise ReportError(f"--gpu-log {path} holds no samples with timestamp, index and utilization.gpu "
                          "(is it a job script's *_gpu.csv?)")
    first = min(when for when, _, _ in rows)
    samples = defaultdict(list)
    for when, index, utilization in rows:
        samples[index].append(((when - first).total_seconds(), utilization))
    return GpuLog(path.name, dict(samples))


# ---------------------------------------------------------------------------------------------
# Tables.

def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def _plural(unit):
    return f"{unit}{'es' if unit.endswith('s') else 's'}"


def _count(n, unit):
    """'1 GPU', '4 GPUs', '2 processes'."""
    return f"{n} {unit if n == 1 else _plural(unit)}"


def _number(value, digits=1):
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


def runs_table(runs):
    rows = []
    for run in runs:
        last = run.records[-1]
        best = max(run.records, key=validated)  # with --model-ema, the better of the model and its average
        peaks = [r["peak_memory_gib"] for r in run.records if r.get("peak_memory_gib") is not None]
        rows.append([
            run.label, len(run.records),
            *(" then ".join(map(str, run.changes(key, default)))
              for key, default in (("world_size", 1), ("nodes", "-"), ("per_process_batch", "-"))),
            run.value("precision", "-"), f"{last['val_accuracy']:.4f}",
            f"{validated(best):.4f} (epoch {best['epoch']})",
            last.get("val_samples", "-"), _number(sum(r["epoch_time_s"] for r in run.records)),
            _number(sum(r.get("eval_time_s", 0.0) for r in run.records)), _number(throughput(run.records)),
            _number(throughput(run.steady())), _number(max(peaks), 2) if peaks else "-",
            _number(run.gpu_mean("gpu_util_percent"), 0), _number(run.gpu_mean("gpu_power_w"), 0),
            run.value("device", "-")])
    header = ["Run", "Epochs", "Processes", "Nodes", "Batch per process", "Precision", "Final accuracy",
              "Best accuracy", "Test images", "Training s", "Evaluation s", "img/s", "img/s after epoch 1",
              "Peak GiB", "GPU util %", "GPU W", "Device"]
    return ["## Runs", "", *_table(header, rows)]


@dataclass(frozen=True)
class ScalingRow:
    label: str
    gpus: int
    nodes: object
    images_per_sec: float
    speedup: float     # images_per_sec / the base run's
    efficiency: float  # speedup / (gpus / the base run's gpus)


def scaling_rows(runs):
    """The guide's table for runs of one recipe, against the run with the fewest GPUs (the
    first given of those)."""
    ordered = sorted(runs, key=lambda run: run.world_size)  # stable: the first given wins a tie
    base = ordered[0]
    base_rate = throughput(base.steady())
    rows = []
    for run in ordered:
        rate = throughput(run.steady())
        speedup = rate / base_rate
        rows.append(ScalingRow(run.label, run.world_size, run.value("nodes", "-"), rate, speedup,
                               speedup / (run.world_size / base.world_size)))
    return rows


def scaling_tables(runs):
    """A scaling table per recipe that was run at two or more GPU counts; otherwise one line
    saying why there is none."""
    groups, mixed = defaultdict(list), []
    for run in runs:
        if len(run.processes) > 1:  # its throughput mixes process counts: no point of a scaling curve
            mixed.append(run.label)
        else:
            groups[run.recipe()].append(run)
    note = ([f"Left out of scaling tables: {', '.join(mixed)}, resumed on another number of processes."]
            if mixed else [])
    comparable = [group for group in groups.values() if len({run.world_size for run in group}) > 1]
    if not comparable:
        if len(runs) > 1:
            return [*note, "No scaling table: that needs runs of one recipe (the same " + ", ".join(RECIPE_KEYS)
                    + ") at different GPU counts."]
        return note
    lines = [*note, ""] if note else []
    for group in comparable:
        rows = scaling_rows(group)
        base, unit = rows[0], "process" if group[0].is_cpu else "GPU"  # CPU runs: gloo processes
        dataset, synthetic, batch, precision, loader, device = group[0].recipe()
        lines += [f"## Scaling: {'synthetic ' if synthetic else ''}{dataset}, {batch} images per {unit}, "
                  f"{precision}, {loader} loader, {device}", ""]
        lines += _table([_plural(unit).capitalize(), "Nodes", "Run", "Throughput (img/s)", "Speedup",
                         "Scaling efficiency"],
                        [[row.gpus, row.nodes, row.label, _number(row.images_per_sec), f"{row.speedup:.2f}x",
                          f"{row.efficiency:.0%}"] for row in rows])
        lines += ["", f"Throughput: training images / training time over each run's epochs after epoch 1 "
                      f"(epoch 1, with cuDNN autotuning, compilation and loader start-up, is left out; a run of "
                      f"one epoch counts it). Speedup: throughput / that of {base.label} ({_count(base.gpus, unit)}). "
                      f"Scaling efficiency: speedup / ({_plural(unit)} / {base.gpus}). Every run has "
                      f"the same batch per {unit} ({batch} images), so each {unit} does the same work per step.", ""]
    return lines


def gpu_table(logs):
    rows = []
    for log in logs:
        for index, samples in sorted(log.samples.items()):
            values = [u for _, u in samples]
            rows.append([log.label, index, len(values), f"{sum(values) / len(values):.0f}%",
                         f"{sorted(values)[len(values) // 2]:.0f}%", _number(samples[-1][0] / 60)])
    return ["## GPU utilization", "", *_table(["Log", "GPU", "Samples", "Mean", "Median", "Minutes"], rows)]


# ---------------------------------------------------------------------------------------------
# The picture.

PLOT_SOFTWARE = "tools/report.py"  # in the PNG's Software field: a picture --plot may replace


def check_plot_path(path):
    """--plot PATH: a new file, or a picture report.py wrote (updated by running it again);
    anything else there (a metrics file, a picture of the user's) is one line, and kept."""
    path = Path(path)
    if path.is_dir():
        raise ReportError(f"--plot {path} is a folder; give a file name such as runs.png")
    if path.exists() and not written_by_report(path):
        raise ReportError(f"--plot {path} exists and is not a picture report.py wrote: choose a new file name, or "
                          "move that file away first; nothing is overwritten")
    if path.suffix.lower() != ".png":  # savefig would write a PNG under any name: a runs.jpg no viewer opens
        raise ReportError(f"--plot {path}: report.py writes PNG pictures; give a name ending in .png, such as "
                          f"{path.with_suffix('.png').name}")


def written_by_report(path):
    """Is ``path`` a PNG whose Software field (a tEXt chunk before the pixels) names report.py?"""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"\x89PNG\r\n\x1a\n") and b"Software\x00" + PLOT_SOFTWARE.encode() in head


def plot(runs, logs, path):
    """A 2 x 2 PNG of FIGURE_INCHES at FIGURE_DPI, written atomically. Raises ImportError
    without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")  # no display on a login or compute node
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ((loss_ax, acc_ax), (rate_ax, gpu_ax)) = plt.subplots(2, 2, figsize=FIGURE_INCHES, dpi=FIGURE_DPI)
    for run in runs:
        epochs = [r["epoch"] for r in run.records]
        line, = loss_ax.plot(epochs, [r["train_loss"] for r in run.records], marker=".", label=f"{run.label} train")
        loss_ax.plot(epochs, [r["val_loss"] for r in run.records], marker=".", linestyle="--", color=line.get_color(),
                     label=f"{run.label} validation")
        acc_ax.plot(epochs, [r["val_accuracy"] for r in run.records], marker=".", label=run.label)
        rate_ax.plot(epochs, [r["images_per_sec"] for r in run.records], marker=".", label=run.label)
    for log in logs:
        for index, samples in sorted(log.samples.items()):
            gpu_ax.plot([t / 60 for t, _ in samples], [u for _, u in samples], label=f"{log.label} GPU {index}")
    sampled = [run for run in runs if any(r.get("gpu_util_percent") is not None for r in run.records)]
    if not logs:  # the metrics' own per-epoch means (NVML), when the runs have them
        for run in sampled:
            epochs = [r for r in run.records if r.get("gpu_util_percent") is not None]
            gpu_ax.plot([r["epoch"] for r in epochs], [r["gpu_util_percent"] for r in epochs], marker=".",
                        label=f"{run.label} (mean per epoch)")
    if not logs and not sampled:
        gpu_ax.text(0.5, 0.5, "no GPU log given (--gpu-log *_gpu.csv) and no GPU samples in the metrics",
                    ha="center", va="center", transform=gpu_ax.transAxes)
    titles = (("Loss (solid: training, dashed: validation)", "epoch", "loss"),
              ("Validation accuracy", "epoch", "fraction of test images"),
              ("Training throughput", "epoch", "images / s"),
              ("GPU utilization", "minutes since the log's first sample" if logs else "epoch", "%"))
    for ax, (title, xlabel, ylabel) in zip((loss_ax, acc_ax, rate_ax, gpu_ax), titles):
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        if xlabel == "epoch":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.png")
    try:
        fig.savefig(tmp, dpi=FIGURE_DPI, metadata={"Software": PLOT_SOFTWARE})  # ours: may be replaced
        os.replace(tmp, path)
    except OSError as err:  # a full disk: one line, and the tables above are printed already
        raise space_problem("--plot", path, err) from None
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Command line.

def build_parser():
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", metavar="METRICS_FILE",
                        help="--metrics-file outputs of train.py / train_ddp.py (JSON lines)")
    parser.add_argument("--gpu-log", nargs="+", default=[], metavar="CSV",
                        help="the job scripts' nvidia-smi logs (*_gpu.csv), for the utilization table and plot")
    parser.add_argument("--plot", metavar="PNG", default=None,
                        help=f"write the picture here ({FIGURE_INCHES[0] * FIGURE_DPI} x "
                             f"{FIGURE_INCHES[1] * FIGURE_DPI} pixels; needs matplotlib)")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        runs = [run for path in args.metrics for run in read_runs(path)]
        logs = [read_gpu_log(path) for path in args.gpu_log]
        if args.plot:
            check_plot_path(args.plot)
    except ReportError as err:
        print(f"report.py: error: {err}", file=sys.stderr)
        return 2
    lines = runs_table(runs) + [""] + scaling_tables(runs) + (gpu_table(logs) if logs else [])
    print("\n".join(lines).rstrip())
    if args.plot:
        try:
            plot(runs, logs, args.plot)
        except ImportError:
            print("report.py: no picture written: matplotlib is not installed; get it with "
                  "pip install matplotlib (or pip install -r requirements-dev.txt)", file=sys.stderr)
            return 0
        except ResourceProblem as err:  # a full disk, a folder without permission
            print(f"report.py: error: {err}", file=sys.stderr)
            return err.exit_code
        print(f"\nPicture written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
