"""Check the network that training uses, in seconds, before a job spends its allocation on it:
all-reduces of every message size from --min-size to --max-size (doubling), on the backend
and devices training uses (NCCL on GPUs, gloo on CPUs, chosen by device_utils exactly as
train_ddp.py chooses them), each result checked element by element, and a table of time,
algbw and busbw per size (nccl-tests' definitions). Start it with torchrun:

    torchrun --standalone --nproc_per_node=4 check_network.py            # the 4 GPUs of one node
    torchrun --standalone --nproc_per_node=2 check_network.py --max-size 64M   # 2 CPU processes (gloo)
    srun --ntasks-per-node=1 apptainer exec --nv --bind ... "$CONTAINER_PATH" \\
        torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=HEAD:29500 \\
        --rdzv_id="$SLURM_JOB_ID" check_network.py --min-busbw 50     # 2 nodes, as multinode_job.sh runs it
    sbatch --account=nnXXXXk multinode_job.sh    # runs it before training (NETWORK_CHECK=0 skips it)
    python check_network.py --interfaces          # GLOO_/NCCL_SOCKET_IFNAME against this node's interfaces

Data: element i on rank r holds (r + 1) * ((i % 7) + 1), integers in float32 (the gradients'
dtype), so the sum over W ranks is exactly ((i % 7) + 1) * W(W + 1) / 2 in any order of
addition (every partial sum stays below 2**24). Every warm-up and timed iteration refills
the buffer (all_reduce works in place) and compares all of its elements with the expected
sums; the comparisons stay on the device and are read once per size.

Timing: CUDA events around each all_reduce on GPUs (launched with async_op=True, then its
future's wait, which only makes the current stream wait: the host never waits inside the
timed span), the clock around gloo's all-reduce on CPUs. A size's time is the mean over its
timed iterations, then the maximum over ranks: the slowest rank sets the pace of a
collective, as it sets training's. algbw = bytes / time, busbw = algbw * 2(W - 1)/W (what
each rank's link carries in a ring all-reduce, comparable across world sizes; n/a for one
process), in GB/s = 1e9 bytes/s. The verdict also gives the
largest size's busbw from the mean over ranks, which nccl-tests reports by default.

Repeats: then --repeat all-reduces of 1 MiB (where NCCL 2.27.3 and later corrupt results now
and then on GH200 + Slingshot with the OFI plugin, NVIDIA/nccl issue 2001) and of 25 MiB
(DDP's gradient bucket), each checked: a fault that strikes one call in tens shows here.

Network: on GPUs each rank writes NCCL's log (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET)
into a temporary folder on local disk, unless NCCL_DEBUG_FILE is set (then that file is
read), and rank 0 reports what NCCL chose: the aws-ofi-nccl (Libfabric) plugin over
Slingshot, or plain TCP sockets when the plugin was not found, which a multi-node run
states as a WARNING. The temporary logs are removed at the end.

Exit status: 0 the check passed; 1 this node's network setup cannot run it (an interface
GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME names that the node lacks, NCCL_NET's plugin not
loading); 2 a bad command line or another setting; 3 an all-reduce
gave a wrong value (one line naming the size, the iterations, the ranks and their hosts);
4 the busbw of the largest size is below --min-busbw; 5 a rank stopped responding or a
collective failed (one line naming the ranks that did not answer). On GPUs the check sets
TORCH_NCCL_BLOCKING_WAIT=1 for itself: NCCL's errors and timeouts then raise in the host's
wait for an all-reduce, as PyTorch documents, which gives status 5, where NCCL's watchdog
would abort the process (SIGABRT) and print C++ stack frames. Training keeps the watchdog.
Under torchrun these are the ranks' statuses; torchrun itself then exits 1.
docs/network.md explains the table.
"""

import argparse
import os
import shutil
import socket
import tempfile
from collections import deque
from typing import NamedTuple

from engine.errors import quiet_interrupt

quiet_interrupt()  # Ctrl-C while torch imports (seconds) ends the command without a traceback

import torch
import torch.distributed as dist

from device_utils import device_name, setup_distributed
from engine.all_reduce_timing import (NCCL_ERRORS_RAISE, QUEUED_AHEAD, Clock, host_wait, start_all_reduce,
                                     wait_for_device)
