"""Model registry: every network ``python -m cgdp.train --model NAME`` can build.

A :class:`ModelSpec` names a builder ``build(num_classes, sample_shape) -> nn.Module`` and what the
trainer needs to feed it: the input shape of one sample (for synthetic data) and its class count,
plus, for the paper's networks, Table 1's per-GPU batch size and parameter count (millions) so
that reports can set measured against published figures. :func:`build_model` with
``device="meta"`` builds a network without allocating its weights (parameter counts of the
paper's networks in milliseconds).

May import: nothing of cgdp outside this package (the command line imports it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from cgdp.models import paper, small


@dataclass(frozen=True)
class ModelSpec:
    name: str
    """Registry key."""
    build: Callable[..., nn.Module]
    """``build(num_classes, sample_shape)`` → a freshly initialised module."""
    input_shape: tuple[int, ...]
    """Shape of one input sample the network was designed for (synthetic data uses it)."""
    num_classes: int
    """Classes of its usual dataset."""
    description: str
    """One line for ``--list-models``."""
    paper_batch: int | None = None
    """Per-GPU minibatch of the paper's Table 1 (None for models not in the paper)."""
    paper_params_m: float | None = None
    """Parameters (millions) in the paper's Table 1."""


def _fixed(fn: Callable[[int], nn.Module], shape: tuple[int, ...]) -> Callable[..., nn.Module]:
    """Wrap a builder whose input shape is fixed by its architecture."""
    def build(num_classes: int, sample_shape: tuple[int, ...] | None = None) -> nn.Module:
        if sample_shape is not None and tuple(sample_shape) != shape:
            raise ValueError(f"{fn.__name__} takes samples of shape {shape}; the data has "
                             f"{tuple(sample_shape)}. Give it data of that shape (--dataset synthetic "
                             f"without --input_shape makes it), or a model for your shape (--list-models)")
        return fn(num_classes)
    return build


_IMAGENET = (3, 224, 224)
MODELS: dict[str, ModelSpec] = {s.name: s for s in (
    ModelSpec("digits_cnn", small.digits_cnn, (1, 8, 8), 10,
              "small CNN for the bundled 8x8 digits (default job, ~98 % in seconds)"),
    ModelSpec("mlp", small.mlp, (1, 8, 8), 10, "two-hidden-layer MLP on flattened inputs"),
    ModelSpec("alexnet", _fixed(paper.alexnet, _IMAGENET), _IMAGENET, 1000,
              "AlexNet as torchvision (61.1 M)", 256, 60),
    ModelSpec("alexnet_caffe", _fixed(paper.alexnet_caffe, (3, 227, 227)), (3, 227, 227), 1000,
              "AlexNet as BVLC/Caffe, grouped convs (61.0 M, the paper's Table 4)", 256, 60),
    ModelSpec("googlenet", _fixed(paper.googlenet, _IMAGENET), _IMAGENET, 1000,
              "GoogLeNet-v1 as torchvision, no aux heads (6.6 M)", 64, 7),
    ModelSpec("vgg16", _fixed(paper.vgg16, _IMAGENET), _IMAGENET, 1000, "VGG-16 as torchvision (138.4 M)", 32, 138),
    ModelSpec("resnet152", _fixed(paper.resnet152, _IMAGENET), _IMAGENET, 1000,
              "ResNet-152 as torchvision (60.2 M)", 12, 49),
)}


def get_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name]


def build_model(name: str, num_classes: int | None = None, sample_shape: tuple[int, ...] | None = None,
                device: str | torch.device | None = None) -> nn.Module:
    """Build registered model ``name``; ``device="meta"`` allocates no weights."""
    spec = get_spec(name)
    classes = num_classes or spec.num_classes
    shape = tuple(sample_shape) if sample_shape is not None else spec.input_shape
    if device is None:
        return spec.build(classes, shape)
    with torch.device(device):
        return spec.build(classes, shape)


def count_params(model: nn.Module) -> int:
    """Trainable parameters (shared tensors counted once)."""
    seen = {id(p): p.numel() for p in model.parameters() if p.requires_grad}
    return sum(seen.values())
