"""Chunk plans: which layers travel to the host together.

A *layer* is a module that directly owns trainable parameters (see :mod:`cgdp.engine.core.layers`); layers are
numbered 0..L-1 in forward order. A *chunk plan* is a list of chunks in the order they are sent
(backward order first), each chunk a list of layer indices. Every layer appears in exactly one
chunk. The engine lays out each device's flat gradient buffer in plan order, so that a chunk is one
contiguous slice and travels as a single copy.
"""
from __future__ import annotations

import numbers
from typing import Sequence

Plan = list[list[int]]


def _check_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def paper_plan(num_layers: int, k: int) -> Plan:
    """The paper's uniform plan with chunk size ``k`` (Le et al., §4.2).

    Chunks come in backward order, each chunk's layers in descending order. If ``num_layers % k
    == 0``: ``num_layers/k - 1`` chunks of size k, then k chunks of size 1; otherwise
    ``num_layers // k`` chunks of size k, then ``num_layers % k`` chunks of size 1. The last few
    layers of backward travel alone because nothing is left to hide their cost behind.
    """
    num_layers = _check_int(num_layers, "num_layers")
    k = _check_int(k, "chunk size k")
    if k < 1:
        raise ValueError(f"chunk size k must be >= 1 (got {k}); use k=1 for one layer per chunk")
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0 (got {num_layers})")
    if num_layers % k == 0:
        big, singles = num_layers // k - 1, k
    else:
        big, singles = num_layers // k, num_layers % k
    big = max(big, 0)
    plan: Plan = []
    top = num_layers - 1
    for _ in range(big):
        plan.append(list(range(top, top - k, -1)))
        top -= k
    for _ in range(singles):
        plan.append([top])
        top -= 1
    return plan


def one_chunk_plan(num_layers: int) -> Plan:
    """All layers in a single chunk: the whole gradient is sent after backward (no overlap)."""
    return [list(range(num_layers - 1, -1, -1))] if num_layers else []


def resolve_plan(chunks: object, num_layers: int) -> Plan:
    """Turn the ``chunks=`` argument (an int k or an explicit plan) into a validated plan."""
    if isinstance(chunks, numbers.Integral) and not isinstance(chunks, bool):
        return paper_plan(num_layers, int(chunks))
    if isinstance(chunks, (list, tuple)):
        return validate_plan(chunks, num_layers)
    raise TypeError(
        f"chunks must be an int chunk size, an explicit plan (a list of lists of layer indices) "
        f"or 'auto'; got {type(chunks).__name__} {chunks!r}")


def validate_plan(plan: Sequence[Sequence[int]], num_layers: int) -> Plan:
    """Check that ``plan`` names every layer 0..num_layers-1 exactly once, in non-empty chunks."""
    out: Plan = []
    seen: dict[int, int] = {}
    for ci, chunk in enumerate(plan):
        if isinstance(chunk, (str, bytes)) or not isinstance(chunk, Sequence):
            raise TypeError(f"chunk plan entry {ci} must be a list of layer indices, got {chunk!r}")
        if len(chunk) == 0:
            raise ValueError(f"chunk {ci} of the plan is empty; every chunk needs at least one layer")
        row = []
        for layer in chunk:
            layer = _check_int(layer, f"layer index in chunk {ci}")
            if not 0 <= layer < num_layers:
                raise ValueError(
                    f"chunk {ci} names layer {layer}, but the model has {num_layers} layers "
                    f"(0..{num_layers - 1}); see Trainer.layer_names for the numbering")
            if layer in seen:
                raise ValueError(f"layer {layer} appears in chunk {seen[layer]} and again in chunk {ci}; "
                                 f"each layer must be in exactly one chunk")
            seen[layer] = ci
            row.append(layer)
        out.append(row)
    missing = sorted(set(range(num_layers)) - set(seen))
    if missing:
        raise ValueError(f"the chunk plan leaves out layer(s) {missing}; every layer 0..{num_layers - 1} "
                         f"must be in exactly one chunk")
    return out
