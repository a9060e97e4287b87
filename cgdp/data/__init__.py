"""Datasets and the input pipeline of ``python -m cgdp.train``.

Three sources, one interface (``len(ds)``, ``ds.sample_shape``, ``ds.num_classes``,
``ds.batch(indices) -> (x float32, y int64)``):

* :func:`digits` — the bundled UCI optical digits (``digits.npz`` next to this file, 1797 8x8
  images, fixed 1437/360 train/test split); no network, no scikit-learn at run time.
* :class:`SyntheticDataset` — one fixed random global batch, returned for every step: for
  throughput runs of the paper's networks, where the input pipeline must cost nothing.
* :class:`ShardDataset` — a directory of ``.npz`` (arrays ``x`` and ``y``) or ``<name>_x.npy`` /
  ``<name>_y.npy`` shards, for users' own data; every shard is checked when it is opened, before
  any training starts (:class:`DataError` says which file is wrong and how).

:class:`Loader` turns a dataset into an endless stream of global batches. Invariants: the order of
samples depends only on ``(seed, epoch)`` (a fresh permutation per epoch, incomplete last batch
dropped), so the loader's whole state is ``(epoch, position)`` and a resumed run sees exactly the
batches an uninterrupted one would. A background thread prepares up to ``prefetch`` batches ahead
(pinned when the devices are CUDA, so host-to-device copies are asynchronous); the consumer's
position, not the thread's, is what a checkpoint records.

May import: nothing of cgdp outside this package (the command line imports it).
"""
from __future__ import annotations

import pathlib
import queue
import threading
from typing import Iterator

import numpy as np
import torch

DIGITS_PATH = pathlib.Path(__file__).with_name("digits.npz")


class DataError(ValueError):
    """A dataset cannot be used; the message says what is wrong and what to do."""


class ArrayDataset:
    """Samples held in NumPy arrays (or memory maps): ``x`` is (N, ...), ``y`` is (N,) integers,
    both as stored (``x`` times ``scale`` is the input); :meth:`batch` and :meth:`tensors` give
    float32 inputs and int64 labels."""

    def __init__(self, x: np.ndarray, y: np.ndarray, scale: float = 1.0, num_classes: int | None = None):
        if len(x) != len(y):
            raise DataError(f"{len(x)} inputs but {len(y)} labels; they must match one to one")
        self.x, self.y, self.scale = x, y, scale
        self.sample_shape = tuple(x.shape[1:])
        self.num_classes = int(num_classes if num_classes is not None else (int(y.max()) + 1 if len(y) else 0))

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.from_numpy(np.ascontiguousarray(self.x[indices])).to(torch.float32)
        if self.scale != 1.0:
            x.mul_(self.scale)
        return x, torch.from_numpy(np.asarray(self.y[indices], dtype=np.int64))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sample at once: ``(x float32, y int64)``, as :meth:`batch` gives them."""
        return self.batch(np.arange(len(self)))

    def __iter__(self):
        # ``x, y = digits("train")`` would otherwise fail with "cannot unpack non-iterable"
        raise TypeError(f"an {type(self).__name__} is not a pair of tensors: ds.tensors() gives (x, y) "
                        f"for every sample, ds.batch(indices) for some")


def digits(split: str) -> ArrayDataset:
    """The bundled handwritten digits, ``split`` = ``"train"`` (1437) or ``"test"`` (360).

    ``.x`` holds the raw pixel counts (uint8 0..16, shape (N, 1, 8, 8)) and ``.y`` the labels 0..9;
    ``.tensors()`` (or ``.batch(indices)``) gives the images as float32 in [0, 1] (the counts divided
    by 16, ``.scale``) and the labels as int64: ``x, y = digits("train").tensors()``.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    with np.load(DIGITS_PATH) as f:
        x, y = f[f"x_{split}"], f[f"y_{split}"]
    return ArrayDataset(x[:, None], y, scale=1.0 / 16.0, num_classes=10)


class SyntheticDataset:
    """Random inputs of a model's shape: one fixed global batch, for throughput runs.

    ``batch`` returns the same pre-generated tensors for every request of the pool's size, so the
    pipeline costs nothing; the labels are random, and accuracy on it means nothing.
    """

    def __init__(self, sample_shape: tuple[int, ...], num_classes: int, length: int, seed: int = 0):
        self.sample_shape, self.num_classes, self.length = tuple(sample_shape), num_classes, length
        self.seed = seed
        self._pool: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return self.length

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(indices)
        if n not in self._pool:
            g = torch.Generator().manual_seed(self.seed)
            self._pool[n] = (torch.randn((n, *self.sample_shape), generator=g),
                             torch.randint(0, self.num_classes, (n,), generator=g))
        return self._pool[n]


