"""Replica 0 is the user's model: what the other replicas follow of it, for both faces.

The user changes the model between steps (``eval()``, ``p.clamp_`` under ``no_grad``, ``load_state_dict``, a layer
replaced) and a forward may write parameters (``nn.Embedding(max_norm=...)``); the other replicas take such changes
before they run again. :class:`Follow` holds replica 0 *as every replica has it* (:meth:`Follow._look`), compared as one
value before every step or forward (:meth:`Follow.before_step`): modes are copied; buffers changed in place are copied
(the face records its own writes, :meth:`Follow.buffers_synced`); a parameter frozen after wrapping is
frozen everywhere, unfreezing one frozen when wrapped is refused (no place in the flat buffers); parameters changed in
place (version counters, which ``p.data`` does not share) are copied, with a warning; hook registrations are followed by
:class:`~cgdp.engine.core.module_hooks.ModuleHooks`; new submodules or parameter objects are refused (buffers, hooks and
optimizers hold the old ones); a ``load_state_dict`` of any submodule reaches every replica through load hooks
(:class:`LocalHooks`), once per call, and ``assign=True`` is refused until undone.

:meth:`Follow.after_forward`: a parameter a forward wrote on replica 0 must end as one device would hold it. Equal
everywhere: nothing to do. A max_norm embedding: every replica takes, per looked-up row (:class:`_Lookups`), the row of
smaller norm (same bits wherever renormalised); a write into a weight saved for backward is refused. Any other
difference is refused, replica 0's parameters copied first. A write on some replica j > 0 only is not seen.
"""
from __future__ import annotations

import operator
import threading
import weakref
from collections import OrderedDict
from functools import partial
from itertools import chain
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.hooks import RemovableHandle

from cgdp.engine.core.module_hooks import ModuleHooks, hook_count
from cgdp.engine.core.user_warning import warn_user

_TRAINING = operator.attrgetter("training")
_GRAD = operator.attrgetter("requires_grad")
_VERSION = operator.attrgetter("_version")
_CHILDREN = operator.attrgetter("_modules")


