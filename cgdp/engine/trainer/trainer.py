"""``cgdp.Trainer``: one process, several devices, gradients averaged on the host during backward.

One ``step``: split the batch in device order (:mod:`~cgdp.engine.trainer.batch`); forward and loss on each device's
thread, every loss checked before any backward; each device's weight (:mod:`~cgdp.engine.trainer.losses`) so that the
weighted gradients sum to the global mean loss's; backward, its hooks sending chunks that the host sums (and allreduces
across ranks) and copies back while backward goes on (:mod:`~cgdp.engine.core.stream`); then the update strategy
(:mod:`~cgdp.engine.core.update`), buffers, schedulers. docs/design.md has the data path step by step.

The step's gradients belong to their one owner (:mod:`cgdp.engine.core.gradients`, new every step). The user's
``model`` is replica 0 (trained in place); the others are deep copies. A step returns after device-side waits only:
whatever frees or relays buffers synchronises first (``close()``, ``set_plan``, ``load_state_dict``, a rejected step).
"""
from __future__ import annotations

import copy
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from cgdp.comm import Comm
from cgdp.engine.core.buffers import BufferWatch, copy_from_first, sync_buffers
from cgdp.engine.core.clip import clip_coefficient
from cgdp.engine.core.drain import quiesce
from cgdp.engine.core.layers import LayerInfo, number_params
from cgdp.engine.core.lifetime import Face, Lifetime, operation, weak_call
from cgdp.engine.core.follow import Follow
from cgdp.engine.core.dense_grads import build_gradients
from cgdp.engine.core.host_update import after_forward
from cgdp.engine.core.memory_report import memory_report
from cgdp.engine.core.param_hooks import ParamHooks
from cgdp.engine.core.plan import first_plan, tuned_plan
from cgdp.engine.core.replicas import Replicas, batch_weights, settings, signature, split_buffers
from cgdp.engine.core.threads import caller_context
from cgdp.engine.sync import Guard
from cgdp.engine.trainer.batch import micro_rounds
from cgdp.engine.trainer.hyperparameters import (HyperparameterMismatchError, Schedulers, agree_on_step,
                                                 check_hyperparameters, verdict)
from cgdp.engine.trainer.losses import loss_weights, parse_step
from cgdp.engine.core.padding import OwnLossCheck, labels_of
from cgdp.engine.trainer.options import check_arguments, refusal, stopped
from cgdp.engine.trainer.passes import DevicePasses, loss_values
from cgdp.engine.trainer.state import check_state
from cgdp.engine.trainer.timing import Timing, step_stats
from cgdp.planning.chunks import Plan, resolve_plan, validate_plan
from cgdp.planning.profile import StepProfile


class NonFiniteGradientError(FloatingPointError):
    """The averaged gradient holds NaN or Inf; the update was not applied."""


