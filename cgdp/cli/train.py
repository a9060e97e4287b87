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
import os
import pathlib
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from cgdp.cli import checkpoint
from cgdp.cli import report
from cgdp.cli import trace
from cgdp.cli.config import Config, ConfigError, help_text, parse_args, presets, to_toml
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

    @property
    def global_batch(self) -> int:
        return self.cfg.train.batch * len(self.devices) * self.ranks


_LAUNCHER_SIZE = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def mpi_world(spec: str) -> tuple[int, int]:
    """(rank, ranks): with ``auto``, MPI is used when an MPI launcher started several ranks."""
    if spec == "none":
        return 0, 1
    if spec == "auto" and not any(int(os.environ.get(k, "1") or 1) > 1 for k in _LAUNCHER_SIZE):
        return 0, 1
    try:
        from mpi4py import MPI
    except ImportError:
        raise ConfigError('train.comm needs mpi4py: pip install "cgdp[mpi]" (or run with --comm none)') from None
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


def prepare(cfg: Config, gpus: int | None = None) -> Job:
    """Check everything and build the job; raises ConfigError / DataError / CheckpointError."""
    if gpus is None:
        from cgdp.engine.backend.cuda import cuda_count
        gpus = cuda_count()
    t = cfg.train
    devices = resolve_devices(t.devices, t.mode, gpus)
    rank, ranks = mpi_world(t.comm)
    global_batch = t.batch * len(devices) * ranks
    train_set, eval_set = _datasets(cfg, global_batch)
    classes = cfg.model.num_classes or train_set.num_classes
    if classes < train_set.num_classes:
        raise ConfigError(f"model.num_classes = {classes}, but the data has labels up to "
                          f"{train_set.num_classes - 1}; use --num_classes {train_set.num_classes} (or 0)")
    torch.manual_seed(t.seed)  # the initial weights depend on the seed only
    try:
        model = build_model(cfg.model.name, classes, train_set.sample_shape)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    from cgdp.engine.layers import find_layers
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
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create results directory {out}: {e.strerror}; choose another --out") from None
    if cfg.run.trace:
        parent = pathlib.Path(cfg.run.trace).parent
        if not parent.is_dir():
            raise ConfigError(f"--trace {cfg.run.trace}: directory {parent} does not exist; create it first")
    resume = None
    if cfg.run.resume:
        path = out / "checkpoint.pt" if cfg.run.resume == "auto" else pathlib.Path(cfg.run.resume)
        resume = checkpoint.load(path)
        _check_resumable(cfg, resume, path)
        if resume["trainer"]["step"] >= total:
            raise ConfigError(f"checkpoint {path} is at step {resume['trainer']['step']}, and this run has "
                              f"{total} steps: nothing to do. Raise --steps to train further")
    return Job(cfg, devices, model, train_set, eval_set, classes, chunks, total, out, resume, rank, ranks)


def _check_resumable(cfg: Config, ck: dict, path: pathlib.Path) -> None:
    old, new = ck["config"], cfg.to_dict()
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


class Metrics:
    """``metrics.jsonl``: one JSON object per line, flushed as written (NaN becomes null)."""

    def __init__(self, out: pathlib.Path | None, append: bool):
        self.rows: list[dict] = []
        self.f = open(out / "metrics.jsonl", "a" if append else "w") if out is not None else None

    def write(self, row: dict) -> None:
        self.rows.append(row)
        if self.f is not None:
            self.f.write(json.dumps(_finite(row)) + "\n")
            self.f.flush()

    def __enter__(self) -> "Metrics":
        return self

    def __exit__(self, *exc) -> None:
        if self.f is not None:
            self.f.close()


