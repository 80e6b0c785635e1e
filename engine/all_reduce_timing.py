"""Timed all-reduces that never hang and never abort the process: check_network.py's. The
host launches each all-reduce without waiting for it (on GPUs), waits for the oldest once
QUEUED_AHEAD are queued, and with NCCL's blocking wait (NCCL_ERRORS_RAISE) an NCCL error or
a timeout raises in that wait, where NCCL's watchdog would abort the process (SIGABRT).
The Clock times each all-reduce with CUDA events on GPUs, the host's clock on CPUs.
"""

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.lost_ranks import is_collective_failure

# NCCL's errors as exceptions in the host's wait (Work.wait), not an abort by its watchdog
# thread, which blocking wait does not start: set before the process group is created. In the
# libraries of PyTorch 2.7 to 2.14 (tests/test_resilience.py).
NCCL_ERRORS_RAISE = {"TORCH_NCCL_BLOCKING_WAIT": "1"}

# All-reduces the host queues ahead of its wait for the oldest (host_wait): enough to keep the
# GPU busy through blocking wait's polls (1 ms apart), few enough (~20 commands each) that
# a lost peer, whose all-reduce never ends, is seen within --collective-timeout of it before
# CUDA's launch queue (~1000 commands) fills and blocks the host inside a launch.
QUEUED_AHEAD = 16


def start_all_reduce(tensor, timeout_s):
    """Start the in-place all-reduce (sum) of ``tensor``; returns its Work. On GPUs the current
    stream waits for it (the future's wait is a stream dependency; the host goes on). On gloo
    the host waits (host_wait): gloo reduces in a thread of its own, and the next iteration's
    refill must not overwrite the buffer under it."""
    work = dist.all_reduce(tensor, async_op=True)
    if tensor.is_cuda:
        work.get_future().wait()
    else:
        host_wait(work, timeout_s)
    return work


def host_wait(work, timeout_s):
    """The host's wait for ``work`` and every all-reduce queued before it (one NCCL stream runs
    them in order). An error (a lost peer, a network fault; on NCCL thanks to
    NCCL_ERRORS_RAISE) or ``timeout_s`` seconds since ``work`` was queued without its end
    raise here (DistBackendError, gloo's RuntimeError), which process_group_scope turns into
    one line and status 5."""
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as err:
        if is_collective_failure(err) or "timed out" not in str(err):
            raise
        # c10d's own "Operation timed out!" (gloo's Work): a collective's failure all the same
        raise dist.DistError(f"all-reduce not finished after {timeout_s:g} s") from None


def wait_for_device(event, timeout_s, what):
    """Wait for a CUDA event without blocking in CUDA: a synchronize() on a communicator whose
    peer stopped responding would wait forever. After host_wait the event is moments away;
    should blocking wait not be in effect, this poll still ends after ``timeout_s`` in a
    RuntimeError that process_group_scope turns into one line naming the lost ranks."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise RuntimeError(f"NCCL {what} timed out: not finished after {timeout_s:g} s")
        time.sleep(1e-4)


class Clock:
    """Times each iteration's all_reduce: CUDA events on GPUs (read once, after the last
    iteration), the host's clock around gloo's all-reduce and the host's wait for it on CPUs.
    On GPUs the small sizes' times include the host's launch of the all-reduce
    (microseconds), which nccl-tests hides by queueing iterations back to back."""

    def __init__(self, device, iterations, timeout_s):
        self.cuda, self.timeout_s = device.type == "cuda", timeout_s
        if self.cuda:
            self.events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                           for _ in range(iterations)]
        self.seconds = [0.0] * iterations

    def start(self, i):
        if self.cuda:
            self.events[i][0].record()
        else:
            self.seconds[i] = time.perf_counter()

    def stop(self, i):
        if self.cuda:
            self.events[i][1].record()
        else:
            self.seconds[i] = time.perf_counter() - self.seconds[i]

    def read(self) -> list:
        """Seconds per iteration; waits for the device."""
        if self.cuda:
            wait_for_device(self.events[-1][1], self.timeout_s, "all-reduce")
            self.seconds = [start.elapsed_time(stop) / 1e3 for start, stop in self.events]
        return self.seconds
