"""``python tools/benchmark.py --report FILE.md``: everything the first hour on a GPU should produce,
in one command of under 9 minutes (what a lent GPU machine allows per command):

1. the versions: GPU, driver, torch, CUDA, cuDNN, NCCL;
2. tools/benchmark.py's comparison of the guide's recipe with this project's defaults (pipeline and
   training), then the defaults' step with ``--compile`` (CUDA graphs) and ``--compile-mode
   default``, each with its GPU kernels per step and the share of the step's time they run;
3. a profile of the defaults' training steps, split into convolutions and matmuls,
   normalization and element-wise work, the rest, and idle time (from the kernels' own time);
4. peak GPU memory at batch 256 and 1024;
5. the GPU test tier (tests/test_gpu.py) with the time that is left; when it does not fit,
   the report says how far it got and gives the command that runs the rest;

and writes one Markdown block for BENCHMARKS.md with every figure and command, ending with
what the figures say about the defaults: whether --compile should become the default on
CUDA, what bounds a step, and where the defaults stand against 25,000 img/s on one GPU.
"""

import importlib.util
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import traceback
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from PIL import Image

if __package__ in (None, ""):  # run as python tools/NAME.py: the project's modules are one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataset_utils import FileImages, preprocessing  # noqa: E402
from device_utils import device_name, peak_memory_gib, reset_peak_memory  # noqa: E402
from engine.dali_loader import DaliLoader  # noqa: E402
from engine.errors import UserError, first_line, space_problem  # noqa: E402
from engine.nccl_log import nccl_report  # noqa: E402
from engine.profiling import is_communication  # noqa: E402
from engine.processes import available_cores  # noqa: E402
from recipe import dali_images  # noqa: E402
from tools.demo_data import photo  # noqa: E402

BUDGET_S = 8.5 * 60  # one command may run 10 minutes on a lent machine: a margin for start-up and writing
GOAL_IMAGES_PER_S = 25_000  # the project's goal for one H100/H200/GH200 with the defaults (issue 3)
COMPILE_PAYS = 1.05  # --compile is worth recommending when it is at least this much faster ...
COMPILE_PAYS_WITHIN_EPOCHS = 10  # ... and a default when its compilation is paid back within this many epochs
EPOCH_IMAGES = 50_000  # one epoch of the guide's task (CIFAR-100's training set), the benchmark's unit
REPO = Path(__file__).resolve().parents[1]
GPU_TIER = "tests/test_gpu.py"
MIN_TIER_S = 30  # less time than this left: the tier is not started
TIER_GRACE_S = 20  # after Ctrl-C, pytest's time to tear down (its fixtures kill the torchruns they started)
# pytest-xdist processes for the tier, where it is installed: its tests are short runs that leave the GPU
# mostly idle, and one after the other they took 366 s for 17 of them on an H200 (2026-11-27), more than
# the report leaves. Three at a time ran them there on 2026-11-26.
TIER_WORKERS = 3

# Operator name fragments of each part of a step (self GPU time of torch.profiler's operators).
CATEGORIES = (
    # Not "cudnn": aten::cudnn_batch_norm (fp16, tf32, fp32 runs) is normalization.
    ("convolutions and matmuls", ("conv", "gemm", "addmm", "aten::mm", "aten::bmm", "linear")),
    ("normalization and element-wise", ("norm", "relu", "clamp", "threshold", "add", "mul", "div", "sub", "dropout",
                                        "bernoulli", "copy", "fill", "where", "sum", "mean", "max_pool", "avg_pool",
                                        "softmax", "nll", "cross_entropy", "sgd", "foreach", "index", "cat", "neg",
                                        "sqrt", "exp", "zero")),
)
OTHER = "other"
COMMUNICATION = "communication"


def category(name):
    """The part of a step an operator belongs to, by its name (the first that matches)."""
    if is_communication(name):
        return COMMUNICATION
    lowered = name.lower()
    for title, fragments in CATEGORIES:
        if any(fragment in lowered for fragment in fragments):
            return title
    return OTHER


def profile_split(rows, wall_ms):
    """{part: % of the wall time} from profiling.top_operators rows (every operator), and
    'idle': the wall time no computation filled (communication overlaps, so it is left out)."""
    spent = {}
    for row in rows:
        part = category(row.name)
        spent[part] = spent.get(part, 0.0) + row.self_ms
    busy = sum(ms for part, ms in spent.items() if part != COMMUNICATION)
    split = {part: 100 * ms / wall_ms for part, ms in spent.items()}
    split["idle"] = max(0.0, 100 * (wall_ms - busy) / wall_ms)
    return split


