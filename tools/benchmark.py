"""Throughput of the guide's recipe against this project's defaults, measured in one run on
one device (a GPU when there is one, else the CPU):

    python tools/benchmark.py                        # stable GPU figures (BENCHMARKS.md: an H200's)
    python tools/benchmark.py --quick                # 14-27 s on 2 CPU cores (two AMD EPYC hosts): a check
    python tools/benchmark.py --json results.json    # the rows, for BENCHMARKS.md
    python tools/benchmark.py --compile              # the project's recipe with torch.compile
    python tools/benchmark.py --dataset mnist        # another data set (its files, or synthetic data of its size)
    python tools/benchmark.py --dataset folder --data-dir my_images --image-size 64 --model my_net.py:Net  # yours
    python tools/benchmark.py --dataset folder --data-dir my_photos --val-fraction 0.2 --image-size 224 \\
        --model torchvision.models:resnet18    # photos: resized-crop against torchvision's RandomResizedCrop
    python tools/benchmark.py --profile              # and torch.profiler's table of the project's steps
    srun --gpus=1 apptainer exec --nv "$CONTAINER_PATH" python tools/benchmark.py --json bench.json  # on Olivia

Recipes:
    guide    the guide's part 1 as it wrote it: its DataLoader (PIL transforms in the main
             process, num_workers=0, pinned memory on CUDA) and its own training loop
             (guide_training_steps: plain SGD with the learning rate alone, fp32 with
             PyTorch's default TF32 convolutions, cuDNN without autotuning, NCHW).
    project  train.py's defaults through train.py's own loop: device loader, bf16 autocast
             where the GPU supports it, channels_last, fused SGD and cuDNN autotuning on CUDA.
Measures:
    pipeline  images per second the input pipeline alone delivers, on the device, ready for
              the model; also the main process's CPU time per image.
    train     images per second of whole training steps (loading, forward, backward,
              optimizer) through each recipe's loop, timed after warm-up steps, with the
              device synchronized before each clock reading.

Data: the --dataset (default CIFAR-100) from --data-dir when it is there, otherwise synthetic
images of the same size (throughput does not depend on pixel values); an image folder or a
FILE.py:NAME data set from --data-dir.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from datetime import datetime, timezone
from itertools import count, islice
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.data import DataLoader

if __package__ in (None, ""):  # run as python tools/NAME.py: the project's modules are one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataset_utils import build_loaders, default_num_workers, set_loader_epoch  # noqa: E402
from device_utils import configure_precision, device_name, memory_format, single_process_context  # noqa: E402
from engine.cli import OneLineParser, run_cli  # noqa: E402
from engine.dali_loader import dali_installed  # noqa: E402
from engine.data_formats import default_data_dir, missing_files  # noqa: E402
from engine.errors import UserError, space_problem  # noqa: E402
from engine.files import check_writable  # noqa: E402
from engine.flags import dataset_name, image_size, open_fraction, plugin_ref, positive_int  # noqa: E402
from engine.models import DEFAULT_MODEL  # noqa: E402
from engine.profiling import device_profiler, kernel_times, top_operators, unused_path  # noqa: E402
from engine.processes import synchronize  # noqa: E402
from engine.task import DATASETS  # noqa: E402
from tools import gpu_report  # noqa: E402
from tools.baselines import (GUIDE_PRECISION, StepTiming, TorchvisionResizedCrops, guide_loader,  # noqa: E402
                             guide_training_steps)
from train_utils import build_task, limited, parse_args, prepare_run, train_steps  # noqa: E402

# train.py flags of each recipe; both get --batch-size from the command line.
RECIPES = {
    "guide": ["--loader", "torchvision", "--num-workers", "0", "--precision", "fp32", "--no-channels-last",
              "--momentum", "0", "--no-nesterov", "--weight-decay", "0", "--lr-schedule", "constant",
              "--warmup-epochs", "0", "--label-smoothing", "0"],
    "project": [],
}


def time_training_steps(task, args, ctx, batches, warmup_steps, steps, timed_context=nullcontext):
    """Train ``task.model`` on ``batches`` with train_utils' steps (the flags' recipe, precision
    and layout): ``warmup_steps`` untimed, then ``steps`` timed, the device synchronized
    before each clock reading, inside ``timed_context()`` (a profiler, say). No evaluation,
    checkpoints or stop requests: the run's StopRequests is never entered, so nothing but
    Ctrl-C stops it."""
    # The LR schedule is a table of --epochs' steps: these steps may run past that many epochs.
    per_epoch = limited(task.train_loader, args.limit_batches)  # prepare_run's steps per epoch
    epochs = -(-(warmup_steps + steps) // per_epoch)  # ceil
    run, state, _ = prepare_run(task, argparse.Namespace(**{**vars(args), "epochs": max(args.epochs, epochs)}), ctx)
    synchronize(ctx.device)
    start = time.perf_counter()
    train_steps(run, islice(batches, warmup_steps), state)  # returns after a host sync
    warmup_s = time.perf_counter() - start
    with timed_context():
        start = time.perf_counter()
        images = train_steps(run, islice(batches, steps), state).images  # ends in a host sync
        seconds = time.perf_counter() - start
    return StepTiming(images / seconds, warmup_s, run.precision.name)



# The compiled steps --report measures beside the eager defaults: (label, train.py's flags).
# --compile first, so that its warm-up is a cold compile's, as a new job pays it.
STEP_VARIANTS = (("--compile (reduce-overhead on CUDA: CUDA graphs)", ["--compile"]),
                 ("--compile --compile-mode default", ["--compile", "--compile-mode", "default"]))


def build_parser():
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a few steps only (14-27 s on 2 CPU cores): checks, not figures to quote")
    parser.add_argument("--batch-size", metavar="IMAGES", type=positive_int, default=None,
                        help="images per step for every measurement (default: 256; 32 with --quick on the CPU)")
    parser.add_argument("--steps", metavar="STEPS", type=positive_int, default=None,
                        help="timed training steps per recipe (default: 100; 2 with --quick)")
    parser.add_argument("--warmup-steps", metavar="STEPS", type=positive_int, default=None,
                        help="untimed training steps first (cuDNN autotuning, compilation; default: 30; "
                             "1 with --quick)")
    parser.add_argument("--pipeline-batches", metavar="BATCHES", type=positive_int, default=None,
                        help="timed batches of each input pipeline (default: 100; 50 with --quick)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the project's recipe")
    parser.add_argument("--profile", metavar="STEPS", type=positive_int, nargs="?", const=5, default=None,
                        help="after the measurements, profile this many training steps of the project's recipe "
                             "(default 5) with torch.profiler and print its table of the most expensive operations")
    parser.add_argument("--dataset", metavar="NAME", type=dataset_name, default="cifar100",
                        help="the data set, as train.py's --dataset (its image size and channels set the model's and "
                             "the pipeline's work)")
    parser.add_argument("--image-size", metavar="PIXELS", type=image_size, default=None,
                        help="--dataset folder: resize the images to N or HxW pixels, as train.py's --image-size")
    parser.add_argument("--val-fraction", metavar="FRACTION", type=open_fraction, default=None,
                        help="a folder without test/: hold out this fraction, as train.py's --val-fraction")
    parser.add_argument("--model", metavar="FILE.py:NAME", type=plugin_ref, default=DEFAULT_MODEL,
                        help="the network, as train.py's --model (default: the guide's WideResNet)")
    parser.add_argument("--data-dir", metavar="DIR", default=str(default_data_dir()),
                        help="use the data set from here when present, else synthetic data of its size")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the result rows to this file")
    parser.add_argument("--report", metavar="FILE.md", default=None,
                        help="on a CUDA GPU, the first GPU hour in one command of under 9 minutes: this comparison, "
                             "the defaults with --compile, a profile split of a step, peak memory at batch 256 and "
                             "1024, the GPU test tier in the time left; appends one Markdown block for BENCHMARKS.md "
                             "to FILE.md, with a recommendation")
    return parser


def recipe_args(recipe, opts, batch, device, real, extra=()):
    """train.py's parsed flags of ``recipe`` at ``batch`` images per step, printed as a command."""
    flags = [*RECIPES[recipe], "--batch-size", str(batch), "--dataset", opts.dataset, "--model", opts.model,
             *(["--image-size", "x".join(map(str, opts.image_size))] if opts.image_size else []),
             *(["--val-fraction", str(opts.val_fraction)] if opts.val_fraction else []), *extra]
    print(f"\n== {recipe} recipe: train.py {' '.join(flags)}", flush=True)
    return parse_args("benchmark", [*flags, "--data-dir", opts.data_dir, "--no-download",
                                    *([] if real else ["--synthetic"])])


