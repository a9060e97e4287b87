"""The four networks of the paper's §5 (Table 1), defined here (no torchvision dependency).

Each matches the torchvision architecture of the same name module for module, so parameter
counts and layer order agree with what PyTorch users know:

=============  =========================  ==============  ====================================
network        cgdp name                  parameters      paper, Table 1
=============  =========================  ==============  ====================================
AlexNet        ``alexnet``                61,100,840      60 M (Caffe's grouped AlexNet)
AlexNet        ``alexnet_caffe``          60,965,224      60 M; per layer equal to Table 4
GoogLeNet-v1   ``googlenet``              6,624,904       7 M
VGG-16         ``vgg16``                  138,357,544     138 M
ResNet-152     ``resnet152``              60,192,808      49 M (see below)
=============  =========================  ==============  ====================================

AlexNet comes in two flavours. The paper ran BVLC/Caffe's ``bvlc_alexnet``: 96-256-384-384-256
channels, conv2/4/5 split in two groups (a relic of the original two-GPU training), LRN after
conv1 and conv2, 227x227 inputs; its per-layer counts are Table 4's (0.03, 0.3, 0.9, 0.7, 0.4,
37.8, 16.8, 4 million). torchvision's ``alexnet`` (the "one weird trick" variant, 64-192-384-256-256,
no groups, no LRN, 224x224) has 61.1 M parameters with a different split over the conv layers.
The presets use torchvision's, since it is the network PyTorch users run; ``alexnet_caffe`` is
there to reproduce Table 4 layer by layer.

GoogLeNet follows torchvision: BatchNorm after every convolution (conv bias off), the "5x5"
branch built from a 3x3 convolution as torchvision does, and no auxiliary classifiers (they
only add a training-time loss; the forward returns the main logits so every loss function
works). Caffe's ``bvlc_googlenet`` (LRN, true 5x5, no BN) has 7.0 M parameters without its
auxiliary heads, which is Table 1's figure.

ResNet-152 is torchvision's (v1.5: stride in the 3x3 convolution), 60.2 M parameters, the
count He et al.'s published model has too. Table 1's 49 M matches neither; we keep the
standard network and report the difference rather than alter it.

Dropout (AlexNet, VGG-16, GoogLeNet) draws random numbers on every replica, each from its own
device's stream (on CPU-emulated devices too: :mod:`cgdp.engine.backend.rng`), so runs with
dropout are bitwise reproducible and resume bitwise from a checkpoint.
"""
from __future__ import annotations

import torch
from torch import nn


def _init(model: nn.Module) -> nn.Module:
    """torchvision's initialisation (He-normal convolutions, N(0, 0.01) linear layers)."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)
    return model


# ----------------------------------------------------------------------------------- AlexNet
def alexnet(num_classes: int = 1000) -> nn.Module:
    """torchvision's AlexNet (224x224 inputs)."""
    features = nn.Sequential(
        nn.Conv2d(3, 64, 11, stride=4, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2))
    return _init(_Classifier(features, nn.AdaptiveAvgPool2d((6, 6)), 256 * 6 * 6, num_classes))


def alexnet_caffe(num_classes: int = 1000) -> nn.Module:
    """BVLC/Caffe's ``bvlc_alexnet`` (227x227 inputs, grouped convolutions, LRN): the paper's."""
    def lrn() -> nn.Module:
        return nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75)
    features = nn.Sequential(
        nn.Conv2d(3, 96, 11, stride=4), nn.ReLU(inplace=True), lrn(), nn.MaxPool2d(3, 2),
        nn.Conv2d(96, 256, 5, padding=2, groups=2), nn.ReLU(inplace=True), lrn(), nn.MaxPool2d(3, 2),
        nn.Conv2d(256, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 384, 3, padding=1, groups=2), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, 3, padding=1, groups=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2))
    return _init(_Classifier(features, nn.Identity(), 256 * 6 * 6, num_classes))


