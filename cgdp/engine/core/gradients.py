"""The one owner of a step's gradients, for both faces: explicit states, one reset point each.

``Trainer`` makes each step's gradient new (:meth:`Gradients.begin_step`, :meth:`Gradients.end_step`).
``DataParallel`` keeps them between backwards, as one device does: the loop sees replica 0 only, and at any time the
true gradient is the sum over replicas of what they hold. States (:class:`GradState`), one transition per event:

=================  ===========================================================  =====================
state              what the replicas hold                                       left by
=================  ===========================================================  =====================
``SUMMED``         every replica the total, the host's sum of the last synced   a backward, a clip, an
                   backward (``update="host"`` reads the host's row in place)   edit, a plan switch
``EDITED``         every replica the same total, changed since the host summed  a backward
                   it (clip, hook, mirrored edit, plan switch, from wrapping)
``ACCUMULATING``   each replica its own part (backwards inside ``no_sync()``)   a backward, an edit
``SENDING``        a synced backward is running: chunks stream to the host      its end (or failure)
``LOCAL``          a backward inside ``no_sync()`` is running: nothing is sent  its end (or failure)
``DROPPED``        nothing: a backward failed partway (``step()`` refused)      a completed backward
=================  ===========================================================  =====================

A backward that fails before any gradient arrived returns to the state before it (``SUMMED`` becomes ``EDITED``:
arming a backward makes the host's rows another's). :meth:`Gradients.drop` is the one reset point. The *parts* behind
:class:`GradPart`: dense (:mod:`~.dense_grads`, streamed) and sparse (:mod:`~.sparse_grads`, joined after); no dense
parameters: an empty plain :class:`GradPart`, not a branch at every call site. :meth:`Gradients.begin` and
:meth:`Gradients.end` run on autograd's threads, the rest on the caller's; never two at once (the operation lock).
"""
from __future__ import annotations

import enum
from typing import Any

import torch

from cgdp.engine.core.user_warning import warn_user


class UserFault(Exception):
    """A backward failed on the user's doing, with nothing in flight: gradients dropped, the model goes on."""

    def __init__(self, error: BaseException):
        super().__init__(repr(error))
        self.error = error


class GradState(enum.Enum):
    SUMMED = "summed"
    EDITED = "edited"
    ACCUMULATING = "accumulating"
    SENDING = "sending"
    LOCAL = "local"
    DROPPED = "dropped"


class GradPart:
    """What the owner asks of each part; as it stands, the empty part. ``whole``: every replica held the total."""

    def begin(self, sync: bool, whole: bool) -> None:
        """Before a backward adds: make the gradients hold what it adds to, ready the path (``sync``: send)."""

    def end(self, sync: bool) -> bool:
        """After a backward: the parts summed (``sync``) or kept; whether user gradient hooks ran."""
        return False

    def after(self) -> None:
        """After :meth:`end` or a failure: nothing armed."""

    def undo(self, whole: bool) -> bool:
        """A backward failed: put back what :meth:`begin` changed if nothing arrived since; whether it could."""
        return True

    def drop(self) -> None:
        """Every gradient dropped: ``.grad`` None on every replica."""

    def follow_edits(self, whole: bool, data: bool = True) -> bool:
        """Copy the user's edits of replica 0's gradients everywhere (``data``: ``.data`` ones, by bits: host read)."""
        return False

    def norm(self, norm_type: float) -> torch.Tensor | float:
        """Of the total gradient, in float64 (a tensor on replica 0's device where it can)."""
        return 0.0

    def scale(self, coef: torch.Tensor) -> None:
        """Every replica's gradient times ``coef``."""

    def attached(self) -> bool:
        """Whether replica 0's ``.grad`` are still what cgdp left (none replaced since)."""
        return True

    def relaid(self) -> None:
        """After a plan switch relaid the flat buffers (their values kept)."""


NOT_SUMMED = ("optimizer.step() after a backward inside model.no_sync() (or a backward through forwards run "
              "inside it): each replica holds only its own part of the gradient, never summed; run the last "
              "backward of the step outside no_sync() (forward and backward both), or inside "
              "model.sync_in_backward(), before optimizer.step()")

_SENDING, _SUMMED_STATE = GradState.SENDING, GradState.SUMMED

_WHOLE = (GradState.SUMMED, GradState.EDITED, GradState.DROPPED)  # every replica holds the total (or nothing)


