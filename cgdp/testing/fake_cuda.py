"""``torch.cuda`` as :class:`cgdp.engine.backend.cuda_runtime.TorchCuda` uses it, over a simulated runtime.

The classes and functions here have the signatures of torch 2.13's (``Stream``, ``Event``,
``StreamContext``, ``device``, ``current_stream``, ``cudart()``, the RNG calls, ``nccl``,
``comm.broadcast_coalesced``, ``_sleep``); ``tests/test_simulated_cuda.py`` compares each with the
installed torch's (:data:`MIRRORS`), so a renamed argument or call in the backend fails in CI.
The behaviour is CUDA's where it matters for cgdp, down to the device bookkeeping of c10:
``torch.cuda.stream(s)`` makes ``s``'s device current and, on exit, sets the previous stream
back through ``set_stream``, which calls ``cudaSetDevice`` on the previous stream's device; a
device guard restores its device lazily (c10's ``MaybeSetDevice``: no ``cudaSetDevice`` on a
device without a context). What happens underneath is :class:`cgdp.testing.cuda_sim.SimulatedCuda`.
"""
from __future__ import annotations

import types
from typing import Any, Optional

import torch

_sim: Any = None
"""The simulator the fakes act on (a ``cgdp.testing.cuda_sim.SimulatedCuda``; one at a time)."""


def active() -> Any:
    if _sim is None:
        raise RuntimeError("no simulated CUDA runtime is active: use cgdp.testing.simulated_cuda()")
    return _sim


def _index(device: Any, optional: bool = True) -> int:
    """torch.cuda._utils._get_device_index: None is the current device."""
    if device is None:
        return active().current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        return active().current_device() if device.index is None else device.index
    return int(device)


class Stream:
    """``torch.cuda.Stream``: one in-order queue of device work (a worker thread, see cuda_sim)."""

    def __new__(cls, device=None, priority=0, **kwargs):
        sim = active()
        if "stream_id" in kwargs:
            return sim.stream_by_id(kwargs["stream_id"], kwargs.get("device_index", sim.current_device()))
        idx = _index(device)
        with _guard(idx):  # as torch: created under a guard of its device
            return sim.new_stream(cls, idx, compute=False)

    def wait_event(self, event: "Event") -> None:
        self.sim.wait_event(self, event)

    def wait_stream(self, stream: "Stream") -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: "Event | None" = None) -> "Event":
        if event is None:
            event = Event()
        event.record(self)
        return event

    def query(self) -> bool:
        self.sim.check()
        done = self.idle()
        if done:  # the host now knows (torch fires no trace callback for a query)
            from cgdp.testing.stream_check import stream_key
            self.sim.checker.stream_synchronize(stream_key(self))
        return done

    def synchronize(self) -> None:
        self.sim.synchronize_stream(self)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    device_type = 1  # c10::DeviceType::CUDA

    def __repr__(self) -> str:
        return f"<simulated torch.cuda.Stream {self.name}>"


class Event:
    """``torch.cuda.Event``: completes when the work recorded before it on its stream has."""

    def __new__(cls, enable_timing=False, blocking=False, interprocess=False, external=False):
        return active().new_event(cls, enable_timing, blocking)

    def record(self, stream: Optional[Stream] = None) -> None:
        self.sim.record_event(self, stream)

    def wait(self, stream: Optional[Stream] = None) -> None:
        (stream if stream is not None else current_stream()).wait_event(self)

    def query(self):
        return self.sim.query_event(self)

    def elapsed_time(self, end_event: "Event"):
        return self.sim.elapsed_time(self, end_event)

    def synchronize(self) -> None:
        self.sim.synchronize_event(self)