class _Classifier(nn.Module):
    """AlexNet/VGG head: features, pooling, then two 4096-wide dropout + ReLU layers."""

    def __init__(self, features: nn.Module, pool: nn.Module, flat: int, num_classes: int,
                 dropout_first: bool = True):
        super().__init__()
        self.features, self.avgpool = features, pool
        # module order as torchvision's, so state_dict keys match: AlexNet drops out before each
        # hidden Linear, VGG after
        def hidden(cin: int) -> list[nn.Module]:
            if dropout_first:
                return [nn.Dropout(0.5), nn.Linear(cin, 4096), nn.ReLU(inplace=True)]
            return [nn.Linear(cin, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5)]
        self.classifier = nn.Sequential(*hidden(flat), *hidden(4096), nn.Linear(4096, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# ------------------------------------------------------------------------------------ VGG-16
def vgg16(num_classes: int = 1000) -> nn.Module:
    """VGG-16 (configuration D) without BatchNorm, as torchvision's ``vgg16``."""
    layers: list[nn.Module] = []
    c = 3
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU(inplace=True)]
            c = v
    return _init(_Classifier(nn.Sequential(*layers), nn.AdaptiveAvgPool2d((7, 7)), 512 * 7 * 7,
                             num_classes, dropout_first=False))


# -------------------------------------------------------------------------------- GoogLeNet
class BasicConv2d(nn.Module):
    def __init__(self, cin: int, cout: int, **kw):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, bias=False, **kw)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class Inception(nn.Module):
    def __init__(self, cin: int, c1: int, c3r: int, c3: int, c5r: int, c5: int, pool: int):
        super().__init__()
        self.branch1 = BasicConv2d(cin, c1, kernel_size=1)
        self.branch2 = nn.Sequential(BasicConv2d(cin, c3r, kernel_size=1),
                                     BasicConv2d(c3r, c3, kernel_size=3, padding=1))
        self.branch3 = nn.Sequential(BasicConv2d(cin, c5r, kernel_size=1),
                                     BasicConv2d(c5r, c5, kernel_size=3, padding=1))
        self.branch4 = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1, ceil_mode=True),
                                     BasicConv2d(cin, pool, kernel_size=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


class GoogLeNet(nn.Module):
    """Inception-v1 as torchvision's ``googlenet(aux_logits=False)``."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1 = BasicConv2d(3, 64, kernel_size=7, stride=2, padding=3)
        self.maxpool1 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.conv2 = BasicConv2d(64, 64, kernel_size=1)
        self.conv3 = BasicConv2d(64, 192, kernel_size=3, padding=1)
        self.maxpool2 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.inception3a = Inception(192, 64, 96, 128, 16, 32, 32)
        self.inception3b = Inception(256, 128, 128, 192, 32, 96, 64)
        self.maxpool3 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.inception4a = Inception(480, 192, 96, 208, 16, 48, 64)
        self.inception4b = Inception(512, 160, 112, 224, 24, 64, 64)
        self.inception4c = Inception(512, 128, 128, 256, 24, 64, 64)
        self.inception4d = Inception(512, 112, 144, 288, 32, 64, 64)
        self.inception4e = Inception(528, 256, 160, 320, 32, 128, 128)
        self.maxpool4 = nn.MaxPool2d(2, stride=2, ceil_mode=True)
        self.inception5a = Inception(832, 256, 160, 320, 32, 128, 128)
        self.inception5b = Inception(832, 384, 192, 384, 48, 128, 128)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(1024, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool1(self.conv1(x))
        x = self.maxpool2(self.conv3(self.conv2(x)))
        x = self.maxpool3(self.inception3b(self.inception3a(x)))
        for m in (self.inception4a, self.inception4b, self.inception4c, self.inception4d, self.inception4e):
            x = m(x)
        x = self.inception5b(self.inception5a(self.maxpool4(x)))
        return self.fc(self.dropout(torch.flatten(self.avgpool(x), 1)))


def googlenet(num_classes: int = 1000) -> nn.Module:
    model = GoogLeNet(num_classes)
    for m in model.modules():  # torchvision: truncated normal, std 0.01
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.trunc_normal_(m.weight, mean=0.0, std=0.01, a=-2, b=2)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    return model


# ------------------------------------------------------------------------------- ResNet-152
class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, blocks: tuple[int, int, int, int], num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._stage(64, blocks[0], 1)
        self.layer2 = self._stage(128, blocks[1], 2)
        self.layer3 = self._stage(256, blocks[2], 2)
        self.layer4 = self._stage(512, blocks[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)

    def _stage(self, width: int, n: int, stride: int) -> nn.Sequential:
        cout = width * Bottleneck.expansion
        down = None
        if stride != 1 or self.inplanes != cout:
            down = nn.Sequential(nn.Conv2d(self.inplanes, cout, 1, stride=stride, bias=False),
                                 nn.BatchNorm2d(cout))
        layers = [Bottleneck(self.inplanes, width, stride, down)]
        self.inplanes = cout
        layers += [Bottleneck(cout, width) for _ in range(1, n)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet152(num_classes: int = 1000) -> nn.Module:
    model = ResNet((3, 8, 36, 3), num_classes)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    return model
