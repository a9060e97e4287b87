"""Per-parameter backward hooks: mark a layer ready, and send its chunk when the chunk is complete.

One ``register_post_accumulate_grad_hook`` per trainable parameter per replica, run on the thread executing that
device's backward, so a device's counters have one writer and need no lock. A hook marks its parameter touched, counts
down its chunk and, at zero, asks the device to send it (which only enqueues). Its per-step state lives in lists and
bytearrays updated in place, which the closure holds directly: a few list operations per call.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


class DeviceHooks:
    def __init__(self, params: list[torch.nn.Parameter], send: Callable[[int], None],
                 stamp: Callable[[], Any], sent: bytearray | None = None):
        """``send(c)``: chunk c is complete (it marks ``sent``, which it may share with the hooks)."""
        n = len(params)
        self.params = params
        self._send = send
        self._stamp = stamp
        self.views: list[torch.Tensor | None] = [None] * n
        """Each parameter's gradient view into the flat buffer (what ``.grad`` must be)."""
        self.param_chunk: list[int] = [0] * n
        self._template: list[int] = []
        self.pending: list[int] = []
        """Per chunk: parameters still to come this step (updated in place)."""
        self.sent = bytearray() if sent is None else sent
        """Per chunk: sent this step (updated in place)."""
        self.touched = bytearray(n)
        self.replaced = bytearray(n)
        """Per parameter: the hook found ``.grad`` replaced and put the view back, overwriting its old contents."""
        self.stolen = bytearray(n)
        """Per parameter: ``.grad`` was set None before backward (a large one); the hook writes ``0.0 + grad`` into the
        view."""
        self.ready_at: list[Any] = [0.0] * n
        self.mode = HookMode()
        """What every hook of this device does this backward (one record, read by every hook)."""
        self._handles = [p.register_post_accumulate_grad_hook(self._make(pid))
                         for pid, p in enumerate(params)]

    @property
    def streaming(self) -> bool:
        """True in mode 'cgdp': hooks send chunks. Otherwise they only mark parameters touched."""
        return self.mode.streaming

    @streaming.setter
    def streaming(self, on: bool) -> None:
        self.mode.streaming = bool(on)

    @property
    def timing(self) -> bool:
        return self.mode.timing

    @timing.setter
    def timing(self, on: bool) -> None:
        self.mode.timing = bool(on)

    @property
    def note(self) -> Callable[[int], None] | None:
        return self.mode.note

    @note.setter
    def note(self, fn: Callable[[int], None] | None) -> None:
        self.mode.note = fn

    def set_layout(self, param_chunk: list[int], chunk_params: list[int],
                   views: list[torch.Tensor]) -> None:
        self.views[:] = views
        self.param_chunk[:] = param_chunk
        self._template = list(chunk_params)
        self.pending[:] = self._template
        self.sent[:] = bytes(len(chunk_params))

    def begin_step(self) -> None:
        self.pending[:] = self._template
        self.sent[:] = bytes(len(self._template))
        self.touched[:] = bytes(len(self.touched))

    def _make(self, pid: int):
        views, touched, replaced, pending, chunk_of, mode = (
            self.views, self.touched, self.replaced, self.pending, self.param_chunk, self.mode)
        send, ready_at, stamp, stolen = self._send, self.ready_at, self._stamp, self.stolen

        def hook(p: torch.Tensor) -> None:
            view, grad = views[pid], p.grad  # read once: another thread may zero_grad
            if grad is not view:
                if grad is not None and stolen[pid]:  # one pass (read, write) where zeroing and adding made three
                    torch.add(grad, 0.0, out=view)
                else:
                    # .grad was replaced (e.g. zero_grad(set_to_none=True) on a replica): autograd then stores a new
                    # tensor instead of adding into the flat buffer. Put it back.
                    if grad is not None:
                        view.copy_(grad)
                    replaced[pid] = 1
                p.grad = view
            touched[pid] = 1
            if mode.timing:
                ready_at[pid] = stamp()
            if mode.streaming:
                c = chunk_of[pid]
                note = mode.note
                if note is not None:
                    note(c)
                left = pending[c] - 1
                pending[c] = left
                if left == 0:
                    send(c)
        return hook

    def flush(self) -> None:
        """Send the chunks that backward never completed (layers unused this step), in plan order."""
        for c, done in enumerate(self.sent):
            if not done:
                self._send(c)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class HookMode:
    """What the hooks of one device do in this backward."""

    __slots__ = ("streaming", "timing", "note")

    def __init__(self) -> None:
        self.streaming = False
        """Send chunks (mode 'cgdp'); otherwise only mark parameters touched."""
        self.timing = False
        """Stamp when each parameter was ready (timed steps)."""
        self.note: Callable[[int], None] | None = None
        """Called with the chunk of each gradient arriving while streaming (CUDA: notes the stream its send must wait
        for)."""
