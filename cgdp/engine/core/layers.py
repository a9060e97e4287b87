"""Layers: the modules that directly own trainable parameters, in forward order (``model.modules()``). A shared (tied)
parameter belongs to the first of them: its gradient is complete only after that earliest user's backward. A layer whose
parameters all belong to an earlier one keeps its number but owns nothing."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Collection

import torch
from torch import nn

from cgdp.engine.core.precision import PARAMETER_DTYPES


@dataclass(frozen=True)
class LayerInfo:
    index: int
    """Position in forward order."""
    name: str
    """Qualified module name (``""`` for the root module)."""
    param_names: tuple[str, ...]
    """Qualified names of the parameters this layer owns, in registration order."""
    numels: tuple[int, ...]
    """Element counts of those parameters."""

    @property
    def numel(self) -> int:
        return sum(self.numels)


def find_layers(model: nn.Module, skip: Collection[int] = ()) -> tuple[list[LayerInfo], list[list[nn.Parameter]]]:
    """The layer table and each layer's parameters; ``skip``: ids left out as if frozen (sparse ones)."""
    infos: list[LayerInfo] = []
    params: list[list[nn.Parameter]] = []
    claimed: set[int] = set()
    for mod_name, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad and id(p) not in skip]
        if not own:
            continue
        mine = [(n, p) for n, p in own if id(p) not in claimed]
        claimed.update(id(p) for _, p in mine)
        prefix = f"{mod_name}." if mod_name else ""
        infos.append(LayerInfo(len(infos), mod_name, tuple(prefix + n for n, _ in mine),
                               tuple(p.numel() for _, p in mine)))
        params.append([p for _, p in mine])
    return infos, params


def trainable_dtype(params: list[list[nn.Parameter]]) -> torch.dtype:
    """The one floating dtype of the trainable parameters (float32, float64, bfloat16 or float16)."""
    dtypes = {p.dtype for layer in params for p in layer}
    if len(dtypes) != 1:
        raise TypeError(f"all trainable parameters must share one dtype for the flat gradient buffer; "
                        f"found {sorted(str(d) for d in dtypes)}. Cast the whole model first, e.g. "
                        f"model.float() or model.to(torch.bfloat16)")
    dtype = dtypes.pop()
    if dtype not in PARAMETER_DTYPES:
        raise TypeError(f"trainable parameters are {dtype}; cgdp trains float32, float64, bfloat16 or "
                        f"float16 parameters. Cast the model, e.g. model.float()")
    return dtype


def nonfinite_layers(params: list[nn.Parameter], layer_pids: list[list[int]], names: list[str]) -> str:
    """Layers whose gradient on this replica holds NaN/Inf, for the error message."""
    bad = [names[i] or "<root>" for i, pids in enumerate(layer_pids)
           if any(params[p].grad is not None and not bool(torch.isfinite(params[p].grad).all()) for p in pids)]
    return ", ".join(bad) or "unknown"


def number_params(layer_params: list[list[nn.Parameter]]) -> list[list[int]]:
    """Per layer, its parameters' engine numbers (pids), in flat-buffer order."""
    pids = itertools.count()
    return [[next(pids) for _ in layer] for layer in layer_params]
