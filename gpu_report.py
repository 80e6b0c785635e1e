"""``python benchmark.py --report FILE.md``: everything the first hour on a GPU should produce,
in one command of under 9 minutes (what a lent GPU machine allows per command):

1. the versions: GPU, driver, torch, CUDA, cuDNN, NCCL;
2. benchmark.py's comparison of the guide's recipe with this project's defaults (pipeline and
   training), then the defaults with ``--compile``;
3. a profile of the defaults' training steps, split into convolutions and matmuls,
   normalization and element-wise work, the rest, and idle time;
4. peak GPU memory at batch 256 and 1024;
5. the GPU test tier (tests/test_gpu.py) with the time that is left; when it does not fit,
   the report says how far it got and the command that runs it whole;

and writes one Markdown block for BENCHMARKS.md with every figure and command, ending with
what the figures say about the defaults: whether --compile should become the default on
CUDA, what bounds a step, and where the defaults stand against 25,000 img/s on one GPU.
"""

import platform
import re
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from device_utils import device_name, nccl_report, peak_memory_gib, reset_peak_memory

BUDGET_S = 8.5 * 60  # one command may run 10 minutes on a lent machine: a margin for start-up and writing
GOAL_IMAGES_PER_S = 25_000  # the project's goal for one H100/H200/GH200 with the defaults (issue 3)
COMPILE_PAYS = 1.05  # --compile becomes the recommended default when it is at least this much faster
REPO = Path(__file__).resolve().parent
GPU_TIER = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py")

# Operator name fragments of each part of a step (self GPU time of torch.profiler's operators).
CATEGORIES = (
    ("convolutions and matmuls", ("conv", "cudnn", "gemm", "addmm", "aten::mm", "aten::bmm", "linear")),
    ("normalization and element-wise", ("norm", "relu", "clamp", "threshold", "add", "mul", "div", "sub", "dropout",
                                        "bernoulli", "copy", "fill", "where", "sum", "mean", "max_pool", "avg_pool",
                                        "softmax", "nll", "cross_entropy", "sgd", "foreach", "index", "cat", "neg",
                                        "sqrt", "exp", "zero")),
    ("communication", ("nccl", "gloo", "c10d::", "all_reduce")),
)
OTHER = "other"


def category(name):
    """The part of a step an operator belongs to, by its name (the first that matches)."""
    lowered = name.lower()
    for title, fragments in CATEGORIES:
        if any(fragment in lowered for fragment in fragments):
            return title
    return OTHER


def profile_split(rows, wall_ms):
    """{part: % of the wall time} from monitor.top_operators rows (every operator), and
    'idle': the wall time no computation filled (communication overlaps, so it is left out)."""
    spent = {}
    for row in rows:
        spent[category(row.name)] = spent.get(category(row.name), 0.0) + row.self_ms
    busy = sum(ms for part, ms in spent.items() if part != "communication")
    split = {part: 100 * ms / wall_ms for part, ms in spent.items()}
    split["idle"] = max(0.0, 100 * (wall_ms - busy) / wall_ms)
    return split


@dataclass
class Figures:
    """What the report measured; None where a part was not run."""
    versions: dict
    rows: list = field(default_factory=list)  # benchmark.py's rows (guide and project)
    compiled: dict = None       # the project's recipe with --compile: images_per_sec, warmup_s
    split: dict = None          # profile_split of the defaults
    peaks: dict = field(default_factory=dict)  # batch -> peak GiB
    tier: str = None            # pytest's summary of tests/test_gpu.py, or how far it got
    seconds: float = 0.0


def versions():
    """The software and hardware the figures belong to."""
    cuda = torch.cuda.is_available()
    found = {"gpu": device_name(torch.device("cuda", 0)) if cuda else "none", "torch": torch.__version__,
             "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
             "nccl": nccl_report().removeprefix("NCCL version: ") if cuda else None, "driver": driver_version(),
             "python": platform.python_version(), "machine": platform.machine()}
    try:
        import torchvision
        found["torchvision"] = torchvision.__version__
    except ImportError:
        found["torchvision"] = None
    return found


def driver_version():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def rate(rows, recipe, measure, loader):
    found = [r for r in rows if (r["recipe"], r["measure"], r["loader"]) == (recipe, measure, loader)]
    return found[0]["images_per_sec"] if found else None


