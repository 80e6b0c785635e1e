"""Seeing where the time goes (engine/monitor.py, engine/profiling.py): GPU sampling in a
thread, TensorBoard scalars that show each epoch once across a resume, and the profiler window,
one trace per rank."""

import gzip
import itertools
import json
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from device_utils import single_process_context
from engine import log as run_log, monitor, profiling, tensorboard_log
from train_utils import parse_args
from conftest import (FAST, TINY_MODEL, error_lines, python_cmd, read_metrics, run, run_main, torchrun_cmd,
                      write_cifar100)

# Tiny CIFAR-100 runs: 2 steps of 4 images per epoch, of the tiny network (what is monitored is the run).
TINY = ("--batch-size", "4", "--limit-batches", "2", "--warmup-epochs", "0", *FAST, *TINY_MODEL)


def _scalars(folder):
    """{tag: [(step, value)]} of the TensorBoard events under ``folder``, as TensorBoard reads them."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                      reason="pip install -r requirements-dev.txt")
    events = accumulator.EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


# ---------------------------------------------------------------------------------------------
# GPU sampling.

def test_gpu_sampler_averages_its_window_and_survives_a_failing_read():
    times = itertools.count()  # sample n is taken at "time" n
    reads = iter(range(1000))

    def read():
        n = next(reads)
        if n == 2:
            raise RuntimeError("NVML hiccup")  # no values for that sample, and sampling goes on
        return 10.0 * n, (None if n == 3 else 100.0 + n)  # power unsupported once

    sampler = monitor.GpuSampler(read, interval_s=0.001, clock=lambda: next(times))
    with sampler:
        deadline = time.time() + 10
        while len(sampler.samples) < 8 and time.time() < deadline:
            time.sleep(0.01)
    assert not sampler.thread.is_alive()
    window = sampler.window(1, 4)  # samples 1..4: utilization 10, -, 30, 40; power 101, -, -, 104
    assert window == monitor.GpuWindow(utilization=(10 + 30 + 40) / 3, power_w=(101 + 104) / 2, samples=4)
    assert all(s.time > 4 for s in sampler.samples)  # what a window used is dropped
    assert sampler.window(0, 4).samples == 0


def test_gpu_fields_over_ranks():
    windows = [monitor.GpuWindow(80.0, 300.0, 5), monitor.GpuWindow(60.0, 200.0, 5), monitor.GpuWindow(None, None, 0)]
    assert monitor.gpu_fields(windows) == {"gpu_util_percent": 70.0, "gpu_power_w": 250.0, "gpu_power_min_w": 200.0}
    assert monitor.gpu_fields([monitor.GpuWindow(None, None, 0)]) == {
        "gpu_util_percent": None, "gpu_power_w": None, "gpu_power_min_w": None}


def test_no_nvml_on_the_cpu():
    assert monitor.nvml_reader(torch.device("cpu")) == (None, "no GPU")


class _FakeNvml:
    """pynvml with the GPUs ``known`` (NVML's UUIDs) at their NVML indices."""
    class NVMLError(Exception):
        pass

    class NVMLError_NotFound(NVMLError):  # noqa: N801 - pynvml's name
        pass

    def __init__(self, known):
        self.known = known

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.known:
            raise self.NVMLError_NotFound("Not Found")
        return ("handle", uuid)

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", self.known[index])


@pytest.mark.parametrize("uuid, known, expected", [
    ("5c1e-b", ["GPU-0a0a-a", "GPU-5c1e-b"], ("handle", "GPU-5c1e-b")),  # CUDA's GPU 0 is NVML's GPU 1
    ("77aa-c", ["GPU-0a0a-a", "MIG-77aa-c"], ("handle", "MIG-77aa-c")),  # a MIG slice
    (None, ["GPU-0a0a-a", "GPU-5c1e-b"], ("handle", "GPU-0a0a-a")),     # torch without UUIDs: by index
    ("dead-d", ["GPU-0a0a-a"], _FakeNvml.NVMLError_NotFound),           # unknown: an error, not another GPU
])
def test_nvml_finds_the_gpu_by_its_uuid(monkeypatch, uuid, known, expected):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid=uuid))
    pynvml = _FakeNvml(known)
    if expected is _FakeNvml.NVMLError_NotFound:
        with pytest.raises(_FakeNvml.NVMLError_NotFound):
            monitor.nvml_handle(pynvml, torch.device("cuda", 0))
    else:
        assert monitor.nvml_handle(pynvml, torch.device("cuda", 0)) == expected


