"""The device's memory: how much there is (a GPU's, or the host's share a cgroup allows),
whether an error ran out of it, and, before training, what a training step takes on the GPU
(``training_bytes``), so that --loader auto puts the data set there only when the step still
fits beside it. What an out-of-memory then says is engine/out_of_memory.py's.
"""

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from engine.plugins import call_user_code
from engine.processes import max_over_ranks

HEADROOM = 0.85  # --accumulate is suggested so that the estimated peak fills at most this share of the memory
DEVICE_DATA_FRACTION = 0.25  # --loader auto, where training cannot be measured: the data set's share of memory
OPTIMIZER_STATE_VALUES = 2  # per trainable parameter: AdamW's two moments, the most recipe.py's optimizers keep
NO_FIT = 2**62  # bytes: a training step that ran out of memory on its own, in an all-reduce of integers


# What an out-of-memory says where it is not an OutOfMemoryError: the CPU allocator; CUDA itself
# (a context, a kernel's launch); cuDNN's and cuBLAS's workspaces and handles, allocated outside
# the caching allocator; and the caching allocator's own message inside another error, as
# torch.compile's BackendCompilerFailed ("backend='inductor' raised:\nOutOfMemoryError: CUDA out
# of memory. ...") carries it.
OUT_OF_MEMORY_MESSAGES = ("can't allocate memory", "CUDA out of memory", "CUDA error: out of memory",
                          "CUDNN_STATUS_ALLOC_FAILED", "CUBLAS_STATUS_ALLOC_FAILED")


def is_out_of_memory(err):
    """Whether ``err``, or an error it was raised from, ran out of memory: OutOfMemoryError,
    MemoryError, or a RuntimeError (CUDA's AcceleratorError is one) saying so above."""
    while err is not None:
        if isinstance(err, (torch.OutOfMemoryError, MemoryError)) or (
                isinstance(err, RuntimeError) and any(text in str(err) for text in OUT_OF_MEMORY_MESSAGES)):
            return True
        err = err.__cause__  # `raise ... from err` only: an error raised while handling one is its own
    return False


def device_memory(device):
    """Bytes of memory of ``device``: the GPU's, or what this process may use of the host's."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory()


def free_device_memory(device):
    """Bytes of the GPU ``device`` this process can still use: what the driver reports free
    (the CUDA context, NCCL's buffers so far and other processes on the GPU are not) plus what
    this process's allocator holds (the model, its cached blocks), which training reuses."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def host_memory(proc_cgroup="/proc/self/cgroup", root="/sys/fs/cgroup"):
    """Bytes this process may use of the host's memory: the node's, or less where a cgroup
    limits it (Slurm's --mem, a container's limit), the smallest limit of its cgroup and
    those above it. cgroup v2 (memory.max) and v1 (memory/.../memory.limit_in_bytes)."""
    limits = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            base, name = Path(root), "memory.max"
        elif "memory" in controllers.split(","):
            base, name = Path(root) / "memory", "memory.limit_in_bytes"
        else:
            continue
        folder = base / path.lstrip("/")
        for level in [folder, *folder.parents]:
            try:
                limits.append(int((level / name).read_text()))  # "max" (v2: none) is not a number
            except (OSError, ValueError):
                pass
            if level == base:
                break
    return min(limits)


# ---------------------------------------------------------------------------------------------
# What training takes on the GPU, measured before the data set may go there.

@dataclass(frozen=True)
class StepShape:
    """The images one optimizer step puts on a device: ``batch`` per process, in micro-batches
    of ``batch // accumulate``, each image ``image_shape`` (H, W, C)."""
    batch: int
    accumulate: int
    image_shape: tuple


@contextmanager
def no_trace(model, device):
    """``with no_trace(model, device):`` ``model`` in training mode, leaving no trace: gradients
    dropped, buffers (BatchNorm's running statistics and counts) and the random number
    generators as they were, the mode restored."""
    saved = [buffer.detach().clone() for buffer in model.buffers()]
    training = model.training
    model.train()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        for param in model.parameters():
            param.grad = None
        with torch.no_grad():
            for buffer, value in zip(model.buffers(), saved):
                buffer.copy_(value)
        model.train(training)


def probe_step(model, images, precision, device):
    """One forward and backward pass of ``images`` (B, C, H, W) through ``model`` in training
    mode that leaves no trace (no_trace)."""
    with no_trace(model, device):
        with precision.autocast(device):
            out = model(images)
        out.float().sum().backward()


def training_bytes(model, shape, precision, device, memory_format):
    """Bytes of GPU memory training ``model`` takes at ``shape`` (a StepShape): the peak of a
    probed micro-batch step (the model, the input, activations, gradients; under DDP the
    gradients are its buckets' views, gradient_as_bucket_view), the rest of the batch's input
    (float32) and the optimizer's state (OPTIMIZER_STATE_VALUES per trainable parameter). Not
    counted, and left to HEADROOM's 15%: NCCL's buffers allocated later and the allocator's
    fragmentation. None on the CPU (nothing to measure: the data set stays where it is);
    infinity when the step alone runs out of memory (the first real step then says so)."""
    if device.type != "cuda":
        return None
    height, width, channels = shape.image_shape
    micro = shape.batch // shape.accumulate
    images = torch.zeros((micro, channels, height, width), device=device).contiguous(memory_format=memory_format)
    try:
        # Twice: the first pass at a shape is where cuDNN's autotuning (cudnn.benchmark) tries
        # its algorithms, some with workspaces far larger than any step then uses.
        probe_step(model, images, precision, device)
        torch.cuda.reset_peak_memory_stats(device)
        probe_step(model, images, precision, device)
        peak = torch.cuda.max_memory_allocated(device)  # the allocator's count, kept on the host: no sync
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        peak = math.inf
    del images
    torch.cuda.empty_cache()  # the probe's blocks back to the GPU, for the data set or other processes
    if math.isinf(peak):
        return peak
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    rest_of_input = (shape.batch - micro) * height * width * channels * 4
    return peak + rest_of_input + OPTIMIZER_STATE_VALUES * trainable


class Measured(NamedTuple):
    """What --loader auto weighs the data set against, in bytes, the tightest over the ranks."""
    training: float   # training_bytes: the most of any rank (infinity: out of memory on its own)
    free: int         # free_device_memory: the least of any rank
    total: int        # the GPU's memory


def measured_training(model, model_ref, precision, accumulate, ctx, image_shape, batch, memory_format):
    """``Measured`` for --loader auto, after a probed training step on this rank's GPU (every
    rank must choose the same loader, so the most needed and the least free of any rank), of
    --model ``model_ref`` at ``precision`` (device_utils.Precision) and --accumulate ``accumulate``. None on
    the CPU, where nothing is measured. An error of the model's own in the probed step is one
    line naming its code (engine/plugins.py), as in training."""
    if ctx.device.type != "cuda":
        return None
    shape = StepShape(batch, accumulate, image_shape)
    needed = call_user_code(lambda: training_bytes(model, shape, precision, ctx.device, memory_format),
                            f"--model {model_ref} in a training step (measured for --loader auto)", model_ref)
    most = max_over_ranks(min(needed, NO_FIT), ctx.control_group)  # an all-reduce of integers: no infinity
    least_free = -max_over_ranks(-free_device_memory(ctx.device), ctx.control_group)
    return Measured(math.inf if most >= NO_FIT else most, least_free, device_memory(ctx.device))
