"""Out of memory, as one line that says what to change: where it happened, the device's
memory and this process's peak, and the changes that keep the recipe, in order: bf16, then
--accumulate with a value that would fit, then a smaller --image-size (or model); and the last
checkpoint with the command that continues from it. Exit status 1, not requeued: the same
job would run out of memory again.

And before training, what a training step takes on the GPU (``training_bytes``), so that
--loader auto puts the data set there only when the step still fits beside it.
"""

import math
import os
import resource
import shlex
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from engine.errors import UserError
from engine.plugins import call_user_code
from engine.processes import max_over_ranks

HEADROOM = 0.85  # --accumulate is suggested so that the estimated peak fills at most this share of the memory
DEVICE_DATA_FRACTION = 0.25  # --loader auto, where training cannot be measured: the data set's share of memory
OPTIMIZER_STATE_VALUES = 2  # per trainable parameter: AdamW's two moments, the most recipe.py's optimizers keep
NO_FIT = 2**62  # bytes: a training step that ran out of memory on its own, in an all-reduce of integers


class OutOfMemory(UserError):
    """A step or an evaluation that did not fit in memory. Any rank may hit it, often all at
    once: a rank other than 0 prints its line only if rank 0 has not ended the job first."""

    exit_code = 1
    rank0_first = True


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


def memory_figures(device):
    """(total bytes, this process's peak bytes) of ``device``: the GPU's (peak of tensors
    allocated since the last reset), or what this process may use of the host's (host_memory)
    and its resident peak."""
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # ru_maxrss: KiB on Linux
    return device_memory(device), peak


def held_outside_torch(device):
    """Bytes of the GPU ``device`` in use but not by PyTorch's allocator: the CUDA context, NCCL's
    buffers, DALI's memory pool, other processes; 0 on the CPU."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


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


def suggested_accumulate(accumulate, micro_batch, peak, total, steps_done):
    """The --accumulate that would fit: from the peak of the steps that ran (memory grows with
    the micro-batch), else twice the current one. Never more than the per-process batch allows."""
    if steps_done and peak:
        wanted = math.ceil(accumulate * peak / (HEADROOM * total))
        suggestion = max(accumulate + 1, wanted)
    else:
        suggestion = accumulate * 2
    batch = micro_batch * accumulate  # per process
    while suggestion < batch and batch % suggestion:
        suggestion += 1  # a divisor of the per-process batch
    return min(suggestion, batch)


def out_of_memory(where, device, accumulate, micro_batch, image_size, precision, steps_done, checkpoint,
                  sized_images=False, checkpointed=True):
    """The OutOfMemory error for a failure ``where`` (e.g. "step 3 of epoch 1 (training)") of a
    run with --accumulate ``accumulate`` and --precision ``precision``. ``checkpoint``: the
    newest checkpoint's path, or None; ``steps_done``: steps that ran; ``sized_images``: the
    images' size is --image-size's (an image folder); ``checkpointed``: --checkpoint-dir given."""
    given = accumulate
    total, peak = memory_figures(device)
    fixes = []
    if precision in ("fp32", "tf32") and device.type == "cuda":
        fixes.append("--precision bf16")
    batch = micro_batch * given
    accumulate = suggested_accumulate(given, micro_batch, peak, total, steps_done)
    if accumulate > given:
        fixes.append(f"--accumulate {accumulate} (micro-batches of {batch // accumulate}; the recipe is unchanged)")
    if sized_images:
        fixes.append(f"a smaller --image-size (now {image_size[0]}x{image_size[1]})")
    else:
        fixes.append("a smaller --model")
    outside = held_outside_torch(device)  # DALI's pool (--loader dali) among them
    held = f", {outside / 2**30:.1f} GiB held outside PyTorch (CUDA, NCCL, DALI)" if outside >= 2**30 else ""
    line = (f"out of memory at {where} on {device} ({total / 2**30:.1f} GiB, this process's peak "
            f"{peak / 2**30:.1f} GiB{held}) with micro-batches of {micro_batch} images of {image_size[0]}x"
            f"{image_size[1]}; try, in this order: {'; then '.join(fixes)}")
    if checkpoint:
        line += f". The last checkpoint, {checkpoint}, continues with: {resume_command(accumulate)}"
    elif not checkpointed:
        line += ". Nothing was saved (no --checkpoint-dir)"
    return OutOfMemory(line, same_on_every_rank=False)


def cache_out_of_memory(images, folder, largest, threads):
    """The OutOfMemory error for decoding ``images`` images into the cache in ``folder``:
    ``threads`` threads each hold one image decoded at full size, the ``largest`` (height,
    width) among them."""
    total, peak = memory_figures(torch.device("cpu"))
    return OutOfMemory(
        f"out of memory decoding {images} images into the image cache in {folder} on {socket.gethostname()} "
        f"({total / 2**30:.1f} GiB, this process's peak {peak / 2**30:.1f} GiB; {threads} threads each decode one "
        f"image at full size, the largest {largest[1]}x{largest[0]} pixels): ask Slurm for more memory (--mem) or "
        "fewer cores (--cpus-per-task: one decoding thread per core). Nothing was trained; the unfinished cache "
        "was removed and earlier ones are kept")


def resume_command(accumulate):
    """This process's command line with --accumulate ``accumulate`` and --resume (torchrun's
    own options are not known here: they stay as they were)."""
    kept, skip = [], False
    for word in sys.argv[1:]:
        if skip:
            skip = False
        elif word == "--accumulate":
            skip = True
        elif not (word.startswith("--accumulate=") or word == "--resume" or word.startswith("--resume=")):
            kept.append(word)
    script = os.path.basename(sys.argv[0])
    launcher = "python" if script == "train.py" else "torchrun (with its options as before)"
    return f"{launcher} {shlex.join([script, *kept, '--accumulate', str(accumulate), '--resume'])}"


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
