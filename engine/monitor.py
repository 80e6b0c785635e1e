"""What a run records about itself besides loss and accuracy, for a user asking where the time
goes: GPU utilization and power per epoch (NVML, sampled in a thread), TensorBoard scalars
(--tensorboard DIR, engine/tensorboard_log.py), and a torch.profiler window of a few training
steps (--profile-dir DIR, engine/profiling.py).

The loop (train_utils.py) sees one object, ``Monitors``: ``step()`` after each training step
(with --profile-dir only), ``end_of_training_phase(start, end)`` once per epoch,
``record(record)`` with each epoch's metrics; a CPU run without --tensorboard or
--profile-dir has none, and does not import this module. Each part is off unless asked for
(or, for NVML, unless there is a GPU and pynvml), and costs nothing per step then: no
profiler, no writer, no thread. Only global rank 0 prints and writes TensorBoard events;
every rank samples its own GPU and writes its own trace.

The optional packages (tensorboard, pynvml from nvidia-ml-py) are imported only here and only
when used; the NGC PyTorch container has both.
"""

import threading
import time
import warnings
from contextlib import ExitStack
from typing import NamedTuple, Optional

import torch

from engine.errors import first_line
from engine.log import count
from engine.processes import gather_objects

GPU_SAMPLE_INTERVAL_S = 1.0  # NVML's utilization counter is itself an average over up to 1 s
NVML_PIP = "pip install nvidia-ml-py"

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
# All of them, as the loop sees them.

class Monitors:
    """The parts a run asked for, entered by ``fit`` once the run ID and first epoch are known.
    ``Monitors()`` is all off. A run with nothing to watch (no GPU, no --tensorboard, no
    --profile-dir) builds none (train_utils.monitors): its records get log.UNWATCHED."""

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
            from engine.profiling import ProfileWindow, fitted_skip, window_length
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
            length = window_length(skip, self.profile_steps, self.steps_left, self.steps_per_epoch) or \
                self.profile_steps  # 0: the run ends first, and says so (_no_trace_said)
            short = (f" (of --profile-steps {self.profile_steps}: the window ends with the epoch)"
                     if length < self.profile_steps else "")
            self.log.info(f"Profiler: {count(length, 'training step', 'training steps')}{short} after the first "
                          f"{skip} of this process{moved}, traces in {self.profile_dir}")

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
