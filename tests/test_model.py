"""model.py: the guide's parameters and state_dict layout, a true global average pool,
and in_channels."""

import pytest
import torch
import torch.nn as nn

import model
from model import WideResNet


class GuideCBR(nn.Module):
    """The guide's model, as published (part 1), as the reference for the layout."""

    def __init__(self, cin, cout):
        super().__init__()
        self.cbr = nn.Sequential(nn.Conv2d(cin, cout, kernel_size=3, stride=(1, 1), padding="same", bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU())

    def forward(self, x):
        return self.cbr(x)


class GuideBlock(nn.Module):
    def __init__(self, cin, cout, scale_input):
        super().__init__()
        self.scale_input = scale_input
        if self.scale_input:
            self.scale = nn.Conv2d(cin, cout, kernel_size=1, stride=(1, 1), padding="same")
        self.layer1 = GuideCBR(cin, cout)
        self.dropout = nn.Dropout(p=0.01)
        self.layer2 = GuideCBR(cout, cout)

    def forward(self, x):
        out = self.layer2(self.dropout(self.layer1(x)))
        return out + (self.scale(x) if self.scale_input else x)


class GuideWideResNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        c = [3, 16, 160, 320, 640]
        self.input_block = GuideCBR(c[0], c[1])
        self.block1 = GuideBlock(c[1], c[2], scale_input=True)
        self.block2 = GuideBlock(c[2], c[2], scale_input=False)
        self.pool1 = nn.MaxPool2d(2)
        self.block3 = GuideBlock(c[2], c[3], scale_input=True)
        self.block4 = GuideBlock(c[3], c[3], scale_input=False)
        self.pool2 = nn.MaxPool2d(2)
        self.block5 = GuideBlock(c[3], c[4], scale_input=True)
        self.block6 = GuideBlock(c[4], c[4], scale_input=False)
        self.pool = nn.AvgPool2d(7)
        self.flat = nn.Flatten()
        self.fc = nn.Linear(c[4], num_classes)

    def forward(self, x):
        out = self.input_block(x)
        out = self.pool1(self.block2(self.block1(out)))
        out = self.pool2(self.block4(self.block3(out)))
        out = self.block6(self.block5(out))
        return self.fc(self.flat(self.pool(out)))


def test_same_parameters_and_state_dict_layout_as_the_guide():
    ours, guide = WideResNet(num_classes=100), GuideWideResNet(num_classes=100)
    ours_state, guide_state = ours.state_dict(), guide.state_dict()
    assert list(ours_state) == list(guide_state)
    assert all(ours_state[k].shape == guide_state[k].shape for k in ours_state)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in guide.parameters())
    assert round(count / 1e6, 1) == 17.2
    # Weights move both ways with strict loading.
    ours.load_state_dict(guide_state, strict=True)
    guide.load_state_dict(WideResNet(num_classes=100).state_dict(), strict=True)


def test_final_pool_averages_the_whole_8x8_map():
    torch.manual_seed(0)
    net = WideResNet(num_classes=100).eval()
    seen = {}
    net.block6.register_forward_hook(lambda module, inputs, output: seen.setdefault("map", output))
    net.pool.register_forward_hook(lambda module, inputs, output: seen.setdefault("pooled", output))
    with torch.no_grad():
        net(torch.randn(2, 3, 32, 32))
    feature_map = seen["map"]  # (2, 640, 8, 8)
    assert feature_map.shape == (2, 640, 8, 8)
    pooled = seen["pooled"].flatten(1)
    torch.testing.assert_close(pooled, feature_map.mean(dim=(2, 3)))
    # The guide's AvgPool2d(7) ignores the last row and column: a different answer.
    guide_pooled = nn.AvgPool2d(7)(feature_map).flatten(1)
    assert not torch.allclose(pooled, guide_pooled)


def test_in_channels_for_grayscale_data():
    net = WideResNet(num_classes=10, in_channels=1)
    assert net.input_block.cbr[0].weight.shape == (16, 1, 3, 3)
    assert net(torch.randn(3, 1, 32, 32)).shape == (3, 10)
    with pytest.raises(RuntimeError):
        net(torch.randn(3, 3, 32, 32))


def test_guide_class_names_still_import():
    assert model.cbrblock is model.ConvBNReLU and model.conv_block is model.ResidualBlock
