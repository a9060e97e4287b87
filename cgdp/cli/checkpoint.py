"""Checkpoints: everything a run needs to continue bit for bit, written atomically.

A checkpoint is one ``torch.save`` file holding the trainer's state (model, optimizer, step, chunk
plan, tuner), the random states (torch CPU and CUDA, NumPy, Python), the data loader's position
and the resolved config. Invariant: the file at ``path`` is always a complete checkpoint, the old
one or the new one. :func:`save` writes a temporary file in the same directory, flushes and fsyncs
it, then ``os.replace``\\ s it over ``path`` (atomic on POSIX and Windows within one file system)
and fsyncs the directory so the rename itself survives a power cut. A crash at any point leaves
the previous checkpoint loadable and at worst a stray ``.tmp`` file, which the next save removes.
"""
from __future__ import annotations

import os
import pathlib
import random
import tempfile
from typing import Any

import numpy as np
import torch

TMP_PREFIX = ".checkpoint-"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or does not fit this run; the message says what to do."""


def _fsync_dir(d: pathlib.Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # directories cannot be opened on some platforms (Windows): nothing to sync
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``state`` to ``path`` atomically (see the module docstring)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f"{TMP_PREFIX}{path.name}.*.tmp"):  # left by a crashed save
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a checkpoint is an ordinary result file
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the rename makes it visible
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def load(path: str | os.PathLike) -> dict[str, Any]:
    path = pathlib.Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; run once with --out {path.parent} "
                              f"(checkpoints are written there), or pass --resume PATH")
    try:
        # weights_only=False: the checkpoint holds RNG states and Python objects we wrote ourselves
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); it is not "
                              f"a cgdp checkpoint or it is damaged") from None


def rng_state() -> dict[str, Any]:
    """Every global random state a training step can touch."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