def has_real_data(opts):
    """The --dataset's files are in --data-dir (else synthetic images of its size are used)."""
    spec = DATASETS.get(opts.dataset)
    return spec is None or not missing_files(opts.data_dir, spec)


def settings(opts, device):
    """(batch size, warm-up steps, timed steps, pipeline batches) for the options."""
    quick = opts.quick
    batch = opts.batch_size or (32 if quick and device.type == "cpu" else 256)
    return (batch, opts.warmup_steps or (1 if quick else 30), opts.steps or (2 if quick else 100),
            opts.pipeline_batches or (50 if quick else 100))


def endless(loader):
    """The loader's batches, epoch after epoch."""
    for epoch in count():
        set_loader_epoch(loader, epoch)
        yield from loader


def pipeline_row(loader, device, layout, batches):
    """The pipeline measures of ``loader`` delivering ``batches`` batches to ``device``."""
    rate, cpu_us = measure_pipeline(loader, device, layout, batches)
    return {"measure": "pipeline", "images_per_sec": rate, "main_cpu_us_per_image": cpu_us, "batches": batches}


def measure_pipeline(loader, device, layout, batches):
    """(images/s, main-process CPU microseconds per image) of ``loader`` delivering batches to ``device``."""
    source = endless(loader)
    next(source)  # worker start-up and first-batch costs are not throughput
    synchronize(device)
    wall, cpu, images = time.perf_counter(), time.process_time(), 0
    for x, y in islice(source, batches):
        x = x.to(device, memory_format=layout, non_blocking=True)
        y = y.to(device, non_blocking=True)
        images += y.size(0)
    synchronize(device)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return images / wall, 1e6 * cpu / images