class _OldDriverNvml(_FakeNvml):
    """An NVML whose library lacks a symbol this pynvml calls: not an NVMLError."""
    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid):
        raise AttributeError("/usr/lib64/libnvidia-ml.so.1: undefined symbol: nvmlDeviceGetHandleByUUID")


def test_an_nvml_that_fails_in_any_way_leaves_the_run_without_samples(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="5c1e-b"))
    monkeypatch.setattr(monitor, "import_pynvml", lambda: _OldDriverNvml(["GPU-5c1e-b"]))
    read, why_not = monitor.nvml_reader(torch.device("cuda", 0))
    assert read is None
    assert why_not == ("not recorded: NVML does not answer (AttributeError: /usr/lib64/libnvidia-ml.so.1: undefined "
                       "symbol: nvmlDeviceGetHandleByUUID)")


# ---------------------------------------------------------------------------------------------
# TensorBoard.

def test_tensorboard_after_a_resume_shows_each_epoch_once(tmp_path):
    """The interrupted run wrote epoch 3 after its last checkpoint (simulated by removing the
    checkpoint of epoch 3): the resumed run trains epoch 3 again and TensorBoard shows it once."""
    pytest.importorskip("tensorboard", reason="pip install -r requirements-dev.txt")
    data = write_cifar100(tmp_path / "data", n_train=8, n_test=8)
    common = ("--data-dir", data, *TINY, "--checkpoint-dir", "ck", "--checkpoint-interval", "0",
              "--tensorboard", "tb", "--metrics-file", "m.jsonl")
    first = run(python_cmd("train.py", "--epochs", "3", *common), cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    run_id = read_metrics(tmp_path / "m.jsonl")[0]["run_id"]
    assert f"TensorBoard: tb/{run_id} (view: tensorboard --logdir tb)" in first.stdout
    newest = sorted((tmp_path / "ck").glob("checkpoint_*.pt"))[-1]
    newest.unlink()
    resumed = run(python_cmd("train.py", "--epochs", "3", *common, "--resume"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "after epoch 2" in resumed.stdout

    scalars = _scalars(tmp_path / "tb" / run_id)
    records = {r["epoch"]: r for r in read_metrics(tmp_path / "m.jsonl")}
    assert {"loss/train", "loss/validation", "accuracy/validation", "speed/images_per_s", "recipe/learning_rate",
            "speed/training_s_per_epoch"} <= scalars.keys()
    assert not any(tag.startswith("gpu/") for tag in scalars)  # the CPU: no GPU values, no empty curves
    assert [step for step, _ in scalars["loss/train"]] == [1, 2, 3]
    for step, value in scalars["accuracy/validation"]:
        assert value == pytest.approx(records[step]["val_accuracy"])
    assert scalars["speed/images_per_s"][-1][1] == pytest.approx(records[3]["images_per_sec"], rel=1e-6)


def test_a_resume_writes_the_checkpoints_last_epoch_again(tmp_path):
    """A process killed after its checkpoint of epoch 2 but before that epoch's event: the
    resumed run writes epoch 2 from the checkpoint's records, once."""
    pytest.importorskip("tensorboard", reason="pip install -r requirements-dev.txt")
    records = [{"epoch": e, "train_loss": 5.0 - e, "val_accuracy": 0.1 * e} for e in (1, 2)]
    first = tensorboard_log.TensorBoardLog(tmp_path / "tb", "run", 1, resumed=False)
    first.add(records[0])  # killed before epoch 2's event
    first.close()
    with monitor.Monitors(_cpu_context(), _Log(), "run", records[-1], resumed=True,
                          tensorboard=tmp_path / "tb") as monitors:
        monitors.record({"epoch": 3, "train_loss": 1.5, "val_accuracy": 0.3})
    assert _scalars(tmp_path / "tb" / "run")["loss/train"] == [(1, 4.0), (2, 3.0), (3, 1.5)]


def test_tensorboard_missing_is_one_line_before_any_work(tmp_path):
    script = python_cmd("train.py")[1]
    blocked = ("import runpy, sys; sys.modules['tensorboard'] = None; "  # as if it were not installed
               f"sys.path.insert(0, {str(script.parent)!r}); sys.argv = ['train.py'] + sys.argv[1:]; "
               f"runpy.run_path({str(script)!r}, run_name='__main__')")
    result = run([sys.executable, "-c", blocked, "--synthetic", "--tensorboard", "tb", "--checkpoint-dir", "ck"],
                 cwd=tmp_path)
    assert result.returncode == 2
    assert error_lines(result.stderr) == [
        "error: --tensorboard needs the tensorboard package, which is not installed: pip install tensorboard"]
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not (tmp_path / "tb").exists() and not (tmp_path / "ck").exists()


# ---------------------------------------------------------------------------------------------
# The profiler.

@pytest.mark.parametrize("argv, message", [
    (["--profile-steps", "3"], "--profile-steps applies with --profile-dir DIR"),
    (["--profile-dir", "p", "--profile-skip", "0"], "argument --profile-skip: '0' is not a positive integer")])
def test_profile_flags(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        parse_args("t", argv)
    assert exit_.value.code == 2
    lines = error_lines(capsys.readouterr().err)
    assert [line.split(": ", 1)[1] for line in lines] == [f"error: {message} (see --help)"]


def test_top_operators_of_a_real_profile():
    conv = torch.nn.Conv2d(3, 8, 3)
    x = torch.randn(4, 3, 16, 16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for _ in range(3):
            conv(x).relu().sum().backward()
    times = profiling.top_operators(profiler.key_averages(), device_time=False, limit=4)
    averages = {e.key: e for e in profiler.key_averages()}
    rows, total_ms = times.rows, times.compute_ms + times.communication_ms
    assert len(rows) == 4 and [r.self_ms for r in rows] == sorted((r.self_ms for r in rows), reverse=True)
    for row in rows:
        assert row.self_ms == pytest.approx(averages[row.name].self_cpu_time_total / 1e3)
        assert row.percent == pytest.approx(100 * row.self_ms / total_ms)
    assert total_ms == pytest.approx(sum(e.self_cpu_time_total for e in averages.values()) / 1e3)
    assert times.communication_ms == 0  # no collective here
    assert averages["aten::convolution_backward"].count == 3
    lines = profiling.operator_table(times, steps=3, wall_ms=3 * total_ms, unit="CPU")
    assert len(lines) == 1 + 4 + 1 and lines[0].split()[:2] == ["operator", "calls"]
    assert lines[-1] == (f"Per step: {total_ms / 3:.1f} ms of computation on the CPU in {total_ms:.1f} ms of wall "
                         "time (33% busy; the rest is waiting: for data, for the host to launch work, for other ranks)")


def test_communication_is_counted_beside_the_computation():
    """A gradient all-reduce overlaps the backward pass: it is not added to the busy time."""
    ops = [SimpleNamespace(key="aten::convolution_backward", count=2, self_cpu_time_total=6000.0),
           SimpleNamespace(key="nccl:all_reduce", count=2, self_cpu_time_total=3000.0),
           SimpleNamespace(key="c10d::allreduce_", count=2, self_cpu_time_total=1000.0)]
    times = profiling.top_operators(ops, device_time=False)
    assert (times.compute_ms, times.communication_ms) == (6.0, 4.0)
    assert profiling.is_communication("record_param_comms")  # what DDP's collectives may be recorded as
    assert [row.name for row in times.rows] == ["aten::convolution_backward", "nccl:all_reduce", "c10d::allreduce_"]
    assert profiling.operator_table(times, steps=2, wall_ms=8.0, unit="GPU")[-1].endswith(
        "(75% busy; the rest is waiting: for data, for the host to launch work, for other ranks); "
        "communication 2.0 ms beside it")


def test_unused_path_never_overwrites(tmp_path):
    path = tmp_path / "run_epoch1_step11_rank0.pt.trace.json.gz"
    assert profiling.unused_path(path) == path
    path.write_text("{}")
    assert profiling.unused_path(path).name == "run_epoch1_step11_rank0_2.pt.trace.json.gz"


def test_two_ranks_write_a_trace_each_and_rank_0_prints_the_table(tmp_path):
    data = write_cifar100(tmp_path / "data", n_train=32, n_test=8)  # 3 steps of 8 per epoch
    result = run(torchrun_cmd(2, "train_ddp.py", "--data-dir", data, "--batch-size", "8", "--epochs", "2",
                              "--limit-batches", "3", "--warmup-epochs", "0", *FAST, "--profile-dir", "prof",
                              "--profile-skip", "1", "--profile-steps", "2", "--metrics-file", "m.jsonl", *TINY_MODEL),
                 cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    records = read_metrics(tmp_path / "m.jsonl")
    run_id = records[0]["run_id"]
    assert [r["profiled"] for r in records] == [True, False]  # epoch 1's steps ran under the profiler
    traces = sorted(p.name for p in (tmp_path / "prof").iterdir())
    assert traces == [f"{run_id}_epoch1_step2_rank{rank}.pt.trace.json.gz" for rank in (0, 1)]
    for trace in traces:
        events = json.loads(gzip.decompress((tmp_path / "prof" / trace).read_bytes()))["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert {"ProfilerStep#0", "ProfilerStep#1"} <= names  # the 2 steps recorded
        assert "aten::convolution_backward" in names
    # Steps 2 and 3 of epoch 1; printed after the training phase, before the evaluation's line.
    assert result.stdout.count("Profile of 2 training steps from step 2 of epoch 1 (CPU time of rank 0)") == 1
    assert result.stdout.index("Profile of") < result.stdout.index("Epoch 1/2:")
    table = result.stdout.split("Profile of 2 training steps", 1)[1].splitlines()[1:]
    assert table[0].split()[:2] == ["operator", "calls"] and "aten::convolution_backward" in "\n".join(table)
    assert any(line.startswith("Per step: ") and "communication" in line for line in table)  # DDP's all-reduces
    assert "Traceback" not in result.stderr and "ERROR" not in result.stderr
    assert "USDT:" not in result.stdout + result.stderr  # kineto's profiler_start and profiler_stop lines


@pytest.mark.parametrize("skip, steps, steps_left, per_epoch, expected", [
    (10, 5, 100, 10, 10), (10, 5, 8, None, 3), (10, 5, 8, 4, 5), (10, 5, 8, 20, 3), (10, 5, 4, 2, 3),
    (2, 5, None, None, 2), (10, 5, 1, None, None), (1, 5, 2, None, 1)])
def test_the_profile_window_is_moved_into_the_run(skip, steps, steps_left, per_epoch, expected):
    """Moved to end with the run, inside its last epoch (8 steps of 4: after step 5, the last
    epoch's first, so steps 6 to 8 are recorded)."""
    assert profiling.fitted_skip(skip, steps, steps_left, per_epoch) == expected


@pytest.mark.parametrize("skip, steps, steps_left, per_epoch, expected", [
    (3, 5, 8, 8, 5),     # one epoch of 8: steps 4 to 8
    (3, 2, 4, 2, 1),     # 2 epochs of 2: after step 3 (epoch 2's first), step 4 alone
    (2, 5, 20, 4, 2),    # epochs of 4: after step 2, steps 3 and 4
    (4, 3, 20, 4, 3),    # step 4 ends an epoch: the window opens after step 5 (the next epoch's first): 6 to 8
    (3, 5, 6, 4, 3),     # resumed after step 2 of an epoch of 4 (6 to go): the process's step 3 is the next epoch's
                         # first, then its steps 2 to 4
    (0, 5, 20, None, 5), (7, 5, 9, None, 2), (3, 5, None, None, 5)])
def test_the_start_up_line_counts_the_steps_the_window_records(skip, steps, steps_left, per_epoch, expected):
    """profiling.window_length: --profile-steps, or fewer where the epoch (or the run) ends first."""
    assert profiling.window_length(skip, steps, steps_left, per_epoch) == expected


def test_a_run_shorter_than_the_profile_skip_still_writes_a_trace_and_says_so(tmp_path, capsys):
    """A quick 4-step trial with the default --profile-skip 10: the window is moved into the
    run, and the start-up line says so; a run with one step says why there is no trace."""
    data = write_cifar100(tmp_path / "data", n_train=32, n_test=8)  # TINY: 2 steps of 4 per epoch
    assert run_main("train.py", "--data-dir", data, *TINY, "--epochs", "2", "--profile-dir", tmp_path / "prof",
                    "--profile-steps", "2") == 0
    out = capsys.readouterr().out
    assert ("Profiler: 1 training step (of --profile-steps 2: the window ends with the epoch) after the first 3 of "
            "this process (--profile-skip 10 moved to 3: this run has 4 training steps to go), traces in "
            f"{tmp_path / 'prof'}") in out
    assert "Profile of 1 training step from step 2 of epoch 2 " in out  # as announced
    (trace,) = (tmp_path / "prof").iterdir()
    assert trace.name.endswith("_epoch2_step2_rank0.pt.trace.json.gz")  # in the last epoch, after its first step
    assert run_main("train.py", "--data-dir", data, *TINY, "--epochs", "1", "--limit-batches", "1", "--profile-dir",
                    tmp_path / "prof1") == 0
    assert ("Profiler: no trace: this run has 1 training step to go, and the first is never profiled (it autotunes "
            "and compiles)") in capsys.readouterr().out
    assert not (tmp_path / "prof1").exists()


def test_a_window_cut_short_by_the_end_of_the_epoch_is_written(tmp_path, capsys):
    """The window records training steps only: the epoch's end ends it, before the evaluation."""
    data = write_cifar100(tmp_path / "data", n_train=8, n_test=8)
    assert run_main("train.py", "--data-dir", data, *TINY, "--epochs", "1", "--profile-dir", tmp_path / "prof",
                    "--profile-skip", "1", "--profile-steps", "5") == 0
    assert ("Profile of 1 training step from step 2 of epoch 1 (cut short by the end of the epoch: 5 asked for)"
            in capsys.readouterr().out)
    (trace,) = (tmp_path / "prof").iterdir()
    assert trace.name.endswith("_epoch1_step2_rank0.pt.trace.json.gz")
    assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]


def test_no_profiler_and_no_thread_unless_asked(tmp_path):
    with monitor.Monitors(_cpu_context(), _Log(), "run", None, False) as monitors:
        assert (monitors.sampler, monitors.tensorboard, monitors.profile) == (None, None, None)
        assert not any(t.name == "gpu-sampler" for t in threading.enumerate())
        assert monitors.end_of_training_phase(0, time.perf_counter()) == {
            **monitor.gpu_fields([monitor.GpuWindow(None, None, 0)]), "profiled": False} == run_log.UNWATCHED


def _cpu_context():
    return single_process_context()


class _Log:
    def __init__(self):
        self.lines = []

    def info(self, line=""):
        self.lines.append(line)