class StreamContext:
    """``torch.cuda.StreamContext``, line for line (the device bookkeeping is the point)."""

    def __init__(self, stream: Optional[Stream]):
        self.stream = stream
        self.idx = active().current_device()
        self.src_prev_stream = None
        self.dst_prev_stream = None

    def __enter__(self):
        cur_stream = self.stream
        if cur_stream is None or self.idx == -1:
            return
        active().counts["stream_contexts"] += 1
        self.src_prev_stream = current_stream(None)
        if self.src_prev_stream.device != cur_stream.device:
            with device(cur_stream.device):
                self.dst_prev_stream = current_stream(cur_stream.device)
        set_stream(cur_stream)

    def __exit__(self, type: Any, value: Any, traceback: Any):
        cur_stream = self.stream
        if cur_stream is None or self.idx == -1:
            return
        if self.src_prev_stream.device != cur_stream.device:
            set_stream(self.dst_prev_stream)
        set_stream(self.src_prev_stream)


def stream(stream: Optional[Stream]) -> StreamContext:
    return StreamContext(stream)


def set_stream(stream: Stream):
    if stream is None:
        return
    active().set_stream(stream)


class device:
    """``torch.cuda.device``: ExchangeDevice on enter, MaybeExchangeDevice on exit."""

    def __init__(self, device: Any):
        self.idx = -1 if device is None or (isinstance(device, int) and device < 0) else _index(device)
        self.prev_idx = -1

    def __enter__(self):
        self.prev_idx = active().exchange_device(self.idx) if self.idx >= 0 else -1

    def __exit__(self, type: Any, value: Any, traceback: Any):
        if self.prev_idx >= 0:
            active().maybe_exchange_device(self.prev_idx)
        return False


def _guard(idx: int) -> "device":
    return device(idx)


def set_device(device: Any) -> None:
    idx = _index(device)
    if idx >= 0:
        active().set_device(idx)


def current_device() -> int:
    return active().current_device()


def current_stream(device: Any = None) -> Stream:
    return active().current_stream(_index(device))


def default_stream(device: Any = None) -> Stream:
    return active().default_stream(_index(device))


def synchronize(device: Any = None) -> None:
    active().synchronize_device(_index(device))


def device_count() -> int:
    return active().num_devices


def is_available() -> bool:
    return True


def cudart():
    return active().cudart


def get_rng_state(device: Any = "cuda") -> torch.Tensor:
    active().check()
    return torch.get_rng_state()  # simulated devices draw from torch's CPU generator


def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    active().check()
    torch.set_rng_state(new_state)


def _sleep(cycles):
    """Device work of ``cycles`` clock cycles on the current stream (1 GHz); the host goes on."""
    active().busy(cycles / 1e9)


class _Generators:
    """``torch.cuda.default_generators``: every simulated device draws from torch's CPU generator."""

    def __getitem__(self, index: int) -> torch.Generator:
        active()._valid(index)
        return torch.default_generator

    def __len__(self) -> int:
        return active().num_devices


def _nccl_is_available(tensors):
    return active().nccl


def _nccl_reduce(inputs, output=None, root=0, op=0, streams=None, comms=None, *, outputs=None) -> None:
    sim = active()
    sim.check()
    sim.counts["reduce"] += 1
    out = inputs[root] if output is None else output
    devs = [_on(sim, t) for t in inputs]
    reads: dict[int, list] = {}
    for d, t in zip(devs, inputs):
        reads.setdefault(d, []).append(t)
    sim.mode.collective(reads, {}, devs[root], "nccl.reduce")
    with sim.mode.forced(None):
        for j, t in enumerate(inputs):
            if j != root:
                out.add_(t)
    sim.mode.collective({}, {devs[root]: [out]}, devs[root], "nccl.reduce")


def _broadcast_coalesced(tensors, devices, buffer_size=10485760):
    sim = active()
    sim.check()
    sim.counts["broadcast_coalesced"] += 1
    idx = [_index(d) for d in devices]
    with sim.mode.forced(None):
        out = [list(tensors)] + [[t.detach().clone() for t in tensors] for _ in idx[1:]]
    for d, copies in zip(idx[1:], out[1:]):
        sim.syncs.place(copies, d)
    sim.mode.collective({idx[0]: list(tensors)}, dict(zip(idx[1:], out[1:])), idx[0], "broadcast_coalesced")
    return out


