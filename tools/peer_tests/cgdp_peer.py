"""pytest plugin: run Lightning's or Accelerate's own tests through cgdp's integrations.

``-p cgdp_peer`` with ``CGDP_PEER=lightning`` makes every ``lightning.pytorch.Trainer(...)`` that
would train on one CPU device (no ``strategy``, ``accelerator`` cpu or auto, ``devices`` 1 or auto,
one node) train with ``CGDPStrategy(devices=["cpu:0", "cpu:1"])``; with ``CGDP_PEER=accelerate``
``accelerate.Accelerator`` is cgdp's, on the same two devices. Unset: nothing changes (the baseline).
``CGDP_PEER_LOG=path``: the ids of the tests that built a substituted Trainer or Accelerator, one a line.
"""
from __future__ import annotations

import functools
import os

import pytest

DEVICES = ["cpu:0", "cpu:1"]
_used: set[str] = set()
_current: list[str] = [""]


def _lightning() -> None:
    import lightning.pytorch as pl

    from cgdp.integrations.lightning import CGDPStrategy

    init = pl.Trainer.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        one_cpu = (kwargs.get("strategy", "auto") == "auto" and kwargs.get("accelerator", "auto") in ("auto", "cpu")
                   and kwargs.get("devices", "auto") in ("auto", 1, "1") and kwargs.get("num_nodes", 1) == 1)
        if one_cpu and not args:
            kwargs["strategy"] = CGDPStrategy(devices=DEVICES)
            _used.add(_current[0])
        init(self, *args, **kwargs)

    pl.Trainer.__init__ = __init__


def _accelerate() -> None:
    import accelerate
    import accelerate.accelerator

    from cgdp.integrations.accelerate import Accelerator

    class PeerAccelerator(Accelerator):
        def __init__(self, *args, devices=None, **kwargs):
            _used.add(_current[0])
            super().__init__(DEVICES if devices is None else devices, *args, **kwargs)

    PeerAccelerator.__name__ = PeerAccelerator.__qualname__ = "Accelerator"
    globals()["Accelerator"] = PeerAccelerator  # where pickle finds it (a prepared DataLoader holds it)
    accelerate.Accelerator = accelerate.accelerator.Accelerator = PeerAccelerator


def pytest_configure(config):
    which = os.environ.get("CGDP_PEER", "")
    if which == "lightning":
        _lightning()
    elif which == "accelerate":
        _accelerate()
    elif which:
        raise pytest.UsageError(f"CGDP_PEER={which!r}: lightning, accelerate or unset")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid
    return (yield)


def pytest_unconfigure(config):
    path = os.environ.get("CGDP_PEER_LOG")
    if path:
        with open(path, "w") as f:
            f.writelines(f"{n}\n" for n in sorted(_used))