from engine.bandwidth import ELEMENT_BYTES, bandwidths, human_size, message_sizes, parse_size
from engine.cli import OneLineParser, run_cli
from engine.errors import RunAborted, UserError, first_sentences
from engine.flags import non_negative_int, positive_float, positive_int
from engine.interfaces import check_interfaces, interfaces_line, node_interfaces
from engine.log import count, rank_list
from engine.nccl_log import (describe_network, nccl_debug_file, nccl_log_settings, nccl_report, network_label,
                             network_report, read_nccl_log)
from engine.lost_ranks import process_group_scope
from engine.exact_sums import (DTYPE, check_result, max_world_size, mismatch_message, mismatches, pattern,
                               sum_of_ranks)
from engine.processes import any_rank, gather_objects

DEFAULT_TIMEOUT_MIN = 5.0  # a check that takes seconds should not wait 10 minutes for a lost rank
# The multi-node reference figures, all-reduce of 64 MB between two 4-GH200 nodes (CSCS Alps):
SLINGSHOT_BUSBW_GBPS = 100  # aws-ofi-nccl over Slingshot: ~108 GB/s (1.1 ms)
SOCKETS_BUSBW_GBPS = 5  # NCCL's plain TCP sockets: ~5.4 GB/s
# For the tests only: CHECK_NETWORK_FAULT=RANK:SIZE:ITERATION makes rank RANK add 1 to one
# element of its result of the all-reduce of SIZE bytes (1K, 64M, ...) in iteration
# ITERATION (1 = the first warm-up one), as a corrupting network would.
FAULT_VARIABLE = "CHECK_NETWORK_FAULT"


class TooSlow(UserError):
    """The busbw of the largest size is below --min-busbw."""

    exit_code = 4


NOT_UNDER_TORCHRUN = ("check_network.py must be started by torchrun, e.g. python tools/torchrun.py --standalone "
                      "--nproc_per_node=4 check_network.py")


class CheckLost(UserError):
    """A collective timed out or lost a peer: the check cannot finish. Exits at once, without
    destroying the process group (which can hang on a hung communicator)."""

    exit_code = 5
    exit_at_once = True


class Fault(NamedTuple):
    rank: int
    nbytes: int
    iteration: int  # 1-based, warm-up iterations first


class SizeResult(NamedTuple):
    nbytes: int
    time_s: float  # mean over the timed iterations, maximum over ranks
    algbw: float  # GB/s
    busbw: float | None  # GB/s; None for one process
    wrong: int  # wrong elements over every rank and iteration
    mean_busbw: float | None = None  # GB/s from the mean over ranks (nccl-tests' default); None for one process


# The sizes --repeat all-reduces again and again: NCCL issue 2001's, and DDP's gradient bucket.
REPEATED_SIZES = (2**20, 25 * 2**20)


# ---------------------------------------------------------------------------------------------
# Data and results: small pure functions.


def parse_fault(text) -> Fault | None:
    """CHECK_NETWORK_FAULT's value (tests only), or None when unset."""
    if not text:
        return None
    parts = text.split(":")
    try:
        if len(parts) != 3:
            raise ValueError
        fault = Fault(int(parts[0]), parse_size(parts[1]), int(parts[2]))
    except Exception:
        raise UserError(f"{FAULT_VARIABLE}={text!r} is not RANK:SIZE:ITERATION (a test hook; unset it)") from None
    return fault


# ---------------------------------------------------------------------------------------------
# Printing: the table and the verdict.

COLUMNS = (("size (B)", 11), ("size", 9), ("count", 11), ("time (us)", 11), ("algbw (GB/s)", 13),
           ("busbw (GB/s)", 13), ("wrong", 7))  # "us": plain ASCII in any terminal and Slurm log


def table_header() -> str:
    return "".join(name.rjust(width) for name, width in COLUMNS)


def table_row(result: SizeResult) -> str:
    busbw = "n/a" if result.busbw is None else f"{result.busbw:.2f}"
    cells = (result.nbytes, human_size(result.nbytes), result.nbytes // ELEMENT_BYTES, f"{result.time_s * 1e6:.1f}",
             f"{result.algbw:.2f}", busbw, result.wrong)
    return "".join(str(cell).rjust(width) for cell, (_, width) in zip(cells, COLUMNS))


