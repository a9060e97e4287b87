"""``DataParallel(update="host")``: the user's own optimizer steps float32 masters on the host.

The user builds one optimizer on ``model.parameters()`` as with ``update="devices"``; torch's
global step hooks (:mod:`cgdp.engine.dataparallel.mirror`) hand its ``step()`` to a
:class:`HostMirror` instead of a :class:`~cgdp.engine.dataparallel.mirror.Mirror`, which, around
the optimizer's own step body:

1. before it (the pre-hook): takes the model's operation lock and checks the gradients
   (``ReplicaSteps.begin``; a step on the parts of ``no_sync()`` is refused), gives the masters
   their gradients: views of the host's sum row when every replica holds it unchanged (one
   machine, nothing clipped or edited since backward), else copies of replica 0's, and
   lends the optimizer the masters: every group's ``"params"`` list and ``optimizer.state`` are
   swapped for the masters' (the same per-parameter state dicts, keyed by the masters);
2. the optimizer's own ``step()`` then runs on the host, unchanged (its class, groups,
   hyperparameters, schedulers), with torch's fused CPU kernel for Adam, AdamW and SGD where the
   user chose no implementation (:func:`~cgdp.engine.core.host_state.prefer_fused`);
3. after it (the post-hook): the swap is undone and every replica's parameters are copied from
   the masters (:meth:`HostMasters.to_devices`): bitwise identical replicas, no device state.

An optimizer that holds no parameter with a master (a sparse embedding's own ``SparseAdam``) gets
a device :class:`~cgdp.engine.dataparallel.mirror.Mirror` instead (:func:`lends_to_host`);
parameters without a master in a host optimizer (frozen when the model was wrapped) are skipped,
as torch skips a parameter without a gradient. Which masters each group lends is worked out again
only when a group's ``"params"`` list changed (:meth:`HostMirror._plan`), and only the stepped
optimizer's masters are copied back.

The user's object keeps working: ``param_groups`` hold the model's parameters between steps,
``state_dict()`` is keyed by them and holds host tensors, ``load_state_dict()`` brings the loaded
state to the host (a load post-hook), and ``close()`` gives the optimizer its state back on the
parameters' device, so it steps replica 0 alone as before wrapping. A step that raised after
the pre-hook (a user's step hook, the body; torch runs no post-hook) is finished at once by the
optimizer's outermost ``step`` (:meth:`HostMirror.raised`): the swap is reverted and every replica
takes the masters as the step left them, what one device holds after its step raised, as the
device mirrors' resync gives with ``update="devices"``.
"""
from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from typing import Any

import torch

from cgdp.engine.core.host_state import prefer_fused
from cgdp.engine.core.host_update import HostMasters, grad_of, is_none
from cgdp.engine.dataparallel.mirror import _ATTR, _install_outermost, _remove_outermost


def lends_to_host(opt: torch.optim.Optimizer, masters: HostMasters) -> bool:
    """Whether ``opt`` holds a parameter that has a host master; one that holds none (a sparse
    embedding's own optimizer, e.g. ``SparseAdam``) steps on the devices as with ``update="devices"``."""
    pid = masters.pid
    return any(id(p) in pid for g in opt.param_groups for p in g["params"])


