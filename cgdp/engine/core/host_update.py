"""The optimizer steps on the host (``update="host"``): its state once, in host memory.

Shared by both faces. :class:`HostMasters` holds float32 *master* copies of replica 0's trainable
parameters in one host allocation (pinned on CUDA: ``Device.host_empty``), each master a view into
it, and the gradient every master reads: a view into the host accumulator's sum row when that row
holds the averaged gradient as is (full-size rows, float32 on the wire: no copy at all), otherwise
a host buffer filled from replica 0's gradients (one copy per step). One ``torch.optim`` optimizer
steps the masters; then every device copies the masters into its replica's parameters, so the
replicas are bitwise identical (the same float32 values on every device) and no device holds
optimizer state.

Invariants: masters equal replica 0's parameters between steps (the masters are refreshed from
replica 0 whenever a parameter's version counter moved, i.e. something other than the engine wrote
it: a ``load_state_dict``, a user's edit); float32 parameters only (masters of 16-bit parameters
would make training differ from one device: refused).

:class:`HostUpdate` is ``cgdp.Trainer``'s strategy (:mod:`cgdp.engine.core.update`): it runs
after backward on the caller's thread, and with the sum row in place the host sends no gradient
back during backward (:attr:`HostAccumulator.send_back`): the parameters travel instead.

Threads: everything here runs on the caller's thread, except :meth:`HostMasters.to_devices`,
whose copies run on each device's thread (a GPU's copies are issued by the thread that owns it).
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Sequence

import torch
from torch import nn

from cgdp.engine.backend.base import Device
from cgdp.engine.core.stream import GradientStream
from cgdp.engine.core.threads import DeviceThreads
from cgdp.engine.core.update import Stamps, Update


def check_host_update(update: str, dtype: torch.dtype | None) -> bool:
    """Whether ``update`` asks for the host optimizer; a sentence for what is not supported."""
    if update not in ("devices", "host"):
        raise ValueError(f"update must be 'devices' (each device steps its replica) or 'host' (one "
                         f"optimizer over float32 masters in host memory), got {update!r}")
    if update == "host" and dtype is not None and dtype != torch.float32:
        raise ValueError(f"update='host' steps float32 masters and copies them back; these parameters are "
                         f"{dtype}, whose replicas would then differ from one device's training: keep "
                         f"update='devices', or train in float32 (with torch.autocast for 16-bit compute)")
    return update == "host"


class HostMasters:
    """Float32 masters of ``params[0]`` in host memory, their gradients, and the copy back."""

    def __init__(self, devs: Sequence[Device], params: Sequence[Sequence[torch.Tensor]]):
        """``params[j]``: replica j's parameters (the same order on every replica)."""
        self.devs = list(devs)
        self.params = [list(p) for p in params]
        numels = [p.numel() for p in self.params[0]]
        self.offsets = [sum(numels[:i]) for i in range(len(numels))]
        total = max(sum(numels), 1)
        self.flat = self.devs[0].host_empty((total,), torch.float32)
        self.masters = [nn.Parameter(self.flat[o:o + n].view(p.shape))
                        for o, n, p in zip(self.offsets, numels, self.params[0])]
        self._grad_buf: torch.Tensor | None = None
        """Host gradients when the accumulator's sum row cannot be read in place (allocated once)."""
        self._attached: tuple | None = None
        self.refresh()

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * 4

    @property
    def grad_bytes(self) -> int:
        """Host bytes held for gradients besides the accumulator's rows."""
        return 0 if self._grad_buf is None else self._grad_buf.numel() * 4

    def refresh(self) -> None:
        """Masters ← replica 0's parameters (at start, after a load or a user's edit)."""
        with torch.no_grad():
            torch._foreach_copy_(self.masters, [p.detach() for p in self.params[0]])
        self._versions = [p._version for p in self.params[0]]

    def follow(self) -> None:
        """Refresh the masters if anything but the engine wrote replica 0's parameters since."""
        if [p._version for p in self.params[0]] != self._versions:
            self.refresh()

    def grads_from_row(self, row: torch.Tensor, offsets: Sequence[int], none: Sequence[int]) -> None:
        """Every master's gradient: a view of ``row`` (the flat layout's ``offsets``); None for ``none``."""
        key = (row.data_ptr(), tuple(offsets), tuple(none))
        if key == self._attached:  # views still in place: no per-step loop
            return
        skip = set(none)
        for pid, m in enumerate(self.masters):
            m.grad = None if pid in skip else row[offsets[pid]:offsets[pid] + m.numel()].view(m.shape)
        self._attached = key

    def grads_from(self, grads: Sequence[torch.Tensor | None], pids: Sequence[int] | None = None) -> None:
        """Masters' gradients ← copies of ``grads`` (replica 0's ``.grad``, None where it has none)."""
        if self._grad_buf is None:
            self._grad_buf = torch.empty_like(self.flat)
        self._attached = None
        dst, src = [], []
        for pid, g in zip(range(len(self.masters)) if pids is None else pids, grads):
            m = self.masters[pid]
            if g is None:
                m.grad = None
                continue
            if g.is_sparse:
                raise NotImplementedError("update='host' steps dense gradients; this parameter has a sparse "
                                          "one (nn.Embedding(sparse=True)): use sparse=False, or update='devices'")
            o = self.offsets[pid]
            m.grad = self._grad_buf[o:o + m.numel()].view(m.shape)
            dst.append(m.grad)
            src.append(g)
        if dst:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)  # note: host waits for the device's gradients (D2H)

    def to_devices(self, threads: DeviceThreads) -> list[Stamps]:
        """Every replica's parameters ← the masters, on each device's thread; per device the stamps."""
        def copy(j: int) -> Stamps:
            dev = self.devs[j]
            t0 = dev.stamp()
            with torch.no_grad():
                # pinned masters: asynchronous on a GPU; the host writes them again only after the
                # next backward, which runs after this copy on the same stream
                torch._foreach_copy_(self.params[j], self.masters, non_blocking=dev.is_cuda)
            return t0, dev.stamp()
        stamps = threads.run_all(copy, computing=True)
        self._versions = [p._version for p in self.params[0]]
        return stamps