class Follow:
    """What replicas 1..G-1 copy from replica 0. ``name``, ``again``: the face and how to start over, for messages;
    ``after_load``: called once every replica has the loaded state; ``unbound``: what the changed-parameters warning
    adds of an optimizer the face does not step."""

    def __init__(self, replicas: Sequence[nn.Module], devices: Sequence[torch.device], name: str, again: str,
                 after_load: Callable[[], None], unbound: tuple[str, str] = ("", "")):
        self.replicas = list(replicas)
        self.name, self.again, self.unbound = name, again, unbound
        self.after_load = after_load
        self.modules = [list(r.modules()) for r in replicas]  # same order on every replica
        self.params = [list(r.parameters()) for r in replicas]  # trainable or not
        self.buffers = [list(r.buffers()) for r in replicas]
        self.hooks = ModuleHooks(replicas, self.params, devices)
        self.wrapped_trainable = list(map(_GRAD, self.params[0]))
        self.trainable = list(self.wrapped_trainable)
        self._names = [n for n, _ in replicas[0].named_modules()]
        self._children = [[(k, id(c)) for k, c in m._modules.items()] for m in self.modules[0]]
        self._child_ids = [c for children in self._children for _, c in children]  # the tree, flat
        self._lookups = _Lookups(self.modules, self.params)
        _watch_registrations(+1)
        me = weakref.ref(self)  # the model (often still held by the user) must not keep this alive
        self._outer: tuple = (None, None)  # the module a load_state_dict call loads, and its missing keys
        self._load: list[RemovableHandle] | None = []  # every submodule's load_state_dict pre- and post-hook
        for m in self.modules[0]:
            self._load += (_local_hook(m, "_load_state_dict_pre_hooks", partial(_load_begins, me)),
                           _local_hook(m, "_load_state_dict_post_hooks", partial(_load_ends, me)))
        self._seen = self._look()

    def close(self) -> None:
        if self._load is not None:
            for h in self._load + self._lookups.handles:
                h.remove()
            self._load = None
            _watch_registrations(-1)

    def _look(self) -> list:
        """Replica 0 now, as one value, built in C (cheap enough for every step)."""
        m0, p0 = self.modules[0], self.params[0]
        return [list(map(_TRAINING, m0)), list(map(_GRAD, p0)), list(map(_VERSION, p0)), _registrations,
                hook_count(), list(map(_VERSION, self.buffers[0]))]

    def stepped(self) -> None:
        """Every replica was stepped alike: the new versions are not a change to follow."""
        self._seen[2] = list(map(_VERSION, self.params[0]))

    def buffers_synced(self) -> None:
        """The face made every replica's buffers the same (after a forward): their new versions are not a change."""
        self._seen[5] = list(map(_VERSION, self.buffers[0]))

    def before_step(self) -> bool:
        """Caller's thread, no replica running: every replica takes what changed on replica 0, or a refusal is raised
        (again until undone). Returns whether the buffers were relisted."""
        now = self._look()
        seen = self._seen
        self._lookups.arm()
        if now == seen:
            return False
        relisted = False
        if now[3] != seen[3] or now[4] != seen[4]:  # replica 0's module tree read again (in C)
            m0 = self.modules[0]
            if list(map(id, chain.from_iterable(map(dict.values, map(_CHILDREN, m0))))) != self._child_ids:
                self._refuse_new_children()
            relisted = self.hooks.follow(moved=True)
        if now[3] != seen[3]:  # a buffer assigned or registered: listed again, every one copied
            self.buffers = [list(r.buffers()) for r in self.replicas]
            now[5] = list(map(_VERSION, self.buffers[0]))
            self._copy_buffers(range(len(self.buffers[0])))
        elif now[5] != seen[5]:  # changed in place (reset_running_stats(), a schedule): replica 0's everywhere
            self._copy_buffers([i for i, (a, b) in enumerate(zip(now[5], seen[5])) if a != b])
        if now[0] != seen[0]:
            self._copy_modes(now[0])
        if now[1] != seen[1]:
            self._copy_requires_grad(now[1])
        if now[2] != seen[2]:
            whose, how = self.unbound
            warn_user(f"replica 0's parameters were changed outside optimizer.step(){whose} ({how}in place under "
                      f"torch.no_grad(), e.g. p.clamp_ or torch.nn.init); {self.name} copies them to "
                      f"every replica before it runs them again. Changes through p.data are not seen: "
                      f"make them on every replica (.replicas)")
            with torch.no_grad():
                for params in self.params[1:]:
                    for p, first in zip(params, self.params[0]):
                        p.copy_(first)
        self._seen = self._look()  # replica 0 as it is now is every replica's
        return relisted

    def _refuse_new_children(self) -> None:
        for i, (m, before) in enumerate(zip(self.modules[0], self._children)):
            now = [(k, id(c)) for k, c in m._modules.items()]
            if now != before:
                where = f"{self._names[i]}." if self._names[i] else ""
                names = sorted({k for k, _ in set(now) ^ set(before)})
                raise RuntimeError(
                    f"the submodule(s) {', '.join(where + n for n in names)} of the model were replaced, added or "
                    f"removed after {self.name} was built; it trains the parameters the model had then on every "
                    f"device (its gradient buffers, hooks and optimizers hold them), so it cannot follow a new "
                    f"layer. Make such changes before building it (or put the old layer back), or {self.again}")

    def _copy_modes(self, flags: list[bool]) -> None:
        """``net.eval()`` or a frozen BatchNorm set on replica 0 alone must not leave the others training."""
        for mods in self.modules[1:]:
            for m, f in zip(mods, flags):
                if m.training is not f:
                    m.training = f

    def _copy_requires_grad(self, now: list[bool]) -> None:
        names = [n for (n, _), was, r in zip(self.replicas[0].named_parameters(), self.wrapped_trainable, now)
                 if r and not was]
        if names:
            raise RuntimeError(f"parameters frozen when {self.name} was built now require grad "
                               f"({', '.join(names[:5])}); unfreeze them before building it, or {self.again}")
        for params in self.params[1:]:
            for q, r in zip(params, now):
                if q.requires_grad is not r:
                    q.requires_grad_(r)
        self.trainable = now

    def _copy_buffers(self, which: Any) -> None:
        with torch.no_grad():
            for bufs in self.buffers[1:]:
                for i in which:
                    if bufs[i].shape == self.buffers[0][i].shape:
                        bufs[i].copy_(self.buffers[0][i])
        self.after_load()  # every replica's buffers are the same: the face's baseline

    def broadcast(self, at: int) -> None:
        """Every replica's submodule ``at`` ← replica 0's state, after a load."""
        self._refuse_new_parameters()
        state = self.modules[0][at].state_dict()
        with torch.no_grad():
            for mods in self.modules[1:]:
                mods[at].load_state_dict(state)
        now = self._look()
        self._seen[:3], self._seen[5] = now[:3], now[5]  # a load that assigned buffers anew is followed by before_step
        self.after_load()

    def _refuse_new_parameters(self) -> None:
        if list(map(id, self.replicas[0].parameters())) == list(map(id, self.params[0])):
            return
        known = set(map(id, self.params[0]))
        names = [n for n, p in self.replicas[0].named_parameters() if id(p) not in known] or ["(removed)"]
        raise RuntimeError(
            f"the parameter(s) {', '.join(names[:5])} of the model are new objects since {self.name} was built "
            f"(load_state_dict(..., assign=True) replaces them); it trains the parameters the model had then on "
            f"every device (its gradient buffers, hooks and optimizers hold them). Load without assign=True (it "
            f"copies into them), or {self.again}")

    def after_forward(self, used: int) -> None:
        """After a forward of replicas 0..used-1 (caller's thread): see the module."""
        versions = list(map(_VERSION, self.params[0]))
        seen = self._seen[2]
        looked = self._lookups.take()  # only max_norm embeddings' weights
        if versions == seen:
            return
        refused, saved = [], []
        with torch.no_grad():
            for i in [i for i, (v, s) in enumerate(zip(versions, seen)) if v != s]:
                ps = [params[i] for params in self.params]
                first = ps[0]
                if rows := looked.get(i):  # looked up: armed by before_step, so ``base`` is this forward's
                    if _merge_rows(ps, rows, self._lookups.norm[i], self._lookups.base[i]):
                        saved.append(i)
                else:
                    same = all(torch.equal(first, p.to(first.device)) for p in ps[1:used])
                    if not same:
                        refused.append(i)
                    for p in ps[used if same else 1:]:  # equal: only replicas without samples (they ran no forward)
                        p.copy_(first)
        self.stepped()  # replica 0's writes are every replica's now
        names = [n for n, _ in self.replicas[0].named_parameters()] if refused or saved else []
        if saved:
            raise RuntimeError(
                f"the model's forward used the weight {', '.join(names[i] for i in saved[:5])} of an "
                f"nn.Embedding(max_norm=...) in another operation that saved it for backward (a penalty on the table, "
                f"a tied layer) after the embedding renormalised the rows its part of the batch looked up; one device "
                f"renormalises the rows of the whole batch first, and the rows the other devices renormalised cannot "
                f"be written without breaking that backward ({self.name} gave them to every replica and drops this "
                f"forward). Use only what the embedding returns (a penalty on the looked-up rows), renormalise outside "
                f"the forward (max_norm=None, torch.embedding_renorm_ under torch.no_grad() before the step), or "
                f"train on one device")
        if refused:
            raise RuntimeError(
                f"the model's forward changed parameter(s) {', '.join(names[i] for i in refused[:5])} in place, "
                f"differently on each device (each replica changes its own copy from its part of the batch), "
                f"which {self.name} cannot make equal to one device; every replica now holds replica 0's. Make "
                f"such changes outside the forward (between steps, under torch.no_grad(): they reach every "
                f"replica), or train on one device")


