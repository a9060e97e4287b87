"""Random numbers on CPU-emulated devices: one stream per device, independent of thread timing.

Emulated devices share torch's one CPU generator. Forwards run concurrently until one draws (dropout); then each device
gets its own stream, swapped in under a lock, and forwards take turns. Device j's seed is a 64-bit word that NumPy's
``SeedSequence`` draws from ``(torch.initial_seed(), j)``: defined for any seed, reproducible, independent per device.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
import torch


class EmulatedRNG:
    def __init__(self, num_devices: int):
        self._lock = threading.Lock()
        self.turns = False
        """Whether forward passes take turns, each with its own random stream."""
        self.states = [torch.Generator().manual_seed(device_seed(torch.initial_seed(), j)).get_state()
                       for j in range(num_devices)]

    @property
    def may_rerun(self) -> bool:
        """Whether a forward may still be done again (:meth:`forward_all`): its buffer writes must be undoable."""
        return not self.turns

    def forward_all(self, run: Callable[[], Any], restore: Callable[[], None] = lambda: None) -> Any:
        """``run()`` every forward; rerun with per-device streams, after ``restore()``, if it drew."""
        if self.turns:
            return run()
        before = torch.default_generator.get_state()
        out = run()
        if torch.equal(torch.default_generator.get_state(), before):
            return out  # no random numbers drawn: nothing depends on thread timing
        # the model draws random numbers: from now on every emulated device has its own stream; this forward is done
        # again that way (its graphs are dropped, its buffer writes undone)
        torch.default_generator.set_state(before)
        restore()
        self.turns = True
        return run()

    def on_device(self, j: int, fn: Callable[[], Any]) -> Any:
        """``fn()`` with device j's random stream, if the devices take turns."""
        if not self.turns:
            return fn()
        with self._lock:
            outer = torch.default_generator.get_state()  # the user's stream stays untouched
            torch.default_generator.set_state(self.states[j])
            try:
                return fn()
            finally:
                self.states[j] = torch.default_generator.get_state()
                torch.default_generator.set_state(outer)


def device_seed(seed: int, j: int) -> int:
    """Emulated device j's seed in [0, 2**64): a hash of torch's seed and j."""
    seq = np.random.SeedSequence(entropy=seed % 2**64, spawn_key=(j,))
    return int(seq.generate_state(1, np.uint64)[0])