def _on(sim: Any, t: torch.Tensor) -> int:
    """The simulated device of ``t`` (the current one for memory the simulator does not know)."""
    d = sim.syncs.device_of(t)
    return sim.current_device() if d is None else d


def namespaces(sim: Any) -> tuple[Any, Any]:
    """(fake ``torch``, fake ``torch.cuda``) for :class:`TorchCuda` (``torch_module=``)."""
    cuda = types.SimpleNamespace(
        Stream=Stream, Event=Event, StreamContext=StreamContext, stream=stream, set_stream=set_stream,
        device=device, set_device=set_device, current_device=current_device, current_stream=current_stream,
        default_stream=default_stream, synchronize=synchronize, device_count=device_count,
        is_available=is_available, cudart=cudart, get_rng_state=get_rng_state, set_rng_state=set_rng_state,
        default_generators=_Generators(), _sleep=_sleep, nccl=types.SimpleNamespace(is_available=_nccl_is_available, reduce=_nccl_reduce),
        comm=types.SimpleNamespace(broadcast_coalesced=_broadcast_coalesced))

    def fake_device(type: Any, index: Any = None) -> torch.device:  # noqa: A002 (torch.device's own)
        d = torch.device(type) if index is None else torch.device(type, index)
        if d.type != "cuda":
            return d
        # simulated devices live in host memory; the index tells cgdp.testing.host_syncs that a
        # tensor made or moved there is device memory (and its tensors report it as their .device)
        return torch.device("cpu", _index(d))
    tensor = types.SimpleNamespace(pin_memory=lambda t: sim.syncs.pin_memory(t),
                                   is_pinned=lambda t: sim.syncs.is_pinned(t))
    fake = types.SimpleNamespace(cuda=cuda, device=fake_device, empty=torch.empty, Generator=torch.Generator,
                                 Tensor=tensor)
    return fake, cuda


MIRRORS: list[tuple[str, Any]] = [
    ("Stream.__new__", Stream.__new__), ("Stream.wait_event", Stream.wait_event),
    ("Stream.wait_stream", Stream.wait_stream), ("Stream.record_event", Stream.record_event),
    ("Stream.query", Stream.query), ("Stream.synchronize", Stream.synchronize),
    ("Event.__new__", Event.__new__), ("Event.record", Event.record), ("Event.wait", Event.wait),
    ("Event.query", Event.query), ("Event.elapsed_time", Event.elapsed_time),
    ("Event.synchronize", Event.synchronize), ("StreamContext.__init__", StreamContext.__init__),
    ("StreamContext.__exit__", StreamContext.__exit__), ("stream", stream), ("set_stream", set_stream),
    ("device.__init__", device.__init__), ("set_device", set_device), ("current_device", current_device),
    ("current_stream", current_stream), ("default_stream", default_stream), ("synchronize", synchronize),
    ("device_count", device_count), ("is_available", is_available), ("cudart", cudart),
    ("get_rng_state", get_rng_state), ("set_rng_state", set_rng_state), ("_sleep", _sleep),
    ("nccl.is_available", _nccl_is_available), ("nccl.reduce", _nccl_reduce),
    ("comm.broadcast_coalesced", _broadcast_coalesced),
]
"""(name under ``torch.cuda``, the fake): each must take the arguments the real one takes."""

CUDART = {"cudaHostRegister": ("ptr", "size", "flags"), "cudaHostUnregister": ("ptr",),
          "cudaGetErrorString": ("error",)}
"""``torch.cuda.cudart()``'s functions (pybind11, no introspection: from torch/csrc/cuda/shared/cudart.cpp)."""
