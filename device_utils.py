"""Device and process-group setup, so the training code never looks at environment variables;
the precision the device computes in (--precision: autocast's dtype, TF32).

A process learns who it is from the variables torchrun sets: RANK (global, 0..WORLD_SIZE-1),
LOCAL_RANK (index on this node, which GPU to use), WORLD_SIZE and LOCAL_WORLD_SIZE. Global
rank 0 is the one process that prints and writes files; local rank only picks the GPU.
"""

import inspect
import os
import platform
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from engine.cli import env_int, launcher_pid
from engine.errors import RunAborted, UserError, first_line
from engine.log import count
from engine.processes import cleanup_distributed  # noqa: F401 (the guide's name for it)
from engine.processes import (DEFAULT_COLLECTIVE_TIMEOUT_MIN, FLIGHT_RECORDER_PREFIX, NCCL_TIMEOUT_MARGIN_MIN,
                              DistContext, group_active)


def get_device(local_rank=0, wanted="auto") -> torch.device:
    """The GPU of this local rank when CUDA is available, else the CPU; --device ``wanted``:
    auto, cuda (one line without a GPU) or cpu (the CPU on a GPU node too)."""
    if wanted == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda, and PyTorch sees no GPU here (CUDA_VISIBLE_DEVICES, the job's --gpus, or a "
                        "CPU-only PyTorch?); --device auto uses the CPU then")
    if wanted != "cpu" and torch.cuda.is_available():
        return torch.device(f"cuda:{local_rank}")
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    """What ran: the GPU's model and memory, or the CPU's model and threads."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
    model = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):  # Linux names the CPU model there
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    return f"CPU: {model}, {count(torch.get_num_threads(), 'thread', 'threads')}"


def peak_memory_gib(device: torch.device):
    """Peak GPU memory allocated by tensors since the last reset, in GiB (None on the CPU).
    Reading it does not wait for the GPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def reset_peak_memory(device: torch.device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_format(channels_last, device: torch.device) -> torch.memory_format:
    """The layout of the model and its input batches: channels_last (NHWC, what tensor-core
    convolutions use) on CUDA, contiguous (NCHW) on the CPU, unless --[no-]channels-last
    (``channels_last`` True or False, None for the default) says otherwise."""
    wanted = channels_last if channels_last is not None else device.type == "cuda"
    return torch.channels_last if wanted else torch.contiguous_format


# ---------------------------------------------------------------------------------------------
# --precision: which dtype the forward pass computes in (autocast), and the TF32 switches.

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    name: str                     # bf16, fp16, tf32 or fp32
    autocast_dtype: object = None  # torch dtype for autocast, None for fp32 math

    def autocaster(self, device):
        """A function of no arguments that returns the forward pass's context on ``device``:
        built once, so that a step enters torch.autocast (or nullcontext) directly."""
        if self.autocast_dtype is None:
            return nullcontext
        return partial(torch.autocast, device.type, dtype=self.autocast_dtype)

    def autocast(self, device):
        return self.autocaster(device)()


def configure_precision(requested, device):
    """Resolve --precision for ``device`` and set the TF32 switches; refuse combinations that
    cannot work."""
    cuda = device.type == "cuda"
    # Only bf16 the GPU computes natively: PyTorch reports emulated bf16 (pre-Ampere GPUs) as
    # supported by default, and it runs slower than fp32 there.
    native_bf16 = cuda and torch.cuda.is_bf16_supported(including_emulation=False)
    if requested == "auto":
        requested = "bf16" if native_bf16 else "fp32"
    if requested in ("fp16", "tf32") and not cuda:
        raise UserError(f"--precision {requested} needs a CUDA GPU; on the CPU use fp32 (or bf16)")
    if requested == "bf16" and cuda and not native_bf16:
        raise UserError("--precision bf16: this GPU has no bf16 support; use fp16 or fp32")
    if cuda:
        # PyTorch lets cuDNN use TF32 for convolutions by default, so the guide's "fp32" was
        # partly TF32. Here fp32 means fp32; every other mode allows TF32 for fp32 leftovers.
        set_tf32(matmuls=requested != "fp32", convolutions=requested != "fp32")
    return Precision(requested, AUTOCAST_DTYPES.get(requested))


def set_tf32(matmuls, convolutions):
    """Allow TF32 for fp32 matmuls and cuDNN convolutions, or not, through the setters every
    supported PyTorch has. From 2.9 on they set ``fp32_precision`` too, so that the older
    reads (``allow_tf32``, ``get_float32_matmul_precision``: TunableOp, a user's code) and the
    newer (``fp32_precision``: inductor) agree; setting ``fp32_precision`` instead makes the
    older reads raise ("a mix of the legacy and new APIs")."""
    torch.set_float32_matmul_precision("high" if matmuls else "highest")  # "high": TF32 on CUDA
    torch.backends.cudnn.allow_tf32 = convolutions


def use_device(local_rank, wanted="auto") -> torch.device:
    """This local rank's device, made the process's own: the current CUDA device (CUDA RNG
    state, bf16 checks, pinned memory and NCCL follow it, not cuda:0), with cuDNN autotuning
    on, which pays because every batch has the same shape (drop_last). ``wanted``: --device."""
    device = get_device(local_rank, wanted)
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise UserError(
                f"LOCAL_RANK={local_rank} but this node shows only {visible} GPU(s): "
                "--nproc_per_node must not exceed the GPUs per node")
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    return device


def single_process_context(device="auto") -> DistContext:
    """For train.py: one process, no process group, on --device ``device``. Accepts torchrun
    with one process."""
    world_size = env_int("WORLD_SIZE", 1)
    if world_size > 1:
        raise UserError(
            f"train.py trains with one process but WORLD_SIZE={world_size}; "
            "use train_ddp.py for several processes (python tools/torchrun.py --standalone --nproc_per_node=N "
            "train_ddp.py)")
    return DistContext(device=use_device(env_int("LOCAL_RANK", 0), device), launcher_pid=launcher_pid())


def flight_recorder_settings(directory, version=None) -> dict:
    """The environment that makes NCCL's flight recorder (on by default since PyTorch 2.6: each
    rank's last 2000 collectives) dump on a collective timeout into ``directory`` as
    nccl_trace_rank_N, read with ``torchfrtrace DIR -p nccl_trace_rank_``. PyTorch 2.11 renamed
    the dump file's variable (TORCH_NCCL_DEBUG_INFO_TEMP_FILE -> TORCH_FR_DUMP_TEMP_FILE) and
    warns about the old name, which 2.7 needs; the switch keeps its TORCH_NCCL_ name in every
    version (2.14's libraries hold no TORCH_FR_DUMP_ON_TIMEOUT: tests/test_resilience.py
    checks each name against the installed torch)."""
    version = torch.torch_version.TorchVersion(version or torch.__version__)
    prefix = str(Path(directory) / FLIGHT_RECORDER_PREFIX)
    file_variable = "TORCH_FR_DUMP_TEMP_FILE" if version >= "2.11" else "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
    return {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", file_variable: prefix}


NOT_UNDER_TORCHRUN = ("train_ddp.py must be started by torchrun, e.g. python tools/torchrun.py --standalone "
                      "--nproc_per_node=2 train_ddp.py (for one process: python train.py)")


def setup_distributed(collective_timeout_min=DEFAULT_COLLECTIVE_TIMEOUT_MIN, trace_dir=None,
                      not_under_torchrun=NOT_UNDER_TORCHRUN, device="auto") -> DistContext:
    """For train_ddp.py: read torchrun's variables, pick this rank's GPU, join the group.

    The GPU is selected before init_process_group so that NCCL binds each rank to its own
    device (otherwise every rank opens a context on cuda:0). nccl on CUDA, gloo on CPU:
    the same code path runs on a laptop and on GH200 nodes.

    ``collective_timeout_min``: how long a rank waits in a collective for the others. The gloo
    group (the per-step stop agreement every rank joins) times out first, so a rank that
    stops responding is named by ``named_collective_failures``; NCCL's watchdog, given
    NCCL_TIMEOUT_MARGIN_MIN more, is the backstop for a hang the gloo group does not see.
    ``trace_dir`` (the checkpoint folder): where NCCL's flight recorder dumps on a timeout,
    unless the environment names a place already. ``not_under_torchrun``: the entry point's
    one line when torchrun's variables are missing. ``device``: --device (cpu: gloo on a GPU node).
    """
    from engine.interfaces import DOCS, NetworkSetupError, check_interfaces
    from engine.nccl_log import refused_network
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserError(not_under_torchrun)
    rank, world_size = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    local_rank = env_int("LOCAL_RANK", 0)
    local_world_size = env_int("LOCAL_WORLD_SIZE", world_size)
    device = use_device(local_rank, device)  # before init_process_group: NCCL binds to the current device
    timeout = timedelta(minutes=collective_timeout_min)
    if device.type == "cuda":
        dumps = ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "TORCH_FR_DUMP_ON_TIMEOUT")
        if trace_dir and not any(name in os.environ for name in dumps):
            os.environ.update(flight_recorder_settings(trace_dir))  # read when NCCL's group is made
    # gloo and NCCL would fail in a traceback per rank on a node without the interfaces the job
    # names (a cluster without Slingshot's hsn0): one line naming the node's interfaces instead.
    check_interfaces(os.environ, uses_nccl=device.type == "cuda")
    try:
        dist.init_process_group(**group_options(device, timeout))
        # Agreeing on a stop flag every step must not wait for the GPU: with NCCL, such flags
        # travel over a separate CPU (gloo) group. On the CPU the default group is gloo already.
        control_group = dist.new_group(backend="gloo", timeout=timeout) if device.type == "cuda" else None
    except (RuntimeError, ValueError) as err:  # DistNetworkError, DistStoreError, gloo's and NCCL's own
        why = refused_network(str(err), platform.node(), os.environ.get("NCCL_NET")) or (
            f"the process group did not start on rank {rank} ({first_line(err)}); check MASTER_ADDR/MASTER_PORT (the "
            f"rendezvous) and the interfaces, see {DOCS}")
        raise NetworkSetupError(why, same_on_every_rank=False) from None
    return DistContext(device=device, rank=rank, local_rank=local_rank, world_size=world_size,
                       local_world_size=local_world_size, process_group=True, control_group=control_group,
                       launcher_pid=launcher_pid())


def group_options(device: torch.device, timeout: timedelta) -> dict:
    """init_process_group's arguments for a rank on ``device``. NCCL on a GPU gets the GPU as
    ``device_id``: its communicator is made at once, so a broken NCCL (a missing library, a
    network that cannot be opened) fails at start-up instead of at the first gradient
    all-reduce, and it waits NCCL_TIMEOUT_MARGIN_MIN longer than the gloo group. gloo on the CPU."""
    if device.type == "cuda":
        return {"backend": "nccl", "timeout": timeout + timedelta(minutes=NCCL_TIMEOUT_MARGIN_MIN), "device_id": device}
    return {"backend": "gloo", "timeout": timeout}


def no_forward_buffer_sync() -> dict:
    """DDP's keyword argument that turns off the broadcast of rank 0's buffers before every
    forward: ``forward_sync_buffers`` since PyTorch 2.13 (where ``broadcast_buffers`` prints a
    FutureWarning on every rank), ``broadcast_buffers`` before it (2.7 to 2.12)."""
    from torch.nn.parallel import DistributedDataParallel

    new = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if new else "broadcast_buffers": False}


