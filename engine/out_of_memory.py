"""Out of memory, as one line that says what to change: where it happened, the device's
memory and this process's peak, and the changes that keep the recipe, in order: bf16, then
--accumulate with a value that would fit, then a smaller --image-size (or model); and the last
checkpoint with the command that continues from it (engine/errors.OutOfMemory: exit status 1).
Imported once a run has run out of memory, which engine/memory.is_out_of_memory recognises.
"""

import math
import os
import resource
import shlex
import socket
import sys

import torch

from engine.errors import OutOfMemory
from engine.memory import HEADROOM, device_memory


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