class Gradients:
    def __init__(self, dense: GradPart, sparse: GradPart | None, devices: list[torch.device]):
        self.dense = dense
        self.parts: list[GradPart] = [dense] + ([sparse] if sparse is not None else [])
        self.trains = type(dense) is not GradPart or sparse is not None  # else input gradients only
        self.state = GradState.EDITED  # the gradients from before wrapping, on every replica
        self._before = self.state  # the state a running backward started from
        self._device = devices[0]

    @property
    def whole(self) -> bool:
        return self.state in _WHOLE

    def begin_step(self, timing: bool, sink: Any, take_hooks: bool) -> bool:
        """A ``Trainer`` step from zero; with ``take_hooks`` the user's gradient hooks wait for the sum: whether any."""
        self.dense.fresh(timing, sink)
        self.state = _SENDING
        return bool(take_hooks and self.dense.param_hooks.take())

    def run_hooks(self, touched: Any, hook_views: Any) -> bool:
        """The hooks taken by :meth:`begin_step`, on the sum, the result in every view ``hook_views`` picks of the
        stream's (the first holds the sum): whether any ran. Also after a failure, :meth:`put_back_hooks`."""
        hooks = self.dense.param_hooks
        if not hooks.taken:
            return False
        hooks.run(touched, hook_views(self.dense.stream.views), {})
        return True

    def put_back_hooks(self) -> None:
        self.dense.param_hooks.put_back()

    def end_step(self, touched: Any) -> None:
        self.dense.settle(touched)
        self.state = _SUMMED_STATE

    def touched(self) -> Any:
        """Per dense parameter, on how many replicas it got a gradient since the marks were reset."""
        return self.dense.marks.counts()

    def host_row(self) -> tuple[Any, list[int], torch.Tensor]:
        """For :meth:`~cgdp.engine.core.host_update.HostMasters.take_grads`: the host's sum row when every replica holds
        it (``SUMMED`` on one machine; one replica: nothing compares a ``.data`` edit with it), else None; the offsets
        and replica 0's flat gradient."""
        st = self.dense.stream
        whole = (self.state is GradState.SUMMED and st.host is not None and st.host.comm is None
                 and len(st.flats) > 1)
        return st.host.sum_row() if whole else None, st.layout.offsets, st.flats[0]

    def device_norm(self) -> float:
        """The 2-norm of replica 0's gradient, read from its device (not the host's sum)."""
        return float(self.parts[0].norm(2.0))  # note: a CPU-GPU sync point

    def begin(self, sync: bool) -> None:
        for part in self.parts:
            part.begin(sync, self.whole)
        self._before, self.state = self.state, GradState.SENDING if sync else GradState.LOCAL

    def end(self) -> None:
        sync = self.state is GradState.SENDING
        try:
            hooked = [part.end(sync) for part in self.parts]  # dense first: the sparse join is not overlapped
        except UserFault:  # the backward failed partway on the user's doing: as one device, it goes on
            self.after()
            self.drop()
            raise
        self.state = (GradState.ACCUMULATING if not sync
                      else GradState.EDITED if any(hooked) else GradState.SUMMED)

    def after(self) -> None:
        for part in self.parts:
            part.after()

    def fail(self) -> None:
        """A backward raised before :meth:`end`: gradients kept if none changed, else dropped."""
        self.after()
        whole = self._before in _WHOLE
        if all(part.undo(whole) for part in self.parts):
            # kept; but the host's rows are no longer theirs (arming a backward reset them)
            self.state = GradState.EDITED if self._before is GradState.SUMMED else self._before
            return
        self.drop()
        warn_user("the previous backward through cgdp.DataParallel failed partway; the gradients "
                  "it left were dropped (every .grad is None)")

    def drop(self) -> None:
        """The one reset point: every gradient dropped until a backward completes."""
        for part in self.parts:
            part.drop()
        self.state = GradState.DROPPED

    def check_step(self) -> None:
        if self.state is GradState.DROPPED:
            raise RuntimeError("the last backward through cgdp.DataParallel failed partway, so the "
                               "gradients are incomplete (they were dropped); call optimizer.zero_grad() "
                               "and redo this step's forward and backward before optimizer.step()")
        if self.state is GradState.ACCUMULATING:
            raise RuntimeError(NOT_SUMMED)
        self.follow_edits()

    def follow_edits(self, data: bool = True) -> None:
        dense, *rest = self.parts
        if dense.follow_edits(self.whole, data) and self.state is GradState.SUMMED:
            self.state = GradState.EDITED
        for part in rest:
            part.follow_edits(self.whole, data)

    def clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        if not self.whole:
            raise RuntimeError("clip_grad_norm_ needs the summed gradient: call it after the backward "
                               "that runs outside model.no_sync()")
        # no .data check (a read): the norm is replica 0's, edits included, as one device's; the step checks
        self.follow_edits(data=False)
        total = self.norm(norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for part in self.parts:
                part.scale(coef)
        if self.state is GradState.SUMMED:  # (DROPPED stays: the step is refused until a backward)
            self.state = GradState.EDITED
        return total

    def norm(self, norm_type: float) -> torch.Tensor:
        """The total's norm, as float32 on replica 0's device (no host read for the dense part)."""
        value, *rest = [part.norm(norm_type) for part in self.parts]
        if rest:  # the norm of the parts' norms (the sparse part's, read on the host)
            value = torch.linalg.vector_norm(torch.stack([torch.as_tensor(v, dtype=torch.float64).to(self._device)
                                                          for v in (value, *rest)]), norm_type)
        if isinstance(value, torch.Tensor):
            return value.to(torch.float32)
        # made on the device (torch.tensor(value, device=...) copies from pageable memory: a host wait)
        return torch.full((), value, dtype=torch.float32, device=self._device)

    def kept(self) -> bool:
        """Whether replica 0's gradients were left as its mirrors had them (else they resync; warns)."""
        if self.parts[0].attached():
            return True
        warn_user("replica 0's gradients were changed during optimizer.step() (optimizer.zero_grad() "
                  "from another thread?); every replica took replica 0's parameters and optimizer "
                  "state, so they stay identical. Drive a cgdp.DataParallel from one thread")
        return False

    def relaid(self) -> None:
        self.parts[0].relaid()
        if self.state is GradState.SUMMED:
            self.state = GradState.EDITED
