"""What a run records about itself besides loss and accuracy, for a user asking where the time
goes: GPU utilization and power per epoch (NVML, sampled in a thread), TensorBoard scalars
(--tensorboard DIR, engine/tensorboard_log.py), and a torch.profiler window of a few training
steps (--profile-dir DIR).

The loop (train_utils.py) sees one object, ``Monitors``: ``step()`` after each training step,
``gpu_window(start, end)`` once per epoch, ``record(record)`` with each epoch's metrics. Each
part is off unless asked for (or, for NVML, unless there is a GPU and pynvml), and costs
nothing per step then: no profiler, no writer, no thread. Only global rank 0 prints and
writes TensorBoard events; every rank samples its own GPU and writes its own trace.

The optional packages (tensorboard, pynvml from nvidia-ml-py) are imported only here and only
when used; the NGC PyTorch container has both.
"""

import os
import threading
import time
import warnings
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from engine.disk_space import space_warning
from engine.errors import first_line
from engine.log import count
from engine.processes import gather_objects, synchronize

GPU_SAMPLE_INTERVAL_S = 1.0  # NVML's utilization counter is itself an average over up to 1 s
NVML_PIP = "pip install nvidia-ml-py"
TOP_OPERATORS = 15  # rows of the profiler's table in the log

# ---------------------------------------------------------------------------------------------
# GPU utilization and power, sampled in a thread.

class GpuSample(NamedTuple):
    time: float                  # time.perf_counter() seconds, the clock the loop times epochs with
    utilization: Optional[float]  # % of the last sample period in which a kernel ran (NVML), or None
    power_w: Optional[float]      # board power draw in watts, or None where the GPU does not report it


class GpuWindow(NamedTuple):
    """One rank's GPU over a stretch of time: means of the samples taken in it."""
    utilization: Optional[float]  # % (None without samples)
    power_w: Optional[float]      # W (None without samples)
    samples: int


def nvml_reader(device):
    """(a function returning (utilization %, power W) of this process's GPU, None) or (None,
    why not). NVML numbers GPUs its own way, so the GPU is found by its UUID, which holds
    whatever CUDA_VISIBLE_DEVICES says."""
    if device.type != "cuda":
        return None, "no GPU"
    pynvml = import_pynvml()
    if pynvml is None:
        return None, f"not recorded: pynvml is not installed ({NVML_PIP})"
    try:
        pynvml.nvmlInit()
        handle = nvml_handle(pynvml, device)
    except Exception as err:  # NVMLError, and whatever an old driver's library throws: monitoring never stops a run
        why = str(err) if isinstance(err, pynvml.NVMLError) else f"{type(err).__name__}: {first_line(err)}"
        return None, f"not recorded: NVML does not answer ({why})"

    def read():
        values = []
        for query, scale in ((lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu, 1),
                             (lambda: pynvml.nvmlDeviceGetPowerUsage(handle), 1e-3)):  # power: mW
            try:
                values.append(query() * scale)
            except pynvml.NVMLError:  # e.g. NOT_SUPPORTED: that value stays unknown
                values.append(None)
        return tuple(values)
    return read, None


def import_pynvml():
    """The pynvml module (package nvidia-ml-py), or None where it is not installed."""
    try:
        with warnings.catch_warnings():  # the old pynvml wrapper warns that it is deprecated
            warnings.simplefilter("ignore")
            import pynvml
    except ImportError:
        return None
    return pynvml