class Subset:
    """The samples of ``base`` at ``indices`` (a fixed hold-out split)."""

    def __init__(self, base, indices: np.ndarray):
        self.base, self.indices = base, np.asarray(indices)
        self.sample_shape, self.num_classes = base.sample_shape, base.num_classes

    def __len__(self) -> int:
        return len(self.indices)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.batch(self.indices[indices])


class ShardDataset:
    """A directory of shards: ``*.npz`` with arrays ``x`` and ``y``, or ``<name>_x.npy`` + ``<name>_y.npy``.

    All shards must have the same sample shape; labels are non-negative integers, 1-D, one per
    sample. ``uint8`` inputs are scaled to [0, 1]; float inputs are used as stored. ``.npy`` shards
    are memory-mapped (only the batches read are paged in); ``.npz`` shards are loaded once.
    """

    def __init__(self, directory: str | pathlib.Path):
        d = pathlib.Path(directory)
        fix = ("Put .npz files holding arrays 'x' (N, ...) and 'y' (N,) there, or pairs "
               "NAME_x.npy / NAME_y.npy")
        if not d.exists():
            raise DataError(f"dataset directory {str(d)!r} does not exist. {fix}")
        if not d.is_dir():
            raise DataError(f"dataset path {str(d)!r} is a file, not a directory of shards. {fix}")
        shards = self._find(d)
        if not shards:
            raise DataError(f"dataset directory {str(d)!r} holds no .npz or NAME_x.npy/NAME_y.npy shards. {fix}")
        self.shards: list[tuple[str, np.ndarray, np.ndarray]] = []
        shape = dtype = None
        for name, x, y in shards:
            if x.ndim < 2:
                raise DataError(f"shard {name}: x has shape {x.shape}; it must be (samples, ...) with at "
                                f"least one sample dimension")
            if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
                raise DataError(f"shard {name}: y must be a 1-D array of integer class labels, got "
                                f"shape {y.shape} dtype {y.dtype}")
            if len(x) != len(y):
                raise DataError(f"shard {name}: {len(x)} inputs but {len(y)} labels; they must match")
            if len(y) == 0:
                raise DataError(f"shard {name} is empty; remove it")
            if not (np.issubdtype(x.dtype, np.floating) or x.dtype == np.uint8):
                raise DataError(f"shard {name}: x has dtype {x.dtype}; use float32 (or uint8 images)")
            if y.min() < 0:
                raise DataError(f"shard {name}: labels must be >= 0, found {int(y.min())}")
            if shape is None:
                shape, dtype, first = x.shape[1:], x.dtype, name
            elif x.shape[1:] != shape or x.dtype != dtype:
                raise DataError(f"shard {name} has samples of shape {x.shape[1:]} {x.dtype}, but shard "
                                f"{first} has {shape} {dtype}; all shards must agree")
            self.shards.append((name, x, y))
        self.sample_shape = tuple(shape)
        self.scale = 1.0 / 255.0 if dtype == np.uint8 else 1.0
        self.num_classes = max(int(y.max()) for _, _, y in self.shards) + 1
        self._ends = np.cumsum([len(y) for _, _, y in self.shards])

    @staticmethod
    def _load(path: pathlib.Path, **kw) -> np.ndarray:
        try:
            return np.load(path, allow_pickle=False, **kw)
        except Exception as e:  # numpy raises several types for damaged files
            raise DataError(f"cannot read shard {path.name}: {e}. Write it with np.save / np.savez") from None

    def _find(self, d: pathlib.Path) -> list[tuple[str, np.ndarray, np.ndarray]]:
        out = []
        for p in sorted(d.glob("*.npz")):
            f = self._load(p)
            missing = [k for k in ("x", "y") if k not in f.files]
            if missing:
                raise DataError(f"shard {p.name} lacks array(s) {missing} (it has {f.files}); save it "
                                f"with np.savez(path, x=inputs, y=labels)")
            try:
                out.append((p.name, f["x"], f["y"]))
            except ValueError as e:  # object arrays (pickles) are refused: loading them runs code
                raise DataError(f"shard {p.name} cannot be read: {e}. Shards hold numeric arrays only; "
                                f"save x as float32 (or uint8) and y as integer labels") from None
        for p in sorted(d.glob("*.npy")):
            stem = p.name[:-4]
            if stem.endswith("_y"):
                if not (d / f"{stem[:-2]}_x.npy").exists():
                    raise DataError(f"shard {p.name} has no matching {stem[:-2]}_x.npy")
                continue
            if not stem.endswith("_x"):
                raise DataError(f"{p.name}: .npy shards come in pairs named NAME_x.npy and NAME_y.npy")
            py = d / f"{stem[:-2]}_y.npy"
            if not py.exists():
                raise DataError(f"shard {p.name} has no matching labels file {py.name}")
            out.append((p.name, self._load(p, mmap_mode="r"), self._load(py, mmap_mode="r")))
        return out

    def __len__(self) -> int:
        return int(self._ends[-1])

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        indices = np.asarray(indices)
        shard = np.searchsorted(self._ends, indices, side="right")
        starts = np.concatenate([[0], self._ends[:-1]])
        xs = np.empty((len(indices), *self.sample_shape), dtype=np.float32)
        ys = np.empty(len(indices), dtype=np.int64)
        for s in np.unique(shard):  # one fancy-index read per shard touched
            sel = np.nonzero(shard == s)[0]
            _, x, y = self.shards[s]
            local = indices[sel] - starts[s]
            xs[sel], ys[sel] = x[local], y[local]
        x = torch.from_numpy(xs)
        if self.scale != 1.0:
            x.mul_(self.scale)
        return x, torch.from_numpy(ys)