def _load_begins(me: Callable[[], Follow | None], module: nn.Module, _state: Any, _prefix: str, _meta: Any,
                 _strict: bool, missing: list, *_: Any) -> None:
    """The first pre-hook of a load (its missing-keys list is new) names the module loaded."""
    follow = me()
    if follow is not None and follow._outer[1] is not missing:
        follow._outer = (module, missing)


def _load_ends(me: Callable[[], Follow | None], module: nn.Module, keys: Any) -> None:
    """The loaded module's post-hook (torch runs the submodules' first): the load is done, broadcast it."""
    follow = me()
    if follow is not None and follow._outer[0] is module and follow._outer[1] is keys.missing_keys:
        follow._outer = (None, None)
        follow.broadcast(next(i for i, m in enumerate(follow.modules[0]) if m is module))


_registrations = 0
"""Modules, parameters and buffers torch registered while a :class:`Follow` lives. ``del model.fc`` is not seen."""
_watchers = 0
_handles: list = []
_lock = threading.Lock()


def _count(*_: Any) -> None:
    global _registrations
    _registrations += 1  # a lost increment of two threads at once still changes the count


def _watch_registrations(delta: int) -> None:
    """torch's global registration hooks, while some :class:`Follow` lives."""
    global _watchers
    with _lock:
        _watchers += delta
        if _watchers == 1 and not _handles:
            _handles[:] = [getattr(nn.modules.module, f"register_module_{kind}_registration_hook")(_count)
                           for kind in ("module", "parameter", "buffer")]
        elif _watchers == 0:
            for h in _handles:
                h.remove()
            _handles.clear()


