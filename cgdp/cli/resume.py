"""Resuming a run: a checkpoint is checked against the run in full before anything changes.

A checkpoint's SHA-256 proves only that the file is what some writer wrote: anyone can compute
one. Its content may still not fit this run: a model changed since the save, optimizer state of
another shape, a key missing or added, a dtype that cannot be cast without loss, random or
loader state of the wrong form, a step counter that disagrees with the loader's position, or a
file crafted to break the resume. :func:`check` looks at every part of it against the resolved
job, before the first file is written and before the trainer, the loader or the random
generators change, and raises :class:`~cgdp.cli.checkpoint.CheckpointError` with one line saying
what does not fit (``python -m cgdp.train`` exits with 2). A checkpoint that passes resumes bit
for bit (``tests/test_checkpoint_fuzz.py`` holds this to over 200 crafted files).

What a checkpoint of ``python -m cgdp.train`` holds (and nothing else):

* ``trainer``: ``Trainer.state_dict()``, checked by :func:`cgdp.engine.trainer.state.check_state`
  against this job's model and a fresh optimizer and tuner, then against the run: every
  parameter has the optimizer state a step leaves, whose ``step`` counts the trainer's steps; the
  hyperparameters are the config's (the learning rate the schedule gave the last step); one
  generator state per device; no scheduler; a tuner state exactly when this run tunes; finite
  weights and state.
* ``rng``: torch, NumPy and Python generator states, each tried on a fresh generator.
* ``loader``: ``{epoch, pos, seed, batch_size}``; ``epoch * steps_per_epoch + pos`` equals the
  trainer's step (one global batch per step).
* ``config``: the resolved config, valid as a whole.
* ``job``: what the config resolved to on the machine that wrote it (devices, mode, MPI ranks,
  global batch, a digest of the training data, the run's length in steps): a resume on other
  devices or other data is refused, and a config edited in one place is caught by the other.
"""
from __future__ import annotations

import math
import pathlib
import random
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from cgdp.cli.checkpoint import CheckpointError
from cgdp.cli.config import Config, ConfigError
from cgdp.engine.trainer.state import check_state, generator_state_ok, probe_state

TOP = {"trainer", "rng", "loader", "config", "job"}
TRAINER = {"model", "optimizer", "step", "plan", "device_rng", "tuner", "scheduler"}
LOADER = {"epoch", "pos", "seed", "batch_size"}


def job_record(devices: list[str], mode: str, ranks: int, global_batch: int, data: str,
               steps: int) -> dict[str, Any]:
    """The ``job`` part of a checkpoint: what this run resolved to (``steps``: its length, which a
    resumed run may change; the rest must stay)."""
    return {"devices": list(devices), "mode": mode, "ranks": ranks, "global_batch": global_batch, "data": data,
            "steps": steps}


