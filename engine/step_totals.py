"""What the training steps of an epoch add up to: the loss and the images, and the first step
whose loss was not finite, kept on the device so that no step waits for the GPU, and summed
over the ranks once, at the end of the epoch (or at a stop).
"""

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
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.first_bad = torch.full((), self.NONE, dtype=torch.int64, device=device)
        self.images = 0

    def add(self, loss, images, step):
        self.loss_sum += loss * images
        self.first_bad = torch.where(torch.isfinite(loss), self.first_bad, torch.clamp(self.first_bad, max=step))
        self.images += images

    def totals(self, lr, stop):
        """Summed over all ranks: one host sync, once per epoch (or stop)."""
        images = torch.tensor(float(self.images), dtype=torch.float64, device=self.loss_sum.device)
        loss_total, images_total = all_reduce(torch.stack([self.loss_sum, images])).tolist()
        first_bad = int(all_reduce(self.first_bad, op="min"))
        return StepTotals(loss_total, int(images_total), 0 if first_bad == self.NONE else first_bad, lr, stop)
