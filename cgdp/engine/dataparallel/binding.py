"""The user's optimizer bound once to a ``DataParallel``: its ``step()`` steps every replica.

``model.bind(opt)`` puts three things on that optimizer, nothing elsewhere; ``close()`` removes them:

1. **its ``step``**, an instance attribute over the one it had (as ``LRScheduler`` does), with the same signature and a
   ``__func__``; the outermost call: in one ``try``/``finally`` it takes the operation lock, checks the gradients,
   steps every replica (:meth:`Binding._step`) and gives the lock back;
2. **a step pre-hook** refusing a step past it (:data:`PAST_BINDING`): it would step replica 0 alone;
3. **a load post-hook**: ``opt.load_state_dict`` reloads what steps the other replicas.

``update="devices"`` (:class:`Binding`): one *mirror* optimizer per other replica, given the hyperparameters each
step, stepped on the device threads beside the user's. Invariant: after every step each replica's parameters and
state are bitwise replica 0's; a step that raised anywhere is followed by a *resync* to replica 0's.

``update="host"`` (:class:`HostBinding`): one optimizer of the user's class over the host's float32 masters, sharing
``opt.state``'s dicts and the step hooks, whose result is copied to every replica, also after a raise. A subclass
overriding ``step()`` is refused (:data:`OWN_STEP`); an optimizer holding no master (``SparseAdam``) gets mirrors.

The binding holds the optimizer and :class:`~.steps.ReplicaSteps` weakly: the optimizer holds it, not the reverse.
"""
from __future__ import annotations

import copy
import inspect
import threading
import types
import weakref
from collections import defaultdict
from typing import Any, Callable

import torch

from cgdp.engine.core.claims import claimed
from cgdp.engine.core.host_state import prefer_fused
from cgdp.engine.core.update import PerReplica

_ATTR = "_cgdp_binding"
_AMP_ATTRS = ("grad_scale", "found_inf")  # what GradScaler.step sets on an optimizer during its step

FOREIGN = ("this optimizer holds parameters of another cgdp engine (another DataParallel or Trainer), or of another "
           "replica than replica 0 (model.replicas[j], j > 0); an optimizer may hold the parameters of one "
           "DataParallel only (model.parameters() or a subset) besides parameters outside every engine: build a "
           "separate optimizer for the others. A layer replaced after wrapping has parameters the DataParallel does "
           "not train: replace layers before wrapping")
NONE_OF_OURS = ("this optimizer holds none of this cgdp.DataParallel's parameters: bind an optimizer over "
                "model.parameters() (or a subset), and step the others as you would without cgdp")
OUTSIDE_WITH_RANKS = ("this optimizer also holds trainable parameters outside the cgdp.DataParallel ({names}), "
                      "whose gradient would stay this rank's own with comm= (only the model's gradients are averaged "
                      "over ranks): put them inside the wrapped model, or freeze them")
NEW_PARAMETER = ("this optimizer holds a parameter that the cgdp.DataParallel did not have when it was built (a layer "
                 "replaced after wrapping?): it cannot step it on every replica. Replace layers before wrapping, or "
                 "close() and wrap model.module again")
CLOSURE = ("optimizer.step(closure) is not supported with cgdp.DataParallel: the closure would run on replica 0 "
           "only")
PAST_BINDING = ("this optimizer's step was called past the step cgdp.DataParallel.bind gave it "
                "(type(optimizer).step(optimizer), or a step method saved before bind), which would step replica 0 "
                "alone: call optimizer.step()")
OWN_STEP = ("update='host' steps a copy of your optimizer's class over float32 masters on the host, and {cls} "
            "overrides step(), which would then run on that copy, not on your object: use a torch.optim optimizer "
            "(with step hooks for extra work), or update='devices'")


def bind(opt: torch.optim.Optimizer, steps: Any, owned: set[int], inside: Callable[[], set[int]]) -> None:
    """Bind ``opt`` to ``steps``'s model (``owned``: ids of replica 0's parameters; ``inside()``: of every parameter of
    every replica, now); nothing if already bound. Parameters outside every replica and every other engine (a head
    applied to the gathered output, a frozen backbone beside the model) are the user's optimizer's alone, as with
    ``nn.DataParallel``: stepped where they are, never on the other replicas."""
    b = opt.__dict__.get(_ATTR)
    if b is not None and b.steps() is steps:
        return
    if b is not None:
        raise ValueError(FOREIGN)
    held = [p for g in opt.param_groups for p in g["params"]]
    pid = steps.host_masters.pid if steps.host_masters is not None else ()
    host = any(id(p) in pid for p in held)
    others = [p for p in held if id(p) not in owned]
    outside = outside_only(others, inside(), host, steps.ranks)
    if others and len(others) == len(held):
        raise ValueError(NONE_OF_OURS)
    (HostBinding if host else Binding)(opt, steps, owned, outside, inside)