def broadcast_buffers(module: torch.nn.Module):
    """Copy rank 0's buffers (BatchNorm running statistics) to every rank.

    train_ddp.py turns off DDP's broadcast of buffers before each forward (training normalizes
    with batch statistics), so every rank updates its running statistics from its own batches
    and they differ. Evaluating after this call evaluates exactly the model that rank 0 saves.
    """
    if group_active():
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


def check_every_parameter_learns(model, module, what):
    """DDP (``model`` wraps ``module``): one line naming a parameter that got no gradient in
    the step just taken (a frozen or unused layer of the user's model), instead of DDP's
    error at the next step. Reads only which .grad exist, on the host: no GPU sync."""
    if model is module:  # not DDP-wrapped: an unused parameter harms nothing
        return
    idle = [name for name, p in module.named_parameters() if p.requires_grad and p.grad is None]
    if idle:
        more = f" (and {len(idle) - 1} more)" if len(idle) > 1 else ""
        raise UserError(f"parameter {idle[0]}{more} of {what} got no gradient in the first step: DDP needs every "
                        "trainable parameter in each step's loss; freeze it with requires_grad_(False) in the model, "
                        "or pass find_unused_parameters=True to DDP in train_ddp.py (slower)")


def parameter_checksums(module: torch.nn.Module) -> torch.Tensor:
    """One float64 value per parameter tensor (sum plus a position-weighted sum, so that
    swapped or shifted values change it too). Shape (2 * number of parameter tensors,)."""
    sums = []
    for param in module.parameters():
        flat = param.detach().flatten().double()
        positions = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64)
        sums += [flat.sum(), (flat * positions).sum() / flat.numel()]
    return torch.stack(sums)