def benchmark(opts, failures=None):
    """The rows of every measure: the guide's recipe and loop, the project's defaults, then the
    project's --loader torchvision (and torchvision's RandomResizedCrop for resized-crop), and for
    an image folder --loader dali where DALI is installed. Each
    part is measured alone: one that fails is named in ``failures`` (a list; its traceback is
    printed) and the others still measure."""
    failures = [] if failures is None else failures
    ctx = single_process_context()
    device = ctx.device
    batch, warmup_steps, steps, pipeline_batches = settings(opts, device)
    spec = DATASETS.get(opts.dataset)
    real = has_real_data(opts)
    common = {"device": device_name(device), "batch_size": batch, "dataset": opts.dataset,
              "data": (spec.title if spec else opts.data_dir) if real else "synthetic", "model": opts.model,
              "torch": torch.__version__, "date": datetime.now(timezone.utc).date().isoformat()}
    rows, data = [], []

    def measure_recipe(recipe):
        args = recipe_args(recipe, opts, batch, device, real, ["--compile"] if opts.compile and recipe == "project"
                           else [])
        task = build_task(args, ctx)
        data[:] = [task.train_loader.dataset, task.test_loader.dataset]
        if recipe == "guide":
            task = replace(task, train_loader=guide_loader(task.train_loader.dataset, batch, device))
        layout = memory_format(args.channels_last, device)
        guide = recipe == "guide"
        described = {"recipe": recipe, "loader": "guide DataLoader" if guide else task.loader,
                     "workers": task.train_loader.num_workers, "channels_last": layout == torch.channels_last,
                     "precision": GUIDE_PRECISION[device.type] if guide else configure_precision(args.precision,
                                                                                                   device).name,
                     "compile": args.compile, **common}
        rows.append({**described, **pipeline_row(task.train_loader, device, layout, pipeline_batches)})
        time_steps = guide_training_steps if guide else time_training_steps
        timing = time_steps(task, args, ctx, endless(task.train_loader), warmup_steps, steps)
        rows.append({**described, "measure": "train", "images_per_sec": timing.images_per_sec, "steps": steps,
                     "warmup_steps": warmup_steps, "warmup_s": timing.warmup_s})
        if opts.profile and recipe == "project":
            print(f"\n== torch.profiler: {opts.profile} training steps of the project recipe, by "
                  f"{'GPU' if device.type == 'cuda' else 'CPU'} time\n{profile_steps(args, ctx, opts.profile)}")

    for recipe in RECIPES:
        gpu_report.attempt(failures, f"the {recipe} recipe", lambda recipe=recipe: measure_recipe(recipe))
    if not data:
        return rows
    train_set, test_set = data
    # This project's --loader torchvision: with the guide's 0 workers (the cost per image) and
    # with train.py's default worker count.
    for workers in sorted({0, default_num_workers(1)}):
        def torchvision_loader(workers=workers):
            loader, _ = build_loaders(train_set, test_set, batch, loader="torchvision", num_workers=workers,
                                      pin_memory=device.type == "cuda")
            rows.append({"recipe": "project --loader torchvision", "loader": "torchvision", "workers": workers,
                         "precision": None, "channels_last": False, "compile": False, **common,
                         **pipeline_row(loader, device, torch.contiguous_format, pipeline_batches)})
        gpu_report.attempt(failures, f"--loader torchvision with {workers} workers", torchvision_loader)
    if train_set.prep.augment == "resized-crop":  # against torchvision's RandomResizedCrop in DataLoader workers
        for workers in sorted({0, default_num_workers(1)}):
            def resized_crops(workers=workers):
                loader = DataLoader(TorchvisionResizedCrops(train_set), batch_size=batch, shuffle=True,
                                    drop_last=True, num_workers=workers, persistent_workers=workers > 0,
                                    pin_memory=device.type == "cuda")
                rows.append({"recipe": "torchvision-resized-crop", "loader": "torchvision", "workers": workers,
                             "precision": None, "channels_last": False, "compile": False, **common,
                             **pipeline_row(loader, device, torch.contiguous_format, pipeline_batches)})
            gpu_report.attempt(failures, f"torchvision's RandomResizedCrop with {workers} workers", resized_crops)
    if opts.dataset == "folder" and dali_installed():  # DALI reading and decoding the files themselves, every epoch
        for threads in sorted({1, max(1, default_num_workers(1))}):
            def dali_pipeline(threads=threads):
                args = recipe_args("project", opts, batch, device, real, ["--loader", "dali", "--num-workers",
                                                                          str(threads)])
                loader = build_task(args, ctx).train_loader
                rows.append({"recipe": "project --loader dali", "loader": "dali", "workers": threads,
                             "precision": None, "channels_last": False, "compile": False, **common,
                             **pipeline_row(loader, device, torch.contiguous_format, pipeline_batches)})
            gpu_report.attempt(failures, f"--loader dali with {threads} threads", dali_pipeline)
    return rows


