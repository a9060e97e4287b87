"""Step 1 of the data path: split the global batch across devices, and weight each part.

The batch is split in device order as ``torch.tensor_split`` does; device j weighs ``n_j / N`` (N over all ranks), so
the weighted gradients sum to the gradient of the global mean loss, also for uneven splits. A batch of n < G samples
goes to the first n devices, one each; a device without samples runs no forward or backward and sends zeros. An empty
batch is refused.

:func:`split_batch` splits tensors that share the batch dimension; :func:`split_nested` any nesting of tuples, lists and
mappings: N is the first dimension most of its tensors share, tensors with it are split, every other value goes whole to
every device. Parts are views until :func:`to_device` copies them on the device's thread. Micro-batches split each part
again (:func:`split_tree`), each weighing its own samples / N.
"""
from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping
from functools import partial
from typing import Any, Callable

import torch

from cgdp.engine.backend.cuda_runtime import upload

Part = tuple[Any, torch.Tensor]
"""One device's ``(inputs, targets)``; inputs a tensor or a tuple of tensors."""


def split_batch(inputs: Any, targets: Any, g: int) -> tuple[list[Part], list[int]]:
    """``(inputs, targets)`` in ``g`` parts (only the ``min(n, g)`` with samples), and every device's sample count."""
    many = isinstance(inputs, (tuple, list))
    xs = tuple(inputs) if many else (inputs,)
    if not xs or not all(isinstance(x, torch.Tensor) for x in xs):
        raise TypeError("inputs must be a tensor (or a tuple of tensors passed as model(*inputs)) "
                        "whose first dimension is the batch")
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a tensor whose first dimension is the batch, got "
                        f"{type(targets).__name__}")
    n = xs[0].shape[0] if xs[0].dim() else 0
    for x in (*xs, targets):
        if x.dim() == 0 or x.shape[0] != n:
            raise ValueError(f"inputs and targets must share the batch dimension; got shapes "
                             f"{[tuple(t.shape) for t in (*xs, targets)]}")
    check_not_empty(n)
    split_x = [torch.tensor_split(x, g) for x in xs]
    split_y = torch.tensor_split(targets, g)
    # a batch smaller than the devices: the first n get a sample each
    parts = [(tuple(s[j] for s in split_x) if many else split_x[0][j], split_y[j]) for j in range(min(n, g))]
    return parts, [int(s.shape[0]) for s in split_y]


def check_not_empty(n: int) -> None:
    if n == 0:
        raise ValueError("cgdp.Trainer got an empty batch (first dimension 0): there is nothing to train on; "
                         "skip empty batches")


def split_nested(batch: Any, g: int) -> tuple[list[Any], list[int], frozenset[int]]:
    """``batch`` in ``g`` parts of its structure (only those with samples), every device's sample count, and the ids of
    the tensors that went whole into every part."""
    found: list[tuple[str, torch.Tensor]] = []

    def note(t: torch.Tensor, where: str) -> torch.Tensor:
        found.append((where, t))
        return t
    _map(batch, note)
    _refuse_ragged_records(batch)
    dims = Counter(t.shape[0] for _, t in found if t.dim() > 0)
    if not dims:
        raise ValueError(f"cannot split the batch across devices: it holds no tensor with a batch "
                         f"dimension (found {_describe(found) or 'no tensor at all'}). Pass a tensor, or "
                         f"a tuple, list or dict of tensors whose first dimension is the batch")
    ranked = dims.most_common()
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        raise ValueError(f"cannot tell the batch dimension: the batch holds as many tensors of first "
                         f"dimension {ranked[0][0]} as of {ranked[1][0]} ({_describe(found)}). cgdp splits the "
                         f"tensors whose first dimension most tensors share; pass values that are not "
                         f"per-sample to loss_fn through its closure instead of the batch")
    n = ranked[0][0]
    check_not_empty(n)
    whole = frozenset(id(t) for _, t in found if t.dim() == 0 or t.shape[0] != n)
    return split_tree(batch, n, g)[:n], [_piece_size(n, g, j) for j in range(g)], whole