def busy_percent(row):
    """The share of a step's wall time (from its unprofiled timing) its kernels ran, in %: a
    row of Figures.steps."""
    return min(100.0, 100 * row["kernel_ms"] / (1e3 * row["batch_size"] / row["images_per_sec"]))


def busy_split(split, busy):
    """``split`` (profile_split's) with its idle share replaced by ``busy``'s complement (the GPU
    busy share from the kernels themselves, in %) and the computing parts scaled to fill
    ``busy`` in their proportions. Host operators' self device time leaves out some of the
    kernels: on an H200 (2026-11-27) the eager step's operators accounted for 61% of its wall
    time while its kernels ran 97% of it, and a CUDA graph of the whole step, which removes
    every launch gap, gained 2%."""
    computing = {part: share for part, share in split.items() if part not in ("idle", COMMUNICATION)}
    total = sum(computing.values())
    scaled = {part: busy * share / total for part, share in computing.items()} if total else {}
    return {**scaled, **({COMMUNICATION: split[COMMUNICATION]} if COMMUNICATION in split else {}),
            "idle": max(0.0, 100.0 - busy)}


@dataclass
class Figures:
    """What the report measured; None where a part was not run."""
    versions: dict
    rows: list = field(default_factory=list)  # tools/benchmark.py's rows (guide and project)
    compiled: dict = None       # the project's recipe with --compile: images_per_sec, warmup_s
    steps: list = field(default_factory=list)  # the step eager and compiled: label, images_per_sec, warmup_s,
    #                                            and where profiled: kernels and kernel_ms per step
    split: dict = None          # profile_split of the defaults (busy_split's where the kernels were counted)
    peaks: dict = field(default_factory=dict)  # batch -> peak GiB
    dali: dict = None           # tools/benchmark.py's dali_photos: --loader dali's images_per_sec on photos
    tutorial: list = None       # tools/tutorial_table.py's table, as lines
    tier: str = None            # pytest's summary of tests/test_gpu.py, or how far it got
    failures: list = field(default_factory=list)  # "part: error" of each part that raised
    seconds: float = 0.0


def attempt(failures, part, measure):
    """``measure()``, or None with its failure added to the list ``failures`` (and its
    traceback printed): these paths run on a GPU for the first time here, and a defect in one
    part (an out-of-memory, a compiler error) must not cost the figures of the others."""
    try:
        return measure()
    except UserError:  # the user's mistake (a --model that is not there): one line, as anywhere
        raise
    except Exception as err:  # noqa: BLE001 - any defect: recorded in the block, shown in full above it
        traceback.print_exc()
        failures.append(f"{part}: {type(err).__name__}{': ' + first_line(err) if str(err).strip() else ''}")
        return None


