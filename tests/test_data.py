"""Datasets and the input pipeline: the bundled digits, shard directories and their errors, and a
loader whose batches depend only on (seed, epoch, position)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cgdp.data import DataError, Loader, ShardDataset, SyntheticDataset, digits, eval_batches, open_shards
from cgdp.cli.train import main


def test_digits_bundled_split():
    tr, te = digits("train"), digits("test")
    assert (len(tr), len(te)) == (1437, 360) and tr.num_classes == te.num_classes == 10
    x, y = te.batch(np.arange(len(te)))
    assert x.shape == (360, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert 0.0 <= float(x.min()) and float(x.max()) == 1.0
    assert sorted(set(y.tolist())) == list(range(10))
    xt = tr.batch(np.arange(len(tr)))[0].reshape(len(tr), -1)
    assert not (xt[:, None, :] == x.reshape(360, -1)[None]).all(-1).any(), "a test image is also in train"


def test_digits_gives_the_float_tensors_its_readme_promises():
    """cgdp/data/README.md: ``x, y = cgdp.data.digits("train").tensors()``; the raw counts stay in ``.x``."""
    ds = digits("train")
    x, y = ds.tensors()
    assert x.shape == (1437, 1, 8, 8) and x.dtype == torch.float32 and float(x.min()) == 0.0 and float(x.max()) == 1.0
    assert y.shape == (1437,) and y.dtype == torch.int64
    assert ds.x.dtype == np.uint8 and torch.equal(x, torch.from_numpy(ds.x).float() / 16)
    with pytest.raises(TypeError, match=r"not a pair of tensors: ds.tensors\(\) gives \(x, y\)"):
        x, y = ds
    readme = (Path(__file__).resolve().parent.parent / "cgdp" / "data" / "README.md").read_text()
    assert 'x, y = cgdp.data.digits("train").tensors()' in readme


def test_runtime_never_imports_sklearn():
    code = "import sys, cgdp.cli.train, cgdp.data; cgdp.data.digits('train'); print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _batches(loader, n):
    return [tuple(t.clone() for t in next(loader)) for _ in range(n)]


@pytest.mark.parametrize("prefetch", [0, 3])
def test_loader_order_depends_only_on_seed_epoch_position(prefetch):
    ds = digits("train")
    a = Loader(ds, 100, seed=7, prefetch=prefetch)
    assert a.steps_per_epoch == 14
    first = _batches(a, 20)  # crosses an epoch boundary
    assert (a.epoch, a.pos) == (1, 6)
    state = a.state_dict()
    rest = _batches(a, 10)
    a.close()
    b = Loader(ds, 100, seed=7, prefetch=3 - prefetch)
    b.load_state_dict(state)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(rest, _batches(b, 10)))
    b.close()
    c = Loader(ds, 100, seed=7, prefetch=0)
    assert all(torch.equal(p[1], q[1]) for p, q in zip(first, _batches(c, 20)))
    # each epoch is a fresh permutation that covers every sample but the dropped remainder once
    ep0 = torch.cat([y for _, y in first[:14]])
    assert len(ep0) == 1400 and not torch.equal(ep0[:100], first[14][1])
    d = Loader(ds, 100, seed=8, prefetch=0)
    assert not torch.equal(first[0][1], next(d)[1])


def test_loader_rejects_other_batch_or_seed():
    ds = digits("train")
    state = Loader(ds, 64, seed=0).state_dict()
    with pytest.raises(DataError, match="same devices, batch and seed"):
        Loader(ds, 32, seed=0).load_state_dict(state)


def test_synthetic_is_one_fixed_batch():
    ds = SyntheticDataset((3, 4, 4), 5, length=64, seed=0)
    x1, y1 = ds.batch(np.arange(16))
    x2, _ = ds.batch(np.arange(16, 32))
    assert x1.shape == (16, 3, 4, 4) and x1 is x2 and int(y1.max()) < 5


def _write_shards(d, rng, n=(30, 20), shape=(2, 3)):
    d.mkdir(parents=True, exist_ok=True)
    xs, ys = [], []
    for i, k in enumerate(n):
        x = rng.standard_normal((k, *shape)).astype(np.float32)
        y = rng.integers(0, 4, k)
        if i % 2:
            np.save(d / f"part{i}_x.npy", x)
            np.save(d / f"part{i}_y.npy", y)
        else:
            np.savez(d / f"part{i}.npz", x=x, y=y)
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


def test_shards_gather_across_files(tmp_path):
    x, y = _write_shards(tmp_path / "s", np.random.default_rng(0))
    ds = ShardDataset(tmp_path / "s")
    assert len(ds) == 50 and ds.sample_shape == (2, 3) and ds.num_classes == int(y.max()) + 1
    idx = np.array([49, 0, 31, 29, 30])
    bx, by = ds.batch(idx)
    assert np.array_equal(bx.numpy(), x[idx]) and np.array_equal(by.numpy(), y[idx])
    tr, ev = open_shards(str(tmp_path / "s"), 0.2)
    assert (len(tr), len(ev)) == (40, 10)
    seen = np.concatenate([tr.indices, ev.indices])
    assert sorted(seen.tolist()) == list(range(50))
    assert sum(len(b[1]) for b in eval_batches(ev, 3)) == 10


def test_shards_train_eval_subdirs(tmp_path):
    rng = np.random.default_rng(1)
    _write_shards(tmp_path / "train", rng)
    _write_shards(tmp_path / "eval", rng, n=(5,))
    tr, ev = open_shards(str(tmp_path), 0.2)
    assert (len(tr), len(ev)) == (50, 5)


def _bad(d, case):
    d.mkdir()
    good_x, good_y = np.zeros((4, 2, 3), np.float32), np.arange(4)
    if case == "missing_y":
        np.savez(d / "a.npz", x=good_x)
    elif case == "lengths":
        np.savez(d / "a.npz", x=good_x, y=np.arange(3))
    elif case == "shapes":
        np.savez(d / "a.npz", x=good_x, y=good_y)
        np.savez(d / "b.npz", x=np.zeros((4, 3, 3), np.float32), y=good_y)
    elif case == "float_labels":
        np.savez(d / "a.npz", x=good_x, y=good_y.astype(np.float32))
    elif case == "corrupt":
        (d / "a.npz").write_bytes(b"not a zip file at all")
    elif case == "unpaired":
        np.save(d / "a_x.npy", good_x)
    elif case == "badname":
        np.save(d / "a.npy", good_x)
    elif case == "negative":
        np.savez(d / "a.npz", x=good_x, y=-good_y - 1)
    return {"missing_y": "lacks array(s) ['y']", "lengths": "4 inputs but 3 labels",
            "shapes": "all shards must agree", "float_labels": "integer class labels",
            "corrupt": "cannot read shard a.npz", "unpaired": "a_y.npy", "badname": "come in pairs",
            "negative": "labels must be >= 0", "empty": "holds no .npz"}[case]


@pytest.mark.parametrize("case", ["missing_y", "lengths", "shapes", "float_labels", "corrupt", "unpaired",
                                  "badname", "negative", "empty"])
def test_bad_shards_say_what_is_wrong(tmp_path, case):
    words = _bad(tmp_path / "d", case)
    with pytest.raises(DataError) as e:
        ShardDataset(tmp_path / "d")
    assert words in str(e.value)


def test_bad_shard_dir_fails_before_training(tmp_path, capsys):
    words = _bad(tmp_path / "d", "shapes")
    for d, w in ((tmp_path / "d", words), (tmp_path / "missing", "does not exist")):
        rc = main(["--dataset", "shards", "--shards", str(d), "--progress", "off"])
        err = capsys.readouterr().err
        assert rc == 2 and w in err and "Traceback" not in err


def test_train_on_shards(tmp_path, capsys):
    rng = np.random.default_rng(0)
    d = tmp_path / "s"
    d.mkdir()
    for i in range(3):  # linearly separable 2-class data, uint8 'images' of shape (1, 4, 4)
        y = rng.integers(0, 2, 64)
        x = (rng.integers(0, 100, (64, 1, 4, 4)) + 150 * y[:, None, None, None]).astype(np.uint8)
        np.savez(d / f"shard{i}.npz", x=x, y=y)
    rc = main(["--dataset", "shards", "--shards", str(d), "--model", "mlp", "--steps", "40", "--batch", "16",
               "--chunks", "1", "--progress", "off", "--plots", "false"])
    out = capsys.readouterr().out
    assert rc == 0 and "eval accuracy" in out
    acc = float(out.rsplit("eval accuracy", 1)[1].split()[0])
    assert acc >= 0.9
