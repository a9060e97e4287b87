"""``python -m cgdp.train``: train a model with cgdp from a config, and record what happened.

With no arguments it runs the default job (``cgdp/configs/default.toml``: a small CNN on the
bundled handwritten digits, on every GPU or on two CPU-emulated devices). The flow is:

1. :func:`prepare` resolves the config into a :class:`Job` — devices, datasets, the model, the chunk
   plan, the checkpoint to resume — and checks all of it, so that every user error ends here with
   a clear message and exit code 2, before any training starts.
2. :func:`train` runs the loop: one ``Trainer.step`` per global batch; a metrics line per step
   (loss, samples/s, Table 3's phases); a profiled step every ``profile_every`` (Table 4's
   per-chunk D2H / accumulate / H2D); traces, evals and atomic checkpoints when asked; a final
   line with ``"final": true`` and ``"eval_accuracy"``.

Resume invariant: the checkpoint holds the trainer (model, optimizer, plan, tuner, step), every
RNG state and the data loader's position, and nothing else influences a step, so a resumed run
produces bitwise the same parameters and losses as an uninterrupted one.
"""
from __future__ import annotations

import json
import math
import pathlib
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from cgdp.cli import checkpoint
from cgdp.cli.interrupt import GracefulStop
from cgdp.cli.outlock import OutLock
from cgdp.cli import memory
from cgdp.cli import report
from cgdp.cli import resume as resuming
from cgdp.cli import startup
from cgdp.cli import trace
from cgdp.cli.output import MODEL_FILE, Metrics, OutputError, disk_error, resume_row, used_out, write_text
from cgdp.cli.config import Config, ConfigError, help_text, parse_args, presets, resumed_config, to_toml
from cgdp.data import DataError, Loader, SyntheticDataset, digits, eval_batches, open_shards
from cgdp.models import MODELS, build_model, count_params, get_spec
from cgdp.cli.progress import Progress

# settings a resumed run may change; anything else must match the checkpoint's run
RESUMABLE_CHANGES = {"train.steps", "train.epochs", "train.timeout_s", "data.prefetch"}


# ------------------------------------------------------------------------------- the job
@dataclass
class Job:
    cfg: Config
    devices: list[str]
    model: nn.Module
    train_set: Any
    eval_set: Any
    num_classes: int
    chunks: int | str | list[list[int]]
    total_steps: int
    out: pathlib.Path | None
    resume: dict | None = None
    rank: int = 0
    """This process's MPI rank (0 on one machine); only rank 0 writes results."""
    ranks: int = 1
    """MPI ranks; each takes its part of every global batch."""
    saved_step: int | None = None
    """The step of the newest checkpoint in ``out`` (None: there is none)."""
    record: dict | None = None
    """What this run resolved to (:func:`cgdp.cli.resume.job_record`), saved in every checkpoint."""
    notes: list[str] | None = None
    """Lines to print before training (a tight memory estimate)."""

    @property
    def global_batch(self) -> int:
        return self.cfg.train.batch * len(self.devices) * self.ranks