class Trainer(Face):
    """Data-parallel training over ``devices`` with gradients averaged on the host.

    Args:
        model: the module to train. It becomes replica 0: moved to ``devices[0]`` in place (as ``model.to(...)`` does)
            and trained in place; the other devices get deep copies (``.replicas``).
        optimizer: ``params -> torch.optim.Optimizer``; one optimizer is built per replica.
        devices: ``["cuda:0", "cuda:1", ...]`` or CPU-emulated ``["cpu:0", "cpu:1", ...]``.
        mode: ``"cgdp"`` (host averaging during backward), ``"typical"`` (device 0 gathers, averages, updates and
            broadcasts the parameters) or ``"single"`` (one device).
        chunks: chunk size k (the paper's uniform plan), an explicit plan (list of lists of layer indices, in send
            order), or ``"auto"`` (the default, as for ``DataParallel``: tuned over the first 8 to 17 steps, then fixed;
            ``"paper"`` runs the paper's Algorithm 1). The plan never changes results, only speed. Modes ``"typical"``
            and ``"single"`` send no chunks: ``"auto"`` is then one layer per chunk, untuned.
        comm: ``None`` for one machine, ``"mpi"``, ``"gloo"`` (docs/multinode.md; or a process group, or a
            :class:`cgdp.comm.Comm`) for several. Every rank must build the same model with the same initial parameters
            (checked at start-up). A comm passed in belongs to the trainer from then on: ``close()`` closes it.
        timeout_s: longest any thread waits for another before the step fails with ``TimeoutError`` (a lost copy, a dead
            MPI peer, a forward that never returns: the trainer is then unusable). ``None`` waits forever (Ctrl-C still
            ends a step).
        profile: profile every step (``.last_profile``); ``profile_next()`` profiles one.
        segment_bytes: chunks larger than this travel in segments of this size, so that copy out, host sum and copy back
            of one chunk overlap (see :mod:`cgdp.engine.core.flatgrad`).
        scheduler: ``optimizer -> LRScheduler``, one per replica, stepped after each applied update.
        clip_grad_norm: clip the averaged gradient's total 2-norm as ``clip_grad_norm_`` does on one device
            (:mod:`cgdp.engine.core.clip`); ``stats["grad_norm"]``: the norm before clipping.
        micro_batches: micro-batches per device part, accumulated on the device; chunks travel during the last one's
            backward only.
        share_devices: allow a GPU to be listed more than once (one replica per entry, each with its own copy streams),
            e.g. ``["cuda:0", "cuda:0"]``: the G > 1 data path on one GPU.
        grad_transfer: ``"bf16"``: float32 gradients travel in bf16 (half the bytes; summed in float32; the error bound
            in :mod:`cgdp.engine.core.host`). ``None``: in their dtype.
        host_memory: bytes of pinned host memory for a ring of ``segment_bytes`` slots (bitwise the results of ``None``:
            (G + 1) x the gradient bytes; :mod:`cgdp.engine.core.host`).
        update: ``"devices"`` (each device steps its own optimizer) or ``"host"``: one optimizer over float32 masters in
            host memory; the parameters go back to every device, and no device holds optimizer state (``.optimizers``:
            that one; :mod:`cgdp.engine.core.host_update`).
    """

    def __init__(self, model: nn.Module, optimizer: Callable[..., torch.optim.Optimizer],
                 devices: Sequence[str], *, mode: str = "cgdp", chunks: int | Plan | str = "auto",
                 comm: None | str | Comm = None, timeout_s: float | None = 300.0,
                 profile: bool = False, segment_bytes: int = 4 << 20,
                 scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                 clip_grad_norm: float | None = None, micro_batches: int = 1,
                 share_devices: bool = False, grad_transfer: str | None = None,
                 host_memory: int | None = None, update: str = "devices"):
        checked = check_arguments(model, optimizer, devices, mode=mode, share_devices=share_devices,
                                  grad_transfer=grad_transfer, timeout_s=timeout_s, segment_bytes=segment_bytes,
                                  clip_grad_norm=clip_grad_norm, micro_batches=micro_batches, update=update,
                                  comm=comm)
        self._host_update = checked.host_update
        self._dtype, self._transfer = checked.dtype, checked.transfer
        self._segment = segment_bytes
        self._host_memory = host_memory
        self._max_norm, self._micro = checked.max_norm, checked.micro_batches
        self._own_loss = OwnLossCheck("cgdp.Trainer", "return (loss_sum, count) from loss_fn: the sum over the "
                                      "part's tokens and how many there are (docs/step.md)")

        self.mode = mode
        self.devices = list(devices)
        self.layers: list[LayerInfo] = checked.layers
        self.step_count = 0
        self.stats: dict[str, float] = {}
        self._timing = Timing(bool(profile))
        self._guard = Guard(timeout_s)
        self._life = Lifetime(self, "Trainer", "create a new Trainer", refusal, stopped, self._guard.fail)

        self._layer_pids = number_params(checked.layer_params)
        self._layer_bytes = [info.numel * self._dtype.itemsize for info in checked.layers]
        self._life.start(self, model, devices, share_devices,
                         lambda devs: self._build(devs, model, optimizer, checked.strategy, chunks, comm, scheduler))

    # ------------------------------------------------------------------ construction
    def _build(self, devs, model, optimizer, strategy, chunks, comm, scheduler) -> None:
        self._devs = devs
        reps = Replicas(model, self._devs, optimizer)
        self._life.claim.add(p for r in reps.modules[1:] for p in r.parameters())
        self.replicas, self.optimizers = reps.modules, reps.optimizers
        self._params, self._buffers = reps.params, reps.buffers
        self._buffer_watch = BufferWatch(reps.buffers, reps.other_buffers)
        # what the other replicas copy from replica 0 between steps (its module hooks are every
        # replica's); its parameters' hooks run on the average
        self._follow = Follow(reps.modules, [d.torch_device for d in self._devs], "cgdp.Trainer",
                              "close() it and create a new Trainer", after_load=weak_call(self._loaded))
        self._life.resources.push(self._follow.close)
        self._update = strategy(self._devs, reps.optimizers, reps.params)
        self.optimizers = self._update.shown()

        opt = reps.optimizers[0]
        self._comm = self._life.open_comm(comm, self._guard.timeout_s, lambda: signature(
            "Trainer", model, self.layers, len(self._devs), self._dtype, mode=self.mode, optimizer=type(opt).__name__,
            optimizer_defaults=repr(sorted(opt.defaults.items(), key=str)), **settings(
                grad_transfer=None if self._transfer is None else "bf16", update="host" if self._host_update else
                "devices", segment_bytes=self._segment, host_memory=self._host_memory, clip_grad_norm=self._max_norm,
                micro_batches=self._micro)))

        plan, self.tuner = first_plan(chunks, self._layer_bytes, len(self._devs), self._comm,
                                      tuned=self._update.streams, paper=True)
        self._tuning = self.tuner is not None

        self._threads, self._rng, self._stream, self._grads = build_gradients(
            self._life, self._devs, self._params, self._layer_pids, self._dtype, plan, guard=self._guard,
            comm=self._comm, param_hooks=ParamHooks(reps.params), initial=[None] * len(self._params[0]),
            keep_grads=False, segment_bytes=self._segment, streaming=self._update.streams, transfer=self._transfer,
            host_memory=self._host_memory)
        self._update.attach(self._stream, self._grads, self._max_norm is not None, self._guard, self._life.resources,
                            self.replicas[0])
        self._stream.want_norm(self._max_norm is not None)
        self._passes = DevicePasses(self._devs, self.replicas, self._rng, self._threads, self._stream, self._timing,
                                    after_forward(self._follow.after_forward, self._update))
        self._schedulers = Schedulers(scheduler, self.optimizers)
        self.schedulers = self._schedulers.schedulers

    def _loaded(self) -> None:
        self._buffer_watch.synced()  # the loaded buffers are the same on every replica

    # ------------------------------------------------------------------ public API
    @property
    def plan(self) -> Plan:
        """The chunk plan in use (send order, forward layer numbering)."""
        return self._stream.plan

    @property
    def layer_names(self) -> list[str]:
        return [info.name for info in self.layers]

    @operation("Trainer.set_plan()")
    def set_plan(self, plan: int | Plan) -> None:
        """Switch the chunk plan between steps (every rank must pass the same plan)."""
        for d in self._devs:
            d.check_caller("Trainer.set_plan()")
        self._relay(resolve_plan(plan, len(self.layers)))

    def profile_next(self) -> None:
        """Profile the next step: ``last_profile`` then holds its :class:`StepProfile`."""
        self._timing.profile_once = True

    def trace_next(self) -> None:
        """Trace the next step: ``last_trace`` then holds its stream events."""
        self._timing.trace_once = True

    @property
    def last_profile(self) -> StepProfile | None:
        """The :class:`StepProfile` of the last profiled step (``profile=True``, :meth:`profile_next`)."""
        return self._timing.last_profile

    @property
    def last_trace(self) -> list[dict[str, Any]] | None:
        """The stream events of the last traced step (:meth:`trace_next`)."""
        return self._timing.last_trace

    @operation("Trainer.step()")
    def step(self, *args: Any, loss_fn: Callable[..., Any] | None = None) -> float:
        """One training iteration on the global batch; returns its loss (see :mod:`cgdp.engine.trainer.losses`).

        ``step(batch, loss_fn)``: ``batch`` a tensor or a nesting of tuples, lists and dicts (a
        ``BatchEncoding``); ``loss_fn(model, part)`` returns the mean loss over the part's samples,
        or ``(loss_sum, count)`` for a mean over items (tokens) of the global batch.
        ``step(inputs, targets, loss_fn)``: ``loss_fn(model(*inputs), targets)``, mean-reduced.
        """
        if loss_fn is not None:
            args = (*args, loss_fn)
        call = parse_step(args, len(self._devs), self._comm)                         # 1. split
        rounds, total, amp = self._prepare(call)
        tuning = self._tuner_plan()
        phase = "forward"
        try:
            # its kernels (the buffers' zeroing) fail first after a sticky CUDA error
            self._begin_step(tuning)
            t_start = time.perf_counter()
            restore = self._buffer_watch.restore
            held = self._passes.hold_micro_batches(rounds[:-1], call.compute, amp, restore)  # micro-batches 1..k-1
            parts, weights = rounds[-1]
            fw = self._passes.forward_all(parts, call.compute, amp, restore)                 # 2. forward
            losses = [f[0].loss for f in fw]
            phase = "backward"  # with MPI the weights are a collective: ranks agree from here on
            weights = loss_weights([f[0] for f in fw], weights, self._comm, call.nested, held, self._update.early)
            if call.nested and fw[0][0].count is None:  # a mean per sample: under uneven padding, said once
                self._own_loss.check([labels_of(p) for p in call.parts])
            # (loss_sum, count) micro-batches: the held gradients were summed with weight
            # 1 / guess_j; now that the total count is known they become 1 / total on the device
            rescale = held.rescale(weights[0])
            fw = [(None, *f[1:]) for f in fw]  # each backward takes its loss: its graph is freed there
            # 3.-6. backward; hooks send each chunk, the host sums it (and allreduces it across
            # ranks) and copies it back, while backward goes on; returns when all are back
            bw = self._passes.backward_all(losses, weights, rescale)
            t_bw = time.perf_counter()
            loss = self._finish_backward([b[0] for b in bw] + held.values,                    # 7.
                                         weights + held.final_weights(weights[0]))
            coef = clip_coefficient(self._grad_norm, self._max_norm)                 #    clip,
            phase = "update"
            t_up = time.perf_counter()
            up = self._apply_update(coef)                                            #    update
            t_end = time.perf_counter()
        except BaseException as exc:
            self._recover(exc, phase)
            raise
        self.step_count += 1
        self._account(fw, bw, up, (t_start, t_bw, t_up, t_end), total, held.seconds, coef, tuning)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, step, plan and tuner state (every replica is identical)."""
        return {"model": self.replicas[0].state_dict(),
                "optimizer": self.optimizers[0].state_dict(),
                "step": self.step_count, "plan": self.plan,
                "device_rng": [st.clone() for st in self._rng.states],
                "tuner": self.tuner.state_dict() if self.tuner is not None else None,
                "scheduler": self._schedulers.state_dict()}

    @operation("Trainer.load_state_dict()")
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; checked in full first, so a bad one changes nothing."""
        for d in self._devs:
            d.check_caller("Trainer.load_state_dict()")
        check_state(state, self.replicas[0], self.optimizers[0], len(self.layers), self.tuner)
        self.replicas[0].load_state_dict(state["model"])  # every replica's (core/follow.py's load hook)
        for opt in self.optimizers:
            # each replica needs its own copy: load_state_dict keeps tensors that already have
            # the right dtype and device, and two optimizers sharing one state corrupt each other
            opt.load_state_dict(copy.deepcopy(state["optimizer"]))
        self._schedulers.load_state_dict(state.get("scheduler"))
        self.step_count = int(state.get("step", 0))
        if state.get("device_rng") is not None and len(state["device_rng"]) == len(self._devs):
            self._rng.states = [st.clone() for st in state["device_rng"]]
        if self.tuner is not None and state.get("tuner") is not None:
            self.tuner.load_state_dict(state["tuner"])
            self._tuning = True  # the next step applies the tuner's plan (its final one if done)
        if state.get("plan") is not None:
            self._relay(validate_plan(state["plan"], len(self.layers)))

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes of parameters, gradients, optimizer state and transfer buffers per device and on
        the host (:mod:`cgdp.engine.core.memory_report`)."""
        host = self._update.masters
        return memory_report(self.devices, self._params, [[o] for o in self._update.optimizers], self._stream,
                             None if host is None else (host, self.optimizers))

    # ------------------------------------------------------------------ one step
    def _tuner_plan(self) -> bool:
        """Put the tuner's plan for this step in place; whether this step is measured for it."""
        if not self._tuning:
            return False
        plan, done = tuned_plan(self.tuner, self._comm, len(self.layers))
        if plan != self._stream.plan:
            self._relay(plan)
        self._tuning = not done  # done: the final plan is in place; no more measurements
        return self._tuning

    def _prepare(self, call: Any) -> tuple[list, int, Any]:
        """The checks, each device's micro-batch rounds, the caller's autocast: (rounds, global batch size, amp)."""
        # before anything runs (with a comm: in the step's allreduce); on the devices: read with the losses
        self._differ = check_hyperparameters(self.optimizers, on_devices=True) if self._comm is None else None
        for d in self._devs:
            d.check_caller()
        self._weights, total = batch_weights(call.sizes, self._comm)
        rounds = micro_rounds(call.parts, call.sizes, total, self._micro, call.whole)
        amp = caller_context([self._devs[0].torch_device.type], grad=False)  # thread-local: captured here
        return rounds, total, amp

    def _begin_step(self, tuning: bool) -> None:
        """After the checks, before the first forward: timing, the buffers to watch, the user's hooks."""
        self._timing.choose(bool(tuning and getattr(self.tuner, "wants_profile", False)))
        if self._follow.before_step():  # what the user changed on the model; buffers relisted (prune)
            self._buffers, others = split_buffers(self.replicas)
            self._buffer_watch = BufferWatch(self._buffers, others)
        self._guard.reset()
        # the step's gradient, from zero; the user's gradient hooks wait for the sum (_finish_backward)
        self._update.begin_step(self._grads.begin_step(*self._timing.start(self._devs), self._update.sums))

    def _finish_backward(self, losses: list[Any], weights: list[Any]) -> float:
        """Global loss, the non-finite check and the parameters nobody touched."""
        touched = self._grads.touched()
        flags = [self._update.reduce(self._stream), self._differ]  # the gradient the update reads; its NaN/Inf
        flags.append(self._stream.grad_norm(read=False) if self._max_norm is not None else 0.0)  # of that gradient
        loss, (bad, differ, self._grad_norm) = loss_values(losses, weights, flags, self._devs[0].torch_device)
        verdict(differ, self.optimizers)  # tensor hyperparameters on the devices, compared there
        if self._comm is not None:  # every rank takes the same values (rank 0's clipping norm)
            self._comm.fence(self._guard.timeout_s)
            loss, bad, self._grad_norm, touched = agree_on_step(self._comm, loss, bad, self._grad_norm, touched,
                                                                self.optimizers)
        if bad:
            raise NonFiniteGradientError(
                f"the averaged gradient has {int(bad)} NaN/Inf value(s) (layers: "
                f"{self._stream.bad_layers(self.layer_names)}); the update was not applied. Lower the learning rate, "
                f"check the inputs, or clip gradients")
        # the user's gradient hooks, on the average (core/param_hooks.py)
        if self._grads.run_hooks(touched, self._update.hook_views) and self._max_norm is not None:
            norm = self._grads.device_norm()  # the norm of their result (rank 0's, as the host's)
            self._grad_norm = norm if self._comm is None else float(
                self._comm.allreduce_small(np.array([norm if self._comm.rank == 0 else 0.0]))[0])
        self._grads.end_step(touched)
        return loss

    def _apply_update(self, coef: torch.Tensor | None) -> list[tuple[Any, Any] | None]:
        """The mode's update, then what every replica shares after it: buffers, schedulers. Per
        device, the stamps around its update (None where it has none)."""
        up = self._update.step(coef, self._stream, self._threads)
        self._sync_buffers()
        self._schedulers.step(only_first_stepped=self._update.only_first_stepped)
        self._follow.stepped()  # the replicas' parameters as the update left them
        return up

    def _sync_buffers(self) -> None:
        """The forwards' buffer writes averaged on every replica (after an update, or a rejection)."""
        changed = self._buffer_watch.changed(self._comm)
        sync_buffers(self._buffers, self._weights, self._comm, changed)
        # a forward is done again (buffers restored) only on emulated devices without random turns
        self._buffer_watch.synced(changed, rerun=self._rng.may_rerun)
        self._follow.buffers_synced()  # what the forwards wrote is not the user's change

    def _account(self, fw: list, bw: list, up: list, times: tuple[float, float, float, float], samples: int,
                 held_s: float, coef: torch.Tensor | None, tuning: bool) -> None:
        """After an applied step: ``stats``, its profile and trace if timed, the tuner's measurement.
        Phase times come from the devices' own clocks in timed steps (CUDA: resolved device events)."""
        self.stats = step_stats(self._devs, fw, bw, up, *times, samples)
        self.stats["forward_s"] += held_s
        self.stats.update(self._update.figures)
        if coef is not None:
            self.stats["grad_norm"] = self._grad_norm
        self._timing.finish(self._devs, fw, bw, up, times[0], self._profile_inputs)
        if tuning:
            self.tuner.observe(self.stats["step_s"], self.last_profile if self._timing.profiling else None)

    def _profile_inputs(self) -> dict[str, Any]:
        """What a profile needs beyond the step's events (:func:`~cgdp.engine.trainer.timing.build_profile`)."""
        return dict(self._stream.profile_inputs(), stats=self.stats, layer_bytes=self._layer_bytes, mode=self.mode,
                    ranks=self._comm.size if self._comm is not None else 1)

    # ------------------------------------------------------------------ failures, plan switches
    def _relay(self, plan: Plan) -> None:
        """The flat buffers laid out for ``plan``, with nothing in flight (``.grad`` kept)."""
        quiesce(self._devs, self._stream.host, self._guard.timeout_s)
        self._stream.set_plan(plan)
        self._grads.relaid()

    def _recover(self, exc: BaseException, phase: str) -> None:
        """After a failed step: the user's gradient hooks back on their parameters; then, unless the
        step was cleanly rejected, let every thread stop, drain the streams, stay usable if safe."""
        self._grads.put_back_hooks()
        if isinstance(exc, (NonFiniteGradientError, HyperparameterMismatchError)):
            # a clean rejection: every rank saw the same flag and every collective has completed,
            # so training can go on; after backward the buffers are kept as an applied step keeps
            # them. The copies back were only ordered on the devices: let them finish, so a caller
            # who stops here (close(), or dropping the trainer) frees nothing a copy still uses
            if phase == "backward":
                self._sync_buffers()
            quiesce(self._devs, self._stream.host, self._guard.timeout_s)
            return
        self._life.fail(exc, self._devs, self._stream.host)
        if not self._update.settle():  # update="host": a checkpoint saved after this error holds the step before
            self._life.broken = "the host update thread did not finish a failed step's updates within timeout_s"
        if phase == "update" and not self._update.undone:  # update="host" undoes its own
            self._life.broken = f"a failure during the update may have left replicas different ({exc!r})"
        if self._comm is not None and phase != "forward":
            self._life.broken = f"a failure in a step with MPI peers leaves them out of step ({exc!r})"
        # the replicas' buffers agree again (a forward may have failed on one)
        if not self._life.broken and not self._threads.stuck:
            copy_from_first(self._buffers)
            copy_from_first(self._buffer_watch.others)
            self._buffer_watch.synced()
            self._follow.buffers_synced()
        self._guard.reset()

