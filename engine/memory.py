"""Out of memory, as one line that says what to change: where it happened, the device's
memory and this process's peak, and the changes that keep the recipe, in order: bf16, then
--accumulate with a value that would fit, then a smaller --image-size (or model); and the last
checkpoint with the command that continues from it. Exit status 1, not requeued: the same
job would run out of memory again.
"""

import math
import os
import resource
import shlex
import sys
from pathlib import Path

import torch

from engine.errors import UserError
from engine.flags import FOLDER

HEADROOM = 0.85  # --accumulate is suggested so that the estimated peak fills at most this share of the memory


class OutOfMemory(UserError):
    """A step or an evaluation that did not fit in memory. Any rank may hit it, often all at
    once: a rank other than 0 prints its line only if rank 0 has not ended the job first."""

    exit_code = 1
    rank0_first = True


def is_out_of_memory(err):
    """CUDA's OutOfMemoryError, the CPU allocator's RuntimeError, or Python's MemoryError."""
    return (isinstance(err, (torch.OutOfMemoryError, MemoryError))
            or (isinstance(err, RuntimeError) and "can't allocate memory" in str(err)))


def memory_figures(device):
    """(total bytes, this process's peak bytes) of ``device``: the GPU's (peak of tensors
    allocated since the last reset), or the node's and this process's resident peak."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, torch.cuda.max_memory_allocated(device)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # ru_maxrss: KiB on Linux


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


def out_of_memory(where, device, args, micro_batch, image_size, precision, steps_done, checkpoint):
    """The OutOfMemory error for a failure ``where`` (e.g. "step 3 of epoch 1 (training)").
    ``checkpoint``: the newest checkpoint's path, or None; ``steps_done``: steps that ran."""
    total, peak = memory_figures(device)
    fixes = []
    if precision in ("fp32", "tf32") and device.type == "cuda":
        fixes.append("--precision bf16")
    batch = micro_batch * args.accumulate
    accumulate = suggested_accumulate(args.accumulate, micro_batch, peak, total, steps_done)
    if accumulate > args.accumulate:
        fixes.append(f"--accumulate {accumulate} (micro-batches of {batch // accumulate}; the recipe is unchanged)")
    if args.dataset == FOLDER:
        fixes.append(f"a smaller --image-size (now {image_size[0]}x{image_size[1]})")
    else:
        fixes.append("a smaller --model")
    line = (f"out of memory at {where} on {device} ({total / 2**30:.1f} GiB, this process's peak "
            f"{peak / 2**30:.1f} GiB) with micro-batches of {micro_batch} images of {image_size[0]}x{image_size[1]}; "
            f"try, in this order: {'; then '.join(fixes)}")
    if checkpoint:
        line += f". The last checkpoint, {checkpoint}, continues with: {resume_command(accumulate)}"
    elif args.checkpoint_dir is None:
        line += ". Nothing was saved (no --checkpoint-dir)"
    return OutOfMemory(line, same_on_every_rank=False)


def run_out_of_memory(run, state, where, steps_done):
    """out_of_memory for a train_utils.Run: its micro-batch, image size, precision and newest
    checkpoint (of ``state``, a TrainState, or None)."""
    checkpoints = state.checkpoints if state else []
    kept = Path(run.args.checkpoint_dir) / checkpoints[-1] if checkpoints else None
    micro = run.task.train_loader.batch_size // run.args.accumulate
    return out_of_memory(where, run.ctx.device, run.args, micro, run.task.data.prep.image_shape[:2],
                         run.precision.name, steps_done, kept)


def resume_command(accumulate):
    """This process's command line with --accumulate ``accumulate`` and --resume (torchrun's
    own options are not known here: they stay as they were)."""
    args, skip = [], False
    for word in sys.argv[1:]:
        if skip:
            skip = False
        elif word == "--accumulate":
            skip = True
        elif not (word.startswith("--accumulate=") or word == "--resume" or word.startswith("--resume=")):
            args.append(word)
    script = os.path.basename(sys.argv[0])
    launcher = "python" if script == "train.py" else "torchrun (with its options as before)"
    return f"{launcher} {shlex.join([script, *args, '--accumulate', str(accumulate), '--resume'])}"
