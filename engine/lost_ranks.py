"""When a rank is lost: a collective that timed out (a rank frozen by a stuck file system, a
hung GPU, SIGSTOP) or lost its peer (a rank killed). Instead of a traceback on every rank,
or a hang until the time limit, the ranks still alive check in through the rendezvous
store and the lowest of them prints one line naming the others; on GPUs each first writes
its NCCL flight recorder. train_ddp.py runs inside ``process_group_scope``.
"""

import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from engine.errors import RunAborted, first_line
from engine.processes import DistContext, cleanup_distributed, group_active

ROLL_CALL_S = 30.0  # after a failed collective: how long the ranks that are alive wait for each other


def is_collective_failure(err: BaseException) -> bool:
    """A collective that timed out or lost a peer (gloo or NCCL), as opposed to an error in the
    user's model or data, which also arrive as RuntimeError."""
    dist_error = getattr(dist, "DistError", ())
    text = str(err)
    return isinstance(err, dist_error) or (isinstance(err, RuntimeError) and (
        "gloo" in text or "NCCL" in text or "Connection closed by peer" in text or "Connection reset" in text))


def roll_call(ctx: DistContext, wait_s: float):
    """After a failed collective: the ranks that did not check in within ``wait_s`` seconds,
    through the rendezvous store (which lives in torchrun, not in any rank). The ranks that
    are alive hit the same failure at about the same time. None when the store is gone too."""
    try:
        store = dist.distributed_c10d._get_default_store()  # private, but in PyTorch 2.7 to 2.15
        store.set_timeout(timedelta(seconds=wait_s))  # not the group's: an unreachable store fails fast
        store.set(f"roll-call/{ctx.rank}", "alive")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [rank for rank in range(ctx.world_size) if not store.check([f"roll-call/{rank}"])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.2)
    except Exception:  # the store's host is gone: nobody can be asked
        return None


class RanksLost(RunAborted):
    """A collective timed out or lost a peer. The entry point exits at once after printing it
    (os._exit): destroying the process groups on the way out could hang on a hung NCCL
    communicator, or in PyTorch 2.7's gloo destructor (see cleanup_distributed)."""

    exit_at_once = True


def dump_flight_recorder(directory, rank):
    """This rank's NCCL flight recorder (its last collectives) as DIR/nccl_trace_rank_N, the
    file NCCL's watchdog writes on its own timeout, which the gloo group's timeout comes
    before. Best effort (a private API, in PyTorch 2.7 to 2.15): the path, or None."""
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if dump is None or directory is None:
        return None
    try:
        path = Path(directory) / f"nccl_trace_rank_{rank}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(dump())
        return path
    except Exception:  # no NCCL group, nothing recorded, a file system in trouble
        return None


def training_stopped(lost, trace):
    """train_ddp.py's RanksLost for the LostRanks ``lost``, with the flight recorder ``trace``."""
    traces = f"; NCCL flight recorder in {trace.parent}/nccl_trace_rank_*" if trace else ""
    return RanksLost(f"{lost.message}: stopping every rank; the checkpoints written so far are kept, continue "
                     f"with --resume{traces}", same_on_every_rank=not lost.printed_here)


@contextmanager
def process_group_scope(ctx: DistContext, timeout_min: float, trace_dir=None, lost_error=training_stopped):
    """The process group's life in an entry point: destroyed at the end, also after an error.

    A collective that timed out or lost a peer becomes one line naming the ranks that stopped
    responding (``lost_error(lost, trace)``: RanksLost, exit status 3, for training), printed
    by the lowest rank still alive, instead of a traceback on every rank. On GPUs each rank
    first writes its NCCL flight recorder into ``trace_dir`` (the checkpoint folder), when
    given. Nothing else is written and the group is not destroyed: the checkpoints so far
    are the run's."""
    try:
        yield
    except RuntimeError as err:
        if not group_active() or not is_collective_failure(err):
            cleanup_distributed()
            raise
        trace = dump_flight_recorder(trace_dir, ctx.rank) if ctx.device.type == "cuda" else None
        raise lost_error(who_is_lost(err, ctx, timeout_min), trace) from None
    except BaseException:
        cleanup_distributed()
        raise
    cleanup_distributed()


class LostRanks(NamedTuple):
    message: str        # 'rank(s) [1] stopped responding (Timed out ...; --collective-timeout 0.1 min)'
    printed_here: bool  # this rank prints it: the lowest rank still alive (every rank when unknown)


def who_is_lost(err, ctx: DistContext, timeout_min: float) -> LostRanks:
    """After the collective failure ``err``: a roll call (up to ROLL_CALL_S) and the line that
    names the ranks that did not answer, with the first sentence of the error."""
    missing = roll_call(ctx, min(ROLL_CALL_S, timeout_min * 60))
    reason = first_line(err)
    reason = reason.split("] ", 1)[-1] if reason.startswith("[") else reason  # gloo's "[file.cc:78] "
    reason = reason.split(". ", 1)[0].rstrip(".")[:200]  # the first sentence: gloo goes on with advice
    who = (f"rank(s) {missing} stopped responding" if missing
           else "every rank is alive but a collective failed" if missing == []
           else "a collective failed and the rendezvous store cannot be reached")
    alive = [rank for rank in range(ctx.world_size) if rank not in (missing or [])]
    return LostRanks(f"{who} ({reason}; --collective-timeout {timeout_min:g} min)",
                     printed_here=missing is None or ctx.rank == alive[0])
