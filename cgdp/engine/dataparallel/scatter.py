"""``DataParallel``'s step 1 and its mirror image: scatter the arguments, gather the outputs.

**Scatter.** Every tensor argument with a batch dimension (nested ones too) is split along dim 0 in device order, as
``torch.tensor_split``; all must share that dimension (a 1-D tensor is a batch of scalars; if the forward then fails,
:func:`unbatched_note` says it may be one sample). A batch of n < G runs on the first n devices (the others send
zeros and step, as in ``Trainer``). Other arguments go to every replica; a call with nothing to split runs on replica 0.

**Gather.** Every replica returns the same structure (dataclasses such as ``ModelOutput`` too). Per tensor in it:

* dimension >= 1: concatenated along dim 0 on ``devices[0]``, in device order;
* a floating 0-dim tensor (a loss): ``sum_j w_j * t_j``, ``w_j = n_j / N`` (exact for per-sample means), or with
  ``sum_scalars`` ``w_j = 1`` (exact for shares of a global sum: a loss divided by ``num_items_in_batch``, whose use
  a :class:`GlobalCount` sees, not assumes: some models accept the count and ignore it);
* any other 0-dim tensor: stacked into a vector of G values, as ``nn.DataParallel``; other leaves kept if equal on
  every replica, else None with a warning.

One autograd function (:class:`_Gather`) makes every gathered tensor, so a backward visits it once: it calls
``on_backward`` (the engine readied), then hands each replica its share of the gradient.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch

from cgdp.engine.backend.cuda_runtime import upload
from cgdp.engine.core.user_warning import warn_user

_LEAF = "leaf"


def _flatten(obj: Any, leaves: list[Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return _LEAF
    if isinstance(obj, dict):  # a dict only, as nn.DataParallel: another Mapping (a UserDict) is a leaf
        keys, factory = list(obj.keys()), _Factory(obj.default_factory) if isinstance(obj, defaultdict) else None
        return ("map", type(obj), keys, [_flatten(obj[k], leaves) for k in keys], factory)
    if isinstance(obj, (tuple, list)):
        return ("seq", type(obj), [_flatten(o, leaves) for o in obj])
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj)]
        return ("dc", type(obj), names, [_flatten(getattr(obj, n), leaves) for n in names])
    leaves.append(obj)
    return _LEAF


def _unflatten(spec: Any, it) -> Any:
    if spec == _LEAF:
        return next(it)
    kind, cls = spec[0], spec[1]
    if kind == "seq":
        items = [_unflatten(s, it) for s in spec[2]]
        return cls(*items) if hasattr(cls, "_fields") else cls(items)  # a namedtuple, or tuple, list or a subclass
    values = {k: _unflatten(s, it) for k, s in zip(spec[2], spec[3])}
    if kind == "dc" or dataclasses.is_dataclass(cls):  # ModelOutput: a dict and a dataclass
        return cls(**values)
    return values if cls is dict else _rebuilt(cls, spec[4] and spec[4].factory, values)


@dataclasses.dataclass
class _Factory:
    """A defaultdict's factory in a spec, not compared: each replica's forward may make its own (a lambda)."""
    factory: Any = dataclasses.field(compare=False)


def _rebuilt(cls: type, factory: Any, values: dict) -> dict:
    """A dict subclass made again from its items, ``cls(items)`` as torch's scatter and gather (a defaultdict with its
    factory); a class whose constructor takes other arguments, or drops items, is refused with a sentence."""
    try:
        out = cls(factory, values) if issubclass(cls, defaultdict) else cls(values)
        if list(out.keys()) == list(values):
            return out
        raise ValueError(f"{cls.__qualname__}(items) made the keys {list(out.keys())}, not {list(values)}")
    except Exception as e:  # (the user's constructor: anything)
        raise TypeError(f"cgdp.DataParallel makes each dict of the arguments and outputs again from its items, and "
                        f"{cls.__module__}.{cls.__qualname__}(items) does not: pass or return a plain dict (dict(x)), "
                        f"or give {cls.__qualname__} a constructor that takes its items as dict's does") from e


def _paths(spec: Any, prefix: str = "output") -> list[str]:
    if spec == _LEAF:
        return [prefix]
    if spec[0] == "seq":
        return [p for i, s in enumerate(spec[2]) for p in _paths(s, f"{prefix}[{i}]")]
    dotted = spec[0] == "dc" or dataclasses.is_dataclass(spec[1])
    return [p for k, s in zip(spec[2], spec[3]) for p in _paths(s, f"{prefix}.{k}" if dotted else f"{prefix}[{k!r}]")]


def scatter(args: tuple, kwargs: dict, devices: Sequence[torch.device]) -> tuple[list[tuple[tuple, dict]], list[int]]:
    """Per device, its ``(args, kwargs)``; and each part's number of samples."""
    leaves: list[Any] = []
    spec = _flatten((tuple(args), dict(kwargs)), leaves)
    batched = [x for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0]
    n = batched[0].shape[0] if batched else 1  # nothing to split: replica 0 runs the whole call
    if any(x.shape[0] != n for x in batched):
        raise ValueError(f"cgdp.DataParallel splits every tensor argument along its first dimension, so "
                         f"they must all have the batch size there; got first dimensions "
                         f"{[x.shape[0] for x in batched]}. Keep tensors that are not per-sample in the "
                         f"module (a buffer) instead of passing them")
    if n == 0:
        raise ValueError("cgdp.DataParallel got an empty batch (first dimension 0): there is nothing to run; "
                         "skip empty batches")
    g = min(len(devices), n)
    split = [torch.tensor_split(x, g) if isinstance(x, torch.Tensor) and x.dim() > 0 else None for x in leaves]
    parts = []
    for j, dev in enumerate(devices[:g]):  # a tensor without a batch dimension goes whole to every replica
        mine = [upload(s[j], dev) if s is not None else upload(x, dev) if isinstance(x, torch.Tensor) else x
                for x, s in zip(leaves, split)]
        parts.append(_unflatten(spec, iter(mine)))
    sizes = [int(s.shape[0]) for s in torch.tensor_split(torch.empty(n, 0), g)]
    return parts, sizes


