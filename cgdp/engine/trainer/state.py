"""Checking a trainer state before it is restored: all or nothing.

``Trainer.load_state_dict`` changes every replica, every optimizer, the step, the plan and the
tuner. Were it to fail half way (``nn.Module.load_state_dict`` copies the keys it has before it
complains about the ones it lacks), the replicas would differ and the trainer would still claim
to be fine. So :func:`check_state` looks at everything first, against replica 0 and optimizer 0
(every replica is identical), and raises ``ValueError`` saying what does not fit; only a state
that passes is applied. A state holds only tensors and plain Python data, so it can be written
with ``torch.save`` and read back with ``torch.load(..., weights_only=True)``.
"""
from __future__ import annotations

import copy
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
        validate_plan(state["plan"], num_layers)  # its ValueError names what is wrong
    rng = state.get("device_rng")
    if rng is not None and not (isinstance(rng, (list, tuple))
                                and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in rng)):
        raise ValueError("the trainer state's device_rng must be a list of generator states (uint8 tensors)")
    if state.get("scheduler") is not None and not isinstance(state["scheduler"], Mapping):
        raise ValueError("the trainer state's scheduler must be a scheduler state dict")
    if tuner is not None and state.get("tuner") is not None:
        try:
            copy.deepcopy(tuner).load_state_dict(state["tuner"])  # a trial on a copy
        except Exception as e:
            raise ValueError(f"the trainer state's tuner state does not fit this tuner ({type(e).__name__}: "
                             f"{e})") from None


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
        v = sd[k]
        if k.endswith(_EXTRA_STATE):  # get_extra_state()'s value: any object its set_extra_state takes
            continue
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"the saved model's {k} is a {type(v).__name__}, not a tensor")
        if v.shape != t.shape:
            raise ValueError(f"the saved model's {k} has shape {tuple(v.shape)}, this model's "
                             f"{tuple(t.shape)}; was it saved from another model?")


def _check_optimizer(sd: Any, optimizer: torch.optim.Optimizer) -> None:
    if not (isinstance(sd, Mapping) and "state" in sd and "param_groups" in sd):
        raise ValueError("the trainer state's 'optimizer' must be an optimizer state dict "
                         "(with 'state' and 'param_groups')")
    groups, mine = sd["param_groups"], optimizer.param_groups
    if not isinstance(groups, (list, tuple)) or len(groups) != len(mine):
        n = len(groups) if isinstance(groups, (list, tuple)) else "?"
        raise ValueError(f"the saved optimizer has {n} parameter group(s), this one {len(mine)}")
    params: dict[Any, torch.Tensor] = {}
    for i, (g, m) in enumerate(zip(groups, mine)):
        ids = g.get("params") if isinstance(g, Mapping) else None
        if not isinstance(ids, (list, tuple)) or len(ids) != len(m["params"]):
            n = len(ids) if isinstance(ids, (list, tuple)) else "?"
            raise ValueError(f"the saved optimizer's group {i} has {n} parameters, this one "
                             f"{len(m['params'])}; was it saved from another model or optimizer?")
        params.update(zip(ids, m["params"]))
    if not isinstance(sd["state"], Mapping):
        raise ValueError("the saved optimizer's 'state' must be a dict")
    for pid, st in sd["state"].items():
        if pid not in params:
            raise ValueError(f"the saved optimizer has state for parameter {pid!r}, which none of its groups lists")
        p = params[pid]
        for name, v in (st.items() if isinstance(st, Mapping) else ()):
            if isinstance(v, torch.Tensor) and v.dim() == p.dim() and v.dim() > 0 and v.shape != p.shape:
                raise ValueError(f"the saved optimizer's {name} of parameter {pid} has shape "
                                 f"{tuple(v.shape)}, the parameter {tuple(p.shape)}")
