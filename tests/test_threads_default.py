"""torch's intra-op threads on cgdp's device threads: on CPU-emulated devices each device thread
gets one share of the cores (not torch's default pool over every core, which G device threads
would fight over), and the caller's own count does not change; ``OMP_NUM_THREADS`` and GPUs are
left as they are. A caller at one thread stays at one thread in a fresh process too, where the
engine starts Numba's threading layer, and the small-model step keeps no OpenMP pool thread spinning."""
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from cgdp.engine.core.threads import usable_cores
from cgdp.testing import simulated_cuda

pytestmark = pytest.mark.skipif(
    usable_cores() < 2 or "parallel backend: OpenMP" not in torch.__config__.parallel_info(),
    reason="needs 2 cores and torch's OpenMP backend (a count per thread)")
SGD = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731


class Spy(nn.Module):
    """Notes torch's intra-op count of every thread its forward runs on."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.seen: dict[str, int] = {}

    def forward(self, x):
        self.seen[threading.current_thread().name] = torch.get_num_threads()
        return self.fc(x)


@pytest.fixture
def user_threads(monkeypatch):
    """The user's thread uses every core (restored after the test), OMP_NUM_THREADS unset."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(usable_cores())
    yield usable_cores()
    torch.set_num_threads(before)


def count_of_a_new_thread() -> int:
    out = []
    t = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
    t.start()
    t.join()
    return out[0]


def run_both_faces(devices):
    """Each face trains one step on ``devices``; the counts its device threads saw, and the
    caller's own count and a new thread's while each face is open."""
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    trained, during = Spy(), []
    with cgdp.Trainer(trained, SGD, devices) as tr:
        tr.step(x, y, F.mse_loss)
        during.append((torch.get_num_threads(), count_of_a_new_thread()))
    wrapped = Spy()
    with cgdp.DataParallel(wrapped, devices) as model:
        F.mse_loss(model(x), y).backward()
        during.append((torch.get_num_threads(), count_of_a_new_thread()))
    return trained.seen, wrapped.seen, during


def test_device_threads_get_one_share_of_the_cores_and_the_callers_count_stays(user_threads):
    for g in (2, 3):
        trained, wrapped, during = run_both_faces([f"cpu:{j}" for j in range(g)])
        share = max(1, user_threads // g)
        # replica 0's forward runs on its device thread; the others' on theirs (their own modules)
        assert trained == wrapped == {"cgdp-cpu:0": share}
        assert share < user_threads
        assert during == [(user_threads, user_threads)] * 2
        assert torch.get_num_threads() == user_threads


def test_omp_num_threads_and_gpus_are_left_as_they_are(user_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", str(user_threads))
    trained, wrapped, _ = run_both_faces(["cpu:0", "cpu:1"])
    assert trained == wrapped == {"cgdp-cpu:0": user_threads}
    monkeypatch.delenv("OMP_NUM_THREADS")
    with simulated_cuda(2, seed=0):
        trained, wrapped, _ = run_both_faces(["cuda:0", "cuda:1"])
    assert set(trained.values()) == set(wrapped.values()) == {user_threads}


def test_the_count_new_threads_start_from_is_kept_when_another_thread_chose_it(user_threads):
    """A worker of the user's set 1 (which sets the count threads start from, process-wide) while
    the caller keeps every core: building either face leaves both as they were (the count new
    threads start from was reset to the caller's before)."""
    worker = threading.Thread(target=lambda: torch.set_num_threads(1))
    worker.start()
    worker.join()
    try:
        assert (torch.get_num_threads(), count_of_a_new_thread()) == (user_threads, 1)
        _, _, during = run_both_faces(["cpu:0", "cpu:1"])
        assert during == [(user_threads, 1)] * 2
        assert (torch.get_num_threads(), count_of_a_new_thread()) == (user_threads, 1)
    finally:
        restore = threading.Thread(target=lambda: torch.set_num_threads(user_threads))
        restore.start()
        restore.join()


ROOT = Path(__file__).resolve().parent.parent

FRESH = textwrap.dedent("""
    import os, threading, torch, torch.nn.functional as F
    from torch import nn
    import cgdp

    def mlp():  # 48 x Linear(32): 96 parameter tensors, one sample per replica
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(48) for m in (nn.Linear(32, 32), nn.ReLU())])

    def native_cpu():
        # CPU seconds of the threads Python did not start (OpenMP's pool threads, among others)
        mine, total = {t.native_id for t in threading.enumerate()}, 0
        for tid in os.listdir("/proc/self/task"):
            if int(tid) not in mine:
                try:
                    with open(f"/proc/self/task/{tid}/stat") as f:
                        total += sum(int(v) for v in f.read().rsplit(")", 1)[1].split()[11:13])
                except FileNotFoundError:
                    pass
        return total / os.sysconf("SC_CLK_TCK")

    torch.set_num_threads(1)
    counts = [torch.get_num_threads()]
    x, y = torch.randn(2, 32), torch.randn(2, 32)
    with cgdp.Trainer(mlp(), lambda p: torch.optim.SGD(p, lr=1e-3), ["cpu:0", "cpu:1"]) as tr:
        counts.append(torch.get_num_threads())
        for _ in range(5):  # warm-up, and the tuner's first plans
            tr.step(x, y, F.mse_loss)
        n0, c0 = native_cpu(), os.times()
        for _ in range(60):
            tr.step(x, y, F.mse_loss)
        n1, c1 = native_cpu(), os.times()
        counts.append(torch.get_num_threads())
    with cgdp.DataParallel(mlp(), ["cpu:0", "cpu:1"]) as model:
        F.mse_loss(model(x), y).backward()
        counts.append(torch.get_num_threads())
    process = (c1.user + c1.system) - (c0.user + c0.system)
    print("counts:", *counts)
    print("native share:", (n1 - n0) / max(process, 1e-9))
""")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads threads' CPU from /proc")
def test_a_caller_at_one_thread_stays_at_one_and_no_openmp_pool_spins_during_steps(tmp_path):
    """In a fresh interpreter (Numba's threading layer not started yet): starting it set the OpenMP count of the thread
    that started it (the caller, in the host kernels' warm-up) to every core, so the caller zeroed its 50688 gradient
    elements per step on 2 threads, and the pool thread OpenMP started for that spun on a core the device threads needed
    (a 48 x Linear(32) step 3x slower on 2 cores). The count is checked exactly; the spinning by a share of the process's
    CPU with a wide margin (0.28 to 0.45 of it with the spinning pool thread on 2 cores, 0.0 without)."""
    script = tmp_path / "fresh_caller.py"
    script.write_text(FRESH)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for k in ("OMP_NUM_THREADS", "NUMBA_THREADING_LAYER", "NUMBA_NUM_THREADS"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    out = dict(line.split(": ", 1) for line in p.stdout.splitlines() if ": " in line)
    assert out["counts"] == "1 1 1 1", p.stdout  # before, built, after 65 steps, DataParallel's backward
    assert float(out["native share"]) < 0.1, p.stdout
