"""Per-device random streams on emulated devices: defined for every seed torch can hold."""
import os
import subprocess
import sys
from pathlib import Path

import torch

import cgdp
from cgdp.engine.backend.rng import EmulatedRNG, device_seed
from cgdp.testing import inside

ROOT = Path(__file__).resolve().parents[1]

# run in a fresh process: torch is unseeded there (a random 64-bit seed), as in a user's script
CHILD = r"""
import torch, cgdp
from cgdp.testing import inside
def train():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    with cgdp.Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1), ["cpu:0", "cpu:1"]) as tr:
        g = torch.Generator().manual_seed(0)
        tr.step(torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g),
                torch.nn.functional.cross_entropy)
        assert inside(tr).rng.turns  # dropout drew: the per-device streams were used
        return [p.detach().clone() for p in tr.replicas[0].parameters()]
train()
print("unseeded", torch.initial_seed())
for seed in (0, 1, 2**62, 2**63 - 1, 2**64 - 1, -1):
    torch.manual_seed(seed)
    a = train()
    torch.manual_seed(seed)
    b = train()
    assert all(torch.equal(p, q) for p, q in zip(a, b)), seed
    print("seed", seed, "ok")
"""


def test_trainer_constructs_and_trains_whatever_the_seed():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count(" ok") == 6 and "unseeded" in p.stdout, p.stdout


def test_device_seeds_are_in_range_distinct_and_reproducible():
    for seed in (0, 1, 2**62, 2**64 - 1, 4348951097678367877):
        seeds = [device_seed(seed, j) for j in range(4)]
        assert all(0 <= s < 2**64 for s in seeds)
        assert len(set(seeds)) == 4
        assert seeds == [device_seed(seed, j) for j in range(4)]
    assert device_seed(0, 0) != device_seed(1, 0)
    torch.manual_seed(2**64 - 1)
    states = EmulatedRNG(3).states
    assert not torch.equal(states[0], states[1])
    torch.manual_seed(2**64 - 1)
    assert all(torch.equal(a, b) for a, b in zip(states, EmulatedRNG(3).states))


def test_data_loader_takes_any_seed_as_torch_does():
    """``--seed -1`` (or 2**62) on the command line: the loader's shuffle takes it modulo 2**64."""
    from cgdp.data import Loader, SyntheticDataset
    data = SyntheticDataset((3,), 2, 20)
    neg = Loader(data, 4, -1, prefetch=0).order(0)
    assert sorted(neg.tolist()) == list(range(20))
    assert (neg == Loader(data, 4, 2**64 - 1, prefetch=0).order(0)).all()
    assert sorted(Loader(data, 4, 2**62, prefetch=0).order(1).tolist()) == list(range(20))


def test_resume_with_dropout_on_emulated_devices_is_bitwise_identical():
    """Dropout draws from each emulated device's own stream; the streams travel in the trainer's
    state (``device_rng``), so a run resumed in a process with another seed (as ``--resume`` is)
    equals the uninterrupted one bitwise. (``python -m cgdp.train --model alexnet`` resumes the
    same way: its losses and final eval loss are bitwise equal too.)"""
    import copy
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 2))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)) for _ in range(4)]

    def trainer(model):
        return cgdp.Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), ["cpu:0", "cpu:1"], chunks=1)

    def steps(tr, batches):
        for x, y in batches:
            tr.step(x, y, torch.nn.functional.cross_entropy)

    with trainer(copy.deepcopy(net)) as tr:
        steps(tr, data)
        assert inside(tr).rng.turns  # dropout drew: the per-device streams were used
        straight = [p.detach().clone() for p in tr.replicas[0].parameters()]
    with trainer(copy.deepcopy(net)) as tr:
        steps(tr, data[:2])
        state = copy.deepcopy(tr.state_dict())
    torch.manual_seed(12345)  # a new process: another seed
    with trainer(copy.deepcopy(net)) as tr:
        tr.load_state_dict(state)
        steps(tr, data[2:])
        resumed = [p.detach().clone() for p in tr.replicas[0].parameters()]
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