def mpi_world(spec: str) -> tuple[int, int]:
    """(rank, ranks): with ``auto``, MPI (gloo) is used when an MPI launcher (torchrun) started several ranks."""
    spec = startup.resolve_comm(spec)
    if spec == "none":
        return 0, 1
    if spec == "gloo":
        from cgdp.comm.gloo import ObjectWorld
        world = ObjectWorld()
        return world.Get_rank(), world.Get_size()
    try:
        from mpi4py import MPI
    except ImportError:
        raise ConfigError('train.comm needs mpi4py: pip install -e ".[mpi]" in the clone of cgdp (or run with --comm none)') from None
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def resolve_devices(spec: str, mode: str, gpus: int) -> list[str]:
    """``auto`` / a count / a comma list of names → device names; ``gpus`` is how many exist."""
    spec = spec.strip()
    if spec == "auto":
        if mode == "single":
            return ["cuda:0" if gpus else "cpu:0"]
        return [f"cuda:{i}" for i in range(gpus)] if gpus else ["cpu:0", "cpu:1"]
    if spec.isdigit():
        n = int(spec)
        if n < 1:
            raise ConfigError("--devices 0: at least one device is needed")
        if gpus and n > gpus:
            raise ConfigError(f"--devices {n} asks for {n} GPUs but this machine has {gpus}; use "
                              f"--devices {gpus} or fewer, or cpu:0,...,cpu:{n - 1} for CPU-emulated devices")
        if mode == "single" and n != 1:
            raise ConfigError(f"mode 'single' trains on one device but --devices asks for {n}; "
                              f"pass --devices 1 or use --mode cgdp")
        return [f"cuda:{i}" for i in range(n)] if gpus else [f"cpu:{i}" for i in range(n)]
    names = [s.strip() for s in spec.split(",") if s.strip()]
    kinds = set()
    for name in names:
        kind, _, idx = name.partition(":")
        if kind not in ("cpu", "cuda") or not idx.isdigit():
            raise ConfigError(f"device {name!r} is not a device name; write cuda:N for a GPU or cpu:N for "
                              f"a CPU-emulated device (e.g. --devices cpu:0,cpu:1)")
        if kind == "cuda" and int(idx) >= gpus:
            have = f"GPUs cuda:0..cuda:{gpus - 1}" if gpus else "no GPU"
            raise ConfigError(f"device {name} does not exist: this machine has {have}. Use fewer GPUs, "
                              f"or CPU-emulated devices (--devices cpu:0,cpu:1)")
        kinds.add(kind)
    if len(kinds) > 1:
        raise ConfigError(f"--devices {spec}: mix of GPUs and CPU-emulated devices; use one kind")
    if len(set(names)) != len(names):
        raise ConfigError(f"--devices {spec} names a device twice; each device takes one replica")
    if mode == "single" and len(names) != 1:
        raise ConfigError(f"mode 'single' trains on one device but --devices names {len(names)}; "
                          f"pass one device or use --mode cgdp")
    return names


def load_plan_file(path: str, num_layers: int) -> list[list[int]]:
    """A chunk plan from a JSON (``[[7, 6], [5], ...]`` or ``{"plan": ...}``) or TOML (``plan = ...``) file."""
    from cgdp.planning.chunks import validate_plan
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"--chunks {path!r}: no such plan file; use auto, a chunk size k, or a JSON file "
                          f"listing chunks in send order, e.g. [[3, 2], [1], [0]]")
    try:
        text = p.read_text()
        if p.suffix == ".toml":
            import tomllib
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
        plan = data["plan"] if isinstance(data, dict) else data
        return validate_plan(plan, num_layers)
    except (ValueError, TypeError, KeyError) as e:  # JSON/TOML errors are ValueErrors
        raise ConfigError(f"plan file {path}: {e}. A plan is a list of chunks in send order, each a "
                          f"list of layer indices 0..{num_layers - 1}, every layer exactly once") from None


def _datasets(cfg: Config, global_batch: int) -> tuple[Any, Any]:
    d = cfg.data
    if d.dataset == "digits":
        return digits("train"), digits("test")
    if d.dataset == "shards":
        return open_shards(d.shards, d.eval_fraction)
    spec = get_spec(cfg.model.name)
    shape = tuple(d.input_shape) or spec.input_shape
    classes = cfg.model.num_classes or spec.num_classes
    n = d.synthetic_samples or 100 * global_batch
    return (SyntheticDataset(shape, classes, n, seed=cfg.train.seed),
            SyntheticDataset(shape, classes, min(n, global_batch), seed=cfg.train.seed + 1))