def verdict(results: list, warmup: int, iters: int, min_busbw) -> str:
    last = results[-1]
    busbw = ("n/a (one process)" if last.busbw is None else
             f"{last.busbw:.2f} GB/s (slowest rank; {last.mean_busbw:.2f} GB/s from the mean over ranks, as nccl-tests "
             "reports it)")
    minimum = f" (--min-busbw {min_busbw:g}, against the slowest rank's)" if min_busbw is not None else ""
    return (f"Network check passed: {count(len(results), 'size', 'sizes')} x ({warmup}+{iters}) all-reduces exact; "
            f"busbw at {human_size(last.nbytes)}: {busbw}{minimum}")


def repeated_sizes(max_size: int) -> list:
    """REPEATED_SIZES that fit in --max-size's buffers, or --max-size alone when none does."""
    return [size for size in REPEATED_SIZES if size <= max_size] or [max_size]


def check_busbw(result: SizeResult, min_busbw, network: str):
    """TooSlow when the largest size's busbw is below --min-busbw."""
    if min_busbw is not None and result.busbw < min_busbw:
        raise TooSlow(f"busbw at {human_size(result.nbytes)} is {result.busbw:.2f} GB/s, below --min-busbw "
                      f"{min_busbw:g} GB/s ({network}; see docs/network.md)")


# ---------------------------------------------------------------------------------------------
# The run.

def build_parser():
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-size", type=parse_size, default=parse_size("1K"), metavar="BYTES",
                        help="smallest all-reduce, in bytes (4096, 1K, 64M, 1G; K = 1024) (default: 1K)")
    parser.add_argument("--max-size", type=parse_size, default=parse_size("256M"), metavar="BYTES",
                        help="largest all-reduce, in bytes; sizes double from --min-size up to it "
                             "(default: 256M; each rank holds 3 buffers of this size)")
    parser.add_argument("--iters", type=positive_int, default=20, metavar="N",
                        help="timed iterations per size, each checked (default: 20)")
    parser.add_argument("--warmup-iters", type=non_negative_int, default=5, metavar="N",
                        help="untimed iterations per size before the timed ones, each checked too (default: 5)")
    parser.add_argument("--repeat", type=non_negative_int, default=100, metavar="N",
                        help="after the table, N more all-reduces of 1 MiB and of 25 MiB (those within --max-size), "
                             "each checked: NCCL issue 2001's size and DDP's gradient bucket (default: 100; 0: none)")
    parser.add_argument("--min-busbw", type=positive_float, default=None, metavar="GBPS",
                        help="fail (exit status 4) when the busbw of the largest size is below this, in GB/s "
                             "(1e9 bytes/s); CSCS's Alps: ~108 between two 4-GH200 nodes over Slingshot, ~5.4 over "
                             "NCCL's TCP sockets (default: no minimum)")
    parser.add_argument("--collective-timeout", type=positive_float, default=DEFAULT_TIMEOUT_MIN, metavar="MINUTES",
                        help="how long a rank waits for the others in a collective before every rank stops with "
                             f"exit status 5 (default: {DEFAULT_TIMEOUT_MIN:g})")
    parser.add_argument("--interfaces", action="store_true",
                        help="only check that GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name interfaces of this node "
                             "(one process, no torchrun): multinode_job.sh runs it on every node first")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.min_size > args.max_size:
        parser.error(f"--min-size {human_size(args.min_size)} is larger than --max-size {human_size(args.max_size)}")
    return args