def open_shards(directory: str, eval_fraction: float) -> tuple[object, object]:
    """``(train, eval)`` from a shard directory: its ``train/`` and ``eval/`` subdirectories when both
    exist, else a fixed hold-out of ``eval_fraction`` of the samples (seed-0 permutation)."""
    d = pathlib.Path(directory)
    if (d / "train").is_dir() and (d / "eval").is_dir():
        train, ev = ShardDataset(d / "train"), ShardDataset(d / "eval")
        if ev.sample_shape != train.sample_shape:
            raise DataError(f"eval shards have samples of shape {ev.sample_shape} but train shards "
                            f"{train.sample_shape}; they must agree")
        ev.num_classes = train.num_classes = max(train.num_classes, ev.num_classes)
        return train, ev
    full = ShardDataset(d)
    n_eval = int(round(len(full) * eval_fraction))
    if n_eval >= len(full):
        raise DataError(f"eval_fraction {eval_fraction} leaves no training samples out of {len(full)}")
    order = np.random.default_rng(0).permutation(len(full))
    return Subset(full, order[: len(full) - n_eval]), Subset(full, order[len(full) - n_eval:])


class Loader:
    """Endless global batches of ``batch_size`` samples from ``dataset``; see the module docstring."""

    def __init__(self, dataset, batch_size: int, seed: int, *, prefetch: int = 2, pin: bool = False,
                 shuffle: bool = True):
        if batch_size > len(dataset):
            raise DataError(f"the global batch ({batch_size} samples) is larger than the dataset "
                            f"({len(dataset)} samples); use a smaller --batch or fewer devices")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.prefetch, self.pin, self.shuffle = prefetch, pin, shuffle
        self.steps_per_epoch = len(dataset) // batch_size
        self.epoch, self.pos = 0, 0
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._gen: Iterator | None = None
        self._stop = threading.Event()

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        # seeds are taken modulo 2**64, as torch.manual_seed does (so --seed -1 works)
        return np.random.default_rng([self.seed % 2**64, epoch]).permutation(len(self.dataset))

    def _produce(self, epoch: int, pos: int) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        while True:
            order = self.order(epoch)
            while pos < self.steps_per_epoch:
                x, y = self.dataset.batch(order[pos * self.batch_size:(pos + 1) * self.batch_size])
                if self.pin:
                    x, y = x.pin_memory(), y.pin_memory()  # lets the H2D copies run asynchronously
                pos += 1
                yield (epoch, pos, x, y) if pos < self.steps_per_epoch else (epoch + 1, 0, x, y)
            epoch, pos = epoch + 1, 0

    def _worker(self, q: queue.Queue, stop: threading.Event, epoch: int, pos: int) -> None:
        try:
            for item in self._produce(epoch, pos):
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as e:  # handed to the consumer, which re-raises it
            q.put(e)

    def __iter__(self) -> "Loader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prefetch <= 0:
            if self._gen is None:
                self._gen = self._produce(self.epoch, self.pos)
            self.epoch, self.pos, x, y = next(self._gen)
            return x, y
        if self._thread is None:
            self._stop = threading.Event()
            self._queue = queue.Queue(maxsize=self.prefetch)
            self._thread = threading.Thread(target=self._worker, name="cgdp-loader", daemon=True,
                                            args=(self._queue, self._stop, self.epoch, self.pos))
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        self.epoch, self.pos, x, y = item
        return x, y

    def state_dict(self) -> dict:
        """The position of the next batch this loader will return (not of the prefetch thread)."""
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "batch_size": self.batch_size}

    def load_state_dict(self, sd: dict) -> None:
        if sd["batch_size"] != self.batch_size or sd["seed"] != self.seed:
            raise DataError(f"the checkpoint's data loader used global batch {sd['batch_size']} and seed "
                            f"{sd['seed']}, this run {self.batch_size} and {self.seed}; resume with the "
                            f"same devices, batch and seed")
        self.close()
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self._thread, self._queue, self._gen = None, None, None


def eval_batches(dataset, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Every sample of ``dataset`` once, in order, the last batch possibly smaller."""
    n = len(dataset)
    for start in range(0, n, batch_size):
        yield dataset.batch(np.arange(start, min(start + batch_size, n)))
