"""Small models that train in minutes on two CPU cores."""
import torch
from torch import nn


class FashionCNN(nn.Module):
    """Two conv layers and a linear classifier for 1 x 28 x 28 images (18,378 parameters)."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(4))
        self.classifier = nn.Linear(32 * 16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


class MnistCNN(nn.Module):
    """The MNIST CNN of Keras's examples (mnist_cnn.py): two 3x3 conv layers, 2x2 max-pooling,
    a 128-unit dense layer and dropout; 1,199,882 parameters for 1 x 28 x 28 images, 98% of
    them in the dense layer. Little compute for its size, so synchronising its gradient
    dominates a training step on a slow network. Other image sizes are pooled to 12 x 12."""

    def __init__(self, in_channels: int = 1, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
            nn.AdaptiveMaxPool2d(12), nn.Dropout(0.25))
        self.classifier = nn.Sequential(
            nn.Linear(64 * 12 * 12, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))
