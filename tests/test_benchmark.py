"""tools/benchmark.py in quick mode on the CPU: both recipes, both measures, and a table that
agrees with the rows it wrote."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine import profiling
from engine.dali_loader import dali_installed, dali_package
from engine.errors import UserError
from tools import gpu_report, loop_overhead, tutorial_table
from conftest import REPO, SMALL_MODEL, error_lines, run_main

REQUIRED = {"recipe", "measure", "images_per_sec", "device", "batch_size", "precision", "loader"}


def test_quick_benchmark_measures_both_recipes_and_writes_the_rows(tmp_path, capsys):
    rows_path = tmp_path / "rows.json"
    assert run_main("tools/benchmark.py", "--quick", "--data-dir", tmp_path / "no-data", "--json", rows_path,
                    "--profile", "1", *SMALL_MODEL) == 0  # a small convolutional network: the rows, not figures
    out = capsys.readouterr().out
    profile = out[out.index("== torch.profiler: 1 training steps of the project recipe, by CPU time"):]
    # The table's top rows, by CPU time: which operators lead varies from run to run for a small network.
    assert len(re.findall(r"^ *aten::\w+ ", profile, re.M)) >= 5 and "Self CPU time total" in profile
    rows = json.loads(rows_path.read_text())
    assert all(REQUIRED <= row.keys() for row in rows)
    found = {(row["recipe"], row["measure"], row["loader"]): row for row in rows}
    for measure in ("pipeline", "train"):
        guide, project = found[("guide", measure, "guide DataLoader")], found[("project", measure, "device")]
        assert guide["workers"] == 0 and guide["precision"] == project["precision"] == "fp32"  # on the CPU
        assert guide["batch_size"] == project["batch_size"] == 32
        for row in (guide, project):
            assert row["device"].startswith("CPU") and row["data"] == "synthetic"
            assert 0 < row["images_per_sec"] < math.inf
        ratio = project["images_per_sec"] / guide["images_per_sec"]
        assert any(line.startswith(measure) and line.endswith(f"{ratio:.1f}x") for line in out.splitlines())
    project_torchvision = [row for row in rows if row["recipe"] == "project --loader torchvision"]
    assert 0 in {row["workers"] for row in project_torchvision}  # the guide's setting, for comparison
    assert {row["warmup_steps"] for row in rows if row["measure"] == "train"} == {1}
    assert f"Rows written to {rows_path}" in out


def _tiny_opts(tmp_path, *extra):
    """benchmark.py --quick's options with a tiny network (TINY_NET): the orchestration, not figures."""
    from tools import benchmark
    (tmp_path / "tiny_net.py").write_text(TINY_NET)
    return benchmark.build_parser().parse_args(["--quick", "--data-dir", str(tmp_path / "no"), "--model",
                                                f"{tmp_path / 'tiny_net.py'}:Net", *extra])


def test_a_part_that_fails_loses_only_its_own_rows(tmp_path, monkeypatch, capsys):
    """An out-of-memory in the project's steps: its rows are 'failed', the guide's and the
    loaders' are measured, and the failure is named under the table."""
    import torch

    from tools import benchmark

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(benchmark, "time_training_steps", out_of_memory)
    failures = []
    rows = benchmark.benchmark(_tiny_opts(tmp_path), failures)
    out = "\n".join(benchmark.table(rows, failures))
    assert re.search(r"^train +[\d,.]+ +failed +-$", out, re.MULTILINE)  # the guide's loop measured
    assert re.search(r"^pipeline +[\d,.]+ +[\d,.]+ +[\d.]+x$", out, re.MULTILINE)
    assert "pipeline of project --loader torchvision --num-workers 0: " in out
    assert "FAILED: the project recipe: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in out