class HostUpdate(Update):
    """``Trainer(update="host")``: one optimizer (the user's factory over the masters) on the host.

    Runs after backward (the global view is complete then: clipping's norm, the step's NaN check
    across ranks); the gradient is the host's sum row itself where it can be (see the module)."""

    streams = True
    sums = True
    overlap = "after backward"
    """When the host update runs (for the profile): this strategy always after backward."""

    def __init__(self, devs: Sequence[Device], optimizers: Sequence[torch.optim.Optimizer],
                 params: Sequence[Sequence[nn.Parameter]], factory: Callable[..., torch.optim.Optimizer]):
        super().__init__(devs, optimizers, params)
        self.masters = HostMasters(devs, params)
        opt = factory(iter(self.masters.masters))
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer(params) must return a torch.optim.Optimizer, got {type(opt).__name__}")
        self.optimizer = opt
        self.host_seconds = 0.0
        """The host optimizer's time in the last step."""

    def attach(self, stream: GradientStream) -> None:
        """Once the stream exists: read the host's sum row in place if it can, and then send no
        gradient back during backward (only the parameters travel back)."""
        host = stream.host
        if host is not None and host.sum_row() is not None:
            host.send_back = False

    def hook_views(self, views: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        raise NotImplementedError("update='host' steps on the host's gradient, so gradient hooks registered on "
                                  "the parameters (register_hook) do not run there: remove them, or use "
                                  "update='devices'")

    def reduce(self, stream: GradientStream) -> float:
        return stream.bad_count()

    def step(self, coef: torch.Tensor | None, stream: GradientStream,
             threads: DeviceThreads) -> list[Stamps | None]:
        m = self.masters
        m.follow()
        t0 = time.perf_counter()
        host = stream.host
        row = host.sum_row() if host is not None and not host.send_back else None
        if row is not None:
            m.grads_from_row(row, stream.layout.offsets, stream.none_pids)
        else:  # replica 0 holds the averaged gradient (a bf16 wire, a ring of host slots)
            m.grads_from([p.grad for p in self.params[0]])
        if coef is not None:
            grads = [g.grad for g in m.masters if g.grad is not None]
            if grads:
                torch._foreach_mul_(grads, coef.to(torch.float32).cpu())
        self.optimizer.step()
        self.host_seconds = time.perf_counter() - t0
        return m.to_devices(threads)

    def reloaded(self) -> None:
        """After ``Trainer.load_state_dict``: the masters take replica 0's loaded parameters, and
        every replica the masters."""
        self.masters.refresh()


def optimizer_state_bytes(opt: torch.optim.Optimizer, device: torch.device | None = None) -> int:
    """Bytes of ``opt``'s state tensors (on ``device``, or all)."""
    total = 0
    for s in opt.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor) and (device is None or v.device == device):
                total += v.numel() * v.element_size()
    return total


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

