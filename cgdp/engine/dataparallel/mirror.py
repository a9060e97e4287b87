"""The user's optimizer steps every replica of a ``DataParallel``: one mirror optimizer per replica.

The user builds one optimizer on ``model.parameters()`` (replica 0's). PyTorch's global step
hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``_post_hook``) see every
``optimizer.step()``; the pre-hook recognises an optimizer over replica 0's parameters of a live
``DataParallel`` (by parameter identity, :data:`_OWNERS`, which maps them to the model's
:class:`~cgdp.engine.dataparallel.steps.ReplicaSteps`, not to the user's module), and then:

1. asks the model to check that replica 0's gradients are still what backward left, and to
   mirror them to the other replicas if the user changed them (``ReplicaSteps.begin``);
2. the first time, builds one mirror optimizer per other replica: the same class, the same param
   groups mapped to that replica's parameters, a copy of the user's state (``state_dict``);
   groups added later with ``add_param_group`` are added to the mirrors too;
3. before every step, copies every hyperparameter of the user's groups into the mirrors' (so
   learning-rate schedulers and manual changes just work);
4. starts each mirror's ``step()`` on its device's thread, concurrently with the user's step of
   replica 0; the post-hook waits for them.

``optimizer.load_state_dict`` reloads the mirrors (a load post-hook on the user's optimizer).

Invariant: after every ``step()``, each replica's parameters and optimizer state are bitwise
equal to replica 0's: the same gradients (bitwise: every device receives the same host sum), the
same state, the same hyperparameters, the same code. Parameters are never broadcast, except after
a step that raised somewhere (:meth:`Mirror.resync`): every replica then takes replica 0's
parameters and optimizer state, which are what one device would hold after that step raised
(unchanged if it raised before changing anything). When replica 0's step raises, torch runs no
post-hook; the model's next operation from that thread does the resync first
(:mod:`cgdp.engine.core.lifetime`), and ``model.replicas`` is always resynced.

An optimizer subclass whose ``step()`` calls ``super().step()`` has both methods wrapped by torch,
so the global hooks fire twice, nested: only the outermost call of an optimizer counts. Each
mirror counts the calls it is inside (:attr:`Mirror.depth`, per thread: a nested call comes from
the thread of the outer one); a step that raised leaves its count behind (torch calls no
post-hook), so the user's optimizer gets an outermost ``step`` of its instance
(:func:`_install_outermost`, over whatever ``step`` it had, a scheduler's counter included) that
starts the count afresh at every call. Only a step called past that instance attribute (
``type(opt).step(opt)``) right after one that raised, with no other operation of the model
between them, would be taken for a nested one.
"""
from __future__ import annotations

import copy
import inspect
import threading
import types
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook



class Owner(Protocol):
    """What a mirror needs of the model whose replicas it steps
    (:class:`~cgdp.engine.dataparallel.steps.ReplicaSteps`)."""

    closed: bool
    mirrors: weakref.WeakSet

    def parameter_maps(self) -> list[dict[int, torch.nn.Parameter]]: ...
    def submit(self, j: int, fn: Callable[[], Any]) -> Future: ...
    def begin(self, cleanup: Callable[[], None]) -> None: ...
    def end(self) -> None: ...
    def resynced(self) -> None: ...
    def kept(self) -> bool: ...
    def make_mirror(self, opt: torch.optim.Optimizer) -> "Mirror": ...


_OWNERS: dict[int, weakref.ref] = {}
"""id(parameter of replica 0) -> the owner that steps its replicas (while its model is open)."""
_ATTR = "_cgdp_mirror"
_INNER = "_cgdp_step"  # the optimizer's own step, under its outermost one
_lock = threading.Lock()
_live = 0
"""How many DataParallel are registered: the global step hooks exist only while one is (every
optimizer step in the process pays their ownership lookup)."""
_handles: list = []


