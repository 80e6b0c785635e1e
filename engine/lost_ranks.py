"""When a rank is lost: a collective that timed out (a rank frozen by a stuck file system, a
hung GPU, SIGSTOP) or lost its peer (a rank killed). Instead of a traceback on every rank,
or a hang until the time limit, the ranks still alive check in through the rendezvous
store and the lowest of them prints one line naming the others, with the host and PID
each registered at start and, for a rank on its own node, how it ended (killed by SIGKILL,
stopped, stuck in the kernel); on GPUs each first writes its NCCL flight recorder.
train_ddp.py runs inside ``process_group_scope``.
"""

import os
import re
import signal
import socket
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch.distributed as dist

from engine.errors import RunAborted, first_line
from engine.interfaces import NetworkSetupError
from engine.nccl_log import refused_network
from engine.private_torch import nccl_trace_dumper
from engine.processes import FLIGHT_RECORDER_PREFIX, DistContext, cleanup_distributed, group_active
from engine.stopping import ignore_stop_signals, newest_checkpoint

# After a failed collective: how long the ranks that are alive wait for each other. Under
# torchrun's 30 s grace: torchrun signals the ranks when one dies and kills them 30 s later.
ROLL_CALL_S = 20.0


# What gloo and NCCL say, in a plain RuntimeError, of a collective that timed out or lost a peer.
# "Application timeout caused pair closure": gloo's timeout in DDP's gradient all-reduce, raised
# from backward(), which names neither gloo nor the peer.
COLLECTIVE_FAILURE_TEXTS = ("gloo", "NCCL", "Connection closed by peer", "Connection reset",
                            "Application timeout caused pair closure")


def is_collective_failure(err: BaseException) -> bool:
    """A collective that timed out or lost a peer (gloo or NCCL), as opposed to an error in the
    user's model or data, which also arrive as RuntimeError."""
    dist_error = getattr(dist, "DistError", ())
    return isinstance(err, dist_error) or (isinstance(err, RuntimeError) and
                                           any(text in str(err) for text in COLLECTIVE_FAILURE_TEXTS))


def _store():
    return dist.distributed_c10d._get_default_store()  # private, but in PyTorch 2.7 to 2.15


def register(ctx: DistContext):
    """Publish where this rank runs ("HOST PID") in the rendezvous store, so that the ranks
    still alive can name it if it is lost. One small write per rank at start."""
    if ctx.world_size > 1:
        _store().set(f"rank-at/{ctx.rank}", f"{socket.gethostname()} {os.getpid()}")


class Whereabouts(NamedTuple):
    host: str
    pid: int


def whereabouts(store, rank):
    """Where ``rank`` registered (Whereabouts), or None when it never did."""
    try:
        if not store.check([f"rank-at/{rank}"]):
            return None
        host, pid = store.get(f"rank-at/{rank}").decode().split()
        return Whereabouts(host, int(pid))
    except Exception:  # an unreachable store, a garbled entry: the rank is named without them
        return None