def profile_steps(args, ctx, steps):
    """torch.profiler's table of ``steps`` training steps of a new task of ``args`` (one
    untimed step first; cuDNN has autotuned these shapes already), the 20 most expensive
    operations by device time."""
    task = build_task(args, ctx)
    with device_profiler(ctx.device) as profiler:
        time_training_steps(task, args, ctx, endless(task.train_loader), 1, steps)
    return profiler.key_averages().table(sort_by="device_time_total" if ctx.device.type == "cuda"
                                         else "cpu_time_total", row_limit=20)


def table(rows, failures=()):
    """Lines of the table: each measure of the guide against the project's defaults, and the
    parts that failed."""
    lines = [f"\nDevice: {rows[0]['device']}, torch {rows[0]['torch']}, batch {rows[0]['batch_size']}, "
             f"{rows[0]['data']} data" if rows else "\nNo figures",
             f"{'measure':<10}{'guide img/s':>14}{'project img/s':>16}{'ratio':>9}"]
    for measure in ("pipeline", "train"):
        guide, project = gpu_report.rate(rows, "guide", measure), gpu_report.rate(rows, "project", measure)
        ratio = f"{project / guide:>8.1f}x" if guide and project else f"{'-':>9}"
        lines.append(f"{measure:<10}{figure(guide):>14}{figure(project):>16}{ratio}")
    guide = gpu_report.rate(rows, "guide", "pipeline")
    for row in rows:
        if row["recipe"] == "project --loader torchvision":
            lines.append(f"pipeline of project --loader torchvision --num-workers {row['workers']}: "
                         f"{row['images_per_sec']:,.1f} img/s"
                         + (f" ({row['images_per_sec'] / guide:.1f}x the guide's)" if guide else ""))
        if row["recipe"] == "torchvision-resized-crop":
            lines.append(f"pipeline of torchvision's RandomResizedCrop, {row['workers']} DataLoader workers: "
                         f"{row['images_per_sec']:,.1f} img/s")
        if row["recipe"] == "project --loader dali":
            lines.append(f"pipeline of project --loader dali, {row['workers']} DALI threads (decoding each file): "
                         f"{row['images_per_sec']:,.1f} img/s, {row['main_cpu_us_per_image']:,.0f} CPU us/image")
    train = [r for r in rows if r["measure"] == "train"]
    if train:
        lines.append("warm-up (not timed): " + ", ".join(
            f"{r['recipe']} {r['warmup_steps']} step{'s' * (r['warmup_steps'] != 1)} in {r['warmup_s']:.1f} s"
            for r in train))
    lines += [f"FAILED: {failure}" for failure in failures]
    return lines


