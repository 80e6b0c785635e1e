"""--profile-dir: a torch.profiler window of a few training steps of each rank, written as a
trace (Perfetto, TensorBoard), and the top operators printed by global rank 0. Imported by
engine/monitor.py's Monitors only when --profile-dir is given.
"""

import os
import time
from pathlib import Path
from typing import NamedTuple

import torch

from engine.errors import space_warning
from engine.log import count
from engine.processes import synchronize

TOP_OPERATORS = 15  # rows of the profiler's table in the log


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


def kernel_times(events):
    """(computation ms, communication ms, count) of the GPU's own operations among a profiler's
    ``events()`` (kernels, and the copies and fills it runs): what the GPU itself ran. Host operators' self device time leaves some kernels
    out (on an H200 an eager step's operators accounted for 61% of its wall time, its kernels for
    97%), and kernels replayed from a CUDA graph have no operator at all."""
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    communication_us = sum(e.device_time for e in kernels if is_communication(e.name))
    compute_us = sum(e.device_time for e in kernels) - communication_us
    return compute_us / 1e3, communication_us / 1e3, len(kernels)


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
    if not cuda:  # kineto's lines, none of them news on a CPU: an ERROR at the first trace that it found
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no GPU, and (newer kineto) a USDT line at each start, stop
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
            times = top_operators(profiler.key_averages(), device_time=cuda)
            if cuda:  # how busy the GPU was: from its kernels, not the operators that launched them
                compute_ms, communication_ms, _ = kernel_times(profiler.events())
                times = times._replace(compute_ms=compute_ms, communication_ms=communication_ms)
            for line in operator_table(times, steps, self.wall_ms, "GPU" if cuda else "CPU"):
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


def window_length(skip, steps, steps_left, steps_per_epoch=None):
    """The training steps ProfileWindow records after the first ``skip`` of the ``steps_left``
    this process trains: ``steps``, or fewer where the epoch or the run ends first (a window
    never spans two epochs, and never starts after an epoch's last step)."""
    if steps_left is None:
        return steps
    after = max(skip, 1)  # the window opens after this process's step ``after``
    if not steps_per_epoch:
        return max(0, min(steps, steps_left - after))
    done = -steps_left % steps_per_epoch  # steps of the first epoch trained before this process (a resume)
    if (done + after) % steps_per_epoch == 0:  # an epoch's last step: the window opens after the next one
        after += 1
    in_epoch = (done + after - 1) % steps_per_epoch + 1  # the step ``after`` within its epoch
    return max(0, min(steps, steps_per_epoch - in_epoch, steps_left - after))


def unused_path(path):
    """``path``, or path with _2, _3 ... before its suffixes when it exists: a trace is never
    overwritten (a run resumed twice from one checkpoint profiles the same steps again)."""
    name, dot, suffixes = path.name.partition(".")
    for n in range(2, 1000):
        if not path.exists():
            return path
        path = path.with_name(f"{name}_{n}{dot}{suffixes}")
    return path
