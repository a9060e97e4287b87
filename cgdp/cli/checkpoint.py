"""Checkpoints: everything a run needs to continue bit for bit, written atomically, checked on load.

A checkpoint holds the trainer's state (model, optimizer, step, chunk plan, tuner), the random
states (torch CPU and CUDA, NumPy, Python), the data loader's position and the resolved config,
all as tensors and plain Python data (:func:`rng_state` converts NumPy's state).

File format: a header line ``CGDP-CHECKPOINT 3``, a line with the SHA-256 of everything after it,
a line of JSON (the checkpoint's step, readable without loading the rest: :func:`peek`), then the
payload, a ``torch.save`` file. :func:`load` reads it back with ``torch.load(weights_only=True)``,
so a checkpoint can never run code (a crafted pickle is refused, not executed), and checks the
SHA-256 first, so a flipped bit or a truncated file is a :class:`CheckpointError`, never a
silently different model. The checksum protects against damage only (anyone can compute one):
whether the content fits the run is checked before anything is changed
(:mod:`cgdp.cli.resume`).

Invariant: the file at ``path`` is always a complete checkpoint, the old one or the new one.
:func:`save` writes a temporary file in the same directory, flushes and fsyncs it, then
``os.replace``\\ s it over ``path`` (atomic on POSIX and Windows within one file system) and fsyncs
the directory so the rename itself survives a power cut. A crash, a full disk or Ctrl-C at any
point leaves the previous checkpoint loadable and at worst a stray ``.tmp`` file, which the next
save removes.
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pathlib
import pickle
import random
import tempfile
from typing import Any

import numpy as np
import torch

TMP_PREFIX = ".checkpoint-"
MAGIC = b"CGDP-CHECKPOINT 3\n"
OLD_MAGIC = b"CGDP-CHECKPOINT 2\n"
_DIGEST_LINE = 64 + 1  # hex SHA-256 and a newline


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


def encode(payload: bytes | memoryview, meta: dict[str, Any]) -> bytes:
    """The header of a checkpoint file whose payload is ``payload`` (the bytes that follow it)."""
    line = json.dumps(meta, sort_keys=True).encode() + b"\n"
    digest = hashlib.sha256(line)
    digest.update(payload)
    return MAGIC + digest.hexdigest().encode() + b"\n" + line


def split(data: bytes) -> tuple[bytes, bytes, memoryview]:
    """``(digest, meta line, payload)`` of a file's bytes that start with :data:`MAGIC` (unchecked)."""
    head = len(MAGIC) + _DIGEST_LINE
    end = data.find(b"\n", head, head + 4096)
    end = head if end < 0 else end + 1
    return data[len(MAGIC):head - 1], data[head:end], memoryview(data)[end:]


def peek(path: str | os.PathLike) -> dict[str, Any] | None:
    """The meta line of the checkpoint at ``path`` (``{"step": N}``) without reading the rest,
    or None if there is no readable checkpoint there."""
    try:
        with open(path, "rb") as f:
            data = f.read(len(MAGIC) + _DIGEST_LINE + 4096)
    except OSError:
        return None
    if not data.startswith(MAGIC):
        return None
    try:
        meta = json.loads(split(data)[1])
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def save(state: dict[str, Any], path: str | os.PathLike, meta: dict[str, Any] | None = None) -> None:
    """Write ``state`` to ``path`` atomically (see the module docstring); ``meta`` (plain JSON)
    goes in the header line that :func:`peek` reads. ``CheckpointError`` if the disk is full or
    not writable (the previous checkpoint is then untouched)."""
    path = pathlib.Path(path)
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    try:
        write_atomically(path, (encode(payload, meta or {}), payload))
    except OSError as e:
        raise _write_error(e, path) from None