def prepare(cfg: Config, gpus: int | None = None, flags: dict | None = None) -> Job:
    """Check everything and build the job; raises ConfigError / DataError / CheckpointError.

    ``flags`` (from :func:`parse_args`): with ``--resume`` and no ``--config``, the checkpoint's
    settings are the run's, and only the flags given on this command line change them."""
    resume, resume_path = None, None
    if cfg.run.resume:
        resume_path = (pathlib.Path(cfg.run.out) / "checkpoint.pt" if cfg.run.resume == "auto"
                       else pathlib.Path(cfg.run.resume))
        if cfg.run.resume == "auto" and not resume_path.exists() and (resume_path.parent / "metrics.jsonl").exists():
            raise checkpoint.CheckpointError(
                f"--out {resume_path.parent} holds a run that stopped before saving a checkpoint (no "
                f"checkpoint.pt), so there is nothing to resume; start again with --overwrite (or a new "
                f"--out), and pass --checkpoint_every N to save along the way")
        resume, meta = checkpoint.load_with_meta(resume_path)
        saved_cfg = resuming.saved_config(resume, resume_path)
        if flags is not None and not flags.get("config"):
            cfg = resumed_config(saved_cfg.to_dict(), cfg, flags.get("given", []))
    if gpus is None:
        from cgdp.engine.backend.cuda import cuda_count
        gpus = cuda_count()
    t = cfg.train
    devices = resolve_devices(t.devices, t.mode, gpus)
    rank, ranks = mpi_world(t.comm)
    global_batch = t.batch * len(devices) * ranks
    if cfg.data.dataset == "synthetic":  # before 100 global batches of indices are laid out
        spec = get_spec(cfg.model.name)
        shape = tuple(cfg.data.input_shape) or spec.input_shape
        _raise(startup.check_batch_memory(global_batch, shape, f"synthetic {cfg.model.name} inputs"), DataError)
    train_set, eval_set = _datasets(cfg, global_batch)
    classes = cfg.model.num_classes or train_set.num_classes
    if classes < train_set.num_classes:
        raise ConfigError(f"model.num_classes = {classes}, but the data has labels up to "
                          f"{train_set.num_classes - 1}; labels must be 0..{classes - 1}: fix the labels, or "
                          f"pass --num_classes {train_set.num_classes} (or 0) if the data really has that many")
    _raise(startup.check_labels(train_set, classes, given=bool(cfg.model.num_classes)), DataError)
    _raise(startup.check_batch_memory(global_batch, train_set.sample_shape, "training inputs"), DataError)
    memory_note = _check_memory(cfg, devices, global_batch, classes, train_set, eval_set)
    torch.manual_seed(t.seed)  # the initial weights depend on the seed only
    try:
        model = build_model(cfg.model.name, classes, train_set.sample_shape)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    from cgdp.engine.core.layers import find_layers
    num_layers = len(find_layers(model)[0])
    chunks: int | str | list[list[int]]
    if t.chunks in ("auto", "paper"):
        chunks = t.chunks if t.mode == "cgdp" else 1  # the tuners choose how to stream to the host
    elif t.chunks.isdigit():
        chunks = int(t.chunks)
    else:
        chunks = load_plan_file(t.chunks, num_layers)
    steps_per_epoch = len(train_set) // global_batch
    if steps_per_epoch < 1:
        raise DataError(f"the global batch ({t.batch} per device x {len(devices)} devices x {ranks} rank(s) = {global_batch}) "
                        f"is larger than the training set ({len(train_set)} samples); lower --batch")
    total = t.epochs * steps_per_epoch if t.epochs else t.steps

    out = pathlib.Path(cfg.run.out) if cfg.run.out else None
    if out is not None:
        if not cfg.run.resume and not cfg.run.overwrite:
            _raise(used_out(out), ConfigError)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create results directory {out}: {e.strerror}; choose another --out") from None
    if cfg.run.trace:
        parent = pathlib.Path(cfg.run.trace).parent
        if not parent.is_dir():
            raise ConfigError(f"--trace {cfg.run.trace}: directory {parent} does not exist; create it first")
    record = resuming.job_record(devices, t.mode, ranks, global_batch, startup.dataset_digest(train_set), total)
    saved = None
    if resume is not None:
        _check_resumable(cfg, saved_cfg, resume_path)
        st = saved_cfg.train
        resuming.check(resume, meta, resume_path, cfg, saved_cfg, record, model, make_optimizer(t),
                       _tuner(chunks, model, len(devices)), num_layers, steps_per_epoch,
                       st.epochs * steps_per_epoch if st.epochs else st.steps, lr_at)
        saved = resume["trainer"]["step"]
        if saved >= total:
            raise ConfigError(f"checkpoint {resume_path} is at step {saved}, and this run has "
                              f"{total} steps: nothing to do. Raise --steps to train further")
    return Job(cfg, devices, model, train_set, eval_set, classes, chunks, total, out, resume, rank, ranks,
               saved_step=saved, record=record, notes=[n for n in (memory_note, memory.time_note(
                   cfg.model.name, count_params(model), devices, t.batch, global_batch, total)) if n])