def register(dp: Owner, params: list[torch.nn.Parameter]) -> weakref.ref:
    """``dp`` owns ``params``; the reference to pass to :func:`unregister`."""
    global _live
    with _lock:
        if _live == 0:
            _handles[:] = [register_optimizer_step_pre_hook(_pre_hook),
                           register_optimizer_step_post_hook(_post_hook)]
        _live += 1
        ref = weakref.ref(dp)
        for p in params:
            _OWNERS[id(p)] = ref
        return ref


def unregister(params: list[torch.nn.Parameter], ref: weakref.ref) -> None:
    """Once per :func:`register` (at close, or when the DataParallel is freed): removes the
    entries of that DataParallel (``ref``) only, never another's."""
    global _live
    with _lock:
        for p in params:
            if _OWNERS.get(id(p)) is ref:
                del _OWNERS[id(p)]
        _live -= 1
        if _live == 0:
            for h in _handles:
                h.remove()
            _handles.clear()


def _owner(opt: torch.optim.Optimizer) -> "Owner | None":
    owners = set()
    unowned = 0
    for group in opt.param_groups:
        for p in group["params"]:
            ref = _OWNERS.get(id(p))
            dp = ref() if ref is not None else None
            if dp is None:
                unowned += 1
            else:
                owners.add(dp)
    if not owners:
        return None
    if len(owners) > 1 or unowned:
        raise ValueError("this optimizer holds parameters of a cgdp.DataParallel together with other "
                         "parameters (or those of another DataParallel); an optimizer may hold the "
                         "parameters of one DataParallel only (model.parameters() or a subset): build "
                         "a separate optimizer for the others. A layer replaced after wrapping has "
                         "parameters the DataParallel does not train: replace layers before wrapping")
    return owners.pop()