def _refuse_ragged_records(tree: Any, where: str = "batch") -> None:
    """Per-sample records (dicts with the same keys) whose tensors differ in length: their lengths are not the batch,
    and counting them could pick one as the batch size."""
    records = isinstance(tree, list) and len(tree) > 1 and all(isinstance(r, Mapping) for r in tree)
    if records and len({tuple(r) for r in tree}) == 1:
        for key in tree[0]:
            lengths = {r[key].shape[0] for r in tree if isinstance(r[key], torch.Tensor) and r[key].dim()}
            if len(lengths) > 1:
                raise ValueError(
                    f"cannot split the batch across devices: {where} is a list of {len(tree)} per-sample "
                    f"records whose {key!r} tensors have different first dimensions "
                    f"({sorted(lengths)[:6]}), and cgdp splits tensors by their first dimension only. "
                    f"Pad them into tensors whose first dimension is the batch (with a length per "
                    f"sample), or give each step a batch of tensors")
    if isinstance(tree, (Mapping, tuple, list)):
        for k, v in tree.items() if isinstance(tree, Mapping) else enumerate(tree):
            _refuse_ragged_records(v, f"{where}[{k!r}]")


def to_device(part: Any, device: torch.device) -> Any:
    """``part`` with every tensor copied to ``device``, host memory staged through page-locked memory."""
    return _map(part, lambda t, where: upload(t, device))


def _map(tree: Any, fn: Callable[[torch.Tensor, str], Any], where: str = "batch") -> Any:
    """``tree`` rebuilt with ``fn(tensor, path)`` in place of every tensor, containers kept."""
    if isinstance(tree, torch.Tensor):
        return fn(tree, where)
    if isinstance(tree, Mapping):
        items = {k: _map(v, fn, f"{where}[{k!r}]") for k, v in tree.items()}
        try:
            out = copy.copy(tree)  # keeps the mapping's type and attributes (BatchEncoding, defaultdict)
            for k, v in items.items():
                out[k] = v
            return out
        except TypeError:  # a read-only mapping: a dict of the same items
            return items
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a named tuple
        return type(tree)(*(_map(v, fn, f"{where}.{f}") for f, v in zip(tree._fields, tree)))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map(v, fn, f"{where}[{i}]") for i, v in enumerate(tree))
    return tree


def _describe(found: list[tuple[str, torch.Tensor]]) -> str:
    return ", ".join(f"{where}: shape {tuple(t.shape)}" for where, t in found[:6]) + (
        ", ..." if len(found) > 6 else "")


def check_micro_batches(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"micro_batches must be an int >= 1 (micro-batches per device and step), got {k!r}")
    return k


def split_tree(tree: Any, n: int, k: int, whole: frozenset[int] = frozenset()) -> list[Any]:
    """``tree`` in ``k`` pieces: tensors with first dimension ``n`` (not in ``whole``) split, the rest whole."""
    splits: dict[int, tuple[torch.Tensor, ...]] = {}

    def take(i: int, t: torch.Tensor, where: str) -> torch.Tensor:
        if id(t) in whole or t.dim() == 0 or t.shape[0] != n:
            return t
        if id(t) not in splits:
            splits[id(t)] = torch.tensor_split(t, k)
        return splits[id(t)][i]

    return [_map(tree, partial(take, i)) for i in range(k)]


def micro_rounds(parts: list[Any], sizes: list[int], total: int, k: int,
                 whole: frozenset[int] = frozenset()) -> list[tuple[list[Any], list[float]]]:
    """Each device's part in ``k`` micro-batches, by round: round i holds every device's i-th micro-batch and its weight
    (samples / ``total``; 0 for devices without samples, whose parts are absent)."""
    if k == 1:
        return [(list(parts), [n / total for n in sizes])]
    short = [j for j, n in enumerate(sizes) if 0 < n < k]  # (a device without samples stays idle)
    if short:
        raise ValueError(f"micro_batches={k} needs at least {k} samples on every device, but device "
                         f"{short[0]} gets {sizes[short[0]]} of this batch; use a larger batch or fewer "
                         f"micro-batches")
    split = [split_tree(part, n, k, whole) for part, n in zip(parts, sizes)]
    return [([s[i] for s in split], [_piece_size(n, k, i) / total for n in sizes]) for i in range(k)]


def _piece_size(n: int, k: int, i: int) -> int:
    """Size of piece i of ``torch.tensor_split`` of n samples into k pieces."""
    return n // k + (1 if i < n % k else 0)
