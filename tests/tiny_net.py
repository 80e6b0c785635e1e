"""A network for tests of the machinery around training (checkpoints, stops, resume): small,
with BatchNorm and dropout like the real one, and a forward that sleeps 50 ms, so that an
epoch lasts long enough to be interrupted in without spending CPU time (--model
tests/tiny_net.py:Net).

HOLD_AT=N:PATH holds each process at its N-th training forward (one that computes gradients:
not the start-up check's, engine/models.check_output) until the file PATH exists,
having written PATH.held<RANK>: a test then acts on a run that is surely still running (a
signal, a second run on its folder) and creates PATH to let it go on. A run that finds PATH
there already (resumed, requeued) is not held.

SIGNAL_AT_SAVE=NAME sends the signal NAME (SIGINT, SIGTERM) to the process when its weights
are first read to be saved (state_dict): a stop that comes after the last step, while the
final weights are written. SIGNAL_AT_BUILD=NAME sends it as the model is first built: before
training, while the run is still being set up."""

import os
import signal
import time

import torch
import torch.nn as nn

FORWARD_S = 0.05


class Net(nn.Module):
    def __init__(self, num_classes, in_channels):
        super().__init__()
        name = os.environ.pop("SIGNAL_AT_BUILD", None)  # once
        if name:
            os.kill(os.getpid(), signal.Signals[name])
        self.layers = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                    nn.Dropout(0.1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))
        self.forwards = 0  # training steps' forwards, in this process

    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            self.forwards += 1
            hold(self.forwards)
        time.sleep(FORWARD_S)
        return self.layers(x)

    def state_dict(self, *args, **kwargs):
        name = os.environ.pop("SIGNAL_AT_SAVE", None)  # once
        if name:
            os.kill(os.getpid(), signal.Signals[name])
        return super().state_dict(*args, **kwargs)


def hold(forwards):
    """Wait, at the HOLD_AT'th training forward, until its file exists (see the module's text)."""
    at, _, path = os.environ.get("HOLD_AT", "").partition(":")
    if not at or int(at) != forwards or os.path.exists(path):
        return
    open(f"{path}.held{os.environ.get('RANK', '0')}", "w").close()
    while not os.path.exists(path):  # a signal's handler runs meanwhile: it only sets a flag
        time.sleep(0.01)