def unbatched_note(args: tuple, kwargs: dict, sizes: Sequence[int]) -> str | None:
    """For a forward that raised: when every tensor split was 1-D, perhaps one sample without a batch dimension
    (a 1-D tensor is also a batch of scalars or labels, so this is said on an error only, never refused)."""
    leaves: list[Any] = []
    _flatten((tuple(args), dict(kwargs)), leaves)
    split = [x for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0]
    if len(sizes) < 2 or any(x.dim() != 1 for x in split):
        return None
    shapes = ", ".join(str(tuple(x.shape)) for x in split)
    return (f"cgdp.DataParallel split the 1-D tensor input{'s' if len(split) > 1 else ''} of shape {shapes} along "
            f"its only dimension, as a batch of {sum(sizes)} samples ({' + '.join(map(str, sizes))} over the "
            f"devices): if it is one sample without a batch dimension, give it one, model(x.unsqueeze(0)) (the "
            f"output then has one too)")


COUNT = "num_items_in_batch"


class GlobalCount(torch.Tensor):
    """``num_items_in_batch`` as a replica gets it: ``used`` notes any torch operation on it (results are plain)."""

    used: bool

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, GlobalCount):
                    t.used = True
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def watch_counts(parts: list[tuple[tuple, dict]], devices: Sequence[torch.device]) -> list[GlobalCount]:
    counts = []
    for (_, kw), dev in zip(parts, devices):
        n = kw.get(COUNT)
        if isinstance(n, torch.Tensor) and n.dim() == 0:
            c = n.as_subclass(GlobalCount)
        elif isinstance(n, (int, float)) and not isinstance(n, bool):
            c = torch.full((), n, device=dev).as_subclass(GlobalCount)  # a number reaches it as a tensor
        else:
            continue
        c.used = False
        kw[COUNT] = c
        counts.append(c)
    return counts


