"""A process forked after cgdp ran (a multiprocessing.Pool with the fork start method, DataLoader
workers) can use cgdp: it never hangs and never dies (GNU OpenMP does not survive a fork; see
cgdp/engine/core/fork.py). Each case runs in its own interpreter under a timeout."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, sys, numpy as np, torch, torch.nn.functional as F
    import cgdp

    def model():
        torch.manual_seed(0)  # 2 x 300 x 256 weights: the host sums run the parallel kernels
        return torch.nn.Sequential(torch.nn.Linear(256, 300), torch.nn.Tanh(), torch.nn.Linear(300, 256))

    def one_step(_=None):
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 256, generator=g), torch.randint(0, 256, (8,), generator=g)
        with cgdp.Trainer(model(), lambda p: torch.optim.SGD(p, lr=0.1), ["cpu:0", "cpu:1"], chunks=1) as tr:
            return tr.step(x, y, F.cross_entropy)

    def host_sum(n):
        out = np.zeros(1 << 17, np.float32)
        cgdp.accumulate(out, [np.full(1 << 17, n, np.float32)] * 2)
        return float(out[0])

    class Summed(torch.utils.data.Dataset):  # a DataLoader worker that uses cgdp
        def __len__(self):
            return 4
        def __getitem__(self, i):
            return torch.tensor([host_sum(i), one_step()])

    if __name__ == "__main__":
        mine = one_step()
        print("parent", host_sum(3), flush=True)
        if sys.argv[1] == "pool":
            with mp.get_context("fork").Pool(2) as pool:
                losses = pool.map_async(one_step, range(2)).get(timeout=60)
                sums = pool.map_async(host_sum, range(2)).get(timeout=60)
            assert sums == [0.0, 2.0], sums
            assert all(abs(l - mine) <= 1e-5 * abs(mine) for l in losses), (losses, mine)
        else:
            loader = torch.utils.data.DataLoader(Summed(), batch_size=2, num_workers=2,
                                                 multiprocessing_context="fork", timeout=60)
            got = torch.cat(list(loader))
            assert got[:, 0].tolist() == [0.0, 2.0, 4.0, 6.0], got
            assert torch.allclose(got[:, 1], torch.tensor(mine), rtol=1e-5), (got, mine)
        print("children ok", flush=True)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
@pytest.mark.parametrize("children", ["pool", "dataloader"])
def test_forked_children_that_use_cgdp_finish(tmp_path, children):
    script = tmp_path / "fork_after_cgdp.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("NUMBA_THREADING_LAYER", None)
    env["NUMBA_NUM_THREADS"] = "2"  # the parent's host sums are parallel (OpenMP)
    try:
        p = subprocess.run([sys.executable, str(script), children], env=env, capture_output=True,
                           text=True, timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the forked {children} hung")
    assert p.returncode == 0 and "children ok" in p.stdout, p.stdout + p.stderr[-3000:]