def _check_memory(cfg: Config, devices: list[str], global_batch: int, classes: int, train_set: Any,
                  eval_set: Any) -> str | None:
    """Refuse, with the numbers, a run that would not fit in memory (:mod:`cgdp.cli.memory`);
    a note if it fits tightly."""
    t, shape = cfg.train, tuple(train_set.sample_shape)
    try:  # on the meta device: what the model takes, without taking it
        measured = memory.measure(lambda: build_model(cfg.model.name, classes, shape), shape, make_optimizer(t))
    except (ValueError, RuntimeError, OverflowError) as e:
        raise ConfigError(f"model {cfg.model.name} with {classes} classes for inputs of shape {shape} cannot be "
                          f"built ({str(e).splitlines()[0][:200]}); check --num_classes and the data") from None
    est = memory.estimate(measured, devices=len(devices), emulated=not devices[0].startswith("cuda"),
                          mode=t.mode, batch=t.batch, input_bytes=memory.input_bytes(shape),
                          global_batch=global_batch, prefetch=cfg.data.prefetch,
                          eval_samples=min(512, len(eval_set)))
    host = memory.available_host()
    _raise(memory.check(est, host, memory.gpu_free(devices), t.devices.strip()), DataError)
    return memory.warning(est, host)


def _tuner(chunks: Any, model: nn.Module, devices: int) -> Any:
    """A fresh chunk tuner like the one the run's trainer will build (None: the plan is fixed)."""
    if not isinstance(chunks, str):
        return None
    from cgdp.engine.core.layers import find_layers
    from cgdp.planning.tuner import make_tuner
    infos, params = find_layers(model)
    itemsize = next(p for layer in params for p in layer).element_size()
    return make_tuner(chunks, [info.numel * itemsize for info in infos], devices)


def _raise(msg: str | None, kind: type[Exception]) -> None:
    if msg:
        raise kind(msg)


def _check_resumable(cfg: Config, saved: Config, path: pathlib.Path) -> None:
    old, new = saved.to_dict(), cfg.to_dict()
    diff = [f"{sec}.{k}: {old[sec].get(k)!r} -> {v!r}" for sec in ("model", "data", "train")
            for k, v in new[sec].items() if f"{sec}.{k}" not in RESUMABLE_CHANGES and old[sec].get(k) != v]
    if diff:
        raise ConfigError(f"checkpoint {path} was written by a run with other settings ({'; '.join(diff)}). "
                          f"Resume with the same settings (only steps/epochs may change), or use a new --out")


