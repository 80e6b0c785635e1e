"""What the training steps of an epoch add up to: the loss and the images, and the first step
whose loss was not finite, kept on the device so that no step waits for the GPU, and summed
over the ranks once, at the end of the epoch (or at a stop); and an evaluation's metrics from
its sums over the ranks.
"""

import math
from typing import NamedTuple

import torch

from engine.processes import all_reduce


class StepTotals(NamedTuple):
    """What ``train_steps`` did, summed over all ranks."""
    loss_sum: float  # training loss times images
    images: int
    first_bad: int   # first step with a non-finite loss, 0 if none
    lr: float        # of the last step
    stop: int        # the agreed stop request (engine.stopping.NO_STOP, STOP_FILE or STOP_SIGNAL)


class LossBooks:
    """The running loss sum and the first step with a non-finite loss, kept on the device so
    that no step waits for the GPU; read once, summed over ranks, by ``totals``."""

    NONE = 2**62  # "no non-finite loss yet": larger than any step, so the minimum over ranks works

    def __init__(self, device):
        # [loss times images, images]: float64 counts images exactly (up to 2**53).
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)
        self.first_bad = torch.full((), self.NONE, dtype=torch.int64, device=device)
        self.images = 0  # the same count on the host, for progress lines

    def add(self, loss, images, step):
        self.sums[0] += loss * images
        self.sums[1] += images  # a Python number into a kernel's arguments: no copy, no sync
        self.first_bad = torch.where(torch.isfinite(loss), self.first_bad, torch.clamp(self.first_bad, max=step))
        self.images += images

    def totals(self, lr, stop):
        """Summed over all ranks: both all-reduces are queued, then one host sync reads them,
        once per epoch (or stop). NONE (2**62) and step numbers are exact in float64."""
        first_bad = all_reduce(self.first_bad.clone(), op="min").double()
        loss_total, images_total, first_bad = torch.cat([all_reduce(self.sums.clone()), first_bad[None]]).tolist()
        first_bad = int(first_bad)
        return StepTotals(loss_total, int(images_total), 0 if first_bad == self.NONE else first_bad, lr, stop)


class EvalResult(NamedTuple):
    accuracy: float  # fraction of test images classified correctly
    loss: float      # mean cross-entropy per image
    samples: int     # test images seen, summed over all ranks
    top5: float = None  # fraction whose class is among the 5 most probable (None: 5 classes or fewer)


def eval_summary(correct, loss_sum, count, top5_correct=None):
    """Metrics from sums over all ranks: each image weighs the same, however uneven the shards.
    ``top5_correct``: images whose class is among the five highest logits, None when not counted."""
    if count <= 0:
        return EvalResult(math.nan, math.nan, 0)
    return EvalResult(correct / count, loss_sum / count, int(count),
                      None if top5_correct is None else top5_correct / count)
