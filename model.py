"""Wide ResNet for CIFAR-100 (and CIFAR-10, Fashion-MNIST, MNIST), the same network as the
"PyTorch on Olivia" guide, and the default of --model (``model:WideResNet``). Your own
network goes in a file of its own: ``--model my_net.py:Net`` (see README, engine/models.py).

The module attribute names (``input_block``, ``block1`` ... ``block6``, ``fc``, and inside
them ``cbr``, ``layer1``, ``layer2``, ``scale``) are the guide's, so a state_dict moves
between the guide's model and this one with ``load_state_dict(strict=True)``.

Two changes, neither of which adds or renames a parameter:
- ``in_channels`` (default 3): 1 for grayscale data such as Fashion-MNIST and MNIST, which
  the guide handled by editing a commented-out line. ``num_classes`` sizes only ``fc``.
- The final pooling is a true global average. The guide's ``AvgPool2d(7)`` on the 8x8 map
  averaged only the top-left 7x7 window and silently ignored the last row and column.
"""

import torch
import torch.nn as nn

# Channel widths of the input block and of the three stages (16 -> 160 -> 320 -> 640).
STAGE_CHANNELS = (16, 160, 320, 640)


class ConvBNReLU(nn.Module):
    """3x3 convolution (no bias: BatchNorm follows), BatchNorm, ReLU; keeps H and W."""

    def __init__(self, input_channels, output_channels):
        super().__init__()
        self.cbr = nn.Sequential(
            nn.Conv2d(input_channels, output_channels, kernel_size=3, padding="same", bias=False),
            nn.BatchNorm2d(output_channels),
            nn.ReLU(),
        )

    def forward(self, x):
        return self.cbr(x)


class ResidualBlock(nn.Module):
    """Two ConvBNReLU layers plus a skip; a 1x1 convolution projects the skip when the
    channel count changes (``scale_input``)."""

    def __init__(self, input_channels, output_channels, scale_input):
        super().__init__()
        self.scale_input = scale_input
        if self.scale_input:
            self.scale = nn.Conv2d(input_channels, output_channels, kernel_size=1)
        self.layer1 = ConvBNReLU(input_channels, output_channels)
        self.dropout = nn.Dropout(p=0.01)
        self.layer2 = ConvBNReLU(output_channels, output_channels)

    def forward(self, x):
        out = self.layer2(self.dropout(self.layer1(x)))
        residual = self.scale(x) if self.scale_input else x
        return out + residual


# The guide's class names, so code written against the guide keeps importing.
cbrblock = ConvBNReLU
conv_block = ResidualBlock


class WideResNet(nn.Module):
    """(N, in_channels, H, W) images -> (N, num_classes) logits; 17.2 M parameters for
    CIFAR-100. The stages see H x W, then H/2 x W/2, then H/4 x W/4 (max-pooling floors odd
    sizes): 32x32, 16x16, 8x8 for CIFAR; 28x28, 14x14, 7x7 for MNIST and Fashion-MNIST. The
    final average is global, so any size from 4x4 up works."""

    def __init__(self, num_classes, in_channels=3):
        super().__init__()
        c0, c1, c2, c3 = STAGE_CHANNELS
        self.input_block = ConvBNReLU(in_channels, c0)
        self.block1 = ResidualBlock(c0, c1, scale_input=True)
        self.block2 = ResidualBlock(c1, c1, scale_input=False)
        self.pool1 = nn.MaxPool2d(2)
        self.block3 = ResidualBlock(c1, c2, scale_input=True)
        self.block4 = ResidualBlock(c2, c2, scale_input=False)
        self.pool2 = nn.MaxPool2d(2)
        self.block5 = ResidualBlock(c2, c3, scale_input=True)
        self.block6 = ResidualBlock(c3, c3, scale_input=False)
        # Global average over whatever spatial size arrives (8x8 for 32x32 inputs, 7x7 for 28x28).
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flat = nn.Flatten()
        self.fc = nn.Linear(c3, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.input_block(x)
        out = self.pool1(self.block2(self.block1(out)))
        out = self.pool2(self.block4(self.block3(out)))
        out = self.block6(self.block5(out))
        return self.fc(self.flat(self.pool(out)))
