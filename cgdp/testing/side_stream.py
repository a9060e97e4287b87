"""A model part on a stream of its own, inside :func:`cgdp.testing.simulated_cuda`: :class:`SideStream`.

On a GPU a model may run part of its forward under ``torch.cuda.stream(s)``; autograd's engine then
runs that part's backward nodes on the same side stream and makes the consumer of their result wait
for it. :class:`SideStream` reproduces that on the simulated runtime (:mod:`cgdp.testing.cuda_sim`),
so the engine's handling of gradients produced on another stream is checked in CI:

* forward: the side stream waits for the main one, runs the part, and the main stream waits for it;
* backward: the part's gradients are computed and accumulated into its parameters' ``.grad`` on the
  side stream, and the main stream waits only for the event recorded before the first of those
  accumulations (where autograd's engine records it: a pre-hook on each parameter's
  ``AccumulateGrad`` node, registered once per parameter), never for the accumulations themselves.

It uses the active runtime only through :mod:`cgdp.testing.fake_cuda` (``active()``,
``side_stream``, ``set_stream``, the fakes' streams); the stream-ordering checks then see every
access where it runs.
"""
from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from cgdp.testing import fake_cuda

if TYPE_CHECKING:
    from cgdp.testing.cuda_sim import SimulatedCuda

__all__ = ["SideStream"]


class _Side:
    """One forward's side-stream state, shared by its two autograd nodes."""

    def __init__(self, sim: SimulatedCuda, main: Any, side: Any):
        self.sim, self.main, self.side, self.done = sim, main, side, None


_backward = threading.local()


class _Exit(torch.autograd.Function):
    """At the side part's input (a node of the main stream): in backward, the main stream waits
    for the gradient the side stream produced, as autograd's engine makes a consumer wait."""

    @staticmethod
    def forward(ctx, x, anchor, st):
        ctx.st = st
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        st = ctx.st
        done = st.done or st.side.record_event()
        st.main.wait_event(done)
        st.sim.set_stream(st.main)
        _backward.side = None
        return g, None, None


class _Enter(torch.autograd.Function):
    """At the side part's output: in backward, its nodes run on the side stream."""

    @staticmethod
    def forward(ctx, h, st):
        ctx.st = st
        return h.view_as(h)

    @staticmethod
    def backward(ctx, g):
        st = ctx.st
        st.done = None
        st.side.wait_stream(st.main)
        st.sim.set_stream(st.side)
        _backward.side = st
        return g, None


class SideStream(torch.nn.Module):
    """Runs ``inner`` on a stream of its own, as a model with ``torch.cuda.stream(s)`` in its
    forward does on a GPU: the side stream waits for the main one, the main one for the result;
    in backward (as autograd's engine runs a node on its forward's stream) the side part's
    gradients are computed and accumulated into its parameters' ``.grad`` on the side stream, and
    the main stream waits only for the gradient that leaves the side part, not for those
    accumulations. Only inside :func:`simulated_cuda`."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sim = fake_cuda.active()
        dev = sim.current_device()
        main, side = sim.current_stream(dev), sim.side_stream(dev)
        for p in self.inner.parameters():
            if id(p) not in _SIDE_NODES:  # once per replica's parameter
                # a pre-hook on the parameter's AccumulateGrad node, where autograd's engine records
                # the event: a hook of the engine's, not a user's gradient hook on the parameter
                node = p.view_as(p).grad_fn.next_functions[0][0]
                node.register_prehook(_producer_done)
                _SIDE_NODES[id(p)] = node  # a leaf's accumulator lives while something holds it
                weakref.finalize(p, _SIDE_NODES.pop, id(p), None)
        st = _Side(sim, main, side)
        anchor = torch.zeros((), requires_grad=True)  # so that _Exit's backward always runs
        x = _Exit.apply(x, anchor, st)
        side.wait_stream(main)
        with fake_cuda.stream(side):
            h = self.inner(x)
        main.wait_stream(side)
        return _Enter.apply(h, st)


_SIDE_NODES: dict[int, Any] = {}
"""id(parameter) -> its AccumulateGrad node, for the parameters of :class:`SideStream` parts."""


def _producer_done(grads: tuple) -> None:
    """Before the first accumulation of the side part: the point autograd's engine records for
    the main stream to wait on (the accumulations come after it)."""
    st = getattr(_backward, "side", None)
    if st is not None and st.done is None:
        st.done = st.side.record_event()
