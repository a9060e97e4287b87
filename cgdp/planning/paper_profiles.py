"""Built-in per-layer profiles of the paper's four networks, for planning without running them.

Parameter counts come from the architectures (AlexNet's are the paper's Table 4 figures); per-layer
backward time is the network's total backward time split in proportion to each layer's
multiply-accumulates, since the paper publishes only totals. Totals (per GPU, the paper's P100 and
minibatch sizes, Table 1):

* AlexNet: forward 50.6 ms, backward 104 ms, update 5.1 ms (Table 3, BVLC/Caffe, 4 GPUs).
* GoogLeNet-v1, VGGNet-16: Table 2's one-GPU iteration, split forward:backward = 1:2.06 as AlexNet's
  Table 3, update time in proportion to parameters (AlexNet: 5.1 ms for 61M).
* ResNet-152: one-GPU iteration about 0.35 s at minibatch 12 (Figure 5), scaled to the minibatch.

Layers are numbered in forward order; each entry is (name, parameters, MACs per sample).
"""
from __future__ import annotations

from cgdp.planning.costs import ModelCosts

ALEXNET_TABLE4_PARAMS_M = [0.03, 0.3, 0.9, 0.7, 0.4, 37.8, 16.8, 4.0]
"""Table 4, layers 1..8 (millions of parameters)."""
ALEXNET_TABLE4_MS = {
    "d2h": [0.014, 0.066, 0.275, 0.174, 0.133, 12.146, 3.156, 0.760],
    "acc": [0.018, 0.155, 0.578, 0.465, 0.285, 13.074, 4.441, 1.263],
    "h2d": [0.007, 0.041, 0.123, 0.095, 0.064, 5.538, 2.568, 1.786],
}
"""Table 4 (4 GPUs, ms), layers 1..8 in forward order."""
ALEXNET_TABLE3_MS = {"BVLC": {"broadcast": 20.0, "forward": 50.6, "backward": 104.0, "grad-acc": 23.0,
                              "update": 5.1, "total": 202.7},
                     "TRL": {"forward": 51.0, "backward": 111.0, "remaining": 21.8e-3, "update": 5.1,
                             "total": 167.1}}
TABLE2_MS = {"AlexNet": {"BVLC": [157.2, 174.3, 202.7], "TRL": [157.4, 163.6, 167.1]},
             "GoogLeNet-v1": {"BVLC": [140.0, 151.7, 163.4], "TRL": [140.9, 151.9, 156.7]},
             "VGGNet-16": {"BVLC": [345.6, 383.7, 445.6], "TRL": [345.2, 361.5, 369.1]}}
"""Table 2: one iteration (ms) on 1, 2, 4 GPUs."""


