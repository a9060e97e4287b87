"""``cgdp.Trainer``: one process, several devices, gradients averaged on the host during backward.

One iteration (``step``), for G devices (and R ranks when a comm is attached):

1. The global batch is split in device order (``torch.tensor_split``); device j gets weight
   w_j = n_j / N (N the global batch over all ranks), so that the sum of the devices' weighted
   gradients is the gradient of the global mean loss, also for uneven splits.
2. Forward and loss on every device, each on its own host thread (one thread per device for the
   whole run). Every loss is checked before any backward starts, so a bad loss rejects the step
   cleanly.
3. Backward with ``grad_tensors=w_j``. Gradient hooks (:mod:`cgdp.hooks`) count down each chunk
   and send it to the host when complete (:mod:`cgdp.backend`); chunks are contiguous slices of the
   flat gradient buffer (:mod:`cgdp.flatgrad`).
4.-6. The host accumulator (:mod:`cgdp.host`) sums each chunk in device order, allreduces it
   across ranks if a comm is attached, and copies it back on every device's H2D stream.
7. After backward each device flushes the chunks it never completed (unused layers), its compute
   stream waits for the last H2D copy, and it steps its own optimizer. Parameters that got no
   gradient anywhere get ``.grad = None`` first, as in single-device training. Floating buffers
   (BatchNorm statistics) are set to their batch-weighted mean on every replica.

Ownership: the flat buffers, hooks and host buffers are the trainer's; the user's ``model`` is
never modified (every replica is a deep copy). Between steps nothing is in flight.
"""
from __future__ import annotations

import copy
import hashlib
import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from cgdp.backend import make_devices, parse_devices
from cgdp.chunks import Plan, resolve_plan, validate_plan
from cgdp.comm import Comm, make_comm
from cgdp.flatgrad import Layout, attach_grads, make_layout
from cgdp.hooks import DeviceHooks
from cgdp.host import HostAccumulator
from cgdp.layers import LayerInfo, find_layers, trainable_dtype
from cgdp.profile import ChunkTiming, StepProfile
from cgdp.sync import Guard, StepAborted

MODES = ("cgdp", "typical", "single")


class NonFiniteGradientError(FloatingPointError):
    """The averaged gradient holds NaN or Inf; the update was not applied."""


