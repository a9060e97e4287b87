"""``cgdp.DataParallel``: the engine behind the user's own loop (``opt = model.bind(opt)`` once, then ``model(x)``,
``loss.backward()``, ``opt.step()``), driving the same :class:`~cgdp.engine.core.stream.GradientStream` and gradient
owner (:mod:`cgdp.engine.core.gradients`: the sum invariant, the states) as ``Trainer``. Each operation (forward, a
backward from :meth:`DataParallel._begin_backward` to :meth:`DataParallel._end_backward`, ``clip_grad_norm_``, the bound
``optimizer.step()``, ``bind()``) holds the operation lock (:mod:`cgdp.engine.core.lifetime`; ``docs/design.md``).

* **Replicas.** ``net`` is replica 0 on ``devices[0]``, trained in place (``.module``); replicas j > 0 are deep copies,
  never broadcast again: each takes the same optimizer step (:mod:`~.steps`, :mod:`~.binding`).
* **Forward** (:mod:`~.scatter`): each part on its device's thread (caller's grad mode and autocast); a training
  forward then gives floating buffers (BatchNorm statistics) their batch-weighted mean on every replica.
* **Backward.** The gather's backward readies the gradients and queues :meth:`_end_backward` (``queue_callback``, as
  DDP), run on the thread that finished the backward before ``backward()`` returns: it flushes incomplete chunks and
  waits for every host SUM (unweighted: the loss on the gathered output already weights each sample). On emulated
  devices every backward runs on one thread; each replica's hooks are still touched by one thread only.
* **Several machines** (``comm``): host sums scaled by 1/R and allreduced per chunk (the mean, as DDP: all of a
  replica's gradient, also what reached replica 0 other than through the gathered output, such as a weight penalty).
  Every rank must do the same synced backwards and training forwards (the buffers' mean is a collective).

Input gradients: :mod:`~.input_grads`; sparse gradients: :mod:`cgdp.engine.core.sparse_grads`; buffers that require
grad: :mod:`~.user_module`. Unsupported (clear errors): ``torch.autograd.grad`` for the parameters, input gradients
with ``create_graph=True`` while training, ``optimizer.step(closure)``. A backward that fails before any gradient
arrived keeps the gradients; one that fails partway drops them, and ``optimizer.step()`` refuses until it is redone.
"""
from __future__ import annotations

import contextlib
import copy
import threading
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.autograd import Variable

from cgdp.engine.backend import default_devices, parse_devices
from cgdp.engine.core.host_update import HostMasters, check_host_update
from cgdp.engine.core.lifetime import Face, Lifetime, operation, weak_call
from cgdp.engine.core.memory_report import memory_report
from cgdp.engine.core.layers import find_layers, number_params, trainable_dtype
from cgdp.engine.core.padding import OwnLossCheck, labels_of
from cgdp.engine.core.param_hooks import ParamHooks
from cgdp.engine.core.plan import first_plan
from cgdp.engine.core.replicas import make_replicas, settings, signature
from cgdp.engine.core.stream import check_sizes
from cgdp.engine.core.threads import caller_context
from cgdp.engine.dataparallel.binding import bind
from cgdp.engine.dataparallel.input_grads import BackwardCheck
from cgdp.engine.core.dense_grads import build_gradients
from cgdp.engine.core.gradients import UserFault
from cgdp.engine.dataparallel.steps import ReplicaSteps
from cgdp.engine.dataparallel.replica_state import ReplicaState
from cgdp.engine.dataparallel.scatter import gather, scatter, unbatched_note, watch_counts
from cgdp.engine.core.sparse_grads import SparseGrads, sparse_parameters
from cgdp.engine.dataparallel.user_module import GradBuffers
from cgdp.engine.core.user_warning import warn_user
from cgdp.engine.sync import Guard, StepAborted, check_timeout
from cgdp.planning.chunks import Plan


NAME = "cgdp.DataParallel"

# a forward's backward sums (the default); accumulates locally (no_sync()); every backward sums (sync_in_backward())
_SYNCED, _NO_SYNC, _SYNC_IN_BACKWARD = "synced", "no_sync", "sync_in_backward"


_SAID_EMULATED = [False]