def _conv(name: str, cin: int, cout: int, k: int, hw: int, groups: int = 1, bias: bool = True):
    params = cout * (cin // groups) * k * k + (cout if bias else 0)
    return (name, params, cout * (cin // groups) * k * k * hw * hw)


def alexnet_layers() -> list[tuple[str, int, int]]:
    """Caffe's bvlc_alexnet (grouped conv2, conv4, conv5), parameters as in Table 4."""
    convs = [_conv("conv1", 3, 96, 11, 55), _conv("conv2", 96, 256, 5, 27, 2), _conv("conv3", 256, 384, 3, 13),
             _conv("conv4", 384, 384, 3, 13, 2), _conv("conv5", 384, 256, 3, 13, 2)]
    fcs = [("fc6", 9216 * 4096 + 4096, 9216 * 4096), ("fc7", 4096 * 4096 + 4096, 4096 * 4096),
           ("fc8", 4096 * 1000 + 1000, 4096 * 1000)]
    return convs + fcs


def vgg16_layers() -> list[tuple[str, int, int]]:
    cfg = [(3, 64, 224), (64, 64, 224), (64, 128, 112), (128, 128, 112), (128, 256, 56), (256, 256, 56),
           (256, 256, 56), (256, 512, 28), (512, 512, 28), (512, 512, 28), (512, 512, 14), (512, 512, 14),
           (512, 512, 14)]
    out = [_conv(f"conv{i + 1}", a, b, 3, hw) for i, (a, b, hw) in enumerate(cfg)]
    return out + [("fc6", 25088 * 4096 + 4096, 25088 * 4096), ("fc7", 4096 * 4096 + 4096, 4096 * 4096),
                  ("fc8", 4096 * 1000 + 1000, 4096 * 1000)]


def googlenet_layers() -> list[tuple[str, int, int]]:
    """Inception-v1 without the auxiliary classifiers (58 layers, about 7M parameters)."""
    out = [_conv("conv1", 3, 64, 7, 112), _conv("conv2r", 64, 64, 1, 56), _conv("conv2", 64, 192, 3, 56)]
    incs = [("3a", 192, 64, 96, 128, 16, 32, 32, 28), ("3b", 256, 128, 128, 192, 32, 96, 64, 28),
            ("4a", 480, 192, 96, 208, 16, 48, 64, 14), ("4b", 512, 160, 112, 224, 24, 64, 64, 14),
            ("4c", 512, 128, 128, 256, 24, 64, 64, 14), ("4d", 512, 112, 144, 288, 32, 64, 64, 14),
            ("4e", 528, 256, 160, 320, 32, 128, 128, 14), ("5a", 832, 256, 160, 320, 32, 128, 128, 7),
            ("5b", 832, 384, 192, 384, 48, 128, 128, 7)]
    for n, cin, c1, r3, c3, r5, c5, pp, hw in incs:
        out += [_conv(f"{n}/1x1", cin, c1, 1, hw), _conv(f"{n}/3x3r", cin, r3, 1, hw), _conv(f"{n}/3x3", r3, c3, 3, hw),
                _conv(f"{n}/5x5r", cin, r5, 1, hw), _conv(f"{n}/5x5", r5, c5, 5, hw), _conv(f"{n}/pool", cin, pp, 1, hw)]
    return out + [("fc", 1024 * 1000 + 1000, 1024 * 1000)]


def resnet152_layers() -> list[tuple[str, int, int]]:
    """ResNet-152's convolutions (no bias; BatchNorm folded in) and fc: 156 layers, about 60M
    parameters: a "flat" network, many similar small layers."""
    out = [_conv("conv1", 3, 64, 7, 112, bias=False)]
    cin = 64
    for stage, (blocks, mid, hw) in enumerate([(3, 64, 56), (8, 128, 28), (36, 256, 14), (3, 512, 7)]):
        for b in range(blocks):
            name = f"res{stage + 2}{b}"
            out += [_conv(f"{name}a", cin, mid, 1, hw, bias=False), _conv(f"{name}b", mid, mid, 3, hw, bias=False),
                    _conv(f"{name}c", mid, 4 * mid, 1, hw, bias=False)]
            if b == 0:
                out.append(_conv(f"{name}proj", cin, 4 * mid, 1, hw, bias=False))
            cin = 4 * mid
    return out + [("fc", 2048 * 1000 + 1000, 2048 * 1000)]


def _costs(layers: list[tuple[str, int, int]], forward_s: float, backward_s: float, update_s: float) -> ModelCosts:
    macs = sum(m for _, _, m in layers)
    return ModelCosts(layer_bytes=[4 * p for _, p, _ in layers],
                      backward_s=[backward_s * m / macs for _, _, m in layers],
                      forward_s=forward_s, update_s=update_s,
                      layer_tensors=[2] * len(layers))  # weight and bias (or the folded BatchNorm's pair)


def _split(iteration_s: float, params: int) -> tuple[float, float, float]:
    update = 5.1e-3 * params / 61.0e6
    fwd = (iteration_s - update) / 3.06
    return fwd, iteration_s - update - fwd, update


def paper_model(name: str, minibatch: int | None = None) -> ModelCosts:
    """Profile of ``alexnet``, ``googlenet``, ``vgg16`` or ``resnet152`` on one P100 (per GPU)."""
    key = name.lower().replace("-", "").replace("_", "")
    if key == "alexnet":
        layers = alexnet_layers()
        # Table 4's parameter counts, not the architecture's (they differ in rounding only)
        layers = [(n, int(p * 1e6), m) for (n, _, m), p in zip(layers, ALEXNET_TABLE4_PARAMS_M)]
        return _costs(layers, 50.6e-3, 104e-3, 5.1e-3)
    if key in ("googlenet", "googlenetv1"):
        layers = googlenet_layers()
        return _costs(layers, *_split(140.0e-3, sum(p for _, p, _ in layers)))
    if key in ("vgg16", "vggnet16"):
        layers = vgg16_layers()
        return _costs(layers, *_split(345.6e-3, sum(p for _, p, _ in layers)))
    if key == "resnet152":
        layers = resnet152_layers()
        it = 0.35 * (minibatch or 12) / 12
        return _costs(layers, *_split(it, sum(p for _, p, _ in layers)))
    raise ValueError(f"unknown paper model {name!r}; use alexnet, googlenet, vgg16 or resnet152")


PAPER_MODELS = ("alexnet", "googlenet", "vgg16", "resnet152")
