"""Faults in the library: stalls, Ctrl-C, re-entrant calls, bad states, and what a trainer leaves
behind. Every wait here is bounded, so a regression fails the test instead of hanging CI."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from helpers import assert_replicas_identical, mlp

ROOT = Path(__file__).resolve().parent.parent
SGD = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
X, Y = torch.randn(6, 12), torch.randint(0, 5, (6,))


class Stall(nn.Module):
    """An MLP whose forward blocks on the device thread named ``on`` while ``STALL`` is armed (a
    module-level dict, because every replica is a deep copy)."""

    def __init__(self, on: str = "cgdp-cpu:1"):
        super().__init__()
        self.net = mlp()
        self.on = on

    def forward(self, x):
        if STALL["armed"] and threading.current_thread().name == self.on:
            STALL["entered"].set()
            STALL["release"].wait(60)
        return self.net(x)


STALL: dict = {"armed": False, "entered": threading.Event(), "release": threading.Event()}


@pytest.fixture
def stall():
    STALL.update(armed=True, entered=threading.Event(), release=threading.Event())
    yield STALL
    STALL["release"].set()
    STALL["armed"] = False


def test_stalled_forward_times_out_and_the_trainer_is_marked_broken(stall):
    tr = cgdp.Trainer(Stall(), SGD, ["cpu:0", "cpu:1"], timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"cpu:1 did not finish within timeout_s = 1 s"):
        tr.step(X, Y, F.cross_entropy)
    took = time.monotonic() - t0
    assert took < 30, took  # the timeout ended the wait, long before the 60 s stall would have
    with pytest.raises(RuntimeError, match=r"cannot continue: the device thread\(s\) of cpu:1 never returned"):
        tr.step(X, Y, F.cross_entropy)
    t0 = time.monotonic()
    tr.close()  # the stuck thread is not joined (it is held for 60 s)
    assert time.monotonic() - t0 < 30


def test_ctrl_c_while_waiting_surfaces_promptly(stall):
    import _thread
    tr = cgdp.Trainer(Stall(), SGD, ["cpu:0", "cpu:1"], timeout_s=None)  # would wait forever
    # Ctrl-C once the step is waiting for the stalled device (not at a timer's guess of when)
    threading.Thread(target=lambda: stall["entered"].wait(30) and _thread.interrupt_main(), daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        tr.step(X, Y, F.cross_entropy)
    assert time.monotonic() - t0 < 30  # promptly: the stall would hold it for 60 s
    with pytest.raises(RuntimeError, match="never returned from a step that failed"):
        tr.step(X, Y, F.cross_entropy)
    tr.close()


def test_a_step_that_returns_after_ctrl_c_leaves_the_trainer_usable(stall):
    """Ctrl-C during a step whose threads all stop: nothing is stuck, the step is undone."""
    import _thread
    with cgdp.Trainer(Stall(), SGD, ["cpu:0", "cpu:1"], timeout_s=None) as tr:
        def interrupt_then_release():
            stall["entered"].wait(30)
            _thread.interrupt_main()
            deadline = time.monotonic() + 30  # release once the step has taken the Ctrl-C, not after a guess
            while cgdp.testing.inside(tr).error is None and time.monotonic() < deadline:
                time.sleep(0.001)
            stall["release"].set()
        threading.Thread(target=interrupt_then_release, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            tr.step(X, Y, F.cross_entropy)
        stall["armed"] = False
        assert tr.step_count == 0
        tr.step(X, Y, F.cross_entropy)
        assert_replicas_identical(tr)


def test_failure_while_another_device_computes_long_leaves_the_trainer_usable():
    """Device 0 fails at once while device 1's forward takes 1.5 s: the step waits for device 1
    (it is slow, not stuck) and the trainer stays usable."""
    class Slow(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            if SLOW["on"] and threading.current_thread().name == "cgdp-cpu:1":
                time.sleep(1.5)
            return self.net(x)

    def loss(out, y):
        if SLOW["on"] and threading.current_thread().name == "cgdp-cpu:0":
            raise RuntimeError("boom on device 0")
        return F.cross_entropy(out, y)

    SLOW["on"] = True
    with cgdp.Trainer(Slow(), SGD, ["cpu:0", "cpu:1"], timeout_s=10) as tr:
        with pytest.raises(RuntimeError, match="boom on device 0"):
            tr.step(X, Y, loss)
        SLOW["on"] = False
        tr.step(X, Y, F.cross_entropy)
        assert tr.step_count == 1
        assert_replicas_identical(tr)


SLOW = {"on": False}


HANG_SCRIPT = textwrap.dedent("""
    import sys, threading, time, signal
    import torch, torch.nn.functional as F
    sys.path.insert(0, {tests!r})
    import cgdp
    from helpers import mlp

    class Forever(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
        def forward(self, x):
            if threading.current_thread().name == "cgdp-cpu:1":
                print("stalled", flush=True)
                threading.Event().wait()  # never returns
            return self.net(x)

    how = sys.argv[1]
    tr = cgdp.Trainer(Forever(), lambda p: torch.optim.SGD(p, lr=0.1), ["cpu:0", "cpu:1"],
                      timeout_s=1.0 if how == "timeout" else None)
    try:
        tr.step(torch.randn(6, 12), torch.randint(0, 5, (6,)), F.cross_entropy)
    except (TimeoutError, KeyboardInterrupt) as e:
        print("caught", type(e).__name__, flush=True)
    if sys.argv[2] == "close":
        tr.close()
        print("closed", flush=True)
    # exit with the stuck thread still inside forward (closed, or just dropped)
""")


@pytest.mark.slow  # a process each
@pytest.mark.parametrize("how, end", [("timeout", "close"), ("sigint", "close"), ("sigint", "drop")])
def test_a_thread_that_never_returns_does_not_block_close_or_exit(tmp_path, how, end):
    script = tmp_path / "hang.py"
    script.write_text(HANG_SCRIPT.format(tests=str(ROOT / "tests")))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, str(script), how, end], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        first = p.stdout.readline()
        assert "stalled" in first, first + p.stdout.read()
        if how == "sigint":
            time.sleep(0.3)
            p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("the process hung at close() or at exit")
    assert p.returncode == 0, out
    expected = "TimeoutError" if how == "timeout" else "KeyboardInterrupt"
    assert f"caught {expected}" in out, out
    assert ("closed" in out) == (end == "close")


def test_step_from_two_threads_at_once_is_refused(stall):
    with cgdp.Trainer(Stall(), SGD, ["cpu:0", "cpu:1"], timeout_s=30) as tr:
        done: list = []
        first = threading.Thread(target=lambda: done.append(tr.step(X, Y, F.cross_entropy)), daemon=True)
        first.start()
        assert stall["entered"].wait(10)
        errors: list = []

        def second():
            for call in (lambda: tr.step(X, Y, F.cross_entropy), lambda: tr.load_state_dict(tr.state_dict())):
                try:
                    call()
                except RuntimeError as e:
                    errors.append(str(e))
        t = threading.Thread(target=second, daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "a second step() hung"
        assert len(errors) == 2, errors
        assert "step() was called from another thread while one is running" in errors[0]
        assert "load_state_dict() was called" in errors[1] and "one call at a time" in errors[1]
        stall["release"].set()
        first.join(10)
        assert done and tr.step_count == 1
        assert_replicas_identical(tr)


def test_step_from_inside_loss_fn_is_a_clear_error():
    with cgdp.Trainer(mlp(), SGD, ["cpu:0", "cpu:1"], timeout_s=30) as tr:
        def nested(out, y):
            tr.step(X, Y, F.cross_entropy)
            return F.cross_entropy(out, y)
        result: list = []

        def outer():
            try:
                tr.step(X, Y, nested)
            except RuntimeError as e:
                result.append(e)
        t = threading.Thread(target=outer, daemon=True)
        t.start()
        t.join(15)
        assert not t.is_alive(), "step() inside loss_fn hung"
        assert result and "inside loss_fn" in str(result[0]), result
        tr.step(X, Y, F.cross_entropy)  # still usable
        assert tr.step_count == 1


CLOSE_AT = {"where": None, "reached": threading.Event(), "engine": None}
"""Where close() lands in a step (``where``: a phase below), set by the test; module level because
every replica is a deep copy."""


def _hold_for_close(where: str) -> None:
    """At phase ``where`` of an armed step: tell the closer, then hold the step there until close()
    has stopped the engine's waits (``cgdp.testing.inside(engine).error``), so that close() lands in
    this phase whatever the machine's load, instead of at a timer's guess."""
    if CLOSE_AT["where"] != where:
        return
    CLOSE_AT["where"] = None  # once per step
    CLOSE_AT["reached"].set()
    deadline = time.monotonic() + 30
    while cgdp.testing.inside(CLOSE_AT["engine"]).error is None:
        assert time.monotonic() < deadline, "close() never took effect"
        time.sleep(0.001)


CLOSE_PHASES = ["forward cpu:0", "forward cpu:1", "loss cpu:1", "backward cpu:0", "update"]


def test_close_from_another_thread_during_a_step_has_a_clear_outcome():
    """close() from another thread lands in each phase of a step (forward and loss on a device
    thread, backward, the update): the step either returns or raises the RuntimeError that names
    close(), never an internal error; close() returns, the trainer refuses further steps and its
    threads are gone. Each landing is arranged with events (the step waits at the phase until
    close() has taken effect), so no timer can fire before the step begins."""

    class HeldSGD(torch.optim.SGD):
        def step(self, closure=None):
            _hold_for_close("update")
            return super().step(closure)

    class Phased(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            dev = threading.current_thread().name.removeprefix("cgdp-")
            _hold_for_close(f"forward {dev}")
            out = self.net(x)
            if out.requires_grad:
                out.register_hook(lambda g: _hold_for_close(f"backward {dev}"))
            return out

    def loss_fn(out, y):
        _hold_for_close(f"loss {threading.current_thread().name.removeprefix('cgdp-')}")
        return F.cross_entropy(out, y)

    gc.collect()
    base = _threads()
    outcomes = {}
    for where in CLOSE_PHASES:
        tr = cgdp.Trainer(Phased(), lambda p: HeldSGD(p, lr=0.1), ["cpu:0", "cpu:1"], chunks=1, timeout_s=30)
        tr.step(X, Y, loss_fn)  # warm: the close below lands inside a steady step
        CLOSE_AT.update(where=where, reached=threading.Event(), engine=tr)
        reached = CLOSE_AT["reached"]
        closer = threading.Thread(target=lambda tr=tr: reached.wait(30) and tr.close())
        closer.start()
        try:
            tr.step(X, Y, loss_fn)
            outcomes[where] = "returned"
        except RuntimeError as e:
            assert "close() was called from another thread" in str(e), (where, repr(e))
            outcomes[where] = "stopped"
        finally:
            CLOSE_AT.update(where=None, engine=None)
        assert reached.is_set(), f"the step never reached {where}"
        closer.join(30)
        assert not closer.is_alive(), "close() hung"
        assert tr.closed
        with pytest.raises(RuntimeError, match="closed"):
            tr.step(X, Y, loss_fn)
        del tr, closer
        deadline = time.monotonic() + 30
        while _threads() > base and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _threads() == base, [t.name for t in threading.enumerate()]
    # a close() during forward, loss or backward stops the step: its waits come after
    assert all(outcomes[w] == "stopped" for w in CLOSE_PHASES if w != "update"), outcomes


# ------------------------------------------------------------------ load_state_dict: all or nothing
def _trained(seed: int, chunks="auto"):
    tr = cgdp.Trainer(mlp(seed=seed), lambda p: torch.optim.Adam(p, lr=1e-2), ["cpu:0", "cpu:1"], chunks=chunks)
    for _ in range(2):
        tr.step(X, Y, F.cross_entropy)
    return tr


def _broken_states(good: dict) -> list[tuple[str, dict, str]]:
    import copy
    out = []
    s = copy.deepcopy(good); del s["model"]["4.bias"]
    out.append(("missing key", s, r"missing \['4.bias'\]"))
    s = copy.deepcopy(good); s["model"]["9.extra"] = torch.zeros(1)
    out.append(("unexpected key", s, r"unexpected \['9.extra'\]"))
    s = copy.deepcopy(good); s["model"]["2.weight"] = torch.zeros(3, 3)
    out.append(("wrong shape", s, r"2.weight has shape \(3, 3\)"))
    s = copy.deepcopy(good); s["optimizer"]["param_groups"].append(dict(s["optimizer"]["param_groups"][0]))
    out.append(("extra group", s, "2 parameter group"))
    s = copy.deepcopy(good); s["optimizer"]["param_groups"][0]["params"] = [0, 1, 2]
    out.append(("group size", s, "group 0 has 3 parameters"))
    s = copy.deepcopy(good); s["optimizer"]["state"][1]["exp_avg"] = torch.zeros(7)
    out.append(("optimizer state shape", s, "exp_avg of parameter 1 has shape"))
    s = copy.deepcopy(good); s["plan"] = [[0, 1]]
    out.append(("bad plan", s, "leaves out layer"))
    s = copy.deepcopy(good); s["tuner"] = {"nonsense": 1}
    out.append(("bad tuner", s, "tuner state does not fit"))
    s = copy.deepcopy(good); del s["optimizer"]
    out.append(("no optimizer", s, r"lacks \['optimizer'\]"))
    s = copy.deepcopy(good); s["step"] = -4
    out.append(("negative step", s, "step must be an int >= 0"))
    return out


def test_a_model_with_extra_state_loads_its_own_state():
    """A module's get_extra_state() is in its state dict as any object, not a tensor."""
    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.seen = mlp(), 0

        def forward(self, x):
            return self.net(x)

        def get_extra_state(self):
            return {"seen": self.seen}

        def set_extra_state(self, state):
            self.seen = state["seen"]

    with cgdp.Trainer(Counted(), SGD, ["cpu:0", "cpu:1"]) as tr:
        tr.step(X, Y, F.cross_entropy)
        state = tr.state_dict()
        state["model"]["_extra_state"] = {"seen": 7}
        tr.load_state_dict(state)
        assert [r.seen for r in tr.replicas] == [7, 7]
        tr.step(X, Y, F.cross_entropy)
        for a, b in zip(*(r.parameters() for r in tr.replicas)):
            assert torch.equal(a, b)


def test_failed_load_state_dict_changes_nothing():
    other = _trained(seed=1)
    good = other.state_dict()
    other.close()
    with _trained(seed=0) as tr:
        before = [[p.detach().clone() for p in r.parameters()] for r in tr.replicas]
        opt_before = [str(o.state_dict()) for o in tr.optimizers]
        plan, step = tr.plan, tr.step_count
        for name, state, match in _broken_states(good):
            with pytest.raises(ValueError, match=match):
                tr.load_state_dict(state)
            for r, b in zip(tr.replicas, before):
                assert all(torch.equal(p, q) for p, q in zip(r.parameters(), b)), name
            assert [str(o.state_dict()) for o in tr.optimizers] == opt_before, name
            assert tr.plan == plan and tr.step_count == step, name
        tr.load_state_dict(good)  # the good state still loads, and training goes on
        assert tr.step_count == 2
        tr.step(X, Y, F.cross_entropy)
        assert_replicas_identical(tr)


def test_state_dict_loads_with_weights_only(tmp_path):
    with _trained(seed=0) as tr:
        torch.save(tr.state_dict(), tmp_path / "s.pt")
        state = torch.load(tmp_path / "s.pt", weights_only=True)
        tr.load_state_dict(state)
        tr.step(X, Y, F.cross_entropy)


# ------------------------------------------------------------------ nothing stays after close
def _threads() -> int:
    return sum(t.name.startswith("cgdp-") for t in threading.enumerate())


def _rss_mb() -> float:
    try:  # give freed heap pages back first (glibc), so RSS shows what is still held
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@pytest.mark.parametrize("mode", ["cgdp", "typical"])
@pytest.mark.parametrize("end", ["close", "drop"])
def test_closed_or_dropped_trainer_is_freed_at_once(mode, end):
    """Without the cycle collector: reference counting alone frees a closed or dropped trainer,
    and its threads stop."""
    cgdp.Trainer(mlp(), SGD, ["cpu:0", "cpu:1"], mode=mode, chunks="auto").close()  # first-use caches
    gc.collect()
    base = _threads()
    gc.disable()
    try:
        for chunks in ("auto", 1):
            tr = cgdp.Trainer(mlp(), SGD, ["cpu:0", "cpu:1"], mode=mode, chunks=chunks, profile=True)
            tr.step(X, Y, F.cross_entropy)
            ref = weakref.ref(tr)
            assert _threads() > base
            if end == "close":
                tr.close()
            del tr
            deadline = time.monotonic() + 30  # a bound against a hang, left at once when they stop
            while _threads() > base and time.monotonic() < deadline:
                time.sleep(0.05)
            assert ref() is None, f"the {end} trainer is kept alive by a reference cycle"
            assert _threads() == base, [t.name for t in threading.enumerate()]
    finally:
        gc.enable()


def test_memory_does_not_grow_over_create_close_cycles():
    """A ~32 MB model, 12 create/step/close cycles with the cycle collector off: RSS stays flat."""
    def big():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    x, y = torch.randn(4, 1024), torch.randint(0, 1024, (4,))
    gc.collect()
    gc.disable()
    try:
        rss = []
        for i in range(12):
            tr = cgdp.Trainer(big(), SGD, ["cpu:0", "cpu:1"], chunks=2)
            tr.step(x, y, F.cross_entropy)
            if i % 2:
                tr.close()
            del tr  # every other one dropped without close()
            rss.append(_rss_mb())
    finally:
        gc.enable()
    # one trainer of this model holds ~170 MB (2 replicas, momentum, flat and host buffers): 8
    # trainers kept alive would add over 1 GB; what remains is the allocator's noise
    assert rss[-1] - rss[3] < 250, rss


def test_typical_mode_names_the_non_finite_layers():
    with cgdp.Trainer(mlp(), SGD, ["cpu:0", "cpu:1"], mode="typical") as tr:
        bad = X.clone()
        bad[0, 0] = float("inf")
        with pytest.raises(cgdp.NonFiniteGradientError, match=r"\(layers: 0\); the update was not applied"):
            tr.step(bad, Y, F.cross_entropy)
