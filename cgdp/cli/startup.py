"""Start-up checks of ``python -m cgdp.train`` that look at the data or at other ranks (MPI or gloo).

MPI start-up contract: when a launcher starts several ranks, MPI is initialised *first*, before
the command line is even parsed (:func:`early_world`). Every rank then checks its own job, and
:func:`agree` gathers every rank's verdict and the job's fingerprint (:func:`fingerprint`): the
settings that must be equal on every rank and a digest of the training data. If any rank found a
user error, or the ranks differ, every rank exits together with code 2 and rank 0 names the rank
and the difference. So one rank's typo never leaves the others waiting in ``MPI_Init`` or in the
trainer's first collective.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Any, Iterator

import numpy as np
import torch

LAUNCHER_SIZE = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
MEMORY_SHARE = 0.5
"""A global batch of inputs may take at most this share of the machine's memory."""


def launched_ranks() -> int:
    """How many ranks the MPI launcher started (1 when not started by one)."""
    sizes = []
    for k in LAUNCHER_SIZE:
        try:
            sizes.append(int(os.environ.get(k, "1") or 1))
        except ValueError:
            pass
    return max(sizes, default=1)


def resolve_comm(spec: str) -> str:
    """``train.comm`` resolved: ``auto`` is ``mpi`` when an MPI launcher started several ranks,
    ``gloo`` when torchrun (or ``RANK``/``WORLD_SIZE``) did, else ``none``."""
    if spec != "auto":
        return spec
    if launched_ranks() > 1:
        return "mpi"
    try:
        if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and "RANK" in os.environ:
            return "gloo"
    except ValueError:
        pass
    return "none"


def early_world(argv: list[str]) -> Any:
    """The ranks' world if a launcher started several and a comm is wanted, else None:
    ``MPI.COMM_WORLD``, or for gloo :class:`cgdp.comm.gloo.ObjectWorld` (the process group made
    from torchrun's environment)."""
    spec = resolve_comm(_flag(argv, "comm", "auto"))
    if spec == "gloo":
        from cgdp.comm.gloo import ObjectWorld
        from cgdp.cli.config import ConfigError, parse_args
        try:  # the rendezvous waits no longer than a step may (flags, --config file or preset)
            timeout = parse_args(argv)[0].train.timeout_s
        except ConfigError as e:  # the same on every rank (the same command): said before any wait
            raise ValueError(str(e)) from None
        return ObjectWorld(timeout)
    if spec != "mpi" or launched_ranks() <= 1:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None  # prepare() says that mpi4py is needed
    return MPI.COMM_WORLD


def fingerprint(cfg: Any, devices: list[str], train_set: Any, total_steps: int) -> dict[str, Any]:
    """What must be the same on every rank: the settings that shape the run, and the data."""
    d = cfg.to_dict()
    fp: dict[str, Any] = {f"model.{k}": v for k, v in d["model"].items()}
    fp.update({f"train.{k}": v for k, v in d["train"].items() if k not in ("devices", "timeout_s", "comm")})
    fp.update({f"data.{k}": v for k, v in d["data"].items() if k not in ("shards", "prefetch")})
    fp.update({"devices per rank": len(devices), "training steps": total_steps,
               "training data": dataset_digest(train_set)})
    return fp


def dataset_digest(ds: Any, samples: int = 64) -> str:
    """A digest of a dataset: its size, sample shape, classes and 64 samples spread over it."""
    h = hashlib.sha256(repr((len(ds), tuple(ds.sample_shape), ds.num_classes)).encode())
    n = len(ds)
    if n:
        x, y = ds.batch(np.unique(np.linspace(0, n - 1, min(samples, n)).astype(np.int64)))
        h.update(x.numpy().tobytes())
        h.update(y.numpy().tobytes())
    return f"{n} samples, sha256 {h.hexdigest()[:16]}"