def check(ck: dict[str, Any], meta: dict[str, Any], path: pathlib.Path, cfg: Config, saved_cfg: Config,
          job: dict[str, Any], model: nn.Module, optimizer: Callable[..., torch.optim.Optimizer],
          tuner: Any, num_layers: int, steps_per_epoch: int, saved_total: int,
          lr_at: Callable[[Any, int, int], float]) -> None:
    """Raise :class:`CheckpointError` unless ``ck`` resumes this job bit for bit (module docstring).

    ``saved_cfg``: the checkpoint's config, already read (:func:`saved_config`); ``job``: this
    run's :func:`job_record`; ``model`` and ``optimizer``: this run's model (not yet trained) and
    optimizer factory; ``tuner``: a fresh tuner if this run tunes its plan, else None;
    ``saved_total``: the steps of the run that wrote the checkpoint."""
    def no(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path} does not fit this run: {why}. Resume from the checkpoint "
                               f"this run wrote, or start again without --resume")
    _exact_keys(ck, TOP, "it", no)
    _check_job(ck["job"], {**job, "steps": saved_total}, no)
    tr = ck["trainer"]
    _exact_keys(tr, TRAINER, "its trainer state", no)
    step = tr["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise no(f"its step is {step!r}, not a count of steps")
    if meta.get("step") != step:
        raise no(f"its header says step {meta.get('step')!r} but its trainer state step {step}")
    opt = optimizer(model.parameters())
    try:
        check_state(tr, model, opt, num_layers, tuner)
    except ValueError as e:
        raise no(str(e).rstrip(".")) from None
    _check_against_run(tr, step, model, opt, saved_cfg, saved_total, job, tuner, lr_at, no)
    _check_loader(ck["loader"], step, cfg, job, steps_per_epoch, no)
    _check_rng(ck["rng"], no)


def saved_config(ck: dict[str, Any], path: pathlib.Path) -> Config:
    """The checkpoint's config, valid in every section (``CheckpointError`` if not)."""
    if not isinstance(ck, Mapping) or not isinstance(ck.get("config"), Mapping):
        raise CheckpointError(f"{path} is not a cgdp.train checkpoint (it holds no config); pass the "
                              f"checkpoint.pt of a cgdp.train run")
    saved = ck["config"]
    try:
        cfg = Config.from_dict(dict(saved), origin="the checkpoint's config")
        full = cfg.to_dict()  # cgdp.train saves every field of every section
        missing = [f"{sec}.{k}" for sec in full for k in full[sec] if k not in saved.get(sec, {})]
        if missing:
            raise ConfigError(f"it lacks {', '.join(missing[:4])}")
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path} holds a config that is not valid ({e}); it was not "
                              f"written by this cgdp.train, or it was edited") from None
    return cfg


def _exact_keys(d: Any, keys: set[str], what: str, no: Callable[[str], CheckpointError]) -> None:
    if not isinstance(d, Mapping):
        raise no(f"{what} is a {type(d).__name__}, not a dict")
    if set(d) != keys:
        missing, extra = sorted(keys - set(d)), sorted(map(str, set(d) - keys))
        raise no(f"{what} lacks {missing} or holds unknown {extra}")


def _check_job(saved: Any, mine: dict[str, Any], no: Callable[[str], CheckpointError]) -> None:
    _exact_keys(saved, set(mine), "its job record", no)
    for k, v in mine.items():
        if saved[k] != v:
            raise no(f"it was written by a run with {k} = {saved[k]!r}, and this run has {v!r}")