def fate(at: Whereabouts, proc="/proc"):
    """How the rank at ``at`` ended, seen from its own node: 'killed by SIGKILL', 'exited with
    status 1', 'is stopped (SIGSTOP or a debugger)', 'is stuck in the kernel (state D: a file
    system or driver call)', 'has exited' (its exit status already collected by torchrun), or
    None: it runs elsewhere, or runs here and may yet answer. A dead rank's exit status is in
    /proc/PID/stat (field 52) until torchrun collects it, a tenth of a second later."""
    if at is None or at.host != socket.gethostname():
        return None
    try:
        with open(f"{proc}/{at.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after "(command)", which may hold spaces
    except (FileNotFoundError, ProcessLookupError):
        return "has exited"
    except OSError:
        return None
    state = fields[0]
    if state in "ZX":
        status = int(fields[49]) if len(fields) > 49 else None  # field 52 of the line: the wait(2) status
        if status is None:
            return "has exited"
        number = status & 0x7F
        if number:
            why = " (the kernel's out-of-memory killer sends it, and kill -9)" if number == signal.SIGKILL else ""
            return f"was killed by {signal_name(number)}{why}"
        return f"exited with status {status >> 8}"
    if state in "Tt":
        return "is stopped (SIGSTOP or a debugger)"
    if state == "D":
        return "is stuck in the kernel (state D: a file system or driver call)"
    return None


def signal_name(number):
    """SIGKILL for 9; 'signal 40' for one without a name (a real-time signal)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# The roll call looks every 10 ms for this long, then every 0.2 s: a dead rank's exit status is
# in /proc only until torchrun collects it (it looks every 0.1 s).
FAST_POLL_S = 1.0


def roll_call(ctx: DistContext, wait_s: float):
    """After a failed collective: the ranks that did not check in within ``wait_s`` seconds,
    through the rendezvous store (which lives in torchrun, not in any rank), each with its
    Whereabouts, its fate and whether it said why it ended. The ranks that are alive hit the
    same failure at about the same time; the call returns as soon as every missing rank is
    seen dead. None when the store is gone too."""
    try:
        store = _store()
        store.set_timeout(timedelta(seconds=wait_s))  # not the group's: an unreachable store fails fast
        store.set(f"roll-call/{ctx.rank}", "alive")
        start = time.monotonic()
        known = {}  # rank -> MissingRank: where it ran is read once, how it ended until it is known
        while True:
            missing = [rank for rank in range(ctx.world_size) if not store.check([f"roll-call/{rank}"])]
            for rank in missing:
                seen = known.get(rank) or MissingRank(rank, whereabouts(store, rank))
                if seen.fate is None or seen.fate.startswith("is "):  # not yet known to be gone
                    seen = seen._replace(fate=fate(seen.at))
                known[rank] = seen._replace(said=store.check([f"said/{rank}"]))
            lost = [known[rank] for rank in missing]
            if not missing or all(rank.gone for rank in lost) or time.monotonic() - start >= wait_s:
                return lost
            time.sleep(0.01 if time.monotonic() - start < FAST_POLL_S else 0.2)
    except Exception:  # the store's host is gone: nobody can be asked
        return None


def said_why(ctx: DistContext):
    """Mark in the store that this rank ends with an error it reports itself (its one line, or
    Python's traceback): the ranks that lose it then add nothing. Best effort."""
    if ctx.world_size > 1:
        try:
            _store().set(f"said/{ctx.rank}", "1")
        except Exception:  # the store is gone: the others then name this rank themselves
            pass


class MissingRank(NamedTuple):
    rank: int
    at: Whereabouts = None  # where it registered, when it did
    fate: str = None        # how it ended, when seen from its node (fate)
    said: bool = False      # it marked that it reports its own error (said_why)

    @property
    def gone(self):
        """Seen dead on this node. A rank that said why but lives on (it waits for rank 0 to
        print first, engine/cli.py) is waited for: leaving first would have torchrun stop it
        before its line."""
        return self.fate is not None and not self.fate.startswith("is ")

    def describe(self):
        where = f" (pid {self.at.pid} on {self.at.host})" if self.at else ""
        how = self.fate or "stopped responding"
        if how == "has exited":  # collected by torchrun before it was read, and it said nothing
            how = ("died without a word: killed (SIGKILL: the kernel's out-of-memory killer, kill -9) or crashed in "
                   "native code")
        return f"rank {self.rank}{where} {how}"


class RanksLost(RunAborted):
    """A collective timed out or lost a peer. The entry point exits at once after printing it
    (os._exit): destroying the process groups on the way out could hang on a hung NCCL
    communicator, or in PyTorch 2.7's gloo destructor (see cleanup_distributed)."""

    exit_at_once = True


def dump_flight_recorder(directory, rank):
    """This rank's NCCL flight recorder (its last collectives) as DIR/nccl_trace_rank_N, the
    file NCCL's watchdog writes on its own timeout, which the gloo group's timeout comes
    before. Best effort (engine/private_torch.py): the path, or None."""
    dump = nccl_trace_dumper()
    if dump is None or directory is None:
        return None
    try:
        path = Path(directory) / f"{FLIGHT_RECORDER_PREFIX}{rank}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(dump())
        return path
    except Exception:  # no NCCL group, nothing recorded, a file system in trouble
        return None


def training_stopped(lost, trace, checkpoint_dir=None):
    """train_ddp.py's RanksLost for the LostRanks ``lost``, with the flight recorder ``trace``
    and what the run's ``checkpoint_dir`` keeps."""
    traces = f"; NCCL flight recorder in {trace.parent}/{FLIGHT_RECORDER_PREFIX}*" if trace else ""
    return RanksLost(f"{lost.message}: stopping every rank; {kept_checkpoints(checkpoint_dir)}{traces}",
                     same_on_every_rank=not lost.printed_here, silent=lost.spoke)


def kept_checkpoints(checkpoint_dir):
    """What a run that ends now keeps, in words: never a --resume where there is nothing to resume."""
    if not checkpoint_dir:
        return "nothing is saved (no --checkpoint-dir)"
    newest = newest_checkpoint(checkpoint_dir)
    if newest is None:
        return f"no checkpoint was written yet (--checkpoint-dir {checkpoint_dir})"
    return f"the checkpoints written so far are kept (newest: {newest}), continue with --resume"


@contextmanager
def process_group_scope(ctx: DistContext, timeout_min: float, trace_dir=None, lost_error=training_stopped):
    """The process group's life in an entry point: destroyed at the end, also after an error.

    A collective that timed out or lost a peer becomes one line naming the ranks that stopped
    responding (``lost_error(lost, trace, trace_dir)``: RanksLost, exit status 3, for training), printed
    by the lowest rank still alive, instead of a traceback on every rank. On GPUs each rank
    first writes its NCCL flight recorder into ``trace_dir`` (the checkpoint folder), when
    given. Nothing else is written and the group is not destroyed: the checkpoints so far
    are the run's."""
    try:
        register(ctx)
        yield
    except RuntimeError as err:
        # NCCL_NET's network refused by a lazily made NCCL group:
        refused = refused_network(str(err), socket.gethostname(), os.environ.get("NCCL_NET"))
        if refused or not group_active() or not is_collective_failure(err):
            cleanup_distributed()
            if refused:
                raise NetworkSetupError(refused, same_on_every_rank=False) from None
            raise
        ignore_stop_signals()  # torchrun signals the ranks left when one dies: the roll call and its line first
        trace = dump_flight_recorder(trace_dir, ctx.rank) if ctx.device.type == "cuda" else None
        raise lost_error(who_is_lost(err, ctx, timeout_min), trace, trace_dir) from None
    except BaseException:
        said_why(ctx)  # before the group goes: the others learn of this rank's end through it
        cleanup_distributed()
        raise
    cleanup_distributed()


class LostRanks(NamedTuple):
    message: str        # 'rank 1 (pid 3564 on node-1) was killed by SIGKILL (...; --collective-timeout 0.1 min)'
    printed_here: bool  # this rank prints it: the lowest rank still alive (every rank when unknown)
    spoke: bool = False  # every lost rank reported its own error (said_why): nobody prints this one


NAMED_AT_MOST = 4  # the lost ranks named one by one; the others are counted


# PyTorch's text for an NCCL collective that timed out, also in blocking wait, where no watchdog
# runs, and with the group's timeout where the wait had its own (check_network.py).
NCCL_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout: WorkNCCL\(.*?OpType=(\w+).*?\) ran for "
                          r"(\d+) milliseconds before timing out")


def short_timeout(reason):
    """'NCCL ALLREDUCE timed out after 300.0 s' for PyTorch's NCCL timeout text; else ``reason``."""
    match = NCCL_TIMEOUT.search(reason)
    return f"NCCL {match[1]} timed out after {int(match[2]) / 1000:.1f} s" if match else reason


def who_is_lost(err, ctx: DistContext, timeout_min: float) -> LostRanks:
    """After the collective failure ``err``: a roll call (up to ROLL_CALL_S) and the line that
    names the ranks that did not answer, where they ran and how they ended, with the first
    sentence of the error."""
    lost = roll_call(ctx, min(ROLL_CALL_S, timeout_min * 60))
    reason = first_line(err)
    reason = reason.split("] ", 1)[-1] if reason.startswith("[") else reason  # gloo's "[file.cc:78] "
    reason = short_timeout(reason.split(". ", 1)[0].rstrip(".")[:300])[:200]  # the first sentence: gloo goes on
    if lost:
        who = "; ".join(rank.describe() for rank in lost[:NAMED_AT_MOST])
        who += f"; and {len(lost) - NAMED_AT_MOST} more rank(s) stopped responding" if len(lost) > NAMED_AT_MOST else ""
    else:
        who = ("every rank is alive but a collective failed" if lost == []
               else "a collective failed and the rendezvous store cannot be reached")
    missing = [rank.rank for rank in lost or []]
    alive = [rank for rank in range(ctx.world_size) if rank not in missing]
    return LostRanks(f"{who} ({reason}; --collective-timeout {timeout_min:g} min)",
                     printed_here=lost is None or ctx.rank == alive[0],
                     spoke=bool(lost) and all(rank.said for rank in lost))
