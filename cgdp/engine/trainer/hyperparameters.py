"""Step 7 of the data path, around the optimizers: what the trainer checks and changes on every replica alike, so that
they stay bitwise identical.

* :func:`check_hyperparameters`: before each update, every optimizer's param-group values must equal optimizer 0's; a
  change on one replica is an error, not a drift. Tensor values on a device are compared there, without a host wait; the
  count of differences is read with the step's losses and rejects the step before the update (:func:`verdict`).
* :func:`agree_on_step` (MPI): the step's one small allreduce carries a hyperparameter digest: every rank rejects alike.
* :class:`Schedulers`: one scheduler per optimizer, stepped together after every applied update, saved as one
  (``ReduceLROnPlateau`` is stepped by the user: ``for s in trainer.schedulers: s.step(metric)``).
"""
from __future__ import annotations

import copy
import functools
import hashlib
import math
import operator
import re
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch

from cgdp.comm import Comm


class HyperparameterMismatchError(ValueError):
    """The optimizers' param groups differ between replicas; the update was not applied."""


_HOST = torch.device("cpu")


def _same(a: Any, b: Any, differ: list[torch.Tensor] | None = None) -> bool:
    """``a == b``; with ``differ``, device tensors are compared there (their differing count appended; True for now)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return False
        if differ is not None and _HOST not in (a.device, b.device):
            with torch.no_grad():  # device to device: no host wait (NaN differs, as in torch.equal)
                differ.append((a.detach() != b.detach().to(a.device, non_blocking=True)).sum())
            return True
        return torch.equal(a.detach().cpu(), b.detach().cpu())
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


_PLAIN_TYPES = frozenset((int, float, bool, str, type(None)))
_WITH_TUPLES = _PLAIN_TYPES | {tuple}


def _plain_values(opt: torch.optim.Optimizer) -> list[list] | None:
    """Sorted (key, type, value) rows of the param groups, or None if a value is not a plain Python value or is NaN.
    C-level calls only: it runs every step on every optimizer."""
    out = []
    for g in opt.param_groups:
        d = dict(g)
        del d["params"]
        values = d.values()
        types = set(map(type, values))
        if not types <= _PLAIN_TYPES and not (
                types <= _WITH_TUPLES and all(set(map(type, v)) <= _PLAIN_TYPES for v in values if type(v) is tuple)):
            return None
        if float in types and not all(map(operator.eq, values, values)):  # NaN: only the detailed check sees it
            return None
        out.append(sorted(zip(d, map(type, values), values)))
    return out


def check_hyperparameters(optimizers: Sequence[torch.optim.Optimizer],
                          on_devices: bool = False) -> torch.Tensor | None:
    """Raise :class:`HyperparameterMismatchError` if any optimizer's param-group values differ from optimizer 0's.
    ``on_devices``: device tensors are compared there; returns how many differ (None if none) for :func:`verdict`."""
    fast = _plain_values(optimizers[0])
    if fast is not None and all(_plain_values(o) == fast for o in optimizers[1:]):
        return None  # every value a plain number, string or tuple, and all equal (the per-step case)
    differ: list[torch.Tensor] | None = [] if on_devices else None
    first = optimizers[0].param_groups
    for j, opt in enumerate(optimizers[1:], start=1):
        groups = opt.param_groups
        if len(groups) != len(first):
            raise HyperparameterMismatchError(
                f"optimizer {j} has {len(groups)} param group(s) but optimizer 0 has {len(first)}; "
                f"every replica's optimizer must have the same groups. The update was not applied")
        for g, (a, b) in enumerate(zip(first, groups)):
            for key in sorted((set(a) | set(b)) - {"params"}):
                if key not in a or key not in b or not _same(a[key], b[key], differ):
                    raise HyperparameterMismatchError(
                        f"trainer.optimizers[{j}].param_groups[{g}][{key!r}] is {b.get(key)!r} but "
                        f"optimizers[0] has {a.get(key)!r}: the replicas would drift apart, so the "
                        f"update was not applied. Change a hyperparameter on every optimizer "
                        f"(for opt in trainer.optimizers: opt.param_groups[{g}][{key!r}] = ...), or "
                        f"pass Trainer(..., scheduler=lambda opt: ...) to schedule it")
    if not differ:
        return None
    return functools.reduce(lambda total, d: total + d.to(total.device, non_blocking=True), differ)  # device to device


def verdict(differ: float, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """After the step's read: if ``differ`` > 0, compare again on the host for the message and reject the step."""
    if differ:
        check_hyperparameters(optimizers)
        raise HyperparameterMismatchError("the optimizers' tensor hyperparameters differ between the replicas; "
                                          "the update was not applied")