def check_replicas_in_sync(module: torch.nn.Module, where: str):
    """Raise RunAborted when any rank's parameters differ from rank 0's.

    DDP keeps the replicas bitwise identical (same averaged gradients, same optimizer), so
    any difference is corruption, e.g. NCCL's LL128 protocol between GH200 nodes. Costs one
    all-gather of a few hundred numbers and a GPU sync: call it at checkpoints, not per step.
    """
    if not group_active():
        return
    local = parameter_checksums(module)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    # NaN never equals itself: a model diverged on every rank (DDP gives each the same update)
    # is named as such, not as corruption. NaN/Inf on some ranks only is corruption, below.
    broken = [rank for rank, sums in enumerate(gathered) if not torch.isfinite(sums).all()]
    if broken and len(broken) == len(gathered):
        first = int((~torch.isfinite(gathered[broken[0]])).nonzero()[0]) // 2  # two sums per parameter tensor
        name = [name for name, _ in module.named_parameters()][first]
        raise RunAborted(f"NaN/Inf in the model parameters on every rank {where} (first in {name}): the "
                         "training diverged (a learning rate too high for this batch, an overflow in fp16), not a "
                         "network fault; stopping without writing a checkpoint (the last one is kept: lower "
                         "--base-lr, or try --precision bf16, and continue with --resume)")
    differing = [rank for rank, sums in enumerate(gathered)
                 if not torch.allclose(sums, gathered[0], rtol=0, atol=0, equal_nan=True)]  # bitwise, NaN too
    if differing:
        nonfinite = f" (NaN/Inf on rank(s) {broken} only)" if broken else ""
        raise RunAborted(f"model parameters on rank(s) {differing} differ from rank 0 {where}{nonfinite}: the replicas "
                         "are out of sync (silent data corruption in communication; check NCCL_PROTO=^LL128 and "
                         "the network settings); stopping without writing a checkpoint")
