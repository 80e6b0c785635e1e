"""A small network with nothing in its forward but tensor operations (tests/tiny_net.py counts
and sleeps, tests/oom_net.py counts its calls): what torch.compile compiles in seconds, with
no Python state to guard on and recompile for (--model tests/plain_net.py:Net)."""

import torch.nn as nn


class Net(nn.Sequential):
    def __init__(self, num_classes, in_channels):
        super().__init__(nn.Conv2d(in_channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))