def agree(world: Any, error: str | None, fp: dict[str, Any] | None) -> str | None:
    """Gather every rank's error and fingerprint; the message every rank exits with, or None."""
    views = world.allgather((error, fp))  # note: every rank waits here for every other
    errors = [f"rank {r} of {len(views)}: {e}" for r, (e, _) in enumerate(views) if e]
    if errors:
        return "; ".join(errors)
    base = views[0][1]
    for r, (_, other) in enumerate(views[1:], start=1):
        diff = [k for k in base if base[k] != other.get(k)]
        if diff:
            k = diff[0]
            return (f"the ranks disagree: rank 0 has {k} = {base[k]!r}, rank {r} has {other.get(k)!r}"
                    f"{f' (and {len(diff) - 1} more)' if len(diff) > 1 else ''}; every rank must run the "
                    f"same command on the same data")
    return None


def check_labels(train_set: Any, num_classes: int, given: bool) -> str | None:
    """Why the labels do not fit ``num_classes`` (None if they do). Shards infer classes from the
    largest label: a stray huge label would silently build a huge output layer."""
    ys = _labels(train_set)
    if ys is None or not len(ys):
        return None
    top = int(max(int(y.max()) for y in ys))
    if top >= num_classes:
        return (f"the data has labels up to {top}, but the model has {num_classes} classes; labels must be "
                f"0..{num_classes - 1}: fix the labels, or pass --num_classes {top + 1} (or 0)")
    if given:
        return None
    distinct = len(np.unique(np.concatenate([np.unique(np.asarray(y)) for y in ys])))
    if num_classes > 1000 and distinct < num_classes / 2:
        return (f"the labels go up to {top} but only {distinct} distinct labels occur: a {num_classes}-class "
                f"output layer would be built. Labels must be 0..C-1; fix them, or pass --num_classes "
                f"{num_classes} if that many classes is really meant")
    return None


def _labels(ds: Any) -> list[np.ndarray] | None:
    base = getattr(ds, "base", ds)
    shards = getattr(base, "shards", None)
    if shards is None:
        return None
    return [np.asarray(y) for _, _, y in shards]


def check_batch_memory(global_batch: int, sample_shape: tuple[int, ...], what: str) -> str | None:
    """Why one global batch of inputs cannot fit in memory (None if it can)."""
    need = global_batch * int(np.prod(sample_shape, dtype=np.float64)) * 4.0
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on every platform
        return None
    if need > MEMORY_SHARE * have:
        return (f"one global batch ({global_batch} samples of {what}, shape {tuple(sample_shape)}) needs "
                f"{need / 2**30:.1f} GiB, more than half of this machine's {have / 2**30:.1f} GiB; lower --batch")
    return None


@contextlib.contextmanager
def intra_op_threads(devices: list[str]) -> Iterator[int]:
    """torch's intra-op threads for the run: on CPU-emulated devices, the usable cores shared among
    the device threads (at least one each), as each DDP process gets under torchrun and as the
    benchmarks run; torch's default (every core for every device thread) makes the device threads'
    pools fight over the same cores. ``OMP_NUM_THREADS``, when set, is the user's choice and kept;
    so are GPUs. The previous setting comes back at the end. Yields the count in use."""
    before = torch.get_num_threads()
    if devices[0].startswith("cuda") or os.environ.get("OMP_NUM_THREADS"):
        yield before
        return
    from cgdp.engine.core.threads import threads_per_device
    torch.set_num_threads(threads_per_device(len(devices)))  # (the device threads choose the same)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def _flag(argv: list[str], name: str, default: str) -> str:
    """``--name`` (or ``--train.name``) as given on the command line, before it is parsed; the last one counts."""
    value = default
    for i, tok in enumerate(argv):
        if tok.split("=")[0] in (f"--{name}", f"--train.{name}"):
            value = tok.split("=", 1)[1] if "=" in tok else (argv[i + 1] if i + 1 < len(argv) else default)
    return value
