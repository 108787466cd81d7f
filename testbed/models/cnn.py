"""The CNNs of the SparDL experiments, defined here (no torchvision): CIFAR-style ResNets
(He et al. 2016, section 4.2: 6n+2 layers, 16/32/64 channels), ResNet-50 (bottlenecks, for
ImageNet-sized input), VGG-16/19 with batch norm, and a CIFAR-style AlexNet.

Every model takes `in_channels` and `classes`, and ends in adaptive average pooling, so the
same definition runs on 3 x 32 x 32 CIFAR images, 1 x 28 x 28 (Fashion-)MNIST, 1 x 8 x 8
digits and 3 x 224 x 224 ImageNet crops."""
from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for small images: three stages of n basic blocks."""

    def __init__(self, depth: int, in_channels: int = 3, classes: int = 10):
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"a CIFAR ResNet has depth 6n+2 (20, 56, 110), got {depth}")
        n = (depth - 2) // 6
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(16), nn.ReLU())
        blocks, cin = [], 16
        for stage, cout in enumerate((16, 32, 64)):
            for i in range(n):
                blocks.append(BasicBlock(cin, cout, 2 if stage and i == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(64, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.head(nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet50(nn.Module):
    """ResNet-50: a 7x7 stem and stages of 3, 4, 6, 3 bottlenecks (25.6M parameters)."""

    def __init__(self, in_channels: int = 3, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False),
                                  nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], 64
        for stage, (count, width) in enumerate(((3, 64), (4, 128), (6, 256), (3, 512))):
            for i in range(count):
                blocks.append(Bottleneck(cin, width, 2 if stage and i == 0 else 1))
                cin = 4 * width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.head(nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


VGG_LAYOUTS = {
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
         512, 512, 512, 512, "M"],
}


class VGG(nn.Module):
    """VGG-16/19 with batch norm and one linear classifier (CIFAR-style). A pooling step is
    skipped once the feature map is 1 x 1, so small images pass through all layers."""

    def __init__(self, depth: int, in_channels: int = 3, classes: int = 10):
        super().__init__()
        if depth not in VGG_LAYOUTS:
            raise ValueError(f"VGG depth must be one of {sorted(VGG_LAYOUTS)}, got {depth}")
        layers, cin = [], in_channels
        for item in VGG_LAYOUTS[depth]:
            if item == "M":
                layers.append(_PoolIfLarger())
            else:
                layers += [nn.Conv2d(cin, item, 3, 1, 1, bias=False), nn.BatchNorm2d(item), nn.ReLU()]
                cin = item
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(512, classes)

    def forward(self, x):
        return self.head(nn.functional.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


class _PoolIfLarger(nn.Module):
    def forward(self, x):
        return nn.functional.max_pool2d(x, 2) if min(x.shape[-2:]) >= 2 else x


class AlexNet(nn.Module):
    """AlexNet for small images (the CIFAR variant of the DGC/SparDL code): five conv layers
    and a three-layer classifier with dropout."""

    def __init__(self, in_channels: int = 3, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, 3, 2, 1), nn.ReLU(), _PoolIfLarger(),
            nn.Conv2d(64, 192, 3, 1, 1), nn.ReLU(), _PoolIfLarger(),
            nn.Conv2d(192, 384, 3, 1, 1), nn.ReLU(),
            nn.Conv2d(384, 256, 3, 1, 1), nn.ReLU(),
            nn.Conv2d(256, 256, 3, 1, 1), nn.ReLU(), _PoolIfLarger(),
            nn.AdaptiveAvgPool2d(2))
        self.classifier = nn.Sequential(
            nn.Dropout(), nn.Linear(256 * 4, 1024), nn.ReLU(),
            nn.Dropout(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, classes))

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))