@dataclasses.dataclass
class _Plan:
    """What :class:`_Gather` needs to split gradients back; lists are per tensor leaf, then per replica."""
    kinds: list[str]  # "cat", "wsum" or "stack"
    devices: list[list[torch.device]]
    lengths: list[list[int]]  # sizes along dim 0 ("cat")
    weights: list[float]  # w_j of each replica's scalars
    dst: torch.device
    on_backward: Callable[[], None] | None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, *tensors: torch.Tensor):
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        outs = _combine_all(plan.kinds, tensors, plan.weights, plan.dst)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        plan: _Plan = ctx.plan
        if plan.on_backward is not None:
            plan.on_backward()  # before any replica's gradient exists: DataParallel arms the engine
        out: list[torch.Tensor | None] = [None]
        for kind, grad, devs, lengths in zip(plan.kinds, grads, plan.devices, plan.lengths):
            if grad is None or kind == "stack":
                out += [None] * len(devs)
            elif kind == "cat":
                out += [p.to(d, non_blocking=True) for p, d in zip(torch.split(grad, lengths), devs)]
            else:
                out += [(grad * w).to(d, non_blocking=True) for w, d in zip(plan.weights, devs)]
        return tuple(out)


def _combine_all(kinds: list[str], tensors: Sequence[torch.Tensor], weights: Sequence[float],
                 dst: torch.device) -> list[torch.Tensor]:
    g = len(weights)
    return [_combine(k, tensors[i * g:(i + 1) * g], weights, dst) for i, k in enumerate(kinds)]


def _combine(kind: str, ts: Sequence[torch.Tensor], weights: Sequence[float], dst: torch.device) -> torch.Tensor:
    if kind == "cat":
        return torch.cat([t.to(dst) for t in ts], 0)
    if kind == "stack":
        return torch.stack([t.to(dst) for t in ts])
    acc = ts[0].to(dst) * weights[0]
    for t, w in zip(ts[1:], weights[1:]):
        acc = acc + t.to(dst) * w
    return acc


_warned: set[str] = set()
_GATHERED = object()


def gather(outputs: Sequence[Any], sizes: Sequence[int], dst: torch.device,
           on_backward: Callable[[], None] | None, sum_scalars: bool = False) -> Any:
    flat: list[list[Any]] = [[] for _ in outputs]
    specs = [_flatten(o, leaves) for o, leaves in zip(outputs, flat)]
    if any(s != specs[0] for s in specs[1:]):
        raise ValueError("the replicas of cgdp.DataParallel returned outputs of different structure "
                         "(keys or lengths); the model's output must not depend on the batch's content")
    total = sum(sizes)
    weights = [1.0] * len(sizes) if sum_scalars else [n / total for n in sizes]
    names = _paths(specs[0])
    kinds, devs, lengths, tensors, result = [], [], [], [], []
    for name, vals in zip(names, zip(*flat)):
        if all(isinstance(v, torch.Tensor) for v in vals):
            kinds.append("cat" if vals[0].dim() > 0 else "wsum" if vals[0].is_floating_point() else "stack")
            devs.append([v.device for v in vals])
            lengths.append([v.shape[0] if v.dim() else 0 for v in vals])
            tensors += vals
            result.append(_GATHERED)  # filled below
        elif any(isinstance(v, torch.Tensor) for v in vals):  # (equal to a number elsewhere is not the same)
            result.append(_none_said(name, "Tensor", "it is a tensor on some replicas only"))
        else:
            result.append(_same_or_none(vals, name))
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        combined = iter(_Gather.apply(_Plan(kinds, devs, lengths, weights, dst, on_backward), *tensors))
    else:  # (no tensor: nothing combined)
        combined = iter(_combine_all(kinds, tensors, weights, dst))
    result = [next(combined) if r is _GATHERED else r for r in result]
    return _unflatten(specs[0], iter(result))


def _same_or_none(vals: list[Any], name: str) -> Any:
    first = vals[0]
    try:
        same = all(v is first or bool(v == first) for v in vals[1:])
    except Exception:  # objects without a usable ==
        same = False
    return first if same else _none_said(name, type(first).__name__, "it differs between replicas and is not a tensor")


def _none_said(name: str, kind: str, why: str) -> None:
    if f"{name}:{kind}" not in _warned:
        _warned.add(f"{name}:{kind}")
        warn_user(f"cgdp.DataParallel cannot gather {name} ({kind}): {why}; it is None in the gathered output "
                  f"(for transformers models, pass use_cache=False)")