def test_a_failed_part_fails_the_command_and_a_mistake_is_one_line(tmp_path, monkeypatch, capsys):
    """The rows measured are printed, and the exit status says a part failed; a --model that
    is not there is the user's mistake: one line, exit 2, not a recorded failure."""
    import sys

    import torch

    from engine.cli import run_cli
    from tools import benchmark

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(benchmark, "time_training_steps", out_of_memory)
    opts = _tiny_opts(tmp_path)
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--quick", "--data-dir", opts.data_dir, "--model", opts.model])
    with pytest.raises(SystemExit) as exit_:
        run_cli(benchmark.main)
    assert exit_.value.code == 1
    assert error_lines(capsys.readouterr().err) == [
        "error: 1 part(s) of the benchmark failed (tracebacks above): the project recipe: OutOfMemoryError: CUDA out "
        "of memory"]
    assert run_main("tools/benchmark.py", "--quick", "--model", tmp_path / "nosuch.py:Net") == 2
    [line] = error_lines(capsys.readouterr().err)
    assert "nosuch.py" in line


def test_the_guide_column_runs_the_guides_own_loop(tmp_path, monkeypatch):
    """Plain SGD with the learning rate alone, cuDNN autotuning off while it runs (and back on
    after), zero_grad after the forward pass, no loss read back per batch."""
    import torch

    from device_utils import single_process_context
    from tools import benchmark
    made, seen, reads = [], [], []

    class RecordedSGD(torch.optim.SGD):
        def __init__(self, params, **kwargs):
            made.append(kwargs)
            super().__init__(params, **kwargs)

        def step(self, closure=None):
            seen.append(torch.backends.cudnn.benchmark)
            return super().step(closure)
    monkeypatch.setattr(torch.optim, "SGD", RecordedSGD)
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: (self.grad_fn and reads.append(self)) or item(self))
    torch.backends.cudnn.benchmark = True
    opts = _tiny_opts(tmp_path)
    ctx = single_process_context()
    args = benchmark.recipe_args("guide", opts, 8, ctx.device, False)
    task = benchmark.build_task(args, ctx)
    batches = benchmark.endless(benchmark.guide_loader(task.train_loader.dataset, 8, ctx.device))
    timing = benchmark.guide_training_steps(task, args, ctx, batches, 1, 2)
    assert made == [{"lr": args.base_lr}] and seen == [False] * 3 and reads == []
    assert torch.backends.cudnn.benchmark is True and timing.images_per_sec > 0


def test_the_report_takes_the_defaults_rows_whichever_loader_they_chose(tmp_path, monkeypatch, capsys):
    """When --loader auto picks the DataLoader (data larger than the device's share), the
    project's rows are the torchvision loader's: the report must not look for the device's."""
    from tools import benchmark
    monkeypatch.setitem(benchmark.RECIPES, "project", ["--loader", "torchvision", "--num-workers", "0"])
    failures = []
    rows = benchmark.benchmark(_tiny_opts(tmp_path), failures)
    assert failures == [] and {r["loader"] for r in rows if r["recipe"] == "project"} == {"torchvision"}
    figures = gpu_report.Figures(versions=gpu_report.versions(), rows=rows)
    block = gpu_report.markdown(figures, "python tools/benchmark.py --report r.md")
    assert re.search(r"^\| train \| [\d,]+ \| [\d,]+ \| - \|$", block, re.MULTILINE)
    assert all("failed" not in line for line in benchmark.table(rows))


def test_peak_memory_is_counted_after_the_warm_up():
    """cuDNN's autotuning workspaces of the first steps are not the steady state."""
    events = []

    def steps(timed_window):
        events.append("warm-up")
        with timed_window():
            events.append("timed steps")
    original = gpu_report.reset_peak_memory, gpu_report.peak_memory_gib
    try:
        gpu_report.reset_peak_memory = lambda device: events.append("reset")
        gpu_report.peak_memory_gib = lambda device: events.append("read") or 3.5
        assert gpu_report.steady_peak_memory(steps, "cuda") == 3.5
    finally:
        gpu_report.reset_peak_memory, gpu_report.peak_memory_gib = original
    assert events == ["warm-up", "reset", "timed steps", "read"]