class _Lookups:
    """The indices each max_norm embedding looked up per replica in the engine's forward (a local forward pre-hook),
    and each weight's reference count before it (a rise: something saved it for backward, so it must not be written).
    ``norm``: position of each such weight -> its ``norm_type``; a tied such weight is refused."""

    def __init__(self, modules: list[list[nn.Module]], params: list[list[nn.Parameter]]):
        pos = {id(p): i for i, p in enumerate(params[0])}
        self.norm: dict[int, float] = {}
        self.ids: dict[int, list[torch.Tensor]] | None = None  # armed (the hooks record) while a dict
        self.base: dict[int, list[int]] = {}
        self.edges: list = []
        self.handles: list[RemovableHandle] = []
        embeddings = [(k, m) for k, m in enumerate(modules[0])
                      if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None]
        for _, m in embeddings:  # all refused before any hook is registered
            if sum(any(q is m.weight for q in o._parameters.values()) for o in modules[0]) > 1:
                raise ValueError("an nn.Embedding with max_norm whose weight is shared with another module "
                                 "(tied) cannot be trained exactly on several devices: each device renormalises "
                                 "only the rows its part of the batch looks up, and the other module would see "
                                 "those. Untie the weight, or renormalise outside the forward (max_norm=None)")
        for k, m in embeddings:
            i = pos[id(m.weight)]
            self.norm[i] = float(m.norm_type)
            self.handles.append(_local_hook(m, "_forward_pre_hooks", partial(_looked_up, i, self)))
            for mods in modules[1:]:
                mods[k].__dict__["_forward_pre_hooks"] = m._forward_pre_hooks  # shared, as every hook dictionary
        self.weights = {i: [ps[i] for ps in params] for i in self.norm}

    def arm(self) -> None:
        """Before the engine's forward (caller's thread)."""
        if not self.weights:
            return
        self.ids = {}
        # read nowhere, but keeps the weights' grad accumulators for the forward (a new one would raise base's count)
        self.edges = [get_gradient_edge(w) for ws in self.weights.values() for w in ws if w.requires_grad]
        self.base = {i: [w._use_count() for w in ws] for i, ws in self.weights.items()}

    def take(self) -> dict[int, list[torch.Tensor]]:
        """After it: the indices looked up per weight."""
        looked, self.ids, self.edges = self.ids or {}, None, []
        return looked


def _looked_up(i: int, lookups: _Lookups, _module: nn.Module, args: tuple) -> None:
    ids = lookups.ids
    if ids is not None and args:
        ids.setdefault(i, []).append(args[0])  # list.append: safe from the replicas' threads


def _merge_rows(ps: list[torch.Tensor], looked: list[torch.Tensor], norm_type: float, base: list[int]) -> bool:
    """Every replica's looked-up rows ← the row of smallest norm (renormalising only shrinks, to the same bits).
    Only differing rows are written. Returns whether a write hit a weight saved for backward."""
    first = ps[0]
    rows = torch.unique(torch.cat([i.detach().reshape(-1).to(first.device, torch.long) for i in looked]))
    values = [p.detach()[rows.to(p.device)].to(first.device) for p in ps]
    merged, norms = values[0], torch.linalg.vector_norm(values[0], norm_type, dim=1)
    for q in values[1:]:
        qn = torch.linalg.vector_norm(q, norm_type, dim=1)
        take = qn < norms
        merged = torch.where(take.unsqueeze(1), q, merged)
        norms = torch.where(take, qn, norms)
    saved = False
    for j, (p, q) in enumerate(zip(ps, values)):
        differ = (q != merged).any(1)
        if bool(differ.any()):
            saved = saved or p._use_count() > base[j]
            p.index_copy_(0, rows[differ].to(p.device), merged[differ].to(p.device))
    return saved


class LocalHooks(OrderedDict):
    """A module's hook dictionary whose ``local`` entries are never pickled or copied: ``torch.save(model)``,
    ``deepcopy`` and ``pickle`` of the user's module carry nothing of cgdp (it pickles as a plain ``OrderedDict``).
    Handles of hooks registered before wrapping point at the old dictionary: an inherited entry counts while there."""

    def __init__(self, previous: OrderedDict):
        super().__init__(previous.items())
        self.previous = previous
        self.inherited = set(previous.keys())
        self.local: set[int] = set()

    def items(self) -> list[tuple[int, Any]]:  # what nn.Module.__call__ calls for forward pre-hooks
        return [(k, v) for k, v in super().items() if k not in self.inherited or k in self.previous]

    def values(self):  # what nn.Module.load_state_dict calls
        return [v for _, v in self.items()]

    def __reduce__(self):
        # a plain OrderedDict: the file (or the copy) holds the user's hooks only
        return OrderedDict, (), None, None, iter([(k, v) for k, v in self.items() if k not in self.local])


def _local_hook(module: nn.Module, attr: str, hook: Callable[..., Any]) -> RemovableHandle:
    """``hook`` in ``module``'s dictionary ``attr`` (by ``register<attr less s>``), kept out of pickles and copies."""
    hooks = getattr(module, attr)
    if not isinstance(hooks, LocalHooks):
        hooks = LocalHooks(hooks)
        setattr(module, attr, hooks)
    handle = getattr(module, "register" + attr[:-1])(hook)
    hooks.local.add(handle.id)
    return handle