def outside_only(params: list[torch.Tensor], inside: set[int], host: bool, ranks: int) -> dict[int, torch.Tensor]:
    """``params`` (none of the model's) as parameters outside every engine, or a refusal: another engine's or
    replica's, a layer replaced after wrapping; a trainable one where only the model's are stepped (``update="host"``)
    or averaged (ranks)."""
    if any(id(p) in inside or claimed(p) for p in params):
        raise ValueError(FOREIGN)
    trainable = [tuple(p.shape) for p in params if p.requires_grad]
    if trainable and host:
        raise ValueError(f"update='host' steps the model's parameters on the host, and this optimizer also holds "
                         f"trainable parameters outside the model ({', '.join(map(str, trainable[:5]))}): give them "
                         f"an optimizer of their own, or use update='devices'")
    if trainable and ranks > 1:
        raise ValueError(OUTSIDE_WITH_RANKS.format(names=", ".join(map(str, trainable[:5]))))
    return {id(p): p for p in params}


class Binding:
    """``update="devices"``: ``mirrors[j - 1]`` steps replica j."""

    def __init__(self, opt: torch.optim.Optimizer, steps: Any, owned: set[int], outside: dict[int, torch.Tensor],
                 inside: Callable[[], set[int]]):
        self._owned, self._inside = owned, inside
        self.outside = outside
        """Parameters outside the model (:func:`outside_only`): the user's optimizer's alone (no mirror holds them)."""
        self.steps = weakref.ref(steps)
        self.opt = weakref.ref(opt)
        self.stepping: threading.Thread | None = None  # the guard lets the optimizer's own step run there
        self.closed = False
        self._lens = [len(g["params"]) for g in opt.param_groups]
        self._build(opt, steps)
        inner = opt.step
        method = isinstance(inner, types.MethodType) and inner.__self__ is opt
        self._had = opt.__dict__.get("step")
        self._inner = (inner.__func__ if method else inner, method)  # no reference to opt itself
        self._handles = [opt.register_step_pre_hook(self._guard), opt.register_load_state_dict_post_hook(self._reload)]
        opt.__dict__["step"] = _outermost(self, inner)
        opt.__dict__[_ATTR] = self
        steps.bindings.add(self)

    def _build(self, opt: torch.optim.Optimizer, steps: Any) -> None:
        self.maps = steps.parameter_maps()
        self.mirrors = [_construct(opt, self._groups(opt.param_groups, m)) for m in self.maps]
        # the Trainer's strategy; replica 0's optimizer is the user's, held weakly here (the optimizer holds us)
        self.update = PerReplica(steps.devs, [None, *self.mirrors], [])
        # (optimizer, id(replica 0's parameter) -> its own, device) of each optimizer the user's groups reach
        self.targets = [(m, mp, next(iter(mp.values())).device) for m, mp in zip(self.mirrors, self.maps)]
        if opt.state:
            self._reload(opt)

    def _groups(self, groups: list[dict], mapping: dict[int, Any]) -> list[dict]:
        out = self.outside
        if any(id(p) not in mapping and id(p) not in out for g in groups for p in g["params"]):
            raise ValueError(NEW_PARAMETER)
        return [{**g, "params": [mapping[id(p)] for p in g["params"] if id(p) not in out]} for g in groups]

    def step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        if self.closed:  # a scheduler's counter built over this step outlived close(): replica 0 alone
            return self._call(opt, args, kwargs)
        if (args and args[0] is not None) or kwargs.get("closure") is not None:
            raise NotImplementedError(CLOSURE)
        steps = self.steps()
        if self.outside and steps.ranks > 1:  # unfrozen since bind (every rank runs the same code)
            names = [tuple(p.shape) for p in self.outside.values() if p.grad is not None]
            if names:
                raise RuntimeError(OUTSIDE_WITH_RANKS.format(names=", ".join(map(str, names[:5]))))
        steps.begin()  # the model's operation lock, the gradients checked
        self.stepping = threading.current_thread()
        try:
            self._sync_groups(opt)
            for k in _AMP_ATTRS:  # GradScaler's, for an optimizer that unscales in its step (fused)
                v = getattr(opt, k, None)
                for m, _, _ in self.targets:
                    m.__dict__.pop(k, None) if v is None else setattr(m, k, v)
            return self._step(opt, steps, args, kwargs)
        finally:
            self.stepping = None
            steps.end()  # the lock given back

    def _call(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        fn, method = self._inner
        return fn(opt, *args, **kwargs) if method else fn(*args, **kwargs)

    def _step(self, opt: torch.optim.Optimizer, steps: Any, args: tuple, kwargs: dict) -> Any:
        try:
            out, errors = self.update.step_bound(lambda: self._call(opt, args, kwargs), steps.threads)
        except BaseException as exc:
            self._after_raise(opt, steps, exc)
            raise
        if errors or not steps.kept():
            self.resync(opt)  # a mirror raised, or replica 0 stepped on other gradients than its mirrors
        if errors:
            j, exc = errors[0]
            raise RuntimeError(f"optimizer.step() raised on replica {j} ({exc!r}) after replica 0's step had "
                               f"completed; every replica now holds replica 0's parameters and optimizer "
                               f"state, so the step took effect and the replicas are identical") from exc
        return out

    def _after_raise(self, opt: torch.optim.Optimizer, steps: Any, exc: BaseException) -> None:
        """A step that raised: every replica takes replica 0's parameters and state, as one device holds them after
        its step raised. Not while a replica may still step (the model then refuses to go on), and with ranks the
        model is unusable anyway: each rank's step may have stopped at another point."""
        if steps.threads.stuck:
            return
        try:
            self.resync(opt)
        except BaseException:
            steps.unusable(f"the replicas may differ: a step raised ({exc!r}) and so did making them equal again")
            raise
        if steps.ranks > 1:
            steps.unusable(f"a step raised on this rank ({exc!r}), so the ranks' parameters may differ")

    def _guard(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.stepping is not threading.current_thread():
            raise RuntimeError(PAST_BINDING)

    def _sync_groups(self, opt: torch.optim.Optimizer) -> None:
        groups = opt.param_groups
        added = groups[len(self._lens):]
        if added:
            new = [p for g in added for p in g["params"] if id(p) not in self._owned and id(p) not in self.outside]
            if new:  # outside ones (a frozen head added later); a layer replaced after wrapping is refused
                self.outside.update(outside_only(new, self._inside(), isinstance(self, HostBinding),
                                                 self.steps().ranks))
            for m, mp, _ in self.targets:
                for g in self._groups(added, mp):
                    m.add_param_group(g)
            self._lens += [len(g["params"]) for g in added]
        if any(len(g["params"]) != n for g, n in zip(groups, self._lens)):
            raise RuntimeError("the parameters of an optimizer param group of a cgdp.DataParallel changed after "
                               "it was bound; add parameters with optimizer.add_param_group instead")
        for m, _, dev in self.targets:
            for gu, gm in zip(groups, m.param_groups):
                for k, v in gu.items():
                    if k != "params":
                        gm[k] = v.to(dev) if isinstance(v, torch.Tensor) and v.device != dev else v

    def _reload(self, opt: torch.optim.Optimizer) -> None:
        self._sync_groups(opt)
        state = _without(opt.state_dict(), [id(p) in self.outside for g in opt.param_groups for p in g["params"]])
        for m in self.mirrors:
            m.load_state_dict(copy.deepcopy(state))

    def resync(self, opt: torch.optim.Optimizer) -> None:
        ours = [p for g in opt.param_groups for p in g["params"] if id(p) not in self.outside]
        with torch.no_grad():
            for mapping in self.maps:
                for p in ours:
                    mapping[id(p)].copy_(p)
        self._reload(opt)

    def optimizers(self) -> tuple[list[Any], list[Any]]:
        """Per replica the optimizer stepping it (replica 0: the user's), and those stepping on the host."""
        return [self.opt(), *self.mirrors], []

    def close(self) -> None:
        self.closed = True
        for h in self._handles:
            h.remove()
        self.mirrors, self.maps, self.targets, self.update = [], [], [], None
        opt = self.opt()
        if opt is None:
            return
        d = opt.__dict__
        d.pop(_ATTR, None)
        if getattr(d.get("step"), "cgdp_bound", False):  # (a scheduler's counter built since stays over it)
            del d["step"]
            if self._had is not None:
                d["step"] = self._had


class HostBinding(Binding):
    """``update="host"``: the host's masters stepped."""

    def _build(self, opt: torch.optim.Optimizer, steps: Any) -> None:
        if not getattr(type(opt).step, "__module__", "").startswith("torch.optim"):  # (torch's wrapper keeps it)
            raise TypeError(OWN_STEP.format(cls=type(opt).__name__))
        self.masters = m = steps.host_masters
        self._to_master = {id(p): master for p, master in zip(m.params[0], m.masters)}
        self.host = _construct(opt, self._groups(opt.param_groups, self._to_master))
        self.targets = [(self.host, self._to_master, torch.device("cpu"))]
        self.host._optimizer_step_pre_hooks = opt._optimizer_step_pre_hooks  # the user's step hooks, shared
        self.host._optimizer_step_post_hooks = opt._optimizer_step_post_hooks
        self._reload(opt)

    def _groups(self, groups: list[dict], mapping: dict[int, Any]) -> list[dict]:
        """Parameters without a master (frozen at wrapping) are skipped, as torch skips one without a gradient."""
        return [{**g, "params": [mapping[id(p)] for p in g["params"] if id(p) in mapping]} for g in groups]

    def _reload(self, opt: torch.optim.Optimizer) -> None:
        """The host optimizer's state is the user's per-parameter dicts, tensors moved to the host."""
        self._sync_groups(opt)
        self._plan(opt)
        self._user_state = opt.state
        state: defaultdict = defaultdict(dict)
        for p, s in opt.state.items():
            if id(p) in self._to_master:
                s.update({k: v.to("cpu") for k, v in s.items() if isinstance(v, torch.Tensor) and not v.is_cpu})
                state[self._to_master[id(p)]] = s
        self.host.state = state

    def _plan(self, opt: torch.optim.Optimizer) -> None:
        pid, ps = self.masters.pid, [p for g in opt.param_groups for p in g["params"]]
        self._pids = [pid[id(p)] for p in ps if id(p) in pid]
        self._others = [p for p in ps if id(p) not in pid]
        self._back = {id(self._to_master[id(p)]): p for p in ps if id(p) in pid}
        self._planned = len(opt.param_groups)

    def _step(self, opt: torch.optim.Optimizer, steps: Any, args: tuple, kwargs: dict) -> Any:
        if opt.state is not self._user_state:  # replaced without load_state_dict
            self._reload(opt)
        elif len(opt.param_groups) != self._planned:  # add_param_group
            self._plan(opt)
        if any(p.grad is not None for p in self._others):
            raise NotImplementedError(
                "update='host' steps the parameters that were dense and trainable when the model was wrapped; "
                "this optimizer also holds one with a gradient that is not among them (a sparse embedding's, "
                "one unfrozen after wrapping, or one outside the model): give the sparse parameters an optimizer "
                "of their own (e.g. torch.optim.SparseAdam: it steps on the devices), unfreeze before wrapping, "
                "give parameters outside the model an optimizer of their own, or use update='devices'")
        m, pids = self.masters, self._pids
        m.follow()
        m.take_grads(*steps.grads.host_row(), pids)  # the host's sum in place where every replica holds it
        prefer_fused(self.host)
        opt._opt_called = True  # what an LR scheduler built before bind looks for (its counter is not run)
        n = len(self.host.state)
        try:
            return self.host.step()
        finally:
            if len(self.host.state) != n:  # the first step made the state: the user's object holds it too
                for master, s in self.host.state.items():
                    opt.state[self._back[id(master)]] = s
            m.to_devices(steps.threads, pids)  # also after a raise: what one device holds then

    def optimizers(self) -> tuple[list[Any], list[Any]]:
        return [], [self.opt()]  # the user's: its state is the host optimizer's

    def close(self) -> None:
        """The optimizer gets its state back on the parameters' device (torch's own placement)."""
        super().close()
        opt = self.opt()
        if opt is not None and opt.state:
            opt.load_state_dict(opt.state_dict())


def _without(state: dict, drop: list[bool]) -> dict:
    """An optimizer ``state_dict`` without the parameters whose position (in group order) ``drop`` marks: the
    mirrors' (they hold no parameter outside the model)."""
    if not any(drop):
        return state
    index = {old: new for new, old in enumerate(i for i, d in enumerate(drop) if not d)}
    return {"state": {index[k]: v for k, v in state["state"].items() if k in index},
            "param_groups": [{**g, "params": [index[i] for i in g["params"] if i in index]}
                             for g in state["param_groups"]]}


def _outermost(b: Binding, inner: Callable[..., Any]) -> Callable[..., Any]:
    """The instance's ``step``: ``inner``'s signature, a ``__func__``, the optimizer held weakly (no cycle)."""
    def unbound(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return b.step(self, args, kwargs)

    def step(*args: Any, **kwargs: Any) -> Any:
        return b.step(b.opt(), args, kwargs)
    step.__func__ = unbound  # type: ignore[attr-defined]
    step.__signature__ = inspect.signature(inner)  # type: ignore[attr-defined]
    step.cgdp_bound = True  # type: ignore[attr-defined]
    if getattr(inner, "_wrapped_by_lr_sched", False):  # what a scheduler checks its counter by
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return step


def _construct(opt: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """``type(opt)(groups, **opt.defaults)``; defaults matter only for later groups (some aren't constructor args)."""
    cls = type(opt)
    sig = inspect.signature(cls.__init__).parameters
    any_kw = any(p.kind is p.VAR_KEYWORD for p in sig.values())
    try:
        return cls(groups, **{k: v for k, v in opt.defaults.items() if any_kw or k in sig})
    except TypeError as exc:
        raise TypeError(f"cgdp.DataParallel steps every replica with a copy of your optimizer, built as "
                        f"{cls.__name__}(param_groups, **optimizer.defaults), which failed ({exc}). Give "
                        f"{cls.__name__} a constructor that accepts its defaults as keywords") from exc
