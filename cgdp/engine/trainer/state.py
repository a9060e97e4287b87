"""Checking a trainer state before it is restored: all or nothing.

``nn.Module.load_state_dict`` copies the keys it has before complaining about the rest, so a failure half way would
leave the replicas different. :func:`check_state` checks everything first, against replica 0 and optimizer 0, and raises
``ValueError`` saying what does not fit; only a state that passes is applied. A state holds only tensors and plain data
(``torch.load(..., weights_only=True)`` reads it).

"Fits" means, beyond keys and shapes: dtype conversions are exact; optimizer state has per parameter the entries this
optimizer's ``step()`` creates (:func:`probe_state`); group hyperparameters keep their types and are finite; generator
states are valid; a tuner state is for this model and device count.
"""
from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from cgdp.planning.chunks import validate_plan

_EXTRA_STATE = "_extra_state"
"""The key suffix of a module's ``get_extra_state()`` in its state dict (not a tensor)."""


def check_state(state: Any, model: nn.Module, optimizer: torch.optim.Optimizer, num_layers: int,
                tuner: Any) -> None:
    """Raise ``ValueError`` unless ``state`` can be loaded into a trainer like this one."""
    if not isinstance(state, Mapping):
        raise ValueError(f"a trainer state is a dict from Trainer.state_dict(), got {type(state).__name__}")
    missing = [k for k in ("model", "optimizer") if k not in state]
    if missing:
        raise ValueError(f"the trainer state lacks {missing} (keys: {sorted(state)}); it is not a "
                         f"Trainer.state_dict()")
    _check_model(state["model"], model)
    _check_optimizer(state["optimizer"], optimizer)
    step = state.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"the trainer state's step must be an int >= 0, got {step!r}")
    if state.get("plan") is not None:
        try:
            validate_plan(state["plan"], num_layers)
        except TypeError as e:  # its message names what is wrong
            raise ValueError(str(e)) from None
    rng = state.get("device_rng")
    if rng is not None and not (isinstance(rng, (list, tuple)) and all(map(generator_state_ok, rng))):
        raise ValueError("the trainer state's device_rng must be a list of generator states (uint8 tensors "
                         "that torch.Generator.set_state takes)")
    if state.get("scheduler") is not None and not isinstance(state["scheduler"], Mapping):
        raise ValueError("the trainer state's scheduler must be a scheduler state dict")
    if tuner is not None and state.get("tuner") is not None:
        _check_tuner(state["tuner"], tuner, num_layers)


def generator_state_ok(t: Any) -> bool:
    """Whether ``t`` is a CPU generator state that ``torch.Generator.set_state`` accepts."""
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 and t.device.type == "cpu"):
        return False
    try:
        torch.Generator().set_state(t)  # a trial on a fresh generator
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def _check_tuner(saved: Any, tuner: Any, num_layers: int) -> None:
    try:
        trial = copy.deepcopy(tuner)  # a trial on a copy
        trial.load_state_dict(saved)
        validate_plan(trial.plan(), num_layers)
    except Exception as e:
        raise ValueError(f"the trainer state's tuner state does not fit this tuner ({type(e).__name__}: "
                         f"{e})") from None
    mine, theirs = tuner.state_dict(), trial.state_dict()
    for k in ("name", "layer_bytes", "devices", "config", "num_layers"):
        if k in mine and mine[k] != theirs.get(k):
            raise ValueError(f"the trainer state's tuner state is for another {k.replace('_', ' ')} "
                             f"({theirs.get(k)!r}; this trainer's tuner has {mine[k]!r})")