class Trainer:
    """Data-parallel training over ``devices`` with gradients averaged on the host.

    Args:
        model: the module to train; each device gets a deep copy (``.replicas``).
        optimizer: ``params -> torch.optim.Optimizer``; one optimizer is built per replica.
        devices: ``["cuda:0", "cuda:1", ...]`` or CPU-emulated ``["cpu:0", "cpu:1", ...]``.
        mode: ``"cgdp"`` (host averaging during backward), ``"typical"`` (device 0 gathers,
            averages, updates and broadcasts the parameters) or ``"single"`` (one device).
        chunks: chunk size k (the paper's uniform plan), an explicit plan (list of lists of layer
            indices, in send order), or ``"auto"`` (tuned while training; ``"paper"`` runs the
            paper's Algorithm 1).
        comm: ``None`` for one machine, ``"mpi"`` (or a :class:`cgdp.comm.Comm`) for several.
            Every rank must build the same model with the same initial parameters (checked at
            start-up). A comm passed in belongs to the trainer from then on: ``close()`` closes it.
        timeout_s: longest any thread waits for another before the step fails with
            ``TimeoutError`` (a lost copy, a dead MPI peer). ``None`` waits forever.
        profile: profile every step (``.last_profile``); ``profile_next()`` profiles one.
        segment_bytes: chunks larger than this travel in segments of this size, so that copy
            out, host sum and copy back of one chunk overlap (see :mod:`cgdp.flatgrad`).
    """

    def __init__(self, model: nn.Module, optimizer: Callable[..., torch.optim.Optimizer],
                 devices: Sequence[str], *, mode: str = "cgdp", chunks: int | Plan | str = 1,
                 comm: None | str | Comm = None, timeout_s: float | None = 300.0,
                 profile: bool = False, segment_bytes: int = 4 << 20):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer must be a callable that takes parameters and returns an optimizer, "
                            "e.g. lambda params: torch.optim.SGD(params, lr=0.1), so that each replica "
                            "gets its own")
        parse_devices(devices)
        if mode == "single" and len(devices) != 1:
            raise ValueError(f"mode='single' trains on one device; got {len(devices)} devices. "
                             f"Pass one device, or use mode='cgdp' for several")
        infos, layer_params = find_layers(model)
        if not any(info.numel for info in infos):
            raise ValueError("the model has no trainable parameters (none with requires_grad=True); "
                             "there is nothing to train")
        self._dtype = trainable_dtype(layer_params)
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s!r}")
        if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes < 1024:
            raise ValueError(f"segment_bytes must be an int >= 1024, got {segment_bytes!r}")
        self._segment = segment_bytes

        self.mode = mode
        self.devices = list(devices)
        self.layers: list[LayerInfo] = infos
        self.step_count = 0
        self.stats: dict[str, float] = {}
        self.last_profile: StepProfile | None = None
        self.last_trace: list[dict[str, Any]] | None = None
        self._profile_always = bool(profile)
        self._profile_once = False
        self._trace_once = False
        self._broken: str | None = None
        self._closed = False
        self._guard = Guard(timeout_s)
        self._timeout_s = timeout_s
        self._events: list[tuple[str, str, str, float, float]] | None = None

        # pid numbering: parameters in forward layer order
        self._layer_pids: list[list[int]] = []
        self._numels: list[int] = []
        for layer in layer_params:
            self._layer_pids.append(list(range(len(self._numels), len(self._numels) + len(layer))))
            self._numels.extend(p.numel() for p in layer)
        self._layer_bytes = [info.numel * torch.tensor([], dtype=self._dtype).element_size()
                             for info in infos]

        self._devs = make_devices(devices, self._guard.fail)
        self._pools: list[ThreadPoolExecutor] = []
        self._hooks: list[DeviceHooks] = []
        self._host: HostAccumulator | None = None
        self._comm: Comm | None = None
        try:
            self._build(model, optimizer, chunks, comm)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ construction
    def _build(self, model, optimizer, chunks, comm) -> None:
        self.replicas: list[nn.Module] = []
        self._params: list[list[nn.Parameter]] = []
        for dev in self._devs:
            replica = copy.deepcopy(model).to(dev.torch_device)
            _, lp = find_layers(replica)
            self.replicas.append(replica)
            self._params.append([p for layer in lp for p in layer])
        self.optimizers: list[torch.optim.Optimizer] = []
        for r in self.replicas:
            opt = optimizer(r.parameters())
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"optimizer(params) must return a torch.optim.Optimizer, got "
                                f"{type(opt).__name__}")
            self.optimizers.append(opt)
        self._buffers = [[b for b in r.buffers() if b.is_floating_point()] for r in self.replicas]

        self._comm = make_comm(comm, timeout_s=self._timeout_s)
        if self._comm is not None:
            self._comm.attach(self._guard.fail)
            self._comm.check_same(self._signature(optimizer))

        self.tuner = None
        if isinstance(chunks, str):
            if chunks not in ("auto", "paper"):
                raise ValueError(f"chunks must be an int, an explicit plan or 'auto'; got {chunks!r}")
            from cgdp.tuner import make_tuner
            cost, ranks = None, 1
            if self._comm is not None and chunks == "auto":
                # the tuner's model learns the MPI stage from a short probe (~0.1 s, collective)
                from cgdp.comm.mpi import probe_alpha_beta
                from cgdp.simulator import Linear
                alpha, beta = probe_alpha_beta(self._comm)
                cost, ranks = Linear(alpha, beta), self._comm.size
            self.tuner = make_tuner(chunks, self._layer_bytes, len(self._devs), comm=cost, ranks=ranks)
            plan = validate_plan(self.tuner.plan(), len(self.layers))
        else:
            plan = resolve_plan(chunks, len(self.layers))
        if self._comm is not None:
            plan = self._comm.broadcast_object(plan)
        self._tuning = self.tuner is not None
        # one CPU random stream per emulated device, derived from torch's seed (reproducible)
        self._cpu_rng_lock = threading.Lock()
        self._rng_turns = False
        """Emulated devices: forward passes take turns, each with its own random stream."""
        self._cpu_rng = [torch.Generator().manual_seed(torch.initial_seed() * 1009 + 7919 * j).get_state()
                         for j in range(len(self._devs))]

        for j, dev in enumerate(self._devs):
            self._pools.append(ThreadPoolExecutor(1, thread_name_prefix=f"cgdp-{dev.name}",
                                                  initializer=dev.bind_thread))
            hooks = DeviceHooks(self._params[j], partial(self._send, j), dev.stamp)
            hooks.streaming = self.mode == "cgdp"
            self._hooks.append(hooks)
        if self.mode == "cgdp":
            from cgdp.accumulate import warm_up
            warm_up(np.dtype(str(self._dtype).replace("torch.", "")), len(self._devs))
            self._host = HostAccumulator(self._devs, self._dtype, self._guard.fail, self._comm,
                                         self._host_threads())
        self._none_pids: list[int] = []
        self._flats: list[torch.Tensor] = []
        self._apply_plan(plan)

    def _host_threads(self) -> int:
        """Threads of the host sum. With GPUs the host cores are idle: use them all. Emulated
        devices already keep every core busy computing; one thread then runs at memory speed
        without waiting for a descheduled helper thread."""
        if self._devs[0].is_cuda:
            return max(1, (os.cpu_count() or 2) - 1)
        return 1

    def _signature(self, optimizer) -> dict[str, str]:
        layers = ";".join(f"{i.name}:{i.numels}" for i in self.layers)
        digest = hashlib.sha256()
        for name, t in self.replicas[0].state_dict().items():
            digest.update(name.encode())
            digest.update(t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        return {"devices_per_rank": str(len(self._devs)), "mode": self.mode,
                "initial_parameters": digest.hexdigest()[:16] + " (seed every rank the same)",
                "layers": layers, "dtype": str(self._dtype),
                "optimizer": type(self.optimizers[0]).__name__,
                "optimizer_defaults": repr(sorted(self.optimizers[0].defaults.items(), key=str))}

    def _apply_plan(self, plan: Plan) -> None:
        """Lay the flat buffers out for ``plan``. Only between steps, with nothing in flight."""
        itemsize = torch.tensor([], dtype=self._dtype).element_size()
        layout = make_layout(plan, self._layer_pids, self._numels, self._segment // itemsize)
        old = self._flats
        old_layout = getattr(self, "_layout", None)
        flats = [torch.zeros(max(layout.total, 1), dtype=self._dtype, device=d.torch_device)
                 for d in self._devs]
        for j, params in enumerate(self._params):
            if old and old_layout is not None:  # keep .grad's values across a plan switch
                for pid in range(len(params)):
                    o, n = old_layout.offsets[pid], self._numels[pid]
                    flats[j][layout.offsets[pid]:layout.offsets[pid] + n].copy_(old[j][o:o + n])
            views = attach_grads(flats[j], params, layout)
            for pid in self._none_pids:
                params[pid].grad = None
            self._hooks[j].set_layout(layout.param_chunk, layout.chunk_params, views)
        self._flats = flats
        self._layout: Layout = layout
        if self._host is not None:
            self._host.set_layout(layout.total, layout.segments, flats,
                                  [f"chunk {c}" for c in layout.segment_chunk])

    # ------------------------------------------------------------------ public API
    @property
    def plan(self) -> Plan:
        """The chunk plan in use (send order, forward layer numbering)."""
        return [list(c) for c in self._layout.plan]

    @property
    def layer_names(self) -> list[str]:
        return [info.name for info in self.layers]

    def set_plan(self, plan: int | Plan) -> None:
        """Switch the chunk plan between steps (every rank must pass the same plan)."""
        self._check_usable()
        new = resolve_plan(plan, len(self.layers))
        self._quiesce()
        self._apply_plan(new)

    def profile_next(self) -> None:
        """Profile the next step: ``last_profile`` then holds its :class:`StepProfile`."""
        self._profile_once = True

    def trace_next(self) -> None:
        """Trace the next step: ``last_trace`` then holds its stream events."""
        self._trace_once = True

    def step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> float:
        """One training iteration on the global batch; returns its mean loss."""
        self._check_usable()
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {loss_fn!r}")
        parts, sizes = self._split(inputs, targets)
        for d in self._devs:
            d.check_caller()
        total = sum(sizes)
        if self._comm is not None:
            total = int(self._comm.allreduce_small(np.array([total], np.float64))[0])
        weights = [n / total for n in sizes]
        self._weights = weights

        tuning = self._tuning
        if tuning:
            plan, done = self.tuner.plan(), self.tuner.done
            if self._comm is not None:  # rank 0 decides, every rank follows
                plan, done = self._comm.broadcast_object((plan, done))
            if plan != self._layout.plan:
                self._quiesce()
                self._apply_plan(validate_plan(plan, len(self.layers)))
            if done:  # the final plan is in place; no more measurements
                self._tuning = tuning = False
        profiling = self._profile_always or self._profile_once or bool(
            tuning and getattr(self.tuner, "wants_profile", False))
        tracing = self._trace_once
        self._profile_once = self._trace_once = False

        self._begin_step(profiling or tracing)
        t_start = time.perf_counter()
        phase = "forward"
        try:
            fw = self._forward_all(parts, loss_fn)
            losses = [f[0] for f in fw]
            phase = "backward"
            bw = self._run_all(lambda j: self._backward_on(j, losses[j], weights[j]))
            t_bw = time.perf_counter()
            loss = self._finish_backward([b[0] for b in bw], weights)
            phase = "update"
            t_up = time.perf_counter()
            self._update()
            t_end = time.perf_counter()
        except NonFiniteGradientError:
            # a clean rejection: every collective and copy of the step has completed, and every
            # rank saw the same flag, so nothing needs recovering and training can go on
            raise
        except BaseException as exc:
            self._recover(exc, phase)
            raise
        self.step_count += 1
        self.stats = {
            "forward_s": max(f[1] for f in fw),
            "backward_s": max(b[2] - b[1] for b in bw),
            # from the end of the last device's backward until the gradients are back everywhere
            # (a device that finished early waits for the others: that is not communication)
            "exposed_comm_s": max(0.0, max(b[3] for b in bw) - max(b[2] for b in bw)),
            "update_s": t_end - t_up,
            "step_s": t_end - t_start,
            "host_s": t_up - t_bw,
            "samples": float(total),
        }
        if profiling or tracing:
            self._collect(t_start, [b[4] for b in bw], profiling, tracing)
        if tuning:
            self.tuner.observe(self.stats["step_s"], self.last_profile if profiling else None)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, step, plan and tuner state (every replica is identical)."""
        return {"model": self.replicas[0].state_dict(),
                "optimizer": self.optimizers[0].state_dict(),
                "step": self.step_count, "plan": self.plan,
                "device_rng": [st.clone() for st in self._cpu_rng],
                "tuner": self.tuner.state_dict() if self.tuner is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_usable()
        for r, opt in zip(self.replicas, self.optimizers):
            r.load_state_dict(state["model"])
            # each replica needs its own copy: load_state_dict keeps tensors that already have
            # the right dtype and device, and two optimizers sharing one state corrupt each other
            opt.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.step_count = int(state.get("step", 0))
        if state.get("device_rng") is not None and len(state["device_rng"]) == len(self._devs):
            self._cpu_rng = [st.clone() for st in state["device_rng"]]
        if self.tuner is not None and state.get("tuner") is not None:
            self.tuner.load_state_dict(state["tuner"])
            self._tuning = True  # the next step applies the tuner's plan (its final one if done)
        if state.get("plan") is not None:
            self._quiesce()
            self._apply_plan(validate_plan(state["plan"], len(self.layers)))

    def close(self) -> None:
        """Remove every hook, stop every thread, free the flat and pinned buffers."""
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        for pool in self._pools:
            pool.shutdown(wait=True)
        if self._host is not None:
            self._host.close()
        for d in self._devs:
            d.close()
        for params in getattr(self, "_params", []):
            for p in params:
                p.grad = None
        self._flats = []
        if self._comm is not None:
            self._comm.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ one step
    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this Trainer is closed; create a new one")
        if self._broken:
            raise RuntimeError(f"this Trainer cannot continue: {self._broken}")

    def _split(self, inputs: Any, targets: Any) -> tuple[list[tuple[Any, Any]], list[int]]:
        g = len(self._devs)
        xs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        if not xs or not all(isinstance(x, torch.Tensor) for x in xs):
            raise TypeError("inputs must be a tensor (or a tuple of tensors passed as model(*inputs)) "
                            "whose first dimension is the batch")
        if not isinstance(targets, torch.Tensor):
            raise TypeError(f"targets must be a tensor whose first dimension is the batch, got "
                            f"{type(targets).__name__}")
        n = xs[0].shape[0] if xs[0].dim() else 0
        for x in (*xs, targets):
            if x.dim() == 0 or x.shape[0] != n:
                raise ValueError(f"inputs and targets must share the batch dimension; got shapes "
                                 f"{[tuple(t.shape) for t in (*xs, targets)]}")
        if n < g:
            raise ValueError(f"a batch of {n} sample(s) cannot be split across {g} devices; "
                             f"use a batch of at least {g} (one sample per device)")
        split_x = [torch.tensor_split(x, g) for x in xs]
        split_y = torch.tensor_split(targets, g)
        parts = []
        for j in range(g):
            xj = tuple(s[j] for s in split_x)
            parts.append((xj if isinstance(inputs, (tuple, list)) else xj[0], split_y[j]))
        return parts, [int(s.shape[0]) for s in split_y]

    def _begin_step(self, timing: bool) -> None:
        self._guard.reset()
        if self._none_pids:  # parameters left without a gradient last step get their view back
            for j, params in enumerate(self._params):
                views = self._hooks[j].views
                for pid in self._none_pids:
                    params[pid].grad = views[pid]
            self._none_pids = []
        for flat in self._flats:
            flat.zero_()
        for h in self._hooks:
            h.begin_step()
            h.timing = timing
        self._events = [] if timing else None
        sink = (lambda *e: self._events.append(e)) if timing else None
        for d in self._devs:
            d.trace = sink
            if timing:
                d.begin_timing()
        if self._host is not None:
            self._host.trace = sink
            self._host.begin_step()

    def _run_all(self, fn: Callable[[int], Any]) -> list[Any]:
        """Run ``fn(j)`` on every device's thread; the first real failure is raised here."""
        futs: list[Future] = [pool.submit(self._guarded, fn, j) for j, pool in enumerate(self._pools)]
        results, first = [], None
        for f in futs:
            try:
                results.append(f.result())  # note: host waits for the device threads
            except BaseException as exc:
                if first is None or (isinstance(first, StepAborted) and not isinstance(exc, StepAborted)):
                    first = exc
        if first is not None:
            # the first failure recorded anywhere (a device, the host, the comm) is the cause;
            # what the other threads raised (aborts, their own timeouts) follows from it
            if self._guard.error is not None:
                raise self._guard.error
            raise first
        return results

    def _guarded(self, fn: Callable[[int], Any], j: int) -> Any:
        try:
            return fn(j)
        except BaseException as exc:
            self._guard.fail(exc)
            raise

    def _forward_all(self, parts, loss_fn) -> list[tuple[torch.Tensor, float]]:
        run = lambda: self._run_all(lambda j: self._forward_on(j, parts[j], loss_fn))  # noqa: E731
        if self._devs[0].is_cuda or self._rng_turns:
            return run()
        before = torch.default_generator.get_state()
        fw = run()
        if torch.equal(torch.default_generator.get_state(), before):
            return fw  # no random numbers drawn: nothing depends on thread timing
        # the model draws random numbers: from now on every emulated device has its own stream;
        # this forward is done again that way (its graphs are dropped, nothing else was changed)
        torch.default_generator.set_state(before)
        self._rng_turns = True
        return run()

    def _forward_on(self, j: int, part: tuple[Any, Any], loss_fn) -> tuple[torch.Tensor, float]:
        dev = self._devs[j]
        x, y = part
        t0 = time.perf_counter()
        if dev.is_cuda or not self._rng_turns:  # each GPU has its own generator
            loss = self._loss_on(j, x, y, loss_fn)
        else:
            # emulated devices share torch's one CPU generator: once the model draws random
            # numbers (dropout), each device gets its own stream, swapped in under a lock, so that
            # results do not depend on thread timing. Forward passes then take turns.
            with self._cpu_rng_lock:
                outer = torch.default_generator.get_state()  # the user's stream stays untouched
                torch.default_generator.set_state(self._cpu_rng[j])
                try:
                    loss = self._loss_on(j, x, y, loss_fn)
                finally:
                    self._cpu_rng[j] = torch.default_generator.get_state()
                    torch.default_generator.set_state(outer)
        self._span(dev.name, "forward", t0)
        return loss, time.perf_counter() - t0

    def _loss_on(self, j: int, x: Any, y: torch.Tensor, loss_fn) -> torch.Tensor:
        dev = self._devs[j]
        if isinstance(x, tuple):
            out = self.replicas[j](*(t.to(dev.torch_device, non_blocking=True) for t in x))
        else:
            out = self.replicas[j](x.to(dev.torch_device, non_blocking=True))
        loss = loss_fn(out, y.to(dev.torch_device, non_blocking=True))
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(f"loss_fn must return a scalar tensor (mean-reduced), got {shape}; "
                            f"use reduction='mean' or call .mean() on the loss")
        if not loss.is_floating_point() or not loss.requires_grad:
            raise ValueError("the loss does not depend on any trainable parameter (no grad_fn); "
                             "check that loss_fn uses the model output")
        return loss

    def _backward_on(self, j: int, loss: torch.Tensor, w: float) -> tuple[float, float, float, float]:
        dev = self._devs[j]
        timed = self._events is not None
        t0 = time.perf_counter()
        s0 = dev.stamp() if timed else t0
        torch.autograd.backward(loss, grad_tensors=torch.full((), w, dtype=loss.dtype, device=loss.device))
        if timed:
            dev.backward_issued()
        if self.mode == "cgdp":
            self._hooks[j].flush()
        value = float(loss.detach())  # note: CPU-GPU sync point; backward's compute has finished
        t1 = time.perf_counter()
        self._span(dev.name, "backward", t0, t1)
        if self.mode == "cgdp":
            # note: host waits until every chunk has been averaged and its copy back issued
            self._guard.wait(self._host.returned, f"the averaged gradients for {dev.name}")
            marker = dev.h2d_marker()
            dev.compute_wait(marker, self._guard)
            dev.settle(marker, self._guard)
        t2 = time.perf_counter()
        return value, t0, t1, t2, s0

    def _send(self, j: int, c: int) -> None:
        """Chunk ``c`` of device ``j`` is complete: copy it to the host (called from a hook)."""
        self._hooks[j].sent[c] = True
        flat, slot, dev, label = self._flats[j], self._host.slot(j), self._devs[j], f"chunk {c}"
        for s in self._layout.chunk_segments[c]:
            lo, hi = self._layout.segments[s]
            dev.send(flat[lo:hi], slot[lo:hi], partial(self._host.arrived, j, s), label)

    def _finish_backward(self, losses: list[float], weights: list[float]) -> float:
        """Global loss, the non-finite check and the parameters nobody touched."""
        touched = np.zeros(len(self._numels), np.float64)
        for h in self._hooks:
            touched += np.frombuffer(h.touched, np.uint8)
        bad = float(sum(self._host.bad)) if self._host is not None else 0.0
        loss = math.fsum(w * l for w, l in zip(weights, losses))
        if self.mode == "typical":
            bad = self._gather_on_first()
        if self._comm is not None:
            self._comm.fence(self._timeout_s)
            vec = self._comm.allreduce_small(np.concatenate([[loss, bad], touched]))
            loss, bad, touched = float(vec[0]), float(vec[1]), vec[2:]
        if bad:
            raise NonFiniteGradientError(
                f"the averaged gradient has {int(bad)} NaN/Inf value(s) (layers: "
                f"{self._bad_layers()}); the update was not applied. Lower the learning rate, "
                f"check the inputs, or clip gradients")
        untouched = np.flatnonzero(touched == 0)
        if untouched.size:
            self._none_pids = untouched.tolist()
            for params in self._params:
                for pid in self._none_pids:
                    params[pid].grad = None
        return loss

    def _bad_layers(self) -> str:
        if self._host is None:
            return "see the gradients of replica 0"
        chunks = sorted({self._layout.segment_chunk[s] for s, b in enumerate(self._host.bad) if b})
        names = [self.layers[i].name or "<root>" for c in chunks for i in self._layout.plan[c]]
        return ", ".join(names) or "unknown"

    def _gather_on_first(self) -> float:
        """Mode 'typical': device 0 sums every device's gradient in device order."""
        first = self._flats[0]
        for flat in self._flats[1:]:
            first.add_(flat.to(first.device, non_blocking=True))
        return float((~torch.isfinite(first)).sum())

    def _update(self) -> None:
        if self.mode == "typical":
            t0 = time.perf_counter()
            self.optimizers[0].step()
            self._span(self._devs[0].name, "update", t0)
            with torch.no_grad():
                for params in self._params[1:]:
                    # one call per device; across devices torch copies tensor by tensor
                    torch._foreach_copy_(params, self._params[0])
        else:
            self._run_all(self._update_on)
        self._sync_buffers()

    def _update_on(self, j: int) -> None:
        t0 = time.perf_counter()
        self.optimizers[j].step()
        self._span(self._devs[j].name, "update", t0)

    def _span(self, device: str, name: str, t0: float, t1: float | None = None) -> None:
        """A compute-stream span for traces (host clock: when the work was issued)."""
        if self._events is not None:
            self._events.append((device, "compute", name, t0, time.perf_counter() if t1 is None else t1))

    def _sync_buffers(self) -> None:
        """Floating buffers (BatchNorm statistics) ← their batch-weighted mean, on every replica."""
        if not self._buffers[0] or (len(self._devs) == 1 and self._comm is None):
            return
        g = len(self._devs)
        with torch.no_grad():
            first = self._buffers[0]
            # weights as in the gradient (shares of the global batch): every replica saw its part
            w = self._weights
            acc = torch._foreach_mul(first, w[0])
            for j in range(1, g):
                torch._foreach_add_(acc, [b.to(first[0].device) for b in self._buffers[j]], alpha=w[j])
            if self._comm is not None:
                flat = torch.cat([a.reshape(-1).double().cpu() for a in acc]).numpy()
                flat = self._comm.allreduce_small(flat)
                pos = 0
                for a in acc:
                    a.copy_(torch.from_numpy(flat[pos:pos + a.numel()]).view_as(a))
                    pos += a.numel()
            for bufs in self._buffers:
                torch._foreach_copy_(bufs, [a.to(bufs[0].device) for a in acc])

    # ------------------------------------------------------------------ failures, plan switches
    def _quiesce(self) -> None:
        """Wait until no copy is in flight on any device (before buffers are relaid)."""
        g = Guard(self._timeout_s)
        for d in self._devs:
            d.synchronize(g)
        if self._host is not None:
            if not self._host.drain(self._timeout_s or 60.0):
                raise TimeoutError("the host accumulator did not drain")
            for d in self._devs:  # copies back issued by what the host just finished
                d.synchronize(g)

    def _recover(self, exc: BaseException, phase: str) -> None:
        """After a failed step: let every thread stop, drain the streams, stay usable if safe."""
        self._guard.fail(exc)
        try:
            g = Guard(30.0)
            for d in self._devs:
                d.synchronize(g)
            if self._host is not None:
                if not self._host.drain(30.0):
                    self._broken = "the host accumulator did not stop after a failed step"
                for d in self._devs:  # copies back issued by what the host just finished
                    d.synchronize(g)
        except BaseException as drain_exc:  # pragma: no cover - only when a stream is wedged
            self._broken = f"a stream did not drain after a failed step ({drain_exc})"
        if phase == "update":
            self._broken = f"a failure during the update may have left replicas different ({exc!r})"
        if self._comm is not None and phase != "forward":
            self._broken = f"a failure in a step with MPI peers leaves them out of step ({exc!r})"
        self._guard.reset()

    # ------------------------------------------------------------------ profiles and traces
    def _collect(self, t_start: float, bw_stamps: list[Any], profiling: bool, tracing: bool) -> None:
        for d in self._devs:
            d.end_timing()
        bw_start = [d.resolve(s) for d, s in zip(self._devs, bw_stamps)]
        events = self._events or []
        if tracing:
            trace = []
            for dev, stream, name, a, b in events:
                trace.append({"device": dev, "stream": stream, "name": name,
                              "start": a - t_start, "end": b - t_start})
            self.last_trace = trace
        if not profiling:
            return
        ready = [math.nan] * len(self.layers)
        for li, pids in enumerate(self._layer_pids):
            best = -1.0
            for j, h in enumerate(self._hooks):
                for pid in pids:
                    if h.touched[pid]:
                        best = max(best, self._devs[j].resolve(h.ready_at[pid]) - bw_start[j])
            if best >= 0:
                ready[li] = best
        t0 = min(bw_start)
        chunks = []
        by = {}
        for dev, stream, name, a, b in events:
            by.setdefault((stream, name), []).append((dev, a, b))
        for c, layers in enumerate(self._layout.plan):
            lo, hi = self._layout.chunk_bounds[c]
            key = f"chunk {c}"
            d2h = by.get(("d2h", key), [])
            h2d = by.get(("h2d", key), [])
            acc = by.get(("accumulate", key), [])
            comm = by.get(("comm", key), [])
            g = len(self._devs)
            busy = lambda xs, k: sum(b - a for _, a, b in xs) / k  # noqa: E731  (segments add up)
            chunks.append(ChunkTiming(
                index=c, layers=list(layers),
                bytes=(hi - lo) * self._flats[0].element_size(),
                d2h_s=busy(d2h, g), acc_s=busy(acc, 1), comm_s=busy(comm, 1), h2d_s=busy(h2d, g),
                sent_s=(min(a for _, a, _ in d2h) - t0) if d2h else 0.0,
                back_s=(max(b for _, _, b in h2d) - t0) if h2d else 0.0))
        s = self.stats
        self.last_profile = StepProfile(
            devices=len(self._devs), ranks=self._comm.size if self._comm is not None else 1,
            mode=self.mode, layer_bytes=list(self._layer_bytes), layer_ready_s=ready,
            forward_s=s["forward_s"], backward_s=s["backward_s"], exposed_comm_s=s["exposed_comm_s"],
            update_s=s["update_s"], step_s=s["step_s"], plan=self.plan, chunks=chunks)
