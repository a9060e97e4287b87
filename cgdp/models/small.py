"""Small models that train in seconds on CPU: the default job's CNN and an MLP.

No dropout and no BatchNorm: nothing random in the forward, so forward passes on CPU-emulated
devices never take turns for their random streams (:mod:`cgdp.engine.backend.rng`).
"""
from __future__ import annotations

import math

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and two linear layers for 1x8x8 digits (about 40 k parameters).

    Reaches about 98 % test accuracy on the bundled digits in a few hundred steps.
    """

    def __init__(self, num_classes: int = 10, in_shape: tuple[int, int, int] = (1, 8, 8), width: int = 16):
        super().__init__()
        c, h, w = in_shape
        self.conv1 = nn.Conv2d(c, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(2 * width * (h // 2) * (w // 2), 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))


class MLP(nn.Module):
    """A multilayer perceptron on flattened inputs."""

    def __init__(self, in_features: int = 64, num_classes: int = 10, hidden: tuple[int, ...] = (128, 64)):
        super().__init__()
        dims = (in_features, *hidden)
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.out = nn.Linear(dims[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(x, 1)
        for layer in self.hidden:
            x = torch.relu(layer(x))
        return self.out(x)


def digits_cnn(num_classes: int = 10, sample_shape: tuple[int, ...] = (1, 8, 8)) -> nn.Module:
    if len(sample_shape) != 3:
        raise ValueError(f"digits_cnn takes images of shape (channels, height, width); the data has "
                         f"samples of shape {tuple(sample_shape)}. Use --model mlp for flat features")
    return DigitsCNN(num_classes, tuple(sample_shape))


def mlp(num_classes: int = 10, sample_shape: tuple[int, ...] = (1, 8, 8)) -> nn.Module:
    return MLP(math.prod(sample_shape), num_classes)
