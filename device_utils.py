"""Device and process-group setup, so the training code never looks at environment variables.

A process learns who it is from the variables torchrun sets: RANK (global, 0..WORLD_SIZE-1),
LOCAL_RANK (index on this node, which GPU to use), WORLD_SIZE and LOCAL_WORLD_SIZE. Global
rank 0 is the one process that prints and writes files; local rank only picks the GPU.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


class UserError(Exception):
    """A mistake in the command line, the environment or the data: the entry points print it
    as one line and exit with status 2, without a traceback.

    ``same_on_every_rank``: every process hits the same error (a bad flag, say), so only
    global rank 0 prints it. Errors that may strike one node alone (a file missing on its
    disk) set it to False and are printed by every rank that hits them.
    """

    def __init__(self, message, same_on_every_rank=True):
        super().__init__(message)
        self.same_on_every_rank = same_on_every_rank


@dataclass(frozen=True)
class DistContext:
    """Who this process is. ``process_group`` is True when torch.distributed is initialized."""

    device: torch.device
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    process_group: bool = False

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only process that prints and writes files."""
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)


def get_device(local_rank=0) -> torch.device:
    """The GPU of this local rank when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device(f"cuda:{local_rank}")
    return torch.device("cpu")


def env_rank() -> int:
    """Global rank from the environment, for code that runs before the context exists."""
    return _env_int("RANK", 0)


def _env_int(name, default):
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def single_process_context() -> DistContext:
    """For train.py: one process, no process group. Accepts torchrun with one process."""
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size > 1:
        raise UserError(
            f"train.py trains with one process but WORLD_SIZE={world_size}; "
            "use train_ddp.py for several processes (torchrun --nproc_per_node=N train_ddp.py)")
    return DistContext(device=get_device(_env_int("LOCAL_RANK", 0)))


def setup_distributed() -> DistContext:
    """For train_ddp.py: read torchrun's variables, pick this rank's GPU, join the group.

    The GPU is selected before init_process_group so that NCCL binds each rank to its own
    device (otherwise every rank opens a context on cuda:0). nccl on CUDA, gloo on CPU:
    the same code path runs on a laptop and on GH200 nodes.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserError(
            "train_ddp.py must be started by torchrun, e.g. "
            "torchrun --standalone --nproc_per_node=2 train_ddp.py (for one process: python train.py)")
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    device = get_device(local_rank)
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise UserError(
                f"LOCAL_RANK={local_rank} but this node shows only {visible} GPU(s): "
                "--nproc_per_node must not exceed the GPUs per node")
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistContext(device=device, rank=rank, local_rank=local_rank, world_size=world_size,
                       local_world_size=local_world_size, process_group=True)


def cleanup_distributed():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _group_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def broadcast_from_rank0(obj):
    """Rank 0's (picklable) ``obj`` on every rank. Every rank blocks here until rank 0
    arrives, so it doubles as a barrier that carries rank 0's outcome."""
    if not _group_active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum over all ranks (no-op with one process). Enqueued on the GPU stream:
    the host only waits when it reads the result."""
    if _group_active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_buffers(module: torch.nn.Module):
    """Copy rank 0's buffers (BatchNorm running statistics) to every rank.

    DDP broadcasts buffers at the start of each training forward, but every rank then
    updates its running statistics from its own batch, so after the last step they differ.
    Evaluating after this call evaluates exactly the model that rank 0 saves.
    """
    if _group_active():
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


def synchronize(device: torch.device):
    """Wait for queued GPU work, so that a clock read afterwards measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