def _check_against_run(tr: dict[str, Any], step: int, model: nn.Module, opt: torch.optim.Optimizer,
                       saved_cfg: Config, saved_total: int, job: dict[str, Any], tuner: Any,
                       lr_at: Callable[[Any, int, int], float], no: Callable[[str], CheckpointError]) -> None:
    """What a Trainer would accept but this run never writes."""
    if tr["scheduler"] is not None:
        raise no("its trainer state holds a scheduler state; cgdp.train schedules the learning rate itself")
    if (tr["tuner"] is None) != (tuner is None):
        raise no("its trainer state holds a chunk tuner state, and this run does not tune its plan"
                 if tuner is None else "this run tunes its chunk plan, and the checkpoint holds no tuner state")
    rng = tr["device_rng"]
    if rng is None or len(rng) != len(job["devices"]):
        raise no(f"it holds {0 if rng is None else len(rng)} device random state(s) for {len(job['devices'])} devices")
    for name, t in model.state_dict().items():
        v = tr["model"][name]
        if isinstance(v, torch.Tensor) and v.dtype != t.dtype:  # cgdp.train saves them as they are
            raise no(f"its model's {name} is {v.dtype}, and this run's model holds {t.dtype}")
        if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise no(f"its model's {name} holds NaN or Inf")
    dtypes = {pid: p.dtype for g, f in zip(tr["optimizer"]["param_groups"], opt.param_groups)
              for pid, p in zip(g["params"], f["params"])}
    fresh = opt.state_dict()
    saved = tr["optimizer"]
    lr = lr_at(saved_cfg.train, step - 1, saved_total) if step else None
    for i, (g, f) in enumerate(zip(saved["param_groups"], fresh["param_groups"])):
        for k, v in f.items():
            if k in ("params", "lr"):
                continue
            if not _equal(g.get(k), v) or set(g) != set(f):
                raise no(f"its optimizer's group {i} has {k} = {g.get(k)!r}, and this run's config gives {v!r}")
        if step and g["lr"] != lr:
            raise no(f"its optimizer's learning rate is {g['lr']!r}, and the run's schedule gave step {step} {lr!r}")
    probes = [probe_state(opt, i) for i in range(len(opt.param_groups))]
    for i, (g, probe) in enumerate(zip(saved["param_groups"], probes)):
        for pid in g["params"]:
            st = saved["state"].get(pid)
            if probe and step and st is None:
                raise no(f"its optimizer has no state for parameter {pid} after {step} step(s)")
            if st is None:
                continue
            if "step" in st and float(st["step"]) != step:
                raise no(f"its optimizer counted {float(st['step']):g} step(s) for parameter {pid}, its trainer {step}")
            for name, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() and v.dtype != dtypes[pid]:
                    raise no(f"its optimizer's {name} of parameter {pid} is {v.dtype}, the parameter {dtypes[pid]}")
                if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                    raise no(f"its optimizer's {name} of parameter {pid} holds NaN or Inf")


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_loader(ld: Any, step: int, cfg: Config, job: dict[str, Any], steps_per_epoch: int,
                  no: Callable[[str], CheckpointError]) -> None:
    _exact_keys(ld, LOADER, "its data loader state", no)
    if not all(_int(ld[k]) for k in LOADER):
        raise no(f"its data loader state {dict(ld)!r} is not four integers")
    if ld["seed"] != cfg.train.seed or ld["batch_size"] != job["global_batch"]:
        raise no(f"its data loader used global batch {ld['batch_size']} and seed {ld['seed']}, this run "
                 f"{job['global_batch']} and {cfg.train.seed}")
    if not (ld["epoch"] >= 0 and 0 <= ld["pos"] < steps_per_epoch):
        raise no(f"its data loader is at epoch {ld['epoch']}, batch {ld['pos']}, and an epoch has "
                 f"{steps_per_epoch} batches")
    if ld["epoch"] * steps_per_epoch + ld["pos"] != step:
        raise no(f"its step counter ({step}) and its data loader's position (epoch {ld['epoch']}, batch "
                 f"{ld['pos']} of {steps_per_epoch}) disagree: one of them was changed")


def _check_rng(rng: Any, no: Callable[[str], CheckpointError]) -> None:
    if not isinstance(rng, Mapping) or not {"torch", "numpy", "python"} <= set(rng) <= {"torch", "numpy",
                                                                                          "python", "cuda"}:
        raise no("its random state is not the torch, NumPy and Python generator states")
    if not generator_state_ok(rng["torch"]):
        raise no("its torch random state is not a generator state")
    try:
        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        if not (isinstance(keys, torch.Tensor) and keys.dtype == torch.int64 and keys.dim() == 1):
            raise ValueError("keys")
        if not (_int(pos) and _int(has_gauss) and isinstance(gauss, float) and math.isfinite(gauss)):
            raise ValueError("fields")
        np.random.RandomState().set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos,
                                           has_gauss, gauss))
        if not bool(((keys >= 0) & (keys < 2**32)).all()):
            raise ValueError("range")
    except (ValueError, TypeError, KeyError, IndexError):
        raise no("its NumPy random state is not a generator state") from None
    try:
        random.Random().setstate(rng["python"])
    except (ValueError, TypeError, OverflowError, IndexError):
        raise no("its Python random state is not a generator state") from None
    cuda = rng.get("cuda", [])
    if not isinstance(cuda, (list, tuple)) or not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8
                                                      for t in cuda):
        raise no("its CUDA random states are not generator states")