def recommendation(figures):
    """What the figures say about the defaults, one line each."""
    lines = []
    eager = rate(figures.rows, "project", "train", "device")
    if eager and figures.compiled:
        gain = figures.compiled["images_per_sec"] / eager
        compiled, warmup = figures.compiled["images_per_sec"], figures.compiled["warmup_s"]
        if gain >= COMPILE_PAYS:
            lines.append(f"--compile trains {gain:.2f}x as fast as the eager defaults ({eager:,.0f} -> {compiled:,.0f} "
                         f"img/s) for {warmup:.0f} s of compilation: make it the default on CUDA (its default mode; "
                         "the other modes are not measured).")
        else:
            lines.append(f"--compile gives {gain:.2f}x ({compiled:,.0f} against {eager:,.0f} img/s): keep it off by "
                         "default.")
    if figures.split:
        parts = {k: v for k, v in figures.split.items() if k not in ("communication",)}
        bound = max(parts, key=parts.get)
        advice = {"convolutions and matmuls": "the step is compute bound in its convolutions: the defaults do what "
                                              "they can (bf16, channels_last); only a larger GPU is faster",
                  "normalization and element-wise": "the step is bound by memory traffic of normalization and "
                                                    "element-wise kernels: --compile fuses them",
                  "idle": "the GPU waits much of the step (the host launching kernels, the input pipeline): a larger "
                          "per-GPU batch or --compile (fewer, larger kernels) fills it",
                  OTHER: "operators outside the usual parts take most of the step: read the profile's table"}[bound]
        lines.append(f"Largest part of a step: {bound} ({parts[bound]:.0f}% of its wall time): {advice}.")
    best = max([r for r in (eager, (figures.compiled or {}).get("images_per_sec")) if r], default=None)
    if best:
        verdict = "met" if best >= GOAL_IMAGES_PER_S else f"missed by {100 * (1 - best / GOAL_IMAGES_PER_S):.0f}%"
        lines.append(f"Goal of {GOAL_IMAGES_PER_S:,} img/s on one GPU: {verdict} ({best:,.0f} img/s, the best of "
                     "the above).")
    return lines


def markdown(figures, command):
    """The block for BENCHMARKS.md."""
    v = figures.versions
    date = datetime.now(timezone.utc).date().isoformat()
    lines = [f"## {date} · {v['gpu']} · driver {v['driver'] or '?'} · torch {v['torch']}, CUDA {v['cuda']}, cuDNN "
             f"{v['cudnn']}, NCCL {v['nccl']}, torchvision {v['torchvision']}, Python {v['python']} ({v['machine']})",
             "", f"`{command}` ({figures.seconds / 60:.1f} min in all; batch {figures.rows[0]['batch_size']}, "
                 f"{figures.rows[0]['data']} data)" if figures.rows else f"`{command}`", ""]
    if figures.rows:
        lines += ["| measure | guide img/s | defaults img/s | defaults + --compile img/s |", "|---|---|---|---|"]
        for measure in ("pipeline", "train"):
            guide, project = rate(figures.rows, "guide", measure, "torchvision"), rate(figures.rows, "project",
                                                                                        measure, "device")
            compiled = (f"{figures.compiled['images_per_sec']:,.0f} (compiling: {figures.compiled['warmup_s']:.0f} s)"
                        if measure == "train" and figures.compiled else "-")
            lines.append(f"| {measure} | {guide:,.0f} | {project:,.0f} | {compiled} |")
        lines.append("")
    if figures.split:
        lines.append("Profile of the defaults' training steps (share of wall time): " + ", ".join(
            f"{part} {share:.0f}%" for part, share in sorted(figures.split.items(), key=lambda kv: -kv[1])))
    peaks = {batch: gib for batch, gib in figures.peaks.items() if gib is not None}  # None: not a GPU
    if peaks:
        lines.append("Peak GPU memory of training steps: " + ", ".join(
            f"batch {batch}: {gib:.2f} GiB" for batch, gib in sorted(peaks.items())))
    if figures.tier:
        lines.append(f"GPU tier (`python -m pytest -q tests/test_gpu.py`): {figures.tier}")
    lines += ["", *(f"- {line}" for line in recommendation(figures))]
    return "\n".join(lines) + "\n"


def run_gpu_tier(timeout_s):
    """tests/test_gpu.py in a process of its own, for at most ``timeout_s``: pytest's summary,
    or how far it got."""
    if timeout_s < 30:
        return "not run (no time left): run `python -m pytest -q tests/test_gpu.py` next"
    try:
        result = subprocess.run([sys.executable, *GPU_TIER], cwd=REPO, capture_output=True, text=True,
                                timeout=timeout_s)
    except subprocess.TimeoutExpired as stopped:
        out = stopped.stdout.decode(errors="replace") if isinstance(stopped.stdout, bytes) else (stopped.stdout or "")
        done = sum(line.count(".") for line in out.splitlines() if re.fullmatch(r"[.sFEx]+( +\[ *\d+%\])?", line))
        failed = sum(line.count("F") + line.count("E") for line in out.splitlines()
                     if re.fullmatch(r"[.sFEx]+( +\[ *\d+%\])?", line))
        return (f"{done} passed and {failed} failed before the time ran out ({timeout_s:.0f} s): run "
                "`python -m pytest -q tests/test_gpu.py` for all of it")
    summary = [line for line in result.stdout.splitlines() if re.search(r"\d+ (passed|failed|skipped)", line)]
    failures = [line for line in result.stdout.splitlines() if line.startswith("FAILED ")]
    return (summary[-1].strip("= ") if summary else f"exit status {result.returncode}") + (
        "; " + "; ".join(failures) if failures else "")


def peak_memory(measure, ctx, batches=(256, 1024)):
    """{batch: peak GiB} of a few training steps at each batch (``measure(batch)`` runs them)."""
    peaks = {}
    for batch in batches:
        reset_peak_memory(ctx.device)
        measure(batch)
        peaks[batch] = peak_memory_gib(ctx.device)
    return peaks


def write(path, text):
    """Append the block: a report never replaces an earlier one in the same file."""
    with open(path, "a") as f:
        f.write(text)