def _say_emulated_once(devices: list[str]) -> None:
    if devices[0].startswith("cuda") or _SAID_EMULATED[0]:
        return
    _SAID_EMULATED[0] = True
    warn_user(f"cgdp.DataParallel found no GPU and runs on {len(devices)} CPU-emulated devices "
              f"({', '.join(devices)}), so that your loop goes through the whole engine before it meets a GPU; "
              f"the replicas share this machine's cores, so it is slower than the plain module (which is what "
              f"nn.DataParallel runs without a GPU). Pass devices=[...] to choose them and silence this, or "
              f"train the plain module for speed")


class DataParallel(Face, nn.Module):
    """Data parallelism over ``devices`` behind your own training loop, gradients summed on the host.

    Args:
        module: the model; it becomes replica 0 (moved to ``devices[0]``, trained in place).
        devices: ``["cuda:0", ...]`` or emulated ``["cpu:0", ...]``; ``None``: every GPU, else two emulated.
        chunks: chunk size k, a plan, or ``"auto"``: uniform plans timed over the first ~3 x log2(layers) iterations.
        comm: ``None``, ``"mpi"``, ``"gloo"``, a process group or a :class:`cgdp.comm.Comm` (closed by ``close()``).
        timeout_s: longest any thread waits for another before backward raises ``TimeoutError``; ``None``: forever.
        segment_bytes, host_memory: as for ``Trainer``.
        scalar_outputs: ``"mean"``, ``"sum"`` or ``"auto"`` (sum when ``num_items_in_batch`` is used; :mod:`~.scatter`).
        update: ``"devices"`` or ``"host"`` (float32 masters stepped on the host; :mod:`~.binding`).
        share_devices: allow a GPU listed more than once, as for ``Trainer`` (tests and measurements, not speed).
    """

    cgdp_engine = True  # not a model to replicate (core/claims.py)

    def __init__(self, module: nn.Module, devices: Sequence[str] | None = None, *,
                 chunks: int | Plan | str = "auto", comm: Any = None, timeout_s: float | None = 300.0,
                 segment_bytes: int = 4 << 20, host_memory: int | None = None, scalar_outputs: str = "auto",
                 update: str = "devices", share_devices: bool = False):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        check_timeout(timeout_s)
        check_sizes(segment_bytes, host_memory)
        if scalar_outputs not in ("auto", "mean", "sum"):
            raise ValueError(f"scalar_outputs must be 'auto', 'mean' or 'sum', got {scalar_outputs!r}")
        if devices is None:
            devices = default_devices()
            _say_emulated_once(devices)
        if isinstance(devices, (list, tuple)):  # torch.device("cuda", 1) is "cuda:1"
            devices = [str(d) if isinstance(d, torch.device) else d for d in devices]
        parse_devices(devices, share_devices)
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters()):
            raise RuntimeError("Modules with uninitialized parameters (lazy modules such as nn.LazyLinear) "
                               "cannot be replicated: run one forward on a sample batch before wrapping")
        sparse = sparse_parameters(module)
        if sparse and comm is not None:
            raise NotImplementedError("cgdp.DataParallel with comm (several machines) does not support "
                                      "sparse gradients (nn.Embedding(sparse=True)): use sparse=False")
        if comm is not None and any(b.requires_grad for b in module.buffers()):
            raise NotImplementedError("cgdp.DataParallel with comm (several machines) averages the gradients of "
                                      "parameters over the ranks, and this model has buffers that require grad, "
                                      "whose gradients would stay each rank's own: make them nn.Parameter, or "
                                      "train on one machine")
        infos, layer_params = find_layers(module, skip={id(p) for p in sparse})
        dtype = trainable_dtype(layer_params) if any(layer_params) else None
        self._host_update = check_host_update(update, dtype)
        self.devices = list(devices)
        self._scalar_outputs = scalar_outputs
        self._own_loss = OwnLossCheck(NAME, "pass num_items_in_batch (the token count of the whole batch, "
                                      "(labels != -100).sum()) to a model that divides by it, as Hugging Face "
                                      "models do, or compute the loss from the gathered logits", warn_user)
        self._sync = _SYNCED  # what a forward's backward does: no_sync() and sync_in_backward() set it
        self._guard = Guard(timeout_s)
        # one operation at a time, and what close() releases (also when dropped without close())
        self._life = Lifetime(self, NAME, "wrap model.module again", _refusal, _stopped, self._guard.fail)
        self._life.start(self, module, devices, share_devices, lambda devs: self._build(
            devs, module, comm, update, infos, layer_params, dtype, chunks, segment_bytes, host_memory))

    def _build(self, devs, module, comm, update, infos, layer_params, dtype, chunks, segment_bytes,
               host_memory) -> None:
        self._devs = devs
        self._comm = self._life.open_comm(comm, self._guard.timeout_s,
                                          lambda: signature("DataParallel", module, infos, len(devs), dtype,
                                                            **settings(update=update, segment_bytes=segment_bytes,
                                                                       host_memory=host_memory,
                                                                       scalar_outputs=self._scalar_outputs)))
        before = [p.grad for layer in layer_params for p in layer]
        reps = make_replicas(module, devs)
        self._life.claim.add(p for r in reps[1:] for p in r.parameters())
        self.module = module
        object.__setattr__(self, "_replicas", reps)  # not submodules: parameters() is replica 0's
        sparse = [sparse_parameters(r) for r in reps]
        params = [[p for layer in find_layers(r, {id(q) for q in sp})[1] for p in layer]
                  for r, sp in zip(reps, sparse)]
        self._grad_buffers = GradBuffers(reps)  # read from replica 0 by every replica
        self._torch_devices = torch_devices = [d.torch_device for d in devs]
        self._state = ReplicaState(reps, torch_devices)
        res = self._life.resources
        res.push(self._state.follow.close)  # its load hook: never pickled with the module
        self._param_hooks = ParamHooks(params, unsupported=sparse[0])  # they run on the sum
        self._backward_check = BackwardCheck()
        plan, tuner = None, None  # nothing to stream
        if any(info.numel for info in infos):  # dense trainable parameters: the streaming path
            # no step profiles here (the loop is the user's): the tuner measures uniform plans
            plan, tuner = first_plan(chunks, [i.numel * dtype.itemsize for i in infos], len(devs), self._comm)
        self._threads, self._rng, self._stream, self._grads = build_gradients(
            self._life, devs, params, number_params(layer_params), dtype, plan, guard=self._guard, comm=self._comm,
            param_hooks=self._param_hooks, initial=before, keep_grads=True, segment_bytes=segment_bytes,
            streaming=True, host_memory=host_memory, sparse=SparseGrads(sparse, torch_devices) if sparse[0] else None)
        if self._stream is not None and self._comm is not None:
            # the mean over ranks, as DDP's: of all the gradient, whatever path it took
            self._stream.host.scale = 1.0 / self._comm.size
        self._params = params
        self._steps = steps = ReplicaSteps(self._life, devs, self._threads, self._grads, self._state,
                                           weak_call(self._parameter_maps), self._stream, self._comm, tuner,
                                           self._guard.timeout_s, HostMasters(devs, params) if self._host_update else None)
        res.push(lambda: [b.close() for b in list(steps.bindings)])

    @property
    def output_device(self) -> torch.device:
        """Where the gathered outputs are (``devices[0]``): put the targets there."""
        return self._devs[0].torch_device

    @property
    def replicas(self) -> list[nn.Module]:
        self._life.ops.clean_stale()  # after a backward that raised: its clean-up first
        return list(self._replicas)

    def rng_state(self) -> dict[str, Any]:
        """The replicas' random streams, for a checkpoint: :meth:`set_rng_state` continues them exactly."""
        return {"states": [s.clone() for s in self._rng.states], "turns": getattr(self._rng, "turns", None)}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        if len(state["states"]) != len(self._rng.states):
            raise ValueError(f"the random state is of {len(state['states'])} replicas, this model has "
                             f"{len(self._rng.states)}: resume on as many devices")
        self._rng.states = [s.clone() for s in state["states"]]
        if state.get("turns") is not None:
            self._rng.turns = state["turns"]

    @operation("bind()")
    def bind(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Bind ``optimizer`` once: its ``step()`` steps every replica until :meth:`close`. Returns it; idempotent."""
        owned = {id(p) for p in [*self._state.params[0], *self._grad_buffers.current(0)]}
        bind(optimizer, self._steps, owned, weak_call(self._inside))
        return optimizer

    def _inside(self) -> set[int]:
        """Every parameter of every replica now (one not among the engine's: a layer replaced after wrapping)."""
        return {id(p) for r in [self.module, *self._replicas[1:]] for p in r.parameters()}

    @property
    def plan(self) -> Plan:
        """The chunk plan in use; empty without dense trainable parameters."""
        return self._stream.plan if self._stream is not None else []

    @operation("forward()")
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        for d in self._devs:
            d.check_caller("model(...)")  # CUDA: the replicas run on the default streams, as must the gather
        if self._state.follow.before_step():  # what the user changed on model.module since; buffers relisted (prune)
            self._state.rebuild_buffers()
        parts, sizes = scatter(args, kwargs, self._torch_devices)
        g = len(parts)
        counts = watch_counts(parts, self._torch_devices) if self._scalar_outputs == "auto" else []
        self._backward_check.disarm()  # guard hooks left by an autograd.grad that failed
        self._guard.reset()  # a forward that raised before left its error: this one reports its own
        if self._grad_buffers:
            self._grad_buffers.refresh(self._torch_devices, g)
        in_caller = caller_context()

        def forward_on(j: int) -> Any:
            if j >= g:
                return None
            try:
                with in_caller():
                    return self._rng.on_device(j, lambda: self._replicas[j](*parts[j][0], **parts[j][1]))
            except Exception as exc:  # the user's own error, said where it happened
                exc.add_note(f"(raised in replica {j} of cgdp.DataParallel, on {self.devices[j]})")
                if hint := unbatched_note(args, kwargs, sizes):
                    exc.add_note(hint)
                raise

        try:
            outs = self._rng.forward_all(lambda: self._threads.run_all(forward_on, computing=True),
                                         self._state.buffer_watch.restore)  # done again if it drew: buffers back
        except BaseException:  # failed on some devices only: counters (BatchNorm's) must agree
            if not self._threads.stuck:
                self._state.broadcast_buffers()
            raise
        self._state.follow.after_forward(g)  # parameters the forward changed in place
        if self.module.training:  # the buffers the forward wrote (BatchNorm's statistics): the same everywhere
            self._state.after_forward(sizes, self._comm, self._rng.may_rerun)
        sync = self._sync != _NO_SYNC
        # read again when the backward starts (autograd's thread): sync_in_backward() around it sums it
        on_backward = ((lambda me=threading.current_thread():
                        self._begin_backward(sync or self._sync == _SYNC_IN_BACKWARD, me))
                       if self._grads.trains else None)
        summed = self._scalar_outputs == "sum" or any(c.used for c in counts)  # shares of a global sum
        out = gather(outs[:g], sizes, self._devs[0].torch_device, on_backward, sum_scalars=summed)
        if not summed:  # a model's own loss under uneven padding, trained on: said once
            self._own_loss.when_trained(out, [labels_of(kw) for _, kw in parts])
        return out

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backwards of forwards run inside accumulate locally; the next synced one sends it all (as DDP's)."""
        return self._syncing(_NO_SYNC)

    def sync_in_backward(self) -> contextlib.AbstractContextManager[None]:
        """Every backward run inside sums, also through forwards run inside :meth:`no_sync` (which then send what
        they accumulated); forwards inside count as synced. DDP's ``require_backward_grad_sync``, as Accelerate's
        ``trigger_sync_in_backward`` sets it: several forwards under ``no_sync()``, their last backward in here."""
        return self._syncing(_SYNC_IN_BACKWARD)

    @contextlib.contextmanager
    def _syncing(self, mode: str) -> Iterator[None]:
        old, self._sync = self._sync, mode
        try:
            yield
        finally:
            self._sync = old

    @operation("clip_grad_norm_()")
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every replica by the summed gradient's norm (taken on replica 0's device); returns it, as FSDP."""
        return self._grads.clip(max_norm, float(norm_type))

    def train(self, mode: bool = True) -> "DataParallel":
        super().train(mode)
        for r in self._replicas[1:]:
            r.train(mode)
        return self

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> "DataParallel":
        """A conversion would change replica 0 alone and the buffers' layout: refused unless a no-op."""
        for t in [*self.module.parameters(), *self.module.buffers()]:
            out = fn(t)
            if out.dtype != t.dtype or out.device != t.device:
                raise RuntimeError(f"cgdp.DataParallel cannot convert its replicas (to {out.dtype} on "
                                   f"{out.device}; they are {t.dtype} on {t.device}): it would change "
                                   f"replica 0 only. Convert the model before wrapping it, e.g. "
                                   f"cgdp.DataParallel(net.to(dtype), devices)")
            if out.stride() != t.stride():
                raise RuntimeError("cgdp.DataParallel cannot change its replicas' memory format after wrapping "
                                   "(it would change replica 0 only): convert the model before wrapping it, e.g. "
                                   "cgdp.DataParallel(net.to(memory_format=torch.channels_last), devices)")
        return self

    def __deepcopy__(self, memo: dict) -> nn.Module:
        """A plain copy of ``model.module``, not a second engine (``AveragedModel(model)`` keeps one)."""
        self._life.ops.clean_stale()  # after a backward that raised: its clean-up first
        return copy.deepcopy(self.module, memo)

    def memory_report(self) -> dict[str, dict[str, int]]:
        per, host = self._steps.optimizers()
        masters = self._steps.host_masters
        return memory_report(self.devices, self._params, per, self._stream,
                             None if masters is None else (masters, host))

    @property
    def tuning(self) -> bool:
        """Whether ``chunks="auto"`` is still timing plans."""
        return self._steps.tuner is not None

    def _parameter_maps(self) -> list[dict[int, nn.Parameter]]:
        """Per replica j > 0: id(replica 0's parameter) -> replica j's (grad-requiring buffers' stand-ins too)."""
        first = list(self.module.parameters())
        return [{**{id(p): q for p, q in zip(first, r.parameters())}, **stand_ins}
                for r, stand_ins in zip(self._replicas[1:], self._grad_buffers.parameter_maps())]

    def _begin_backward(self, sync: bool, owner: threading.Thread) -> None:
        """Autograd thread, in the gather's backward, before any replica's gradient exists."""
        if not self._life.ops.take_backward(owner, self._after_failed_backward):
            return  # a second gathered output in the same backward
        try:
            self._life.check_usable()
            if not self._backward_check.trains(self._state.params[0], self._state.follow.trainable):
                self._life.ops.give()  # input gradients only: autograd alone, as on one device
                return
            self._guard.reset()
            self._grads.begin(sync)
            Variable._execution_engine.queue_callback(self._end_backward)
        except BaseException:
            self._life.ops.give()
            raise

    def _after_failed_backward(self) -> None:
        """A backward raised before :meth:`_end_backward`: let every copy stop, then keep or drop the gradients."""
        self._life.fail(RuntimeError("the previous backward failed"), self._devs, self._host())
        self._guard.reset()
        self._grads.fail()

    def _end_backward(self) -> None:
        try:
            self._grads.end()
        except UserFault as exc:  # a hook raised, or an edit inside no_sync(): gradients dropped, nothing broke
            raise exc.error from None
        except BaseException as exc:
            self._life.broken = (self._life.fail(exc, self._devs, self._host())
                                 or f"a backward failed, the replicas' gradients may differ ({exc!r})")
            if isinstance(exc, StepAborted) and self._guard.error is not None:
                raise self._guard.error from None  # the cause (close() from another thread, a device's error)
            raise
        finally:
            self._grads.after()
            self._life.ops.give()

    def _host(self) -> Any:
        return self._stream.host if self._stream is not None else None


def _refusal(what: str, running: str, inside: bool) -> str:
    return (f"{what} was called on a {NAME} while its {running} is running on "
            f"{'inside it' if inside else 'another thread'}; a {NAME} takes one operation at a time (forward, "
            f"backward, optimizer.step(), clip_grad_norm_): drive it from one thread, or serialise the calls "
            f"with a lock")


def _stopped(running: str) -> str:
    return (f"{NAME}.close() was called while its {running} was running; that {running} stopped (nothing "
            f"applied unless it was past its last wait) and the {NAME} is closed")