def lossless(v: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``v`` converts to ``dtype`` and back unchanged (NaN stays NaN)."""
    if v.dtype == dtype:
        return True
    if v.is_complex() and not dtype.is_complex:
        return False
    back = v.to(dtype).to(v.dtype)
    return bool(((back == v) | (back.isnan() & v.isnan())).all())


def _check_tensor(v: Any, what: str, shape: torch.Size, dtype: torch.dtype) -> None:
    if not isinstance(v, torch.Tensor):
        raise ValueError(f"the saved {what} is a {type(v).__name__}, not a tensor")
    if v.layout != torch.strided or v.is_quantized or v.device.type != "cpu":
        raise ValueError(f"the saved {what} is a {v.layout} tensor on {v.device}; a state holds dense CPU tensors")
    if v.shape != shape:
        raise ValueError(f"the saved {what} has shape {tuple(v.shape)}, this one {tuple(shape)}; was it "
                         f"saved from another model?")
    if not lossless(v, dtype):
        raise ValueError(f"the saved {what} is {v.dtype} and holds values that {dtype} cannot represent "
                         f"exactly; loading would round them (a lossy cast is refused: save it as {dtype})")


def _check_model(sd: Any, model: nn.Module) -> None:
    if not isinstance(sd, Mapping):
        raise ValueError(f"the trainer state's 'model' must be a state dict, got {type(sd).__name__}")
    mine = model.state_dict()
    missing = [k for k in mine if k not in sd]
    extra = [k for k in sd if k not in mine]
    if missing or extra:
        raise ValueError(f"the saved model does not match this model: missing {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
                         f"{' ...' if len(extra) > 5 else ''}; was it saved from another model?")
    for k, t in mine.items():
        if not k.endswith(_EXTRA_STATE):  # (else get_extra_state()'s value: any object its set_extra_state takes)
            _check_tensor(sd[k], f"model's {k}", t.shape, t.dtype)


def _check_optimizer(sd: Any, optimizer: torch.optim.Optimizer) -> None:
    if not (isinstance(sd, Mapping) and "state" in sd and "param_groups" in sd):
        raise ValueError("the trainer state's 'optimizer' must be an optimizer state dict "
                         "(with 'state' and 'param_groups')")
    groups, mine = sd["param_groups"], optimizer.param_groups
    if not isinstance(groups, (list, tuple)) or len(groups) != len(mine):
        n = len(groups) if isinstance(groups, (list, tuple)) else "?"
        raise ValueError(f"the saved optimizer has {n} parameter group(s), this one {len(mine)}")
    params: dict[Any, tuple[torch.Tensor, int]] = {}
    for i, (g, m) in enumerate(zip(groups, mine)):
        ids = g.get("params") if isinstance(g, Mapping) else None
        if not isinstance(ids, (list, tuple)) or len(ids) != len(m["params"]):
            n = len(ids) if isinstance(ids, (list, tuple)) else "?"
            raise ValueError(f"the saved optimizer's group {i} has {n} parameters, this one "
                             f"{len(m['params'])}; was it saved from another model or optimizer?")
        if len(set(map(_key, ids))) != len(ids) or any(_key(pid) in params for pid in ids):
            raise ValueError(f"the saved optimizer's group {i} lists a parameter twice")
        _check_group(g, m, i)
        params.update({_key(pid): (p, i) for pid, p in zip(ids, m["params"])})
    if not isinstance(sd["state"], Mapping):
        raise ValueError("the saved optimizer's 'state' must be a dict")
    probes = [probe_state(optimizer, i) for i in range(len(mine))]
    for pid, st in sd["state"].items():
        if _key(pid) not in params:
            raise ValueError(f"the saved optimizer has state for parameter {pid!r}, which none of its groups lists")
        p, i = params[_key(pid)]
        if not isinstance(st, Mapping):
            raise ValueError(f"the saved optimizer's state of parameter {pid} is a {type(st).__name__}, not a dict")
        probe = probes[i]
        if probe is not None and set(st) != set(probe):
            raise ValueError(f"the saved optimizer's state of parameter {pid} has {sorted(map(str, st))}; "
                             f"{type(optimizer).__name__} keeps {sorted(probe)}")
        for name, v in st.items():
            kind = probe.get(name) if probe is not None else None
            if isinstance(kind, torch.dtype):  # a scalar tensor (Adam's step): never cast on load
                if not (isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype == kind and v.layout == torch.strided):
                    raise ValueError(f"the saved optimizer's {name} of parameter {pid} must be a {kind} scalar "
                                     f"tensor, got {_kind(v)}")
            elif kind == "param" or (kind is None and isinstance(v, torch.Tensor) and v.dim() > 0):
                _check_tensor(v, f"optimizer's {name} of parameter {pid}", p.shape,
                              p.dtype if p.is_floating_point() else v.dtype)
            elif kind is not None and type(v).__name__ != kind:
                raise ValueError(f"the saved optimizer's {name} of parameter {pid} is {_kind(v)}, not a {kind}")


def _key(pid: Any) -> Any:
    """A dict key for a saved parameter id (an unhashable id is refused as a missing one)."""
    try:
        hash(pid)
    except TypeError:
        return repr(pid)
    return pid


def _kind(v: Any) -> str:
    return f"a {v.dtype} tensor of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else f"a {type(v).__name__}"


def _check_group(saved: Mapping, live: Mapping, i: int) -> None:
    """Every hyperparameter this optimizer's group has, of a compatible type, finite."""
    for k, mine in live.items():
        if k == "params":
            continue
        if k not in saved:
            raise ValueError(f"the saved optimizer's group {i} lacks {k!r}")
        if not _same_kind(saved[k], mine):
            raise ValueError(f"the saved optimizer's group {i} has {k} = {saved[k]!r}, this optimizer "
                             f"{mine!r}: not a value of that kind")


def _same_kind(v: Any, mine: Any) -> bool:
    number = (int, float)
    if isinstance(mine, bool) or mine is None:
        return v is None or isinstance(v, bool)
    if isinstance(mine, number) or (isinstance(mine, torch.Tensor) and mine.dim() == 0):
        if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point():
            v = float(v)
        return isinstance(v, number) and not isinstance(v, bool) and math.isfinite(v)
    if isinstance(mine, (tuple, list)):
        return (isinstance(v, (tuple, list)) and len(v) == len(mine)
                and all(_same_kind(a, b) for a, b in zip(v, mine)))
    return type(v) is type(mine)


def probe_state(optimizer: torch.optim.Optimizer, group: int) -> dict[str, Any] | None:
    """What ``optimizer``'s step keeps per parameter of group ``group``: ``"param"`` for a tensor shaped like the
    parameter, a dtype for a scalar tensor, else the type's name; from one step of a fresh copy on a small parameter
    (None if that needs a closure)."""
    cls = type(optimizer)
    g = optimizer.param_groups[group]
    dtype = g["params"][0].dtype if g["params"] else torch.float32
    p = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
    p.grad = torch.zeros_like(p)
    try:
        sig = inspect.signature(cls.__init__).parameters
        any_kw = any(q.kind is q.VAR_KEYWORD for q in sig.values())
        hp = {k: v for k, v in g.items() if k != "params" and (any_kw or k in sig)}
        probe = cls([p], **hp)
        for k, v in g.items():  # group values that are not constructor arguments
            if k != "params":
                probe.param_groups[0].setdefault(k, v)
        probe.step()
    except Exception:  # noqa: BLE001 - no probe: the shape checks still apply
        return None
    out: dict[str, Any] = {}
    for k, v in probe.state[p].items():
        tensor = isinstance(v, torch.Tensor)
        out[k] = "param" if tensor and v.shape == p.shape else v.dtype if tensor and v.dim() == 0 else type(v).__name__
    return out