def versions():
    """The software and hardware the figures belong to."""
    cuda = torch.cuda.is_available()
    found = {"gpu": device_name(torch.device("cuda", 0)) if cuda else "none", "gpus": torch.cuda.device_count(),
             "torch": torch.__version__,
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


EXCLUSIVE_MODES = ("Exclusive_Process", "Exclusive_Thread", "Prohibited")


def compute_mode():
    """GPU 0's compute mode as nvidia-smi names it (Default, Exclusive_Process, ...), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader", "--id=0"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    mode = out.stdout.strip() if out.returncode == 0 else ""
    return mode or None


def tier_blocked(mode):
    """Why the GPU tier cannot run beside this process on a GPU in ``mode``, or None. In an
    exclusive mode one process holds the GPU: the report's own, so every process the tier
    starts (train.py, torchrun's ranks) would fail to create its CUDA context."""
    if mode not in EXCLUSIVE_MODES:
        return None
    return (f"not run: GPU 0 is in {mode} compute mode, where only one process may use it, and this report holds "
            f"it; run the tier alone after the report: `python -m pytest -q {GPU_TIER}` (its multi-process tests "
            "need the Default mode: `nvidia-smi -c DEFAULT` as root, or ask for a GPU in that mode)")


def rate(rows, recipe, measure):
    """images/s of ``recipe``'s (guide, project) ``measure`` (pipeline, train), None when it
    failed or was not run. The project's row is its defaults' loader, whichever that is."""
    found = [r for r in rows if (r["recipe"], r["measure"]) == (recipe, measure)]
    return found[0]["images_per_sec"] if found else None


def warmup_s(rows, recipe):
    """Seconds of ``recipe``'s untimed training warm-up steps (0 when not measured)."""
    found = [r for r in rows if (r["recipe"], r["measure"]) == (recipe, "train")]
    return found[0].get("warmup_s", 0.0) if found else 0.0


def compile_advice(eager, compiled, eager_warmup_s):
    """Whether --compile should be the default on CUDA: faster by COMPILE_PAYS, and its
    compilation (the compiled warm-up's extra seconds) paid back by the faster steps within
    COMPILE_PAYS_WITHIN_EPOCHS epochs."""
    rate, cost_s = compiled["images_per_sec"], max(compiled["warmup_s"] - eager_warmup_s, 0.0)
    gain = rate / eager
    if gain < COMPILE_PAYS:
        return f"--compile gives {gain:.2f}x ({rate:,.0f} against {eager:,.0f} img/s): keep it off by default."
    epochs = cost_s / (1 / eager - 1 / rate) / EPOCH_IMAGES  # images until the saved seconds equal the cost
    said = (f"--compile trains {gain:.2f}x as fast as the eager defaults ({eager:,.0f} -> {rate:,.0f} img/s) for "
            f"{cost_s:.0f} s of compilation, paid back after {epochs:.1f} epochs of {EPOCH_IMAGES:,} images")
    if epochs <= COMPILE_PAYS_WITHIN_EPOCHS:
        return f"{said}: make it the default on CUDA."
    return f"{said}: keep it a flag, for runs longer than that."


def recommendation(figures):
    """What the figures say about the defaults, one line each."""
    lines = []
    eager = rate(figures.rows, "project", "train")
    if eager and figures.compiled:
        lines.append(compile_advice(eager, figures.compiled, warmup_s(figures.rows, "project")))
    if figures.split:
        parts = {k: v for k, v in figures.split.items() if k != COMMUNICATION}
        bound = max(parts, key=parts.get)
        advice = {"convolutions and matmuls": "the step is compute bound in its convolutions: the defaults do what "
                                              "they can (bf16, channels_last); only a larger GPU is faster",
                  "normalization and element-wise": "the step is bound by memory traffic of normalization and "
                                                    "element-wise kernels: --compile fuses them",
                  "idle": "the GPU waits much of the step (the host launching kernels, the input pipeline): --compile "
                          "(on CUDA its kernels replayed as CUDA graphs) or a larger per-GPU batch fills it",
                  OTHER: "operators outside the usual parts take most of the step: read the profile's table"}[bound]
        lines.append(f"Largest part of a step: {bound} ({parts[bound]:.0f}% of its wall time): {advice}.")
    best = max([r for r in (eager, (figures.compiled or {}).get("images_per_sec")) if r], default=None)
    if best:
        verdict = "met" if best >= GOAL_IMAGES_PER_S else f"missed by {100 * (1 - best / GOAL_IMAGES_PER_S):.0f}%"
        lines.append(f"Goal of {GOAL_IMAGES_PER_S:,} img/s on one GPU: {verdict} ({best:,.0f} img/s, the best of "
                     "the above).")
    return lines


def per_s(images_per_sec):
    return "failed" if images_per_sec is None else f"{images_per_sec:,.0f}"


# What a tier on one GPU cannot show: its NCCL runs have world size 1.
ONE_GPU_LEAVES = ("NCCL between processes (each NCCL run had one rank: the replica check compared rank 0 with "
                  "itself, check_network.py's all-reduce was a local copy), DDP's gradient all-reduce, NVLink "
                  "between GPUs and Slingshot between nodes; run tests/test_gpu.py on a node with 2+ GPUs and "
                  "multinode_job.sh's network check for those.")


def markdown(figures, command):
    """The block for BENCHMARKS.md."""
    v = figures.versions
    date = datetime.now(timezone.utc).date().isoformat()
    lines = [f"## {date} · {v['gpu']} · driver {v['driver'] or '?'} · torch {v['torch']}, CUDA {v['cuda']}, cuDNN "
             f"{v['cudnn']}, NCCL {v['nccl']}, torchvision {v['torchvision']}, Python {v['python']} ({v['machine']})",
             "", f"`{command}` ({figures.seconds / 60:.1f} min in all; batch {figures.rows[0]['batch_size']}, "
                 f"{figures.rows[0]['data']} data)" if figures.rows else f"`{command}`", ""]
    if figures.rows:
        lines += ["| measure | guide img/s (its own loop) | defaults img/s | defaults + --compile img/s |",
                  "|---|---|---|---|"]
        for measure in ("pipeline", "train"):
            guide, project = rate(figures.rows, "guide", measure), rate(figures.rows, "project", measure)
            compiled = (f"{figures.compiled['images_per_sec']:,.0f} (compiling: {figures.compiled['warmup_s']:.0f} s)"
                        if measure == "train" and figures.compiled else "-")
            lines.append(f"| {measure} | {per_s(guide)} | {per_s(project)} | {compiled} |")
        lines.append("")
    if figures.steps:
        lines += [f"| training step, batch {figures.steps[0]['batch_size']} | img/s | warm-up s | GPU kernels per "
                  "step | GPU busy |", "|---|---|---|---|---|"]
        for row in figures.steps:
            busy = f"{busy_percent(row):.0f}%" if "kernel_ms" in row else "-"
            kernels = f"{row['kernels']:.0f}" if "kernels" in row else "-"
            lines.append(f"| {row['label']} | {per_s(row['images_per_sec'])} | {row['warmup_s']:.0f} | {kernels} | "
                         f"{busy} |")
        lines += ["", "Warm-up: the untimed first steps, compiling included. GPU busy: the kernels' GPU time per step "
                      "(5 profiled steps) over the step's time in the timed run (unprofiled).", ""]
    if figures.split:
        lines.append("Profile of the defaults' training steps (share of wall time): " + ", ".join(
            f"{part} {share:.0f}%" for part, share in sorted(figures.split.items(), key=lambda kv: -kv[1])))
    peaks = {batch: gib for batch, gib in figures.peaks.items() if gib is not None}  # None: not a GPU, or failed
    if peaks:
        lines.append("Peak GPU memory of training steps: " + ", ".join(
            f"batch {batch}: {gib:.2f} GiB" for batch, gib in sorted(peaks.items())))
    if figures.dali:
        lines.append(f"--loader dali on {figures.dali['photos']} (decode, random resized crop to 224x224, flip, "
                     f"normalize): {figures.dali['images_per_sec']:,.0f} img/s (the goal: at least 10,000 on an H100)")
    if figures.tutorial:
        lines += ["", "The tutorial's table (`python tools/tutorial_table.py --images 10000 --epochs 2`): "
                  + figures.tutorial[0], *figures.tutorial[1:], ""]
    if figures.tier:
        lines.append(f"GPU tier (`python -m pytest -q tests/test_gpu.py`): {figures.tier}")
        if figures.versions.get("gpus", 0) < 2:
            lines.append(f"Not verified on one GPU: {ONE_GPU_LEAVES}")
    if figures.failures:
        lines += ["", "Failed (tracebacks in the command's output):", *(f"- {failure}" for failure in figures.failures)]
    lines += ["", *(f"- {line}" for line in recommendation(figures))]
    return "\n".join(lines) + "\n"


def dali_photos(device, batch, measure, photos=4096, height=375, width=500):
    """{"images_per_sec", "photos"} of --loader dali's training pipeline on ``photos`` JPEG photos
    of ``width`` x ``height`` (written first, on threads): decode, resized crop to 224, flip;
    ``measure(loader, batches)`` gives the images per second (tools/benchmark.py's)."""
    with tempfile.TemporaryDirectory(prefix="dali-photos-") as folder:
        def write(i):
            path = Path(folder) / f"{i:05d}.jpg"
            Image.fromarray(photo(np.random.default_rng(i), i % 3, height, width)).save(path, quality=90)
            return str(path)
        with ThreadPoolExecutor(available_cores()) as pool:
            files = list(pool.map(write, range(photos)))
        prep = preprocessing((224, 224, 3), (0.5,) * 3, (0.25,) * 3, "resized-crop", stored_size=(256, 256))
        loader = DaliLoader(FileImages(files, np.zeros(photos), prep), batch, dali_images, device, True,
                            threads=max(1, min(8, available_cores() - 1)))
        rate = measure(loader, 4 * len(loader))
    return {"images_per_sec": rate, "photos": f"{photos} JPEG photos of {width}x{height}"}


def run_gpu_tier(timeout_s, log, tests=GPU_TIER, workers=TIER_WORKERS):
    """pytest ``tests`` in a process group of its own for at most ``timeout_s``, in ``workers``
    processes where pytest-xdist is installed, its output going to ``log`` as it runs: pytest's
    summary and its failures, or, when the time runs out or pytest dies, what finished and the
    command that runs the rest."""
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    # --dist loadgroup: the tests of one xdist_group (the compiles, which share a cache) in one worker.
    parallel = ["-n", str(workers), "--dist", "loadgroup"] if workers > 1 and importlib.util.find_spec("xdist") else []
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *parallel, str(tests)]
    print(f"GPU tier: {shlex.join(['python', *command[1:]])}, for at most {timeout_s:.0f} s; its output: {log}",
          flush=True)
    with open(log, "w") as out:
        # A report started in the background (``&``, nohup) ignores SIGINT, and pytest would
        # inherit that: Ctrl-C must reach it, so that its fixtures tear down.
        ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if ignored:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            process.wait(timeout=timeout_s)
            stopped = None
        except subprocess.TimeoutExpired:
            stop(process)
            stopped = f"before the time ran out ({timeout_s:.0f} s)"
        except BaseException:  # Ctrl-C in the report: pytest, in its own session, would go on alone
            stop(process)
            raise
    text = Path(log).read_text(errors="replace")
    failures = [line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    summary = [line for line in text.splitlines() if re.fullmatch(r"=+ .*\d+ (passed|failed|skipped|error).* =+", line)]
    interrupted = re.search(r"^!+ KeyboardInterrupt !+$", text, flags=re.MULTILINE)
    if summary and not interrupted:  # a whole run (also one that ended just as the time ran out)
        return summary[-1].strip("= ") + "".join(f"; {line}" for line in failures)
    outcomes = outcomes_of(text)
    counts = ", ".join(f"{list(outcomes.values()).count(outcome)} {outcome.lower()}"
                       for outcome in OUTCOMES if outcome in outcomes.values())
    failed = [test for test, outcome in outcomes.items() if outcome in ("FAILED", "ERROR")]
    rest = " ".join(f"--deselect {shlex.quote(f'{tests}::{test}')}" for test in outcomes)
    return (f"{counts or 'no test finished'} {stopped or f'before pytest died (exit status {process.returncode})'}"
            + "".join(f"; FAILED {tests}::{test}" for test in failed)
            + f"; the rest: `python -m pytest -q {tests}{' ' + rest if rest else ''}`")


OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")


def outcomes_of(text):
    """{test name: one of OUTCOMES} from ``pytest -v``'s lines (a test that was running when
    pytest stopped has none). The name is the test ID after its file's path, which pytest
    writes relative to the rootdir or the working directory; a parameter may hold spaces."""
    outcomes = "|".join(OUTCOMES)
    found = re.findall(rf"^\S+?::(.+?) ({outcomes})\b", text, flags=re.MULTILINE)
    # pytest-xdist's: "[gw0] [ 50%] PASSED tests/test_gpu.py::test_x[a b]"
    parallel = re.findall(rf"^\[gw\d+\] \[ *\d+%\] ({outcomes}) \S+?::(.+?) *$", text, flags=re.MULTILINE)
    return {**dict(found), **{test: outcome for outcome, test in parallel}}


def stop(process):
    """Ctrl-C to pytest's process group, so pytest tears its fixtures down (they kill the
    torchruns they started); after TIER_GRACE_S, SIGKILL to pytest and every process below it
    (torchrun's ranks run in sessions of their own, out of the group's reach)."""
    try:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=TIER_GRACE_S)
        return
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        pass
    kill_tree(process)


def kill_tree(process):
    """SIGKILL to ``process`` and every process below it, then reap it."""
    for pid in [process.pid, *descendants(process.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def descendants(pid):
    """Every process below ``pid`` (from /proc), in whichever session."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def steady_peak_memory(steps, device):
    """Peak GPU memory in GiB of the timed training steps that ``steps(timed_context)`` runs
    inside ``timed_context()``, counted from after their warm-up: the first steps' cuDNN
    autotuning workspaces are not what training holds."""
    peaks = []

    @contextmanager
    def timed_window():
        reset_peak_memory(device)
        yield
        peaks.append(peak_memory_gib(device))
    steps(timed_window)
    return peaks[-1]


def write(path, text):
    """Append the block: a report never replaces an earlier one in the same file. A disk that
    cannot take it leaves the file as it was and prints the block, so the GPU's minutes are
    not lost, before the one line (ResourceProblem)."""
    path = Path(path)
    before = path.stat().st_size if path.exists() else None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(text)
    except OSError as err:
        if before is None:
            path.unlink(missing_ok=True)
        elif path.exists():
            os.truncate(path, before)
        print(text, flush=True)
        raise space_problem("--report", path, err, needed=len(text.encode())) from None


if __name__ == "__main__":  # the parts of a report, not a command of its own
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(__doc__)
        sys.exit(0)
    sys.exit("gpu_report.py: error: it holds the parts of a GPU report; run python tools/benchmark.py --report FILE.md")