def _plain(v: Any) -> Any:
    """A value whose repr is the same on every rank (an object's default repr holds its address)."""
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().tolist()
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return type(v).__qualname__


def agree_on_step(comm: Comm, loss: float, bad: float, norm: float, touched: np.ndarray,
                  optimizers: Sequence[torch.optim.Optimizer]) -> tuple[float, float, float, np.ndarray]:
    """One small allreduce over every rank: the summed loss and NaN/Inf count, rank 0's clipping norm (other CPUs may
    round its last bits differently), per parameter the devices that got a gradient, and a hyperparameter digest
    ``[mismatch, h, h * h]`` with ``h`` a 16-bit hash of optimizer 0's values: summed over R ranks, they agree iff
    ``R * Σh² == (Σh)²`` (exact in float64), so every rank reaches the same verdict (and raises on a mismatch)."""
    try:
        check_hyperparameters(optimizers)
        mismatch = 0.0
    except HyperparameterMismatchError:
        mismatch = 1.0
    text = repr([sorted(((k, _plain(v)) for k, v in g.items() if k != "params"), key=str)
                 for g in optimizers[0].param_groups])
    h = float(int.from_bytes(hashlib.sha256(text.encode()).digest()[:2], "little"))
    norm0 = norm if comm.rank == 0 else 0.0
    vec = comm.allreduce_small(np.concatenate([[loss, bad, norm0], [mismatch, h, h * h], touched]))
    mismatch, h, hh = vec[3:6]
    if mismatch:
        check_hyperparameters(optimizers)  # this rank's own message, if it is the one that differs
        raise HyperparameterMismatchError(
            "the optimizers' hyperparameters differ between the replicas of another rank; the update "
            "was not applied. Change hyperparameters on every optimizer of every rank, or use "
            "Trainer(..., scheduler=lambda opt: ...)")
    if comm.size * hh != h * h:
        raise HyperparameterMismatchError(
            "the optimizers' hyperparameters (param-group values such as lr) differ between MPI "
            "ranks; the update was not applied. Change them the same way on every rank, or use "
            "Trainer(..., scheduler=lambda opt: ...)")
    return float(vec[0]), float(vec[1]), float(vec[2]), vec[6:]


class Schedulers:
    """One scheduler per optimizer, built by ``factory(optimizer)``, stepped together."""

    def __init__(self, factory: Callable[[torch.optim.Optimizer], Any] | None,
                 optimizers: Sequence[torch.optim.Optimizer]):
        if factory is not None and not callable(factory):
            raise TypeError("scheduler must be a callable that takes an optimizer and returns a "
                            "scheduler, e.g. lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10), "
                            "so that each replica gets its own")
        self.schedulers: list[Any] = []
        if factory is None:
            return
        for opt in optimizers:
            s = factory(opt)
            if not (callable(getattr(s, "step", None)) and callable(getattr(s, "state_dict", None))):
                raise TypeError(f"scheduler(opt) must return a learning-rate scheduler (with step() "
                                f"and state_dict()), got {type(s).__name__}")
            self.schedulers.append(s)

    def step(self, only_first_stepped: bool = False) -> None:
        """After an applied update. ``only_first_stepped``: mode ``typical``, where only optimizer 0 steps."""
        with warnings.catch_warnings():
            if only_first_stepped:
                warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            for s in self.schedulers:
                if not isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    s.step()  # ReduceLROnPlateau needs the user's metric: they step it

    def state_dict(self) -> dict[str, Any] | None:
        return self.schedulers[0].state_dict() if self.schedulers else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            for s in self.schedulers:
                s.load_state_dict(copy.deepcopy(state))  # each its own copy, as for the optimizers