def all_reduce_size(buffers, count, args, ctx, fault):
    """The warm-up and timed all-reduces of ``count`` elements, every result checked on the
    device. Returns (mean time of the timed ones in s, this rank's Mismatch list)."""
    source, result, expected = (b[:count] for b in buffers)
    iterations = args.warmup_iters + args.iters
    checks = torch.empty(iterations, 4, dtype=torch.float64, device=ctx.device)
    timeout_s = args.collective_timeout * 60
    clock = Clock(ctx.device, iterations, timeout_s)
    queued = deque()  # the Works the host has not waited for
    for i in range(iterations):
        result.copy_(source)  # all_reduce is in place: each iteration reduces fresh data
        clock.start(i)
        queued.append(start_all_reduce(result, timeout_s))
        clock.stop(i)
        if fault and fault == (ctx.rank, count * ELEMENT_BYTES, i + 1):
            result[count // 2] += 1  # the test hook (CHECK_NETWORK_FAULT)
        checks[i] = check_result(result, expected)
        if len(queued) > QUEUED_AHEAD:
            host_wait(queued.popleft(), timeout_s)
    host_wait(queued[-1], timeout_s)
    seconds = clock.read()
    return sum(seconds[args.warmup_iters:]) / args.iters, mismatches(ctx.rank, checks.cpu().tolist())


def allocate(max_count, ctx):
    """The source (this rank's values), result and expected buffers of the largest size. The
    ranks agree on success first: a rank that cannot allocate must not leave the others
    waiting in an all-reduce it never joins."""
    size = human_size(max_count * ELEMENT_BYTES)
    why = None
    try:
        values = pattern(max_count, ctx.device)
        buffers = (values * float(ctx.rank + 1), torch.empty_like(values), values * float(sum_of_ranks(ctx.world_size)))
        del values
    except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError
        why = first_sentences(err)  # the allocator's words, with the bytes it was asked for
    if any_rank(why is not None, ctx.control_group):
        if why is not None:
            raise UserError(f"cannot allocate 3 buffers of {size} on {ctx.device} ({why}): choose a smaller "
                            "--max-size", same_on_every_rank=False)
        raise UserError(f"another rank cannot allocate 3 buffers of {size}: choose a smaller --max-size")
    return buffers


def first_contact(ctx, log_path, timeout_s):
    """One all-reduce of a single value (it creates NCCL's communicator, which logs its
    choice of network), then every rank's NcclLog and whether its value was right, on rank 0."""
    one = torch.full((1,), float(ctx.rank + 1), dtype=DTYPE, device=ctx.device)
    host_wait(start_all_reduce(one, timeout_s), timeout_s)
    if ctx.device.type == "cuda":
        done = torch.cuda.Event()
        done.record()
        wait_for_device(done, timeout_s, "first all-reduce")
    right = one.item() == sum_of_ranks(ctx.world_size)
    log = read_nccl_log(log_path) if log_path else None
    return gather_objects((log, right, one.item(), socket.gethostname()), ctx.control_group)


def check_lost(lost, trace, checkpoint_dir):
    """process_group_scope's error for a rank lost during the check (which writes neither a
    flight recorder nor checkpoints: ``trace`` and ``checkpoint_dir`` are None)."""
    return CheckLost(f"the network check could not finish: {lost.message}", same_on_every_rank=not lost.printed_here,
                     silent=lost.spoke)


def run(args, ctx, log_path, environ_before, fault):
    """The whole check on an initialized group; raises on a wrong value or a slow network."""
    say = print if ctx.is_main else (lambda *a, **k: None)
    if ctx.world_size > max_world_size():
        raise UserError(f"{ctx.world_size} ranks: float32 sums stay exact for at most {max_world_size()}")
    if args.min_busbw is not None and ctx.world_size == 1:
        raise UserError("--min-busbw needs 2 or more processes: one process sends nothing (busbw n/a)")
    backend = dist.get_backend()
    sizes = message_sizes(args.min_size, args.max_size)
    span = f"{human_size(sizes[0])} to {human_size(sizes[-1])}" if len(sizes) > 1 else human_size(sizes[0])
    say(f"Network check: all-reduce (sum) of float32, {span} ({count(len(sizes), 'size', 'sizes')}), "
        f"{args.warmup_iters} warm-up + {args.iters} timed iterations per size, every result checked", flush=True)
    say(f"Backend: {backend}, world size {ctx.world_size} ({count(ctx.num_nodes, 'node', 'nodes')} x "
        f"{count(ctx.local_world_size, 'process', 'processes')} per node)")
    say(f"Device: {device_name(ctx.device)}; torch {torch.__version__}")
    for line in network_report(ctx, environ_before) if ctx.is_main else []:
        say(line)
    contacts = first_contact(ctx, log_path, args.collective_timeout * 60)
    logs, hosts = [log for log, _, _, _ in contacts], [host for _, _, _, host in contacts]
    wrong_first = [rank for rank, (_, right, _, _) in enumerate(contacts) if not right]
    if wrong_first:
        raise RunAborted(f"the first all-reduce (one value) gave {contacts[wrong_first[0]][2]} on ranks "
                         f"{rank_list(wrong_first)}, expected {sum_of_ranks(ctx.world_size)}: data is corrupted "
                         "between ranks (see docs/network.md)")
    for line in describe_network(backend, logs, ctx.num_nodes, environ_before):
        say(line)
    library = nccl_report() if backend == "nccl" else ""  # named with any wrong value: issue 2001 is NCCL's
    buffers = allocate(sizes[-1] // ELEMENT_BYTES, ctx)
    say(table_header(), flush=True)
    results = []
    for nbytes in sizes:
        elements = nbytes // ELEMENT_BYTES
        mean_s, found = all_reduce_size(buffers, elements, args, ctx, fault)
        gathered = gather_objects((mean_s, found), ctx.control_group)
        time_s = max(mean for mean, _ in gathered)  # the slowest rank sets the pace
        found = [m for _, rank_found in gathered for m in rank_found]
        mean_time_s = sum(mean for mean, _ in gathered) / len(gathered)
        results.append(SizeResult(nbytes, time_s, *bandwidths(nbytes, time_s, ctx.world_size),
                                  sum(m.wrong for m in found), bandwidths(nbytes, mean_time_s, ctx.world_size)[1]))
        say(table_row(results[-1]), flush=True)
        if found:
            raise RunAborted(mismatch_message(nbytes, elements, args.warmup_iters + args.iters, found, hosts,
                                              library))
    if args.repeat:
        repeat(buffers, args, ctx, fault, hosts, library, say)
    check_busbw(results[-1], args.min_busbw, network_label(backend, logs))
    say(verdict(results, args.warmup_iters, args.iters, args.min_busbw), flush=True)


def repeat(buffers, args, ctx, fault, hosts, library, say):
    """--repeat checked all-reduces of each of repeated_sizes: a corruption that strikes one
    call in tens (NCCL issue 2001) is one line with the iterations, ranks and the NCCL."""
    sizes = repeated_sizes(args.max_size)
    rounds = argparse.Namespace(warmup_iters=0, iters=args.repeat, collective_timeout=args.collective_timeout)
    for nbytes in sizes:
        elements = nbytes // ELEMENT_BYTES
        _, found = all_reduce_size(buffers, elements, rounds, ctx, fault)
        found = [m for rank_found in gather_objects(found, ctx.control_group) for m in rank_found]
        if found:
            raise RunAborted(mismatch_message(nbytes, elements, args.repeat, found, hosts, library,
                                              what="repeated all-reduce"))
    say(f"Repeated: {args.repeat} more all-reduces of {' and '.join(map(human_size, sizes))}, every element "
        "checked: exact", flush=True)


def main():
    args = parse_args()
    if args.interfaces:  # before torchrun: one line per node, no process group to fail in
        uses_nccl = torch.cuda.is_available()
        check_interfaces(os.environ, uses_nccl)
        print(interfaces_line(os.environ, node_interfaces(), uses_nccl, socket.gethostname()))
        return
    fault = parse_fault(os.environ.get(FAULT_VARIABLE))
    environ_before = dict(os.environ)  # what the user set, for the report
    log_dir = log_path = None
    if torch.cuda.is_available():  # NCCL: before it starts, have it log its choice of network
        if "NCCL_DEBUG_FILE" not in os.environ:
            log_dir = tempfile.mkdtemp(prefix="check_network_")  # TMPDIR: local disk
        os.environ.update(nccl_log_settings(os.environ, log_dir), **NCCL_ERRORS_RAISE)
        log_path = nccl_debug_file(os.environ["NCCL_DEBUG_FILE"], socket.gethostname(), os.getpid())
    try:
        ctx = setup_distributed(args.collective_timeout, not_under_torchrun=NOT_UNDER_TORCHRUN)
        with process_group_scope(ctx, args.collective_timeout, lost_error=check_lost):
            run(args, ctx, log_path, environ_before, fault)
    finally:
        if log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    run_cli(main)