def save_model(model: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write a model's ``state_dict`` to ``path`` as a plain ``torch.save`` file (tensors on the
    CPU), which ``torch.load(path, weights_only=True)`` reads: the trained model where PyTorch
    users look for it. Atomic as :func:`save`; ``OSError`` if it cannot be written."""
    plain = type(model)((k, v.detach().cpu()) for k, v in model.items())
    if hasattr(model, "_metadata"):  # load_state_dict's per-module versions, as torch keeps them
        plain._metadata = model._metadata
    buf = io.BytesIO()
    torch.save(plain, buf)
    write_atomically(pathlib.Path(path), (buf.getbuffer(),))


def write_atomically(path: pathlib.Path, parts: tuple[bytes | memoryview, ...]) -> None:
    """Replace ``path`` with the concatenated ``parts``: a temporary file in the same directory,
    fsynced, renamed over ``path``, the directory fsynced. ``OSError`` leaves ``path`` as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f"{TMP_PREFIX}{path.name}.*.tmp"):  # left by a crashed save
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a checkpoint is an ordinary result file
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the rename makes it visible
        os.replace(tmp, path)
    except BaseException:  # also Ctrl-C: the old file stays, the partial one goes
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _write_error(e: OSError, path: pathlib.Path) -> CheckpointError:
    kept = "the previous checkpoint there is intact" if path.exists() else "no checkpoint was written"
    again = "run again with --resume" if path.exists() else "start the run again (with --overwrite)"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = f"the disk is full (no space left on the device of {path.parent})"
        fix = f"free some space (or use another --out) and {again}"
    else:
        what = f"{e.strerror or e}"
        fix = f"check that the directory is writable and {again}"
    return CheckpointError(f"cannot save checkpoint {path}: {what}; {kept}. To continue, {fix}")


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save`, verifying its SHA-256; never runs pickled code."""
    return load_with_meta(path)[0]


def read(path: str | os.PathLike) -> dict[str, Any]:
    """``cgdp.load_checkpoint``: the checkpoint a ``cgdp.train --out DIR`` run wrote (``path`` is the
    file or ``DIR``), checked as :func:`load` does. The dict holds what the run saved (``"trainer"``,
    ``"rng"``, ``"loader"``, ``"config"``, ``"job"``) and, lifted from ``"trainer"``, ``"model"`` (the
    model's ``state_dict``), ``"optimizer"`` (replica 0's optimizer ``state_dict``) and ``"step"``."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "checkpoint.pt"
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError:
        head = MAGIC  # load() says what is wrong
    if not head.startswith(MAGIC) and not head.startswith(OLD_MAGIC) and head[:2] == b"PK":
        raise CheckpointError(f"{path} is a plain torch file, not a cgdp checkpoint (OUT/model.pt, the trained "
                              f"model, is one): read it with torch.load(path, weights_only=True)")
    state = load(path)
    trainer = state.get("trainer")
    if not isinstance(trainer, dict) or "model" not in trainer:
        raise CheckpointError(f"{path} is a cgdp checkpoint without a trainer's state (not written by "
                              f"python -m cgdp.train); read it with cgdp.cli.checkpoint.load")
    return {**state, "model": trainer["model"], "optimizer": trainer.get("optimizer"), "step": trainer.get("step")}


def load_with_meta(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`load`, and the header's meta line (``{}`` if it is not a JSON object)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; run once with --out {path.parent} "
                              f"(checkpoints are written there), or pass --resume PATH")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror}") from None
    if data.startswith(OLD_MAGIC):
        raise CheckpointError(f"{path} was written by an older cgdp (checkpoint format 2), which this version "
                              f"cannot resume; start the run again (with --overwrite)")
    if not data.startswith(MAGIC):
        kind = "a torch file, but not one written by cgdp.train" if data[:2] == b"PK" or data[:1] == b"\x80" \
            else "not a cgdp checkpoint"
        raise CheckpointError(f"{path} cannot be read as a checkpoint: it is {kind} (or one from an older "
                              f"cgdp). Pass the checkpoint.pt of a cgdp.train run, or start without --resume")
    digest, line, payload = split(data)
    check = hashlib.sha256(line)
    check.update(payload)
    if check.hexdigest().encode() != digest:
        raise CheckpointError(f"checkpoint {path} is damaged: its SHA-256 checksum does not match its "
                              f"contents (a truncated copy, a flipped bit on disk). Use an intact copy, or "
                              f"start again without --resume")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} holds Python objects other than tensors and plain data "
                              f"({first[:200]}); it was not written by cgdp.train and is not loaded, "
                              f"because loading it could run code") from None
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); it is not "
                              f"a cgdp checkpoint or it is damaged") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not a cgdp checkpoint")
    try:
        meta = json.loads(line)
    except ValueError:
        meta = None
    return state, meta if isinstance(meta, dict) else {}


def rng_state() -> dict[str, Any]:
    """Every global random state a training step can touch, as tensors and plain data."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos),
                                       int(has_gauss), float(gauss)),
                             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