def _pre_hook(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    mirror = opt.__dict__.get(_ATTR)
    if mirror is False:  # a mirror optimizer itself
        return
    if mirror and mirror.depth and mirror.thread is threading.current_thread():
        mirror.depth += 1  # super().step() inside a step already mirrored
        return
    if mirror is None or mirror.dp() is None or mirror.dp().closed:
        opt.__dict__.pop(_ATTR, None)  # a closed model's optimizer steps replica 0 alone again
        dp = _owner(opt)
        if dp is None:
            return
        mirror = dp.make_mirror(opt)  # a Mirror, or a HostMirror (update="host")
        opt.__dict__[_ATTR] = mirror
    mirror.before(args, kwargs)


def _post_hook(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    mirror = opt.__dict__.get(_ATTR)
    if not mirror or not mirror.depth:
        return
    mirror.depth -= 1
    if not mirror.depth:
        mirror.after()


def _nothing() -> None:
    pass


def _install_outermost(opt: torch.optim.Optimizer) -> None:
    """Give ``opt`` an outermost ``step`` of its instance, over the one it has (its class's, or a
    scheduler's counter around it): the count of nested calls starts afresh at each call of this
    thread, even after a step that raised (see the module). Like torch's LR-scheduler counter it
    holds ``opt`` weakly (the optimizer stays free of reference cycles: its state is freed with its
    last reference), has the signature of the step it covers (``GradScaler`` reads it), and has the
    ``__func__`` a scheduler built later unwraps."""
    inner = opt.step
    bound = isinstance(inner, types.MethodType) and inner.__self__ is opt
    opt.__dict__[_INNER] = (inner.__func__ if bound else inner, bound)  # no reference to opt itself

    def unbound(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        mirror = self.__dict__.get(_ATTR)
        if mirror and mirror.thread is threading.current_thread():
            mirror.depth = 0
        fn, is_method = self.__dict__[_INNER]
        try:
            return fn(self, *args, **kwargs) if is_method else fn(*args, **kwargs)
        except BaseException:
            getattr(self.__dict__.get(_ATTR), "raised", _nothing)()  # update="host": give the masters back now
            raise

    ref = weakref.ref(opt)

    def step(*args: Any, **kwargs: Any) -> Any:
        return unbound(ref(), *args, **kwargs)
    step.__func__ = unbound  # type: ignore[attr-defined]
    step.__signature__ = inspect.signature(inner)  # type: ignore[attr-defined]
    step.cgdp_outermost = True  # type: ignore[attr-defined]
    if getattr(inner, "_wrapped_by_lr_sched", False):  # what a scheduler checks its counter by
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.__dict__["step"] = step


def _remove_outermost(opt: torch.optim.Optimizer) -> None:
    """``opt.step`` as it was before :func:`_install_outermost`, unless a scheduler built since
    wraps it (then it stays, and only resets counts of a live mirror)."""
    d = opt.__dict__
    if not getattr(d.get("step"), "cgdp_outermost", False):
        return
    fn, bound = d.pop(_INNER)
    if bound and fn is getattr(type(opt), "step", None):
        del d["step"]  # the class's own step again
    else:
        d["step"] = types.MethodType(fn, opt) if bound else fn


_AMP_ATTRS = ("grad_scale", "found_inf")
"""What ``GradScaler.step`` sets on an optimizer for the length of its step (torch/amp/grad_scaler.py)."""


class Mirror:
    """The mirror optimizers of one user optimizer (``mirrors[j - 1]`` steps replica j)."""

    def __init__(self, opt: torch.optim.Optimizer, dp: Owner):
        self.opt = opt
        self.dp = weakref.ref(dp)
        self.maps = dp.parameter_maps()
        self.inflight: list[Future] = []
        self.depth = 0
        """How many calls of ``opt``'s step (and hooked parent steps) the current one is inside."""
        self.thread: threading.Thread | None = None
        self.mirrors = [self._build(j) for j in range(1, len(self.maps) + 1)]
        self._load_hook = opt.register_load_state_dict_post_hook(self._reload)
        if _INNER not in opt.__dict__:
            _install_outermost(opt)
        dp.mirrors.add(self)

    def detach(self) -> None:
        """The ``DataParallel`` closed: drop the mirror optimizers (the other replicas' parameters
        and optimizer state) and the hook on the user's optimizer, which steps replica 0 alone."""
        self._load_hook.remove()
        self.mirrors, self.maps, self.inflight = [], [], []
        d = self.opt.__dict__
        if d.get(_ATTR) is self:
            del d[_ATTR]
        _remove_outermost(self.opt)

    def _groups(self, j: int, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        mapping = self.maps[j - 1]
        if any(id(p) not in mapping for g in groups for p in g["params"]):
            raise ValueError("this optimizer holds a parameter that the cgdp.DataParallel did not have when it "
                             "was built (a layer replaced after wrapping?): it cannot step it on every replica. "
                             "Replace layers before wrapping, or close() and wrap model.module again")
        return [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [mapping[id(p)] for p in g["params"]]} for g in groups]

    def _build(self, j: int) -> torch.optim.Optimizer:
        cls = type(self.opt)
        sig = inspect.signature(cls.__init__).parameters
        any_kw = any(p.kind is p.VAR_KEYWORD for p in sig.values())
        # every group carries all its hyperparameters; the constructor's defaults only matter for
        # groups added later, and some defaults are not constructor arguments (AdamW's)
        defaults = {k: v for k, v in self.opt.defaults.items() if any_kw or k in sig}
        try:
            m = cls(self._groups(j, self.opt.param_groups), **defaults)
        except TypeError as exc:
            raise TypeError(f"cgdp.DataParallel steps every replica with a copy of your optimizer, built "
                            f"as {cls.__name__}(param_groups, **optimizer.defaults), which failed ({exc}). "
                            f"Give {cls.__name__} a constructor that accepts its defaults as keywords") from exc
        m.__dict__[_ATTR] = False
        if self.opt.state:
            m.load_state_dict(copy.deepcopy(self.opt.state_dict()))
        return m

    def _reload(self, opt: torch.optim.Optimizer) -> None:
        """After ``opt.load_state_dict``: every mirror gets its own copy of the state."""
        self._sync_groups()
        state = opt.state_dict()
        for m in self.mirrors:
            m.load_state_dict(copy.deepcopy(state))

    def _sync_groups(self) -> None:
        """Groups added with ``add_param_group`` go to the mirrors; hyperparameters are copied."""
        groups = self.opt.param_groups
        for j, m in enumerate(self.mirrors, start=1):
            if len(m.param_groups) < len(groups):
                for g in self._groups(j, groups[len(m.param_groups):]):
                    m.add_param_group(g)
            dev = next(iter(self.maps[j - 1].values())).device
            for gu, gm in zip(groups, m.param_groups):
                if len(gu["params"]) != len(gm["params"]):
                    raise RuntimeError("the parameters of an optimizer param group of a cgdp.DataParallel "
                                       "changed after its first step; add parameters with "
                                       "optimizer.add_param_group instead")
                for k, v in gu.items():
                    if k != "params":
                        gm[k] = v.to(dev) if isinstance(v, torch.Tensor) and v.device != dev else v

    def _sync_amp(self) -> None:
        """``torch.amp.GradScaler`` steps an optimizer that unscales inside its own step (fused Adam,
        AdamW, SGD: ``_step_supports_amp_scaling``) with ``grad_scale`` and ``found_inf`` set on it for
        that step; each mirror gets them too (the fused kernels move them to its device), so it
        unscales as replica 0 does and skips a step with an inf or NaN gradient as replica 0 does."""
        for k in _AMP_ATTRS:
            v = getattr(self.opt, k, None)
            for m in self.mirrors:
                if v is None:
                    m.__dict__.pop(k, None)
                else:
                    setattr(m, k, v)

    def before(self, args: tuple, kwargs: dict) -> None:
        dp = self.dp()
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:  # args[0]: opt
            raise NotImplementedError("optimizer.step(closure) is not supported with cgdp.DataParallel: "
                                      "the closure would run on replica 0 only")
        dp.begin(self.failed_on_replica_0)  # the model's operation lock, until after() or the clean-up
        try:
            self._sync_groups()
            self._sync_amp()
            self.inflight = [dp.submit(j, m.step) for j, m in enumerate(self.mirrors, start=1)]
        except BaseException:
            self.failed_on_replica_0()
            dp.end()
            raise
        self.depth, self.thread = 1, threading.current_thread()

    def after(self) -> None:
        errors = self._wait()
        dp = self.dp()
        if errors or (dp is not None and not dp.kept()):
            self.resync()  # a step that raised, or replica 0 stepped on other gradients than its mirrors
        if dp is not None:
            dp.end()  # gives the model's operation lock back
        if errors:
            j, exc = errors[0]
            raise RuntimeError(f"optimizer.step() raised on replica {j} ({exc!r}) after replica 0's step had "
                               f"completed; every replica now holds replica 0's parameters and optimizer "
                               f"state, so the step took effect and the replicas are identical") from exc

    def failed_on_replica_0(self) -> None:
        """The clean-up of a step that raised on replica 0 (torch ran no post-hook): the other
        replicas may have stepped; they take replica 0's parameters and state, as one device has
        them after its step raised."""
        self._wait()
        self.resync()
        dp = self.dp()
        if dp is not None:
            dp.resynced()

    def _wait(self) -> list[tuple[int, BaseException]]:
        """Wait for the other replicas' steps; (replica, exception) of those that raised."""
        inflight, self.inflight = self.inflight, []
        errors = []
        for j, f in enumerate(inflight, start=1):
            try:
                f.result()  # note: host waits for the other replicas' updates
            except BaseException as exc:
                errors.append((j, exc))
        return errors

    def resync(self) -> None:
        """Every replica takes replica 0's parameters (those of this optimizer) and optimizer state."""
        with torch.no_grad():
            for j, m in enumerate(self.mirrors, start=1):
                mapping = self.maps[j - 1]
                for group in self.opt.param_groups:
                    for p in group["params"]:
                        mapping[id(p)].copy_(p)
        state = self.opt.state_dict()
        for m in self.mirrors:
            m.load_state_dict(copy.deepcopy(state))
