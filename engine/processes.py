"""Who this process is and how the processes agree: its place among them (DistContext, made
by device_utils from torchrun's variables, which engine/cli.py reads) and the small
collectives the engine uses (rank 0 decides, every rank gets the answer). Everything here is a no-op with one process and needs no GPU: the agreements travel
over the gloo control group.
"""

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.errors import UserError

DEFAULT_COLLECTIVE_TIMEOUT_MIN = 10.0  # NCCL's own default; gloo's is 30 minutes


# NCCL's flight recorder of each rank (its last collectives), dumped on a hang as PREFIX + the rank.
FLIGHT_RECORDER_PREFIX = "nccl_trace_rank_"

NCCL_TIMEOUT_MARGIN_MIN = 1.0  # NCCL waits this much longer than the gloo group, which names the rank


PATIENT_WAIT = timedelta(days=1)  # waits for rank 0's one-off work (a download, a decode): the job's limit bounds them


@dataclass(frozen=True)
class DistContext:
    """Who this process is. ``process_group`` is True when torch.distributed is initialized."""

    device: torch.device
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    process_group: bool = False
    control_group: object = None  # gloo group for small CPU-side collectives (None: the default group)
    launcher_pid: int = None      # torchrun's process, the parent of this one (None: not started by torchrun)

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only process that prints and writes files."""
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)


def available_cores() -> int:
    """CPU cores this process may run on (its Slurm allocation's, not the node's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def synchronize(device: torch.device):
    """Wait for queued GPU work, so that a clock read afterwards measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# PyTorch 2.7's gloo process group joins its worker threads in its destructor while holding
# the GIL (fixed in 2.8, pytorch/pytorch#154976). A worker still freeing the tensors of the
# last collective (all_gather_object's) needs the GIL for them: the process hangs in
# destroy_process_group, at the end of a run. Half a second with the GIL released lets the
# workers finish first (it struck 2 of 4 runs of
# tests/test_resilience.py's 2-process tests on 2.7.1 here, and none with the pause).
GLOO_SETTLE_S = 0.5


def cleanup_distributed():
    if not group_active():
        return
    if torch.__version__ < "2.8":  # TorchVersion compares as a version: 2.8.0a0 counts as before 2.8
        time.sleep(GLOO_SETTLE_S)
    dist.destroy_process_group()


def group_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def broadcast_from_rank0(obj, group=None):
    """Rank 0's (picklable) ``obj`` on every rank. Every rank blocks here until rank 0
    arrives, so it doubles as a barrier that carries rank 0's outcome. Pass the gloo control
    group to keep the GPU out of it."""
    if not group_active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def from_rank0(decide, group=None, patient=False):
    """Call ``decide()`` on global rank 0 only; every rank returns its result, or raises the
    UserError it raised, once rank 0 is done. For what one process must decide or do for all
    (which checkpoint to load, writing a file) while the others wait.

    ``patient``: rank 0's work may take longer than --collective-timeout (a download, decoding
    an image folder, a user's data code): the others wait for it in a barrier of its own
    (gloo's monitored_barrier) with a deadline of PATIENT_WAIT, when ``group`` is gloo."""
    outcome = None
    if not group_active() or dist.get_rank() == 0:
        try:
            outcome = (True, decide())
        except UserError as err:
            outcome = (False, err)
    if patient and group_active() and dist.get_backend(group) == "gloo":
        dist.monitored_barrier(group=group, timeout=PATIENT_WAIT)
    ok, value = broadcast_from_rank0(outcome, group)
    if not ok:
        raise value
    return value


def max_over_ranks(value: int, group=None) -> int:
    """The largest of every rank's ``value``, on every rank. A one-element all-reduce of a CPU
    tensor (pass the gloo control group): no GPU sync, a few tens of microseconds."""
    return PendingMax(value, group).result() if group_active() else value


class PendingMax:
    """A max_over_ranks under way: creating it launches the all-reduce and returns at once;
    ``result`` waits for it (by then usually long finished) and reads it."""

    def __init__(self, value: int, group=None):
        self.tensor = torch.tensor([int(value)])
        self.work = dist.all_reduce(self.tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def result(self) -> int:
        self.work.wait()
        return int(self.tensor.item())


def any_rank(flag: bool, group=None) -> bool:
    """True on every rank when ``flag`` is True on any rank (see max_over_ranks)."""
    return bool(max_over_ranks(int(flag), group))


def gather_objects(obj, group=None) -> list:
    """Every rank's picklable ``obj``, in rank order, on every rank."""
    if not group_active():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def all_reduce(tensor: torch.Tensor, op="sum") -> torch.Tensor:
    """In-place "sum" or "min" over all ranks (no-op with one process). Enqueued on the GPU
    stream: the host only waits when it reads the result."""
    if group_active():
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN}[op])
    return tensor