def test_an_unwritable_json_path_fails_before_measuring(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert run_main("tools/benchmark.py", "--quick", "--json", tmp_path / "file" / "rows.json") == 2
    captured = capsys.readouterr()
    assert error_lines(captured.err) == [captured.err.strip()] and "--json" in captured.err
    assert "recipe" not in captured.out  # nothing was measured


# ---------------------------------------------------------------------------------------------
# --report (tools/gpu_report.py): it measures a GPU; here, its pieces and its refusal without one.

def test_report_needs_a_gpu_and_says_so_in_one_line(tmp_path, capsys):
    assert run_main("tools/benchmark.py", "--report", tmp_path / "report.md") == 2
    captured = capsys.readouterr()
    assert error_lines(captured.err) == [captured.err.strip()]
    assert "--report measures a CUDA GPU and this machine has none" in captured.err
    assert not (tmp_path / "report.md").exists() and "recipe" not in captured.out


def _figures(eager, compiled, split):
    rows = [{"recipe": recipe, "measure": measure, "loader": loader, "images_per_sec": value, "batch_size": 256,
             "data": "synthetic"}
            for recipe, loader, values in (("guide", "torchvision", (5000.0, 5100.0)),
                                           ("project", "device", (90000.0, eager)))
            for measure, value in zip(("pipeline", "train"), values, strict=True)]
    versions = {"gpu": "NVIDIA H100 80GB HBM3, 79.1 GiB", "gpus": 1, "driver": "570.1", "torch": "2.8.0",
                "cuda": "12.9", "cudnn": 91000, "nccl": "2.27.3", "torchvision": "0.23.0", "python": "3.12.3",
                "machine": "aarch64"}
    return gpu_report.Figures(versions=versions, rows=rows, compiled={"images_per_sec": compiled, "warmup_s": 95.0},
                              split=split, peaks={256: 5.5, 1024: 21.0}, tier="30 passed, 1 skipped in 250.0s",
                              seconds=500.0)


def test_report_block_and_its_recommendation():
    split = {"convolutions and matmuls": 45.0, "normalization and element-wise": 38.0, "idle": 12.0, "other": 5.0}
    text = gpu_report.markdown(_figures(20000.0, 26000.0, split), "python tools/benchmark.py --report r.md")
    lines = text.splitlines()
    assert lines[0].startswith("## ") and "NVIDIA H100 80GB HBM3" in lines[0] and "torch 2.8.0, CUDA 12.9" in lines[0]
    assert "| train | 5,100 | 20,000 | 26,000 (compiling: 95 s) |" in lines
    assert "| pipeline | 5,000 | 90,000 | - |" in lines
    assert "Peak GPU memory of training steps: batch 256: 5.50 GiB, batch 1024: 21.00 GiB" in lines
    assert not any(line.startswith("| training step") for line in lines)  # no steps measured: no table
    steps = _figures(20000.0, 26000.0, split)
    steps.steps = [{"label": "the defaults (eager)", "images_per_sec": 20000.0, "warmup_s": 3.2, "kernels": 342.0,
                    "kernel_ms": 9.6, "batch_size": 256},  # of 12.8 ms per step at 20,000 img/s: 75% busy
                   {"label": "--compile", "images_per_sec": 26000.0, "warmup_s": 95.0, "batch_size": 256}]  # no profile
    steps.rows = []  # the comparison failed: the steps' table stands alone
    assert "| the defaults (eager) | 20,000 | 3 | 342 | 75% |" in gpu_report.markdown(steps, "c")
    steps.rows = _figures(20000.0, 26000.0, split).rows
    table = gpu_report.markdown(steps, "c").split("| training step, batch 256 |", 1)[1].splitlines()
    assert table[:4] == [" img/s | warm-up s | GPU kernels per step | GPU busy |", "|---|---|---|---|---|",
                         "| the defaults (eager) | 20,000 | 3 | 342 | 75% |", "| --compile | 26,000 | 95 | - | - |"]
    assert "GPU tier (`python -m pytest -q tests/test_gpu.py`): 30 passed, 1 skipped in 250.0s" in lines
    assert not any("DALI" in line or "tutorial" in line for line in lines)  # not measured: not in the block
    dali = _figures(20000.0, 26000.0, split)
    dali.dali = {"images_per_sec": 12345.6, "photos": "4096 JPEG photos of 500x375"}
    dali.tutorial = ["MNIST as PNG files, 10,000 training images, 2 epochs, on NVIDIA H100", "", "| step | x |"]
    lines = gpu_report.markdown(dali, "python tools/benchmark.py --report r.md").splitlines()
    assert ("--loader dali on 4096 JPEG photos of 500x375 (decode, random resized crop to 224x224, flip, normalize): "
            "12,346 img/s (the goal: at least 10,000 on an H100)") in lines
    assert ("The tutorial's table (`python tools/tutorial_table.py --images 10000 --epochs 2`): MNIST as PNG files, "
            "10,000 training images, 2 epochs, on NVIDIA H100") in lines and "| step | x |" in lines
    assert f"Not verified on one GPU: {gpu_report.ONE_GPU_LEAVES}" in lines  # its NCCL runs had one rank
    two = _figures(20000.0, 26000.0, split)
    two.versions["gpus"] = 2
    assert "Not verified on one GPU" not in gpu_report.markdown(two, "python tools/benchmark.py --report r.md")
    # 95 s of compiling (no eager warm-up in these rows) against 1/20,000 - 1/26,000 s saved per image:
    # 8.2 M images, 164.7 epochs of 50,000.
    assert ("- --compile trains 1.30x as fast as the eager defaults (20,000 -> 26,000 img/s) for 95 s of "
            "compilation, paid back after 164.7 epochs of 50,000 images: keep it a flag, for runs longer than "
            "that.") in text
    # 5.5 s of compiled warm-up less 0.5 s of eager: 5 s, paid back after 433,333 images.
    quick = gpu_report.compile_advice(20000.0, {"images_per_sec": 26000.0, "warmup_s": 5.5}, 0.5)
    assert quick.endswith("paid back after 8.7 epochs of 50,000 images: make it the default on CUDA.")
    assert "- Largest part of a step: convolutions and matmuls (45% of its wall time)" in text
    assert "- Goal of 25,000 img/s on one GPU: met (26,000 img/s" in text
    slow = gpu_report.recommendation(_figures(20000.0, 20200.0, {**split, "idle": 60.0}))
    assert slow[0].startswith("--compile gives 1.01x") and "keep it off by default" in slow[0]
    assert slow[1].startswith("Largest part of a step: idle (60% of its wall time)")
    assert slow[2].startswith("Goal of 25,000 img/s on one GPU: missed by 19%")


def test_profile_split_of_a_real_profile():
    import torch
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.BatchNorm2d(16), torch.nn.ReLU())
    x = torch.randn(8, 3, 32, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        conv(x).sum().backward()
    times = profiling.top_operators(profiler.key_averages(), device_time=False, limit=None)
    total = times.compute_ms
    split = gpu_report.profile_split(times.rows, wall_ms=2 * total)  # half of the wall time computing
    assert split["idle"] == pytest.approx(50.0)
    assert sum(share for part, share in split.items() if part != "idle") == pytest.approx(50.0)
    assert split["convolutions and matmuls"] > 0 and split["normalization and element-wise"] > 0
    assert gpu_report.category("aten::cudnn_convolution") == "convolutions and matmuls"
    assert gpu_report.category("aten::native_batch_norm") == "normalization and element-wise"
    assert gpu_report.category("aten::cudnn_batch_norm_backward") == "normalization and element-wise"  # not conv
    assert gpu_report.category("record_param_comms") == "communication"
    assert gpu_report.category("nccl:all_reduce") == "communication"


def test_gpu_report_run_alone_points_to_the_command(capsys):
    assert run_main("tools/gpu_report.py", "--report", "r.md") == ("gpu_report.py: error: it holds the parts of a GPU "
                                                                   "report; run python tools/benchmark.py --report "
                                                                   "FILE.md")
    assert run_main("tools/gpu_report.py", "--help") == 0  # README's tools table lists it: its docstring
    assert capsys.readouterr().out.startswith("``python tools/benchmark.py --report FILE.md``: everything the first")


def test_the_capture_probe_needs_a_gpu_and_says_so_in_one_line(tmp_path, capsys):
    assert run_main("tools/capture_probe.py", "--only", "eager", "--out", tmp_path / "p.json") == 2
    captured = capsys.readouterr()
    assert captured.err == "error: capture_probe.py measures CUDA graphs, and this machine has no CUDA GPU\n"
    assert captured.out == "" and not (tmp_path / "p.json").exists()  # nothing measured, nothing written
    (tmp_path / "mine.json").write_text("my rows\n")
    assert run_main("tools/capture_probe.py", "--out", tmp_path / "mine.json") == 2  # checked before the GPU
    assert capsys.readouterr().err == (f"error: --out {tmp_path / 'mine.json'} exists already; choose a new file "
                                       "name (nothing is overwritten)\n")
    assert (tmp_path / "mine.json").read_text() == "my rows\n"


def test_kernel_times_count_the_gpus_kernels_and_set_communication_apart():
    """From a profiler's events (duck-typed here: a CPU has no kernel events): the CUDA ones
    alone, NCCL's kernels apart, a CUDA graph's replayed kernels like any other."""
    from types import SimpleNamespace

    import torch
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(name=name, device_type=device, device_time=us) for name, device, us in (
        ("sm90_xmma_fprop_implicit_gemm_bf16", cuda, 700.0), ("triton_poi_fused_relu_0", cuda, 250.0),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", cuda, 400.0), ("aten::convolution", cpu, 9000.0))]
    assert profiling.kernel_times(events) == (0.95, 0.4, 3)
    assert profiling.kernel_times([]) == (0.0, 0.0, 0)


def test_the_idle_share_comes_from_the_kernels_time():
    """The operators' split (61% of the wall time computing) rescaled to the kernels' 97% busy
    (an H200's eager step, 2026-11-27), in the operators' proportions; communication kept."""
    split = {"convolutions and matmuls": 33.0, "normalization and element-wise": 28.0, "other": 0.0, "idle": 39.0}
    busy = gpu_report.busy_percent({"kernel_ms": 12.97, "images_per_sec": 19152.0, "batch_size": 256})  # of 13.37 ms
    assert busy == pytest.approx(97.0, abs=0.1)
    scaled = gpu_report.busy_split(split, busy)
    assert scaled["idle"] == pytest.approx(100 - busy)
    assert scaled["convolutions and matmuls"] == pytest.approx(busy * 33 / 61)
    assert sum(share for part, share in scaled.items() if part != "idle") == pytest.approx(busy)
    assert gpu_report.busy_split({**split, "communication": 7.0}, 50.0)["communication"] == 7.0
    assert gpu_report.busy_percent({"kernel_ms": 20.0, "images_per_sec": 19152.0, "batch_size": 256}) == 100.0


def test_gpu_tier_summary_on_this_machine(tmp_path):
    """No GPU here: the tier is collected and skipped, and the summary says so. In one process:
    TIER_WORKERS xdist workers would each start torch to skip a few tests (the parallel run is
    test_a_gpu_tier_in_parallel_out_of_time_says_how_far_it_got's)."""
    summary = gpu_report.run_gpu_tier(300, tmp_path / "tier.log", workers=1)
    assert re.fullmatch(r"\d+ skipped in [\d.]+s( \(\d+:\d+:\d+\))?", summary), summary
    assert "tests/test_gpu.py::test_" in (tmp_path / "tier.log").read_text()  # the whole output, one line per test


SLOW_TESTS = """
import os
import signal
import subprocess
import sys
import time

import pytest


def test_fast():
    pass


@pytest.mark.parametrize("stop", ["stop file"])  # an ID with a space, as test_gpu.py's
def test_failing(stop):
    assert False


def test_skipped():
    pytest.skip("no second GPU here")


@pytest.mark.xfail(reason="known")
def test_known():
    assert False


def test_slow():
    if os.environ.get("IGNORE_SIGINT"):  # a test that will not stop, with a process of its own session below it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        open(os.environ["IGNORE_SIGINT"], "w").write(str(child.pid))
    if os.environ.get("DIE"):
        os._exit(3)
    time.sleep(600)


def test_after():
    pass
"""


def _finished(tests, why):
    """run_gpu_tier's summary of SLOW_TESTS stopped in test_slow, ``why``."""
    return (f"1 passed, 1 failed, 1 skipped, 1 xfail {why}; FAILED {tests}::test_failing[stop file]; the rest: "
            f"`python -m pytest -q {tests} --deselect {tests}::test_fast --deselect '{tests}::test_failing[stop file]' "
            f"--deselect {tests}::test_skipped --deselect {tests}::test_known`")


def test_a_gpu_tier_out_of_time_says_how_far_it_got_and_what_is_left(tmp_path, monkeypatch):
    """Ctrl-C at the deadline: pytest stops and says what finished; the command runs the rest.
    Also from a report started in the background, which ignores SIGINT."""
    monkeypatch.setattr(gpu_report, "TIER_GRACE_S", 60)
    tests = tmp_path / "test_slow.py"
    tests.write_text(SLOW_TESTS)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        start = time.monotonic()
        summary = gpu_report.run_gpu_tier(10, tmp_path / "logs" / "tier.log", tests, workers=1)
        assert time.monotonic() - start < 10 + 30  # stopped by Ctrl-C, not killed after the grace or slept for 600 s
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # as it was
    finally:
        signal.signal(signal.SIGINT, previous)
    assert summary == _finished(tests, "before the time ran out (10 s)")
    assert "::test_fast PASSED" in (tmp_path / "logs" / "tier.log").read_text()


def test_a_gpu_tier_that_ignores_ctrl_c_is_killed_with_what_it_started(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_report, "TIER_GRACE_S", 2)
    monkeypatch.setenv("IGNORE_SIGINT", str(tmp_path / "child.pid"))
    tests = tmp_path / "test_slow.py"
    tests.write_text(SLOW_TESTS)
    summary = gpu_report.run_gpu_tier(10, tmp_path / "tier.log", tests, workers=1)
    assert summary == _finished(tests, "before the time ran out (10 s)")
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and "Z" not in Path(f"/proc/{child}/stat").read_text().split(")")[1][:3]:
        assert time.monotonic() < deadline, "the test's own-session child was left running"
        time.sleep(0.1)


def test_a_gpu_tier_in_parallel_out_of_time_says_how_far_it_got(tmp_path, capsys):
    """With pytest-xdist (as the report runs it): the outcomes are read from xdist's lines, and
    test_slow, running when the time ran out, is left to the command for the rest (test_after
    finishes or not, as the scheduler placed it)."""
    pytest.importorskip("xdist")
    tests = tmp_path / "test_slow.py"
    tests.write_text(SLOW_TESTS)
    # Long enough for two xdist workers to start and finish the quick tests on a loaded 2-core
    # machine (10 s was not, once); test_slow still runs out of it.
    tier_s = 30
    summary = gpu_report.run_gpu_tier(tier_s, tmp_path / "tier.log", tests, workers=2)
    assert re.match(rf"[12] passed, 1 failed, 1 skipped, 1 xfail before the time ran out \({tier_s} s\); FAILED "
                    + re.escape(f"{tests}::test_failing[stop file]; the rest: "), summary), summary
    rest = summary.split("the rest: ", 1)[1]
    deselected = set(re.findall(r"--deselect '?\S+?::(\w+)", rest))
    assert {"test_failing", "test_fast", "test_known", "test_skipped"} <= deselected <= {
        "test_failing", "test_fast", "test_known", "test_skipped", "test_after"}
    assert f"-n 2 --dist loadgroup {tests}, for at most {tier_s} s" in capsys.readouterr().out  # the command it ran
    assert gpu_report.outcomes_of("[gw1] [ 50%] PASSED tests/test_gpu.py::test_x[stop file]\n") == {
        "test_x[stop file]": "PASSED"}


def test_a_gpu_tier_that_dies_says_what_finished(tmp_path, monkeypatch):
    monkeypatch.setenv("DIE", "1")
    tests = tmp_path / "test_slow.py"
    tests.write_text(SLOW_TESTS)
    summary = gpu_report.run_gpu_tier(300, tmp_path / "tier.log", tests, workers=1)
    assert summary == _finished(tests, "before pytest died (exit status 3)")


TINY_NET = """
import torch.nn as nn


def Net(num_classes, in_channels):
    return nn.Sequential(nn.Conv2d(in_channels, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, num_classes))
"""


def test_report_runs_every_part_and_names_the_one_that_failed(tmp_path, monkeypatch, capsys):
    """--report's orchestration on the CPU (main() refuses it here; report() is called), with
    a tiny network: a part that raises is named in the block, and the others still measure."""
    import torch

    from tools import benchmark
    (tmp_path / "tiny_net.py").write_text(TINY_NET)
    report = tmp_path / "report.md"
    report.write_text("an earlier report\n")

    def no_compiler(model, **kwargs):
        raise RuntimeError("no C++ compiler here\nsecond line")
    monkeypatch.setattr(torch, "compile", no_compiler)
    tier_calls = []
    monkeypatch.setattr(gpu_report, "run_gpu_tier", lambda left_s, log: tier_calls.append((left_s, log)) or "stub")
    opts = benchmark.build_parser().parse_args(["--quick", "--report", str(report), "--data-dir", str(tmp_path / "no"),
                                                "--model", f"{tmp_path / 'tiny_net.py'}:Net"])
    benchmark.report(opts)
    captured = capsys.readouterr()
    text = report.read_text()
    assert text.startswith("an earlier report\n## ")  # appended, never replaced
    block = text.split("\n", 1)[1]
    assert block in captured.out and "Appended to" in captured.out
    assert "RuntimeError: no C++ compiler here\nsecond line" in captured.err  # its traceback, in full
    failed = block.split("Failed (tracebacks in the command's output):\n", 1)[1].split("\n\n", 1)[0]
    assert failed.splitlines() == [  # those parts alone
        "- the defaults with --compile (reduce-overhead on CUDA: CUDA graphs): RuntimeError: no C++ compiler here",
        "- the defaults with --compile --compile-mode default: RuntimeError: no C++ compiler here"]
    steps = block.split("| training step, batch 32 |", 1)[1].splitlines()[2:]  # the eager row alone, no kernels
    assert re.fullmatch(r"\| the defaults \(eager\) \| [\d,]+ \| \d+ \| - \| - \|", steps[0]) and steps[1] == ""
    guide, project = (re.search(r"^\| train \| ([\d,]+) \| ([\d,]+) \| - \|$", block, re.MULTILINE)[i]
                      for i in (1, 2))
    assert int(guide.replace(",", "")) > 0 and int(project.replace(",", "")) > 0
    split = re.search(r"^Profile of the defaults' training steps \(share of wall time\): (.*)$", block, re.MULTILINE)[1]
    shares = dict(re.fullmatch(r"(.+) (\d+)%", part).groups() for part in split.split(", "))
    assert "convolutions and matmuls" in shares and "idle" in shares
    assert "Peak GPU memory" not in block  # no GPU: no peaks, and no failure either
    assert "DALI" not in block and "tutorial" not in block  # GPU parts: not run on the CPU
    [(left_s, log)] = tier_calls
    assert 0 < left_s < gpu_report.BUDGET_S and log == tmp_path / "report.gpu_tier.log"
    assert "GPU tier (`python -m pytest -q tests/test_gpu.py`): stub" in block


def test_a_command_past_its_timeout_is_killed_with_every_process_below_it(tmp_path):
    """conftest.run, which the torchrun tests use: a rank in a session of its own (as torchrun
    starts them) must not outlive its timed-out test on a GPU."""
    from conftest import run

    pid_file = tmp_path / "grandchild"
    child = ("import os, subprocess, sys, time; "
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(600)")
    with pytest.raises(subprocess.TimeoutExpired):
        run([sys.executable, "-c", child], cwd=tmp_path, timeout=5)
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is delivered asynchronously; the grandchild is reaped by init
        try:
            if Path(f"/proc/{grandchild}/stat").read_text().split()[2] == "Z":
                break
        except OSError:  # gone
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"process {grandchild} outlived its timed-out test")


def test_the_gpu_tier_runs_cheap_tests_first_and_the_cold_compiles_last():
    """--report gives the tier what is left of its budget: a cold --compile first would leave
    no time for the twenty cheap tests. No test before the compiles may wait longer than a
    few steps need."""
    import ast

    tree = ast.parse((REPO / gpu_report.GPU_TIER).read_text())
    tests = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
    compiles = [i for i, test in enumerate(tests) if "compile" in test.name]
    assert len(tests) > 15 and compiles == list(range(len(tests) - 4, len(tests)))
    for test in tests[:compiles[0]]:
        timeouts = [kw.value for node in ast.walk(test) if isinstance(node, ast.Call) for kw in node.keywords
                    if kw.arg == "timeout"]
        assert all(isinstance(t, ast.Constant) and t.value <= 120 for t in timeouts), test.name


@pytest.mark.parametrize("mode, blocked", [("Exclusive_Process", True), ("Default", False), (None, False)])
def test_a_gpu_in_exclusive_mode_is_named_instead_of_a_tier_of_failures(tmp_path, monkeypatch, mode, blocked):
    """On a GPU that takes one process (clusters set Exclusive_Process), the report's own
    process holds it: the tier's processes could not start, so the block says why and how."""
    stub = tmp_path / "nvidia-smi"
    stub.write_text(f"#!/bin/sh\necho '{mode or ''}'\n" if mode else "#!/bin/sh\nexit 9\n")
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert gpu_report.compute_mode() == mode
    why = gpu_report.tier_blocked(gpu_report.compute_mode())
    assert (why is not None) == blocked
    if blocked:
        assert why.startswith("not run: GPU 0 is in Exclusive_Process compute mode, where only one process may use it")
        assert "`python -m pytest -q tests/test_gpu.py`" in why


def test_loop_overhead_times_both_loops_on_the_same_steps(capsys):
    """tools/loop_overhead.py: the project's loop and the bare one, the same steps of the same
    batch, each a rate and a time per step that agree, and their ratio."""
    threads = torch.get_num_threads()
    try:
        loop_overhead.main(["--steps", "3", "--repeats", "1", "--batch-size", "16"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "3 steps of 16 images, cpu, 1 thread(s), best of 1" in out
    rows = re.findall(r"^(project|bare) loop: +([\d,]+) img/s \(([\d.]+) ms/step\)$", out, re.M)
    assert [name for name, _, _ in rows] == ["project", "bare"]
    rates = [float(rate.replace(",", "")) for _, rate, _ in rows]
    for rate, (_, _, ms) in zip(rates, rows):
        assert rate == pytest.approx(16 / (float(ms) / 1e3), rel=0.01)
    ratio = re.search(r"^ratio: (\d+\.\d\d)x \(project / bare\)$", out, re.M)
    assert ratio and float(ratio[1]) == pytest.approx(rates[0] / rates[1], abs=0.01)


def test_the_tutorial_table_trains_on_mnist_written_as_png_files(tmp_path):
    """tools/tutorial_table.py: MNIST (a stand-in here) as DIR/train/CLASS/N.png, each PNG the
    array it came from; a row measured through train.py on it, a row that cannot run saying why."""
    splits = tutorial_table.mnist(tmp_path / "no-mnist", 40)
    assert [len(labels) for _, labels in splits.values()] == [40, 8] and splits["train"][0].shape[1:] == (28, 28, 1)
    assert tutorial_table.write_png_folder(tmp_path / "png", splits) == 48
    label = int(splits["train"][1][7])
    with Image.open(tmp_path / "png" / "train" / str(label) / "00007.png") as png:
        assert png.mode == "L" and np.array_equal(np.asarray(png), splits["train"][0][7, :, :, 0])
    with pytest.raises(UserError, match="^--rows: no row 'AMP'; the rows are standard PyTorch, NVIDIA DALI"):
        tutorial_table.main(["--rows", "AMP"])
    done = subprocess.run([sys.executable, REPO / "tools" / "tutorial_table.py", "--images", "64", "--epochs", "2",
                           "--batch-size", "16", "--model", f"{REPO / 'tests' / 'tiny_net.py'}:Net", "--data-dir",
                           tmp_path / "no-mnist", "--rows", "NVIDIA DALI,without GPU", "--markdown", tmp_path / "t.md"],
                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    table = (tmp_path / "t.md").read_text().splitlines()
    assert table[0] == "MNIST as PNG files, 64 training images, 2 epochs, on the CPU"
    if dali_installed():
        assert re.fullmatch(r"\| NVIDIA DALI \| [\d,]+ \| \d+\.\d \|", table[4]), table
    else:
        assert table[4] == f"| NVIDIA DALI | - | - (DALI is not installed: pip install {dali_package()}) |"
    assert table[5] == "| without GPU | - | - (no GPU here: the standard PyTorch row runs on the CPU) |"