def _finite(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def _save(job: Job, trainer, loader: Loader) -> None:
    checkpoint.save({"trainer": trainer.state_dict(), "rng": checkpoint.rng_state(),
                     "loader": loader.state_dict(), "config": job.cfg.to_dict()},
                    job.out / "checkpoint.pt")


def train(job: Job) -> dict:
    """Run ``job``; return its final metrics row."""
    import cgdp
    cfg, t, r = job.cfg, job.cfg.train, job.cfg.run
    loss_fn = nn.functional.cross_entropy
    loader = Loader(job.train_set, job.global_batch, t.seed, prefetch=cfg.data.prefetch,
                    pin=job.devices[0].startswith("cuda"))
    lead = job.rank == 0  # every rank trains the same model; rank 0 alone writes and prints
    metrics = Metrics(job.out if lead else None, append=job.resume is not None)
    wall0 = time.perf_counter()
    with cgdp.Trainer(job.model, make_optimizer(t), job.devices, mode=t.mode, chunks=job.chunks,
                      timeout_s=t.timeout_s, comm="mpi" if job.ranks > 1 else None) as trainer, metrics:
        start = 0
        if job.resume is not None:
            trainer.load_state_dict(job.resume["trainer"])
            loader.load_state_dict(job.resume["loader"])
            checkpoint.set_rng_state(job.resume["rng"])
            start = trainer.step_count
        metrics.write({"kind": "config", "config": cfg.to_dict(), "devices": job.devices,
                       "layers": [layer.name for layer in trainer.layers],
                       "params": count_params(trainer.replicas[0]), "steps": job.total_steps,
                       "steps_per_epoch": loader.steps_per_epoch, "resumed_at": start if job.resume else None})
        stop = job.total_steps if not r.stop_after else min(job.total_steps, start + r.stop_after)
        tracer = trace.Recorder(r.trace if lead else "",
                                max(start, min(r.trace_step, job.total_steps - r.trace_steps)),
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
                profiling = r.profile_every > 0 and (step + 1) % r.profile_every == 0
                if tracer.wants(step):
                    trainer.trace_next()
                if profiling:
                    trainer.profile_next()
                t_step = time.perf_counter()
                loss = trainer.step(x, y, loss_fn)
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
        finally:
            progress.close()
            loader.close()
        done = trainer.step_count
        if lead and job.out is not None and (done == job.total_steps or r.stop_after):
            _save(job, trainer, loader)
        note = tracer.write()
        if note:
            print(note)
        steps_rows = [row for row in metrics.rows if row.get("kind") == "step"]
        run_s = sum(x["wall_s"] for x in steps_rows)
        if done < job.total_steps:
            final = {"kind": "stopped", "final": False, "step": done,
                     "note": f"stopped after {done} steps; continue with --resume"}
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
            _summarise(job, metrics.rows, last_profile, trainer.layers, final.get("tuner"))
    return final


def _summarise(job: Job, rows: list[dict], profile: dict | None, layers: list, tuner: str | None) -> None:
    text = [report.phase_table(rows)] + ([tuner + "\n"] if tuner else [])
    if profile is not None:
        text.append(report.chunk_table(profile, [layer.name for layer in layers]))
    summary = "\n".join(text)
    print(summary)
    if job.out is not None:
        (job.out / "summary.md").write_text(summary)
        if job.cfg.run.plots:
            print(report.write_plots(job.out, rows, profile))


# ------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
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
        job = prepare(cfg)
    except (ConfigError, DataError, checkpoint.CheckpointError) as e:
        print(f"cgdp.train: error: {e}", file=sys.stderr)
        return 2
    resolved = to_toml(cfg)
    lead = job.rank == 0
    if lead:
        ranks = f"; {job.ranks} MPI ranks" if job.ranks > 1 else ""
        print(f"# resolved config (devices: {', '.join(job.devices)}{ranks}; {job.total_steps} steps)\n{resolved}")
    if flags["print_config"]:
        return 0
    if lead and job.out is not None:
        (job.out / "config.toml").write_text(resolved)
    try:
        final = train(job)
    except KeyboardInterrupt:
        print("\ninterrupted; continue from the last checkpoint with --resume", file=sys.stderr)
        return 130
    except FloatingPointError as e:  # cgdp.NonFiniteGradientError: the run diverged
        print(f"cgdp.train: error: {e} (the run diverged; --lr is {cfg.train.lr})", file=sys.stderr)
        return 1
    if not lead:
        return 0
    if final.get("final"):
        print(f"eval accuracy {final['eval_accuracy']:.4f} after {final['step']} steps "
              f"({final['wall_s']:.1f} s)")
    else:
        print(final["note"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