def nvml_handle(pynvml, device):
    """NVML's handle of the CUDA ``device``, by its UUID (torch prints it without NVML's
    "GPU-" prefix, or "MIG-" for a MIG slice), or by index where torch does not know the UUID.
    A UUID NVML knows under neither name raises NVMLError_NotFound: the index could be another
    GPU's."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is None:
        return pynvml.nvmlDeviceGetHandleByIndex(device.index)
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
    except pynvml.NVMLError_NotFound:
        return pynvml.nvmlDeviceGetHandleByUUID(f"MIG-{uuid}")


class GpuSampler:
    """Calls ``read()`` -> (utilization %, power W) every ``interval_s`` in a daemon thread and
    keeps the samples until ``window`` has used them. The training loop never waits for it."""

    def __init__(self, read, interval_s=GPU_SAMPLE_INTERVAL_S, clock=time.perf_counter):
        self.read, self.interval_s, self.clock = read, interval_s, clock
        self.samples = []
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        self.thread.join(timeout=2 * self.interval_s)  # a GPU fallen off the bus can hang NVML: do not wait for it

    def _run(self):
        while not self.stopped.is_set():
            try:
                utilization, power = self.read()
            except Exception:  # a sampler must never take training down: no sample this time
                utilization = power = None
            with self.lock:
                self.samples.append(GpuSample(self.clock(), utilization, power))
            self.stopped.wait(self.interval_s)

    def window(self, start, end):
        """Means of the samples taken from ``start`` to ``end`` (this sampler's clock); older
        samples are dropped."""
        with self.lock:
            taken = [s for s in self.samples if start <= s.time <= end]
            self.samples = [s for s in self.samples if s.time > end]
        return GpuWindow(_mean(s.utilization for s in taken), _mean(s.power_w for s in taken), len(taken))


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def gpu_fields(windows):
    """The metrics line's GPU fields from every rank's GpuWindow: means over the GPUs that
    reported (None on the CPU or without NVML), and the lowest GPU's power, which shows a GPU
    that waits for the others."""
    powers = [w.power_w for w in windows if w.power_w is not None]
    return {"gpu_util_percent": _mean(w.utilization for w in windows), "gpu_power_w": _mean(powers),
            "gpu_power_min_w": min(powers) if powers else None}


# ---------------------------------------------------------------------------------------------
# The profiler window.

class OperatorRow(NamedTuple):
    name: str
    calls: int
    self_ms: float   # time in the operator itself (its kernels on a GPU), over the window
    percent: float   # of all operators' self time


class OperatorTimes(NamedTuple):
    rows: list             # OperatorRow, the most self time first
    compute_ms: float      # self time of every operator but communication
    communication_ms: float  # all-reduces: on their own stream (NCCL) or thread (gloo), overlapping compute


def is_communication(name):
    """DDP's gradient all-reduces and other collectives, by operator name."""
    lowered = name.lower()
    return (any(part in lowered for part in ("nccl", "gloo", "all_reduce", "record_param_comms"))
            or lowered.startswith("c10d::"))


def top_operators(averages, device_time, limit=TOP_OPERATORS):
    """The ``limit`` operators with the most self time (device time on a GPU: the kernels they
    launched; CPU time on the CPU) from ``profiler.key_averages()``, and the totals in ms,
    communication apart: it runs beside the computation, so adding it would overstate how
    busy the device was. Only host-side operators count, so each kernel is counted once."""
    key = "self_device_time_total" if device_time else "self_cpu_time_total"
    ops = [e for e in averages if getattr(e, "device_type", None) in (None, torch.autograd.DeviceType.CPU)
           and not e.key.startswith("ProfilerStep") and getattr(e, key) > 0]
    total_us = sum(getattr(e, key) for e in ops)
    communication_us = sum(getattr(e, key) for e in ops if is_communication(e.key))
    ops.sort(key=lambda e: getattr(e, key), reverse=True)
    rows = [OperatorRow(e.key, e.count, getattr(e, key) / 1e3, 100 * getattr(e, key) / total_us) for e in ops[:limit]]
    return OperatorTimes(rows, (total_us - communication_us) / 1e3, communication_us / 1e3)


def operator_table(times, steps, wall_ms, unit):
    """Lines for the log: the top operators and how busy the device was per step."""
    lines = [f"{'operator':<52}{'calls':>7}{f'self {unit} ms':>14}{'per step':>10}{'share':>7}"]
    for row in times.rows:
        lines.append(f"{row.name[:51]:<52}{row.calls:>7}{row.self_ms:>14.2f}{row.self_ms / steps:>10.2f}"
                     f"{row.percent:>6.1f}%")
    if wall_ms:
        busy = min(100.0, 100 * times.compute_ms / wall_ms)
        lines.append(f"Per step: {times.compute_ms / steps:.1f} ms of computation on the {unit} in "
                     f"{wall_ms / steps:.1f} ms of wall time ({busy:.0f}% busy; "
                     "the rest is waiting: for data, for the host to launch work, for other ranks)"
                     + (f"; communication {times.communication_ms / steps:.1f} ms beside it"
                        if times.communication_ms else ""))
    return lines


def device_profiler(device):
    """torch.profiler over the host's operators and, on CUDA, the GPU's kernels (not started)."""
    cuda = device.type == "cuda"
    if not cuda:  # else kineto logs an ERROR line at the first trace that it found no GPU
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    return torch.profiler.profile(activities=activities)


class ProfileWindow:
    """torch.profiler over ``steps`` training steps after the first ``skip`` (at least 1) of
    this process (cuDNN autotuning, torch.compile and the loader's start-up are over by then;
    when the skip ends an epoch, after the next epoch's first step).
    The window records training steps only: it ends with the epoch's training phase at the
    latest (then it has fewer steps). After that phase each rank writes
    DIR/RUN_epochE_stepS_rankR.pt.trace.json.gz (Perfetto, TensorBoard) and global rank 0
    prints the top operators, so writing them is not counted as training time.

    Not torch.profiler.schedule: its window is fixed in steps from the profiler's start, while
    this one moves off an epoch's first step and ends with the epoch's training phase; and its
    warm-up step, without which it warns, would have to run under the profiler before the
    window. start()/stop() around the window, with ProfilerStep#N spans as schedule's step()
    writes them, give the same trace."""

    def __init__(self, directory, skip, steps, ctx, run_id, log, steps_per_epoch=None):
        self.directory, self.ctx, self.run_id, self.log = Path(directory), ctx, run_id, log
        self.skip, self.steps, self.steps_per_epoch = skip, steps, steps_per_epoch
        self.taken, self.recorded, self.where = 0, 0, None
        self.profiler = self.started = self.marker = self.wall_ms = None
        self.recording = False

    def _mark_step(self):
        """Open the span ProfilerStep#N of the next step (what Perfetto and TensorBoard's
        profiler plugin show as steps), closing the one before."""
        if self.marker is not None:
            self.marker.__exit__(None, None, None)
        self.marker = None
        if self.recording:
            self.marker = torch.profiler.record_function(f"ProfilerStep#{self.recorded}")
            self.marker.__enter__()

    def step(self, epoch, step):
        """After training step ``step`` of ``epoch``."""
        self.taken += 1
        if self.recording:
            self.recorded += 1
            if self.recorded >= self.steps:
                self._stop()
            else:
                self._mark_step()
        elif self.where is None and self.taken >= self.skip and step != self.steps_per_epoch:
            # Once, and never after an epoch's last step: the next training step is a new epoch's.
            self.where = (epoch, step + 1)  # the next step is the first recorded
            synchronize(self.ctx.device)  # the window starts with an idle device
            self.profiler = device_profiler(self.ctx.device)
            self.profiler.start()
            self.started, self.recording = time.perf_counter(), True
            self._mark_step()

    def _stop(self):
        synchronize(self.ctx.device)  # every kernel of the window has run
        self.wall_ms = (time.perf_counter() - self.started) * 1e3
        self.recording = False
        self._mark_step()  # closes the last step's span
        self.profiler.stop()

    def end_of_training_phase(self):
        """After an epoch's training steps (or a stop): end the window if it is recording, and
        write and print it if it has ended. True when this phase was (partly) profiled."""
        if self.profiler is None:
            return False
        if self.recording:
            self._stop()
        profiler, self.profiler = self.profiler, None
        epoch, step = self.where
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"{self.run_id}_epoch{epoch}_step{step}_rank{self.ctx.rank}.pt.trace.json.gz"
        path = unused_path(self.directory / name)
        tmp = path.with_name(f".tmp-{path.name}")  # ends in .gz: torch compresses it (a tenth of the size)
        try:
            profiler.export_chrome_trace(str(tmp))
            os.replace(tmp, path)
        except OSError as err:  # a full disk: the run goes on without this trace, and says so
            tmp.unlink(missing_ok=True)
            self.log.info(space_warning(f"the profiler trace of rank {self.ctx.rank}", path, err,
                                        "training goes on without it"))
            return True
        if self.ctx.is_main:
            cuda = self.ctx.device.type == "cuda"
            steps = max(self.recorded, 1)
            short = (f" (cut short by the end of the epoch: {self.steps} asked for)" if self.recorded < self.steps
                     else "")
            self.log.info(f"Profile of {count(steps, 'training step', 'training steps')} from step {step} of epoch "
                          f"{epoch}{short} ({'GPU' if cuda else 'CPU'} time of rank 0): trace of each rank in "
                          f"{self.directory}, e.g. {path.name} (open it in https://ui.perfetto.dev)")
            for line in operator_table(top_operators(profiler.key_averages(), device_time=cuda), steps, self.wall_ms,
                                       "GPU" if cuda else "CPU"):
                self.log.info(line)
        return True


def fitted_skip(skip, steps, steps_left, steps_per_epoch=None):
    """The --profile-skip this run can honour: ``skip`` when the window starts within the
    ``steps_left`` training steps (None: unknown), else moved so that the window of ``steps``
    ends with the run, never onto the first step, and within the last epoch (a window never
    spans two); None when no step after the first is left."""
    if steps_left is None or skip < steps_left:
        return skip
    if steps_left < 2:
        return None
    if steps_per_epoch and steps_per_epoch > 1:
        steps = min(steps, steps_per_epoch - 1)  # after the last epoch's first step
    return max(1, steps_left - steps)


def unused_path(path):
    """``path``, or path with _2, _3 ... before its suffixes when it exists: a trace is never
    overwritten (a run resumed twice from one checkpoint profiles the same steps again)."""
    name, dot, suffixes = path.name.partition(".")
    for n in range(2, 1000):
        if not path.exists():
            return path
        path = path.with_name(f"{name}_{n}{dot}{suffixes}")
    return path


# ---------------------------------------------------------------------------------------------
# All of them, as the loop sees them.

class Monitors:
    """The parts a run asked for, entered by ``fit`` once the run ID and first epoch are known.
    ``Monitors()`` is all off (tools/benchmark.py's timed steps)."""

    def __init__(self, ctx=None, log=None, run_id=None, last_record=None, resumed=False, steps_left=None,
                 steps_per_epoch=None, tensorboard=None, profile_dir=None, profile_skip=0, profile_steps=0):
        self.ctx, self.log = ctx, log
        self.tensorboard_dir = tensorboard  # --tensorboard DIR, or None
        self.profile_dir, self.profile_skip, self.profile_steps = profile_dir, profile_skip, profile_steps
        self.run_id, self.last_record, self.resumed = run_id, last_record, resumed  # last_record: the checkpoint's
        self.steps_left = steps_left  # training steps this process has to go (None: as many as asked)
        self.steps_per_epoch = steps_per_epoch
        self.sampler = self.tensorboard = self.profile = None
        self.stack = ExitStack()

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self.stack.close()  # the sampler's thread, a writer: nothing left running
            raise
        return self

    def _start(self):
        if self.ctx is None:
            return
        ctx = self.ctx
        read, why_not = nvml_reader(ctx.device)
        if read is not None:
            self.sampler = self.stack.enter_context(GpuSampler(read))
        if ctx.device.type == "cuda":
            self.log.info("GPU utilization and power: " + (f"sampled every {GPU_SAMPLE_INTERVAL_S:g} s by NVML, "
                                                            "means per epoch in the metrics" if read else why_not))
        if self.tensorboard_dir and ctx.is_main:
            # A resume rewrites the checkpoint's last epoch: a process killed between its
            # checkpoint and its TensorBoard event would otherwise leave that epoch out.
            from engine.tensorboard_log import TensorBoardLog
            first_epoch = self.last_record["epoch"] if self.last_record else 1
            self.tensorboard = TensorBoardLog(self.tensorboard_dir, self.run_id, first_epoch, self.resumed,
                                              self.log.info)
            self.stack.callback(self.tensorboard.close)
            if self.last_record:
                self.tensorboard.add(self.last_record)
            self.log.info(f"TensorBoard: {self.tensorboard.path} (view: tensorboard --logdir {self.tensorboard_dir})")
        if self.profile_dir:
            skip = fitted_skip(self.profile_skip, self.profile_steps, self.steps_left, self.steps_per_epoch)
            to_go = count(self.steps_left or 0, "training step", "training steps")
            if skip is None or self.steps_per_epoch == 1:
                why = ("each epoch has one training step, and a window never spans two epochs"
                       if skip is not None else f"this run has {to_go} to go, and the first is never profiled "
                                                "(it autotunes and compiles)")
                self.log.info(f"Profiler: no trace: {why}")
                return
            self.profile = ProfileWindow(self.profile_dir, skip, self.profile_steps, ctx, self.run_id, self.log,
                                         self.steps_per_epoch)
            self.stack.callback(self.profile.end_of_training_phase)  # a stop or an error: what was recorded
            self.stack.callback(self._no_trace_said)
            moved = (f" (--profile-skip {self.profile_skip} moved to {skip}: this run has {to_go} to go)"
                     if skip != self.profile_skip else "")
            self.log.info(f"Profiler: {self.profile_steps} training steps after the first {skip} of this process"
                          f"{moved}, traces in {self.profile_dir}")

    def _no_trace_said(self):
        if self.profile.where is None:  # stopped (a signal, an error, early stopping) before the window
            taken = count(self.profile.taken, "training step", "training steps")
            self.log.info(f"Profiler: no trace written: the run ended after {taken} of this process, before the "
                          f"window's first (after {self.profile.skip})")

    def __exit__(self, *exc):
        self.stack.close()

    def step(self, epoch, step):
        if self.profile is not None:
            self.profile.step(epoch, step)

    def end_of_training_phase(self, start, end):
        """The metrics line's fields for the training phase from ``start`` to ``end``
        (perf_counter seconds): its GPU utilization and power (a gather over the control
        group, a few hundred bytes, on every rank) and whether the profiler recorded in it
        (its steps ran slower), after writing that profile."""
        window = self.sampler.window(start, end) if self.sampler else GpuWindow(None, None, 0)
        windows = gather_objects(window, self.ctx.control_group) if self.ctx is not None else [window]
        profiled = self.profile.end_of_training_phase() if self.profile is not None else False
        return {**gpu_fields(windows), "profiled": profiled}

    def record(self, record):
        if self.tensorboard is not None:
            self.tensorboard.add(record)
