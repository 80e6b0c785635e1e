"""A network for tests of the machinery around training (checkpoints, stops, resume): small,
with BatchNorm and dropout like the real one, and a forward that sleeps 50 ms, so that an
epoch lasts long enough to be interrupted in without spending CPU time (--model
tests/tiny_net.py:Net)."""

import time

import torch.nn as nn

FORWARD_S = 0.05


class Net(nn.Module):
    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.layers = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                    nn.Dropout(0.1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))

    def forward(self, x):
        time.sleep(FORWARD_S)
        return self.layers(x)