def figure(images_per_sec):
    return "failed" if images_per_sec is None else f"{images_per_sec:,.1f}"


def report(opts):
    """--report: every figure of the first GPU hour (tools/gpu_report.py) into one Markdown block. A
    part that fails is named in the block and the others still run."""
    start = time.monotonic()
    figures = gpu_report.Figures(versions=gpu_report.versions())
    ctx = single_process_context()
    batch, warmup_steps, steps, _ = settings(opts, ctx.device)
    real = has_real_data(opts)

    def attempt(part, measure):
        print(f"\n== report: {part}", flush=True)
        return gpu_report.attempt(figures.failures, part, measure)

    def project_steps(extra, batch_size, warmup, timed, timed_context=nullcontext):
        args = recipe_args("project", opts, batch_size, ctx.device, real, extra)
        task = build_task(args, ctx)
        return time_training_steps(task, args, ctx, endless(task.train_loader), warmup, timed, timed_context)

    print("\n== report: the guide against the defaults", flush=True)
    figures.rows = benchmark(opts, figures.failures)
    for line in table(figures.rows):
        print(line)
    # The step three ways: eager, compiled and replayed as CUDA graphs (--compile's auto on CUDA), compiled.
    eager = gpu_report.rate(figures.rows, "project", "train")
    figures.steps = [{"label": "the defaults (eager)", "images_per_sec": eager, "batch_size": batch,
                      "warmup_s": gpu_report.warmup_s(figures.rows, "project"), "flags": []}] if eager else []
    for label, extra in STEP_VARIANTS:
        timing = attempt(f"the defaults with {label}", lambda extra=extra: project_steps(extra, batch, warmup_steps,
                                                                                       steps))
        if timing:
            figures.steps.append({"label": label, "images_per_sec": timing.images_per_sec, "batch_size": batch,
                                  "warmup_s": timing.warmup_s, "flags": extra})
    figures.compiled = next((row for row in figures.steps if row["flags"] == ["--compile"]), None)
    # 5 profiled steps of each (on the CPU of the eager defaults' alone: no kernels to count): GPU
    # kernels per step and their time, and from the eager defaults' profile its split by operator.
    cuda = ctx.device.type == "cuda"
    for label, flags in [("the defaults (eager)", []), *((row["label"], row["flags"]) for row in figures.steps
                                                          if row["flags"] and cuda)]:
        profile = attempt(f"a profile of {label}", lambda flags=flags: profiled(
            lambda profiler: project_steps(flags, batch, 3, 5, lambda: profiler), ctx.device))
        if profile is None:
            continue
        row = next((row for row in figures.steps if row["flags"] == flags), {})
        if cuda:
            row.update(kernel_profile(profile.profiler, 5))
        if not flags:
            figures.split = operator_split(profile, ctx.device, 5 * batch)
            if "kernel_ms" in row:  # idle from the kernels' own time, not the operators'
                figures.split = gpu_report.busy_split(figures.split, gpu_report.busy_percent(row))
    for size in (256, 1024):
        figures.peaks[size] = attempt(f"peak memory at batch {size}", lambda size=size: gpu_report.steady_peak_memory(
            lambda window: project_steps([], size, 2, 3, window), ctx.device))
    if ctx.device.type == "cuda" and dali_installed():  # decoding + cropping photos on the GPU; the tutorial's table
        figures.dali = attempt("--loader dali on JPEG photos", lambda: gpu_report.dali_photos(
            ctx.device, batch, lambda loader, n: measure_pipeline(loader, ctx.device, torch.contiguous_format, n)[0]))
        figures.tutorial = attempt("the tutorial's table", lambda: subprocess.run(
            [sys.executable, str(Path(__file__).with_name("tutorial_table.py")), "--images", "10000", "--epochs", "2"],
            check=True, stdout=subprocess.PIPE, text=True).stdout.split("\n\nMNIST as PNG", 1)[1].strip().splitlines())
    command = f"python tools/benchmark.py --report {opts.report}"
    figures.seconds = time.monotonic() - start
    print(f"\n== the figures so far (should the GPU tier overrun):\n{gpu_report.markdown(figures, command)}",
          flush=True)
    # The tier stops at the budget, then has TIER_GRACE_S to tear down, and the block is written.
    left_s = gpu_report.BUDGET_S - gpu_report.TIER_GRACE_S - (time.monotonic() - start)
    tier_log = unused_path(Path(opts.report).with_suffix(".gpu_tier.log"))
    blocked = gpu_report.tier_blocked(gpu_report.compute_mode())
    figures.tier = (blocked or attempt("the GPU tier", lambda: gpu_tier(ctx, left_s, tier_log, figures.failures))
                    if blocked or left_s >= gpu_report.MIN_TIER_S
                    else f"not run (no time left): run `python -m pytest -q {gpu_report.GPU_TIER}` next")
    if tier_log.exists():
        figures.tier = f"{figures.tier or 'failed (see Failed below)'} (its output: {tier_log})"
    figures.seconds = time.monotonic() - start
    text = gpu_report.markdown(figures, command)
    print(f"\n{text}", flush=True)  # first: the figures survive a file that cannot be written
    gpu_report.write(opts.report, text)
    print(f"Appended to {opts.report}: copy it into BENCHMARKS.md")