# ---------------------------------------------------------------------------- the loop
def make_optimizer(t) -> Callable[..., torch.optim.Optimizer]:
    if t.optimizer == "sgd":
        return lambda p: torch.optim.SGD(p, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    if t.optimizer == "adam":
        return lambda p: torch.optim.Adam(p, lr=t.lr, weight_decay=t.weight_decay)
    return lambda p: torch.optim.AdamW(p, lr=t.lr, weight_decay=t.weight_decay)


def lr_at(t, step: int, total: int) -> float:
    """Learning rate of step ``step`` (0-based): linear warm-up, then constant or cosine."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.schedule == "cosine":
        span = max(total - t.warmup_steps, 1)
        return 0.5 * t.lr * (1 + math.cos(math.pi * (step - t.warmup_steps) / span))
    return t.lr


def evaluate(trainer, dataset, batch: int = 512) -> tuple[float, float]:
    """Accuracy and mean loss of replica 0 (all replicas are identical) on ``dataset``."""
    model = trainer.replicas[0]
    dev = next(model.parameters()).device
    model.eval()
    correct, loss_sum, n = 0, 0.0, 0
    try:
        with torch.no_grad():
            for x, y in eval_batches(dataset, batch):
                out = model(x.to(dev))
                y = y.to(dev)
                loss_sum += float(nn.functional.cross_entropy(out, y, reduction="sum"))
                correct += int((out.argmax(1) == y).sum())
                n += len(y)
    finally:
        model.train()
    return correct / max(n, 1), loss_sum / max(n, 1)


def _nonfinite(e: FloatingPointError, x: Any, step: int, lr: float) -> Exception:
    """Blame the data when the inputs were not finite, the learning rate only when they were."""
    xs = x if isinstance(x, (tuple, list)) else (x,)
    bad = sum(int((~torch.isfinite(t)).sum()) for t in xs if isinstance(t, torch.Tensor) and t.is_floating_point())
    if bad:
        return DataError(f"the input batch of step {step} holds {bad} NaN/Inf value(s): the data is bad, not the "
                         f"learning rate. Clean the dataset (no update was applied)")
    return FloatingPointError(f"{e} (the run diverged at step {step}; --lr is {lr})")


def _save(job: Job, trainer, loader: Loader, last: bool = False) -> None:
    """The checkpoint; with ``last``, also the trained model as a plain state_dict (``OUT/model.pt``)."""
    checkpoint.save({"trainer": trainer.state_dict(), "rng": checkpoint.rng_state(),
                     "loader": loader.state_dict(), "config": job.cfg.to_dict(), "job": job.record},
                    job.out / "checkpoint.pt", meta={"step": trainer.step_count})
    job.saved_step = trainer.step_count
    if last:
        try:
            checkpoint.save_model(trainer.replicas[0].state_dict(), job.out / MODEL_FILE)
        except OSError as e:
            raise disk_error(e, job.out / MODEL_FILE, f"{job.out / 'checkpoint.pt'} holds the same model "
                             f"(cgdp.load_checkpoint(path)['model'])") from None


def _kept(job: Job) -> str:
    """What a failed write leaves intact, and how to go on from it."""
    if job.out is not None and job.saved_step is not None:
        return (f"the checkpoint at step {job.saved_step} and the metrics lines before are intact; "
                f"continue with --out {job.out} --resume once there is space")
    return "no checkpoint has been written yet, so start the run again (with --overwrite) once there is space"


def train(job: Job) -> dict:
    """Run ``job``; return its final metrics row."""
    import cgdp
    cfg, t, r = job.cfg, job.cfg.train, job.cfg.run
    loss_fn = nn.functional.cross_entropy
    loader = Loader(job.train_set, job.global_batch, t.seed, prefetch=cfg.data.prefetch,
                    pin=job.devices[0].startswith("cuda"))
    lead = job.rank == 0  # every rank trains the same model; rank 0 alone writes and prints
    metrics = Metrics(job.out if lead else None, append=job.resume is not None)
    metrics.kept = lambda: _kept(job)
    wall0 = time.perf_counter()
    with startup.intra_op_threads(job.devices), \
            cgdp.Trainer(job.model, make_optimizer(t), job.devices, mode=t.mode, chunks=job.chunks,
                         timeout_s=t.timeout_s, comm=_comm(job), update=t.update) as trainer, metrics, \
            GracefulStop(job.ranks == 1, saves=lead and job.out is not None) as interrupt:
        start = 0
        if job.resume is not None:
            trainer.load_state_dict(job.resume["trainer"])
            loader.load_state_dict(job.resume["loader"])
            checkpoint.set_rng_state(job.resume["rng"])
            start = trainer.step_count
            metrics.write(resume_row(job.out if lead else None, start))
        metrics.write({"kind": "config", "config": cfg.to_dict(), "devices": job.devices,
                       "layers": [layer.name for layer in trainer.layers],
                       "params": count_params(trainer.replicas[0]), "steps": job.total_steps,
                       "steps_per_epoch": loader.steps_per_epoch, "resumed_at": start if job.resume else None})
        stop = job.total_steps if not r.stop_after else min(job.total_steps, start + r.stop_after)
        tracer = trace.Recorder(r.trace if lead else "",
                                # trace_step counts from 1, like the step lines; the recorder from 0
                                max(start, min(r.trace_step - 1, job.total_steps - r.trace_steps)),
                                r.trace_steps, trainer.devices)
        last_profile = None
        progress = Progress(job.total_steps, start, r.progress if lead else "off")
        try:
            for step in range(start, stop):
                lr = lr_at(t, step, job.total_steps)
                for opt in trainer.optimizers:
                    for g in opt.param_groups:
                        g["lr"] = lr
                t0 = time.perf_counter()
                x, y = next(loader)
                if job.ranks > 1:  # the same global batch on every rank; each takes its part
                    x = torch.tensor_split(x, job.ranks)[job.rank]
                    y = torch.tensor_split(y, job.ranks)[job.rank]
                t_data = time.perf_counter() - t0
                # Table 4 of every run: the run's last step is profiled if no other step was
                profiling = r.profile_every > 0 and ((step + 1) % r.profile_every == 0 or
                                                     (last_profile is None and step + 1 == stop))
                if tracer.wants(step):
                    trainer.trace_next()
                if profiling:
                    trainer.profile_next()
                t_step = time.perf_counter()
                try:
                    loss = trainer.step(x, y, loss_fn)
                except FloatingPointError as e:  # cgdp.NonFiniteGradientError
                    raise _nonfinite(e, x, step + 1, lr) from None
                wall = time.perf_counter() - t0
                n, st = step + 1, trainer.stats
                if tracer.wants(step):
                    tracer.add(n, t_step, st, trainer.last_trace)
                row = {"kind": "step", "step": n, "loss": loss, "lr": lr,
                       "samples_per_s": job.global_batch / wall, "wall_s": wall, "data_s": t_data,
                       "epoch": loader.epoch + loader.pos / loader.steps_per_epoch,
                       **{k: st.get(k, 0.0) for k in report.PHASES}}
                if n % r.log_every == 0 or n == stop:
                    metrics.write(row)
                if profiling and trainer.last_profile is not None:
                    last_profile = trainer.last_profile.to_dict()
                    metrics.write({"kind": "profile", "step": n, **last_profile})
                progress.update(n, loss, row["samples_per_s"])
                if r.eval_every and n % r.eval_every == 0 and n < job.total_steps:
                    acc, eloss = evaluate(trainer, job.eval_set)
                    metrics.write({"kind": "eval", "step": n, "eval_accuracy": acc, "eval_loss": eloss})
                    progress.note(f"step {n}: eval accuracy {acc:.4f}, eval loss {eloss:.4f}")
                if lead and job.out is not None and r.checkpoint_every and n % r.checkpoint_every == 0:
                    _save(job, trainer, loader)
                if interrupt.requested:
                    break
        finally:
            progress.close()
            loader.close()
        done = trainer.step_count
        if lead and job.out is not None and (done == job.total_steps or r.stop_after or interrupt.requested):
            _save(job, trainer, loader, last=True)
        note = tracer.write()
        if note:
            print(note)
        steps_rows = [row for row in metrics.rows if row.get("kind") == "step"]
        run_s = sum(x["wall_s"] for x in steps_rows)
        if done < job.total_steps:
            why = "interrupted" if interrupt.requested else "stopped"
            saved = (f"checkpoint saved in {job.out}; continue with --out {job.out} --resume" if job.out is not None
                     else "no --out, so no checkpoint was written (pass --out DIR to be able to resume)")
            final = {"kind": "stopped", "final": False, "step": done, "interrupted": interrupt.requested,
                     "note": f"{why} after {done} steps; {saved}"}
        else:
            acc, eloss = evaluate(trainer, job.eval_set)
            final = {"kind": "final", "final": True, "step": done, "eval_accuracy": acc, "eval_loss": eloss,
                     "train_loss": steps_rows[-1]["loss"] if steps_rows else None,
                     "wall_s": time.perf_counter() - wall0,
                     "samples_per_s": len(steps_rows) * job.global_batch / run_s if run_s else None}
        final["plan"] = trainer.plan
        if trainer.tuner is not None:
            final["tuner"] = trainer.tuner.describe()
        metrics.write(final)
        if lead:
            report.summarise(job.out, job.cfg, metrics.rows, last_profile, [layer.name for layer in trainer.layers],
                             final.get("tuner"), start if job.resume is not None else None)
    return final


def _comm(job: Job) -> Any:
    """The MPI comm of a run with several ranks: each rank also writes its error to OUT/rank<r>.error,
    on its own machine, since a dead link loses what the launcher forwards; and none waits more than
    a minute at exit for a launcher out of reach (docs/mpi.md)."""
    if job.ranks == 1:
        return None
    error_file = job.out / f"rank{job.rank}.error" if job.out is not None else None
    if startup.resolve_comm(job.cfg.train.comm) == "gloo":
        from cgdp.comm.gloo import GlooComm
        return GlooComm(timeout_s=job.cfg.train.timeout_s, error_file=error_file)
    from cgdp.comm.mpi import MPIComm
    return MPIComm(timeout_s=job.cfg.train.timeout_s, finalize_timeout_s=60.0, error_file=error_file)


# ------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    lock = OutLock()  # one run at a time in an --out: held from before --out is read until the end
    try:
        return _main(sys.argv[1:] if argv is None else list(argv), lock)
    finally:
        lock.release()


def _main(argv: list[str], lock: OutLock) -> int:
    try:
        world = startup.early_world(argv)  # several MPI ranks: MPI is up before anything can fail
    except (ValueError, TimeoutError) as e:  # the launcher's environment is wrong (MASTER_PORT out of range...),
        print(f"cgdp.train: error: {e}", file=sys.stderr)  # or the other ranks never came
        return 2
    job, error = None, None
    try:
        cfg, flags = parse_args(argv)
        if flags["help"]:
            print(help_text())
            return 0
        if flags["list_models"]:
            for name, spec in MODELS.items():
                print(f"{name:<14} {spec.description}")
            return 0
        if flags["list_presets"]:
            print("\n".join(presets()))
            return 0
        if cfg.run.out and not flags["print_config"] and (world is None or world.Get_rank() == 0):
            try:
                lock.take(cfg.run.out)
            except RuntimeError as e:
                raise ConfigError(str(e)) from None
        job = prepare(cfg, flags=flags)
    except (ConfigError, DataError, checkpoint.CheckpointError) as e:
        error = str(e)
    except Exception as e:  # not a user error; still, with MPI the other ranks must not wait forever
        if world is None:
            raise
        error = f"{type(e).__name__}: {e}"
    if world is not None:  # every rank exits together, or none does
        fp = startup.fingerprint(job.cfg, job.devices, job.train_set, job.total_steps) if job else None
        error = startup.agree(world, error, fp)
    if error:
        if world is None or world.Get_rank() == 0:
            print(f"cgdp.train: error: {error}", file=sys.stderr)
        return 2
    cfg = job.cfg
    resolved = to_toml(cfg)
    lead = job.rank == 0
    if lead:
        kind = "gloo" if startup.resolve_comm(cfg.train.comm) == "gloo" else "MPI"
        ranks = f"; {job.ranks} {kind} ranks" if job.ranks > 1 else ""
        print(f"# resolved config (devices: {', '.join(job.devices)}{ranks}; {job.total_steps} steps)\n{resolved}")
        if job.devices[0].startswith("cpu") and cfg.train.devices.strip().isdigit():
            print(f"# no GPU found: --devices {cfg.train.devices.strip()} runs {len(job.devices)} CPU-emulated "
                  f"device(s), each holding a full replica in host memory")
        for note in job.notes or []:
            print(note, file=sys.stderr)
    if flags["print_config"]:
        return 0
    try:
        if lead and job.out is not None:
            write_text(job.out / "config.toml", resolved, "nothing was changed in " + str(job.out))
        final = train(job)
    except KeyboardInterrupt:
        # the step of the checkpoint on disk, read back: a second Ctrl-C may land in a save
        meta = checkpoint.peek(job.out / "checkpoint.pt") if job.out is not None else None
        if job.out is None:
            kept = "no checkpoint (no --out)"
        elif meta is None or not isinstance(meta.get("step"), int):
            kept = "no checkpoint was saved (none had been written yet)"
        else:
            kept = f"the checkpoint at step {meta['step']} in {job.out} is intact; continue with --resume"
        print(f"\ninterrupted; {kept}", file=sys.stderr)
        return 130
    except (DataError, checkpoint.CheckpointError, OutputError) as e:
        print(f"cgdp.train: error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # the run diverged (the inputs were finite)
        print(f"cgdp.train: error: {e}", file=sys.stderr)
        return 1
    if not lead:
        return 0
    if final.get("final"):
        print(f"eval accuracy {final['eval_accuracy']:.4f} after {final['step']} steps "
              f"({final['wall_s']:.1f} s)")
    else:
        print(final["note"])
    if job.out is not None and (job.out / MODEL_FILE).is_file():
        print(f"trained model: {job.out / MODEL_FILE} (model.load_state_dict(torch.load(path, weights_only=True)))")
    elif job.out is None and final.get("final"):  # a stopped run's note already says so
        print("nothing was saved (no --out): pass --out DIR to keep the trained model, a checkpoint to resume "
              "from, the metrics and the plots")
    return 130 if final.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