class HostMirror:
    """Lends the user's optimizer the host masters for the body of each of its steps."""

    def __init__(self, opt: torch.optim.Optimizer, dp: Any):
        self.opt = opt
        self.dp = weakref.ref(dp)
        self.host = dp.host_masters
        self.depth = 0
        self.thread: threading.Thread | None = None
        self._pid = self.host.pid
        self._lists: list[list] = []
        self._plan()  # refuses what it cannot step now, not at the first step
        self._user_state = opt.state
        self._host_state = self._rekey()
        self._lent: list | None = None
        self._fused: list[int] = []
        self._load_hook = opt.register_load_state_dict_post_hook(self._reload)
        if "_cgdp_step" not in opt.__dict__:
            _install_outermost(opt)
        dp.mirrors.add(self)

    def _plan(self) -> None:
        """Per group, the masters lent and their parameters' numbers, worked out again only when a
        group's ``"params"`` list is another object or another length (``add_param_group``, a
        user's swap): a step does no Python pass over the parameters."""
        groups = self.opt.param_groups
        if (len(groups) == len(self._lists)
                and all(g["params"] is ps and len(ps) == n for g, ps, n in zip(groups, self._lists, self._lens))):
            return
        pid, masters = self._pid, self.host.masters
        self._pids = [[pid[id(p)] for p in g["params"] if id(p) in pid] for g in groups]
        self._masters = [[masters[k] for k in ks] for ks in self._pids]
        self._flat = [k for ks in self._pids for k in ks]
        self._replica_0 = [self.host.params[0][k] for k in self._flat]
        # parameters without a master (frozen when the model was wrapped, a sparse embedding's):
        # skipped as torch skips a parameter without a gradient; one that has a gradient is refused
        self._others = [p for g in groups for p in g["params"] if id(p) not in pid]
        self._lists = [g["params"] for g in groups]
        self._lens = [len(ps) for ps in self._lists]

    def _check_others(self) -> None:
        for p in self._others:
            if p.grad is not None:
                raise NotImplementedError(
                    "update='host' steps the parameters that were dense and trainable when the model was "
                    "wrapped; this optimizer also holds one with a gradient that is not among them (a "
                    "sparse embedding's, or one unfrozen after wrapping): give the sparse parameters an "
                    "optimizer of their own (e.g. torch.optim.SparseAdam: it steps on the devices), "
                    "unfreeze before wrapping, or use update='devices'")

    def _rekey(self):
        masters, pid = self.host.masters, self._pid
        return keyed_state({p: s for p, s in self.opt.state.items() if id(p) in pid},
                           {id(p): masters[pid[id(p)]] for p in self.opt.state if id(p) in pid})

    def _reload(self, opt: torch.optim.Optimizer) -> None:
        """After ``opt.load_state_dict``: its new state, on the host, for the masters."""
        self._user_state = opt.state
        self._host_state = self._rekey()

    def before(self, args: tuple, kwargs: dict) -> None:
        dp = self.dp()
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:
            raise NotImplementedError("optimizer.step(closure) is not supported with cgdp.DataParallel: "
                                      "the closure would run on replica 0 only")
        dp.begin(self.failed_on_replica_0)  # the model's operation lock, until after() or the clean-up
        try:
            dp.check_host_step()
            self.host.follow()
            self._plan()
            if self._others:
                self._check_others()
            flat = self._flat
            grads = list(map(grad_of, self._replica_0))
            summed = dp.host_sum()
            if summed is not None:  # the host's sum as is: read in place, no copy from the device
                none = [pid for pid, g in zip(flat, grads) if g is None] if any(map(is_none, grads)) else []
                self.host.grads_from_row(summed[0], summed[1], none)
            else:
                self.host.grads_from(grads, flat)
            if self.opt.state is not self._user_state:  # replaced without load_state_dict
                self._reload(self.opt)
            groups = self.opt.param_groups
            self._lent = self._lists
            for g, ms in zip(groups, self._masters):
                g["params"] = ms
            self.opt.state = self._host_state
            self._states = len(self._host_state)
            self._fused = prefer_fused(self.opt)  # for this step only: the user's groups keep their choice
        except BaseException:
            self._give_back()
            dp.end()
            raise
        self.depth, self.thread = 1, threading.current_thread()

    def _give_back(self) -> None:
        """The user's parameters and state in the optimizer again; new state entries follow."""
        if self._lent is None:
            return
        for g, ps in zip(self.opt.param_groups, self._lent):
            g["params"] = ps
        for k in self._fused:
            self.opt.param_groups[k]["fused"] = None
        self._fused = []
        self._lent = None
        self.opt.state = self._user_state
        if len(self._host_state) != self._states:  # the first step made the state
            back = {id(m): p for m, p in zip(self.host.masters, self.host.params[0])}
            for m, s in self._host_state.items():
                self._user_state[back[id(m)]] = s

    def after(self) -> None:
        dp = self.dp()
        try:
            self._give_back()
            if dp is not None:
                dp.host_copy_back(self._flat)  # only this optimizer's parameters changed
        finally:
            if dp is not None:
                dp.end()

    def raised(self) -> None:
        """The user's ``step()`` raised after :meth:`before` (a step pre- or post-hook of the
        user's, the body; torch runs no post-hook): at once, as :meth:`after` would, the optimizer
        gets its parameters back (a ``zero_grad()`` next must clear theirs, not the masters') and
        every replica takes the masters as the step left them: what one device holds after its
        step raised (unchanged if it raised before the body, stepped if in a post-hook)."""
        if self.depth and self.thread is threading.current_thread():
            self.depth = 0
            self.after()

    def failed_on_replica_0(self) -> None:
        """The clean-up, at the model's next operation, of a step that raised where
        :meth:`raised` did not see it (the optimizer's first step, which ran before its outermost
        ``step`` was installed; ``type(opt).step(opt)``): the same result. A ``zero_grad()``
        called in between found the masters lent: the gradients it dropped there are dropped on
        replica 0's parameters, whose they were meant to be."""
        if self._lent is not None:
            masters, params = self.host.masters, self.host.params[0]
            for k in self._flat:
                if masters[k].grad is None and params[k].grad is not None:
                    params[k].grad = None
        self._give_back()
        dp = self.dp()
        if dp is not None:
            dp.host_copy_back(self._flat)
            dp.resynced()  # every replica took the masters: no edit of the user's to follow

    def detach(self) -> None:
        """The model closed: the optimizer gets its state back on the parameters' device."""
        self._give_back()
        self._load_hook.remove()
        d = self.opt.__dict__
        if d.get(_ATTR) is self:
            del d[_ATTR]
        _remove_outermost(self.opt)
        if self.opt.state:
            self.opt.load_state_dict(self.opt.state_dict())  # torch's own placement of each state tensor


def keyed_state(state: dict, keys: dict[int, torch.Tensor]) -> defaultdict:
    """``state`` (an optimizer's, keyed by parameter) re-keyed by ``keys[id(param)]``, the same
    per-parameter dicts (shared, not copied), tensors moved to the host."""
    out: defaultdict = defaultdict(dict)
    for p, s in state.items():
        for k, v in list(s.items()):
            if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                s[k] = v.to("cpu")
        out[keys[id(p)]] = s
    return out