def gpu_tier(ctx, timeout_s, log, failures):
    """gpu_report.run_gpu_tier, with the GPU memory this process cached given back first (when
    it can be: after a sticky CUDA error it cannot, and the tier, a process of its own, still
    runs)."""
    if ctx.device.type == "cuda":
        gpu_report.attempt(failures, "giving back the cached GPU memory before the tier", torch.cuda.empty_cache)
    return gpu_report.run_gpu_tier(timeout_s, log)


class Profiled(NamedTuple):
    timing: StepTiming  # of the profiled steps
    profiler: object    # torch.profiler's, stopped


def profiled(steps, device):
    """Profiled of the training steps ``steps(profiler)`` runs inside a device profiler."""
    profiler = device_profiler(device)
    return Profiled(steps(profiler), profiler)


def kernel_profile(profiler, count):
    """{"kernels": GPU operations per step, "kernel_ms": their GPU time per step} of ``count``
    profiled training steps on CUDA. Kernels replayed from a CUDA graph count too (the profiler
    sees them; no host operator launched them)."""
    compute_ms, _, kernels = kernel_times(profiler.events())
    return {"kernels": kernels / count, "kernel_ms": compute_ms / count}


def operator_split(profile, device, images):
    """gpu_report.profile_split of a Profiled's steps (``images`` images in them), from
    torch.profiler's operators."""
    times = top_operators(profile.profiler.key_averages(), device_time=device.type == "cuda", limit=None)
    return gpu_report.profile_split(times.rows, 1e3 * images / profile.timing.images_per_sec)


def main():
    opts = build_parser().parse_args()
    if opts.report:
        if not torch.cuda.is_available():
            raise UserError("--report measures a CUDA GPU and this machine has none; run it on a GPU node, e.g. "
                            "srun --gpus=1 apptainer exec --nv \"$CONTAINER_PATH\" python tools/benchmark.py --report "
                            "report.md")
        check_writable(opts.report, "--report")
        return report(opts)
    if opts.json:
        check_writable(opts.json, "--json")  # before minutes of measuring, not after
    failures = []
    rows = benchmark(opts, failures)
    for line in table(rows, failures):
        print(line)
    if opts.json:
        write_rows(rows, opts.json)
    if failures:  # the rows measured are printed above (and written): the command still failed
        raise PartsFailed(f"{len(failures)} part(s) of the benchmark failed (tracebacks above): {failures[0]}"
                          + (f"; and {len(failures) - 1} more" if len(failures) > 1 else ""))


class PartsFailed(UserError):
    """A part of the benchmark raised (out of memory, a compiler error): exit status 1."""

    exit_code = 1


def write_rows(rows, path):
    """--json: the rows, whole or not at all (the table printed has every figure either way)."""
    text = json.dumps(rows, indent=1)
    tmp = Path(path).with_name(f".{Path(path).name}.tmp{os.getpid()}")
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)  # check_writable allows a new folder
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise space_problem("--json", path, err, needed=len(text)) from None
    print(f"Rows written to {path}")


if __name__ == "__main__":
    run_cli(main)
