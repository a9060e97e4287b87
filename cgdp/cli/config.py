"""Job configuration for ``python -m cgdp.train``: typed sections, TOML files, presets, overrides.

A job is a :class:`Config` of four sections — ``model``, ``data``, ``train``, ``run`` — each a
dataclass whose fields carry a one-line docstring (``--help`` prints them). ``Config()`` is the
embedded default job. Values come, in order of precedence, from ``--key value`` on the command line,
then a TOML file (``--config FILE``) or a bundled preset (``--config NAME``, ``cgdp/configs/NAME.toml``),
then the defaults. Every value is type-checked when it is set and every section validates itself at
construction, so a wrong config fails with a :class:`ConfigError` (what was wrong, what to do) before
any model is built. Field names are unique across sections, so ``--lr`` and ``--train.lr`` are the same.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import math
import pathlib
import tomllib
import typing
from dataclasses import dataclass, field
from typing import Any

PRESET_DIR = pathlib.Path(__file__).parent.parent / "configs"


class ConfigError(ValueError):
    """A user-facing configuration problem; ``python -m cgdp.train`` prints it and exits with 2."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _choice(value: str, key: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{key} must be one of {', '.join(choices)}; got {value!r}")


@dataclass
class ModelConfig:
    name: str = "digits_cnn"
    """Network from the registry (``--list-models``); the paper's: alexnet, googlenet, vgg16, resnet152."""
    num_classes: int = 0
    """Output classes; 0 takes the dataset's."""

    def __post_init__(self) -> None:
        _check_types(self, "model")
        from cgdp.models import MODELS
        if self.name not in MODELS:
            close = difflib.get_close_matches(self.name, MODELS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown model {self.name!r}{hint}; choose one of {', '.join(MODELS)}")
        _check(self.num_classes >= 0, f"model.num_classes must be >= 0 (0 = from the dataset); got {self.num_classes}")


@dataclass
class DataConfig:
    dataset: str = "digits"
    """``digits`` (bundled handwritten digits), ``synthetic`` (random tensors, throughput runs) or ``shards``."""
    shards: str = ""
    """Directory of ``.npz`` (x, y) or ``NAME_x.npy``/``NAME_y.npy`` shards, for ``dataset = "shards"``."""
    eval_fraction: float = 0.2
    """Share of the shards held out for eval, unless the directory has ``train/`` and ``eval/``."""
    input_shape: list[int] = field(default_factory=list)
    """Synthetic sample shape, e.g. ``3,224,224``; empty = the model's own."""
    synthetic_samples: int = 0
    """Synthetic samples per epoch; 0 = 100 global batches."""
    prefetch: int = 2
    """Batches prepared ahead on a background thread (0 = load in the training loop)."""

    def __post_init__(self) -> None:
        _check_types(self, "data")
        _choice(self.dataset, "data.dataset", ("digits", "synthetic", "shards"))
        _check(self.dataset != "shards" or bool(self.shards),
               "data.dataset = 'shards' needs a directory: pass --shards DIR")
        _check(not self.shards or self.dataset == "shards",
               f"--shards {self.shards!r} is given but the dataset is {self.dataset!r}; add --dataset shards")
        _check(0.0 < self.eval_fraction < 1.0, f"data.eval_fraction must be in (0, 1); got {self.eval_fraction}")
        _check(all(d > 0 for d in self.input_shape), f"data.input_shape must be positive sizes; got {self.input_shape}")
        _check(self.synthetic_samples >= 0 and self.prefetch >= 0,
               "data.synthetic_samples and data.prefetch must be >= 0")


@dataclass
class TrainConfig:
    devices: str = "auto"
    """``auto`` (all GPUs, else 2 CPU-emulated), a count, or names: ``cuda:0,cuda:1`` / ``cpu:0,cpu:1``."""
    mode: str = "cgdp"
    """``cgdp`` (host averages during backward), ``typical`` (the paper's baseline) or ``single`` (one device)."""
    chunks: str = "auto"
    """Chunk plan: ``auto`` (tuned while training), ``paper`` (Algorithm 1), a chunk size k, or a plan file."""
    update: str = "devices"
    """``devices`` (each device steps its replica) or ``host`` (one optimizer over float32 masters in host
    memory: no optimizer state on the devices; mode cgdp)."""
    batch: int = 32
    """Samples per device per step (the global batch is batch x devices)."""
    steps: int = 300
    """Training steps (ignored when ``epochs`` > 0)."""
    epochs: int = 0
    """If > 0, train this many passes over the training set instead of ``steps``."""
    optimizer: str = "sgd"
    """``sgd`` (with momentum), ``adam`` or ``adamw``."""
    lr: float = 0.05
    """Peak learning rate."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 0.0
    """L2 penalty (decoupled for adamw)."""
    schedule: str = "constant"
    """Learning-rate schedule after warm-up: ``constant`` or ``cosine`` (to 0 at the last step)."""
    warmup_steps: int = 0
    """Linear warm-up steps from 0 to ``lr``."""
    seed: int = 0
    """Seed of the model's initial weights and of the data order."""
    timeout_s: float = 300.0
    """Seconds a step may wait on a device or peer before failing instead of hanging."""
    comm: str = "auto"
    """Several machines: ``auto`` (MPI when started by mpiexec with more than one rank, gloo when by
    torchrun), ``mpi``, ``gloo`` or ``none``."""

    def __post_init__(self) -> None:
        _check_types(self, "train")
        _choice(self.mode, "train.mode", ("cgdp", "typical", "single"))
        _choice(self.optimizer, "train.optimizer", ("sgd", "adam", "adamw"))
        _choice(self.update, "train.update", ("devices", "host"))
        _check(self.update == "devices" or self.mode == "cgdp",
               f"train.update=host steps on the gradient the host sums, which mode {self.mode} does not stream; "
               f"use --mode cgdp")
        _choice(self.schedule, "train.schedule", ("constant", "cosine"))
        _choice(self.comm, "train.comm", ("auto", "mpi", "gloo", "none"))
        _check(bool(self.devices.strip()), "train.devices is empty; use auto, a count, or device names")
        _check(self.batch >= 1, f"train.batch (per device) must be >= 1; got {self.batch}")
        _check(self.steps >= 1 or self.epochs >= 1, "set train.steps or train.epochs to at least 1")
        _check(self.epochs >= 0 and self.warmup_steps >= 0, "train.epochs and train.warmup_steps must be >= 0")
        _check(self.lr > 0 and math.isfinite(self.lr), f"train.lr must be > 0 and finite; got {self.lr}")
        for k in ("momentum", "weight_decay"):
            v = getattr(self, k)
            _check(v >= 0 and math.isfinite(v), f"train.{k} must be >= 0 and finite; got {v}")
        _check(self.timeout_s > 0 and math.isfinite(self.timeout_s),
               f"train.timeout_s must be a finite number of seconds > 0 (e.g. 86400 for a day); got {self.timeout_s}")
        if self.chunks != "auto" and self.chunks.lstrip("-").isdigit():
            _check(int(self.chunks) >= 1, f"train.chunks must be >= 1 (or auto, or a plan file); got {self.chunks}")


@dataclass
class RunConfig:
    out: str = ""
    """Results directory (metrics.jsonl, config.toml, checkpoint.pt, plots); empty = print only."""
    resume: str = ""
    """Checkpoint to continue from; ``--resume`` alone means ``OUT/checkpoint.pt``. The run's model,
    data and train settings come from the checkpoint; flags given again must match (steps may grow)."""
    overwrite: bool = False
    """Replace the results of an earlier run in ``out`` (without it, such an ``out`` is refused)."""
    log_every: int = 1
    """Write a metrics line (loss, samples/s, phase times) every N steps."""
    profile_every: int = 50
    """Profile one step every N steps: per-chunk D2H, accumulate, H2D (0 = never)."""
    eval_every: int = 0
    """Evaluate every N steps (0 = only at the end)."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps (0 = only at the end); needs ``out``."""
    stop_after: int = 0
    """Stop after N steps of this run with a checkpoint, to continue later with ``--resume`` (0 = off)."""
    trace: str = ""
    """Write a Chrome/Perfetto trace (JSON) of some iterations to this file."""
    trace_step: int = 5
    """First step traced (after warm-up), counted from 1 as in metrics.jsonl."""
    trace_steps: int = 1
    """Number of consecutive steps traced."""
    progress: str = "auto"
    """``auto`` (a bar on a terminal, lines otherwise), ``bar``, ``lines`` or ``off``."""
    plots: bool = True
    """Write summary PNGs to ``out`` when matplotlib is installed."""

    def __post_init__(self) -> None:
        _check_types(self, "run")
        _choice(self.progress, "run.progress", ("auto", "bar", "lines", "off"))
        for k in ("log_every", "trace_steps"):
            _check(getattr(self, k) >= 1, f"run.{k} must be >= 1; got {getattr(self, k)}")
        for k in ("profile_every", "eval_every", "checkpoint_every", "stop_after", "trace_step"):
            _check(getattr(self, k) >= 0, f"run.{k} must be >= 0; got {getattr(self, k)}")
        _check(self.out or not (self.checkpoint_every or self.stop_after),
               "checkpoints need a results directory: add --out DIR")
        _check(self.out or self.resume != "auto",
               "--resume without a path needs --out DIR (it reads OUT/checkpoint.pt)")


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "run": RunConfig}
ALIASES = {"model": "model.name"}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """What network to train."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where its samples come from."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """How to train it: devices, mode, chunks, batch, optimizer."""
    run: RunConfig = field(default_factory=RunConfig)
    """What to write: results, checkpoints, traces, progress."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, origin: str = "config") -> "Config":
        parts = {}
        for sec, values in d.items():
            if sec not in SECTIONS:
                raise ConfigError(f"{origin}: unknown section [{sec}]; sections are {', '.join(SECTIONS)}")
            if not isinstance(values, dict):
                raise ConfigError(f"{origin}: {sec} must be a table ([{sec}]), got {values!r}")
            hints = _hints(SECTIONS[sec])
            kw = {}
            for k, v in values.items():
                if k not in hints:
                    raise ConfigError(_unknown(f"{sec}.{k}", origin))
                kw[k] = _from_toml(v, hints[k], f"{sec}.{k}", origin)
            parts[sec] = SECTIONS[sec](**kw)
        return cls(**parts)


# ------------------------------------------------------------------------------ type checks
@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The field types of a section (``typing.get_type_hints`` evaluates them anew on every call)."""
    return typing.get_type_hints(cls)


def _tname(tp: object) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, "a list of integers")  # type: ignore[arg-type]


def _check_types(obj: object, section: str) -> None:
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        tp = _hints(type(obj))[f.name]
        v = getattr(obj, f.name)
        ok = (isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
              if tp == list[int] else
              isinstance(v, (int, float)) and not isinstance(v, bool) if tp is float else
              isinstance(v, int) and not isinstance(v, bool) if tp is int else isinstance(v, tp))
        if not ok:
            raise ConfigError(f"{section}.{f.name} must be {_tname(tp)}; got {type(v).__name__} {v!r}")
        if tp is float:
            setattr(obj, f.name, float(v))


def _from_toml(v: object, tp: object, key: str, origin: str) -> object:
    """A TOML value for field ``key``: the few spellings TOML allows are normalised, others checked later."""
    if key in ("train.devices", "train.chunks") and isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    if key == "train.devices" and isinstance(v, list) and all(isinstance(i, str) for i in v):
        return ",".join(v)
    if key == "train.chunks" and isinstance(v, list):
        raise ConfigError(f"{origin}: train.chunks takes auto, a chunk size, or the path of a plan file; "
                          f"put an explicit plan in its own JSON file")
    if tp is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if type(v) is not tp and not (tp == list[int] and isinstance(v, list)):
        raise ConfigError(f"{origin}: {key} must be {_tname(tp)}; got {type(v).__name__} {v!r}")
    return v


def _from_cli(text: str, tp: object, flag: str) -> object:
    """Parse the command-line string for a field of type ``tp``; the message names the flag."""
    try:
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
        if tp is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp == list[int]:
            return [int(p) for p in text.replace("x", ",").split(",") if p.strip()]
        return text
    except ValueError:
        raise ConfigError(f"{flag} expects {_tname(tp)}, got {text!r}") from None


# ------------------------------------------------------------------------- keys and lookup
def all_keys() -> dict[str, str]:
    """Every accepted option name (short and dotted) → its dotted key."""
    keys: dict[str, str] = {}
    for sec, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            keys[f"{sec}.{f.name}"] = f"{sec}.{f.name}"
            assert f.name not in keys, f"field name {f.name} is not unique across sections"
            keys[f.name] = f"{sec}.{f.name}"
    keys.update(ALIASES)
    return keys


# common names from other trainers, so that the error can point at ours
SYNONYMS = {"learning_rate": "lr", "batch_size": "batch", "num_steps": "steps", "max_steps": "steps",
            "device": "devices", "gpus": "devices", "output": "out", "output_dir": "out", "optim": "optimizer",
            "num_epochs": "epochs", "arch": "model", "data": "dataset"}


def _unknown(key: str, origin: str = "command line") -> str:
    keys = all_keys()
    sec, _, name = key.rpartition(".")
    close = [SYNONYMS[name]] if name in SYNONYMS else difflib.get_close_matches(name, keys, n=3)
    if origin == "command line":
        hint = f" Did you mean {', '.join('--' + c for c in close)}?" if close else ""
        return f"unknown option --{key}.{hint} Run python -m cgdp.train --help for the list of options."
    close = [keys[c] for c in close]
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return (f"{origin}: unknown key {key}.{hint} Run python -m cgdp.train --help for the keys "
            f"of each section.")


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of dataclass ``cls`` (the string right after each field)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = " ".join(str(b.value.value).replace("``", "").split())  # type: ignore[union-attr]
    return docs


# -------------------------------------------------------------------------------- loading
def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def load_file(spec: str) -> Config:
    """``spec`` is a TOML file path or the name of a bundled preset."""
    path = pathlib.Path(spec)
    if not path.is_file():
        if path.suffix or "/" in spec or "\\" in spec:
            raise ConfigError(f"config file {spec!r} does not exist; give a TOML file or a preset "
                              f"name ({', '.join(presets())})")
        path = PRESET_DIR / f"{spec}.toml"
        if not path.is_file():
            raise ConfigError(f"{spec!r} is neither a config file nor a preset; presets are "
                              f"{', '.join(presets())}")
    try:
        data = tomllib.loads(path.read_text())
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text file (not UTF-8); --config takes a TOML file such as "
                          f"cgdp/configs/default.toml, or a preset name") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e}); see cgdp/configs/default.toml for an example") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    return Config.from_dict(data, origin=str(path))


def parse_args(argv: list[str]) -> tuple[Config, dict[str, typing.Any]]:
    """Parse ``[--config FILE|PRESET] [--key value ...] [--help ...]`` into a Config and CLI-only
    flags; ``flags["given"]`` holds the ``(flag, "section.field", raw)`` set on the command line
    and ``flags["config"]`` the ``--config`` argument (or None)."""
    flags: dict[str, typing.Any] = {"help": False, "list_models": False, "list_presets": False,
                                    "print_config": False}
    keys = all_keys()
    pairs: list[tuple[str, str, str | None]] = []  # (flag, dotted key, raw value or None)
    config_file: str | None = None
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in ("-h", "--help"):
            flags["help"] = True
            i += 1
            continue
        if not tok.startswith("--"):
            raise ConfigError(f"unexpected argument {tok!r}: options are written --key value "
                              f"(run python -m cgdp.train --help)")
        name, eq, value = tok[2:].partition("=")
        name = name.replace("-", "_")  # --log-every and --log_every are the same option
        if name in ("list_models", "list_presets", "print_config"):
            flags[name] = True
            i += 1
            continue
        has_value = bool(eq) or (i + 1 < len(argv) and not argv[i + 1].startswith("--"))
        raw = value if eq else (argv[i + 1] if has_value else None)
        i += 1 if eq or not has_value else 2
        if name == "config":
            if raw is None:
                raise ConfigError("--config needs a TOML file or a preset name "
                                  f"({', '.join(presets())})")
            config_file = raw
            continue
        if name not in keys:
            raise ConfigError(_unknown(name))
        pairs.append((tok.split("=")[0], keys[name], raw))
    cfg = load_file(config_file) if config_file else Config()
    flags.update(given=pairs, config=config_file)
    return apply_overrides(cfg, pairs), flags


def resumed_config(saved: dict, cfg: Config, given: list[tuple[str, str, str | None]]) -> Config:
    """The config of ``--resume`` without ``--config``: the saved run's model, data and train
    settings, with the flags ``given`` on this command line on top; the run section is this one's."""
    d = cfg.to_dict()
    try:
        old = Config.from_dict({sec: saved[sec] for sec in ("model", "data", "train")},
                               origin="the checkpoint's config").to_dict()
    except (KeyError, TypeError):
        raise ConfigError("the checkpoint holds no readable config; pass the run's settings again") from None
    mine = {dotted for _, dotted, _ in given}
    for sec in ("model", "data", "train"):
        d[sec] = {k: (d[sec][k] if f"{sec}.{k}" in mine else v) for k, v in old[sec].items()}
    return Config(**{sec: SECTIONS[sec](**d[sec]) for sec in SECTIONS})


def apply_overrides(cfg: Config, pairs: list[tuple[str, str, str | None]]) -> Config:
    """Set each ``(flag, "section.field", raw)``; sections are rebuilt so they validate again."""
    d = cfg.to_dict()
    for flag, dotted, raw in pairs:
        sec, name = dotted.split(".")
        tp = _hints(SECTIONS[sec])[name]
        if raw is None:
            if dotted == "run.resume":
                raw = "auto"
            elif tp is bool:
                raw = "true"
            else:
                raise ConfigError(f"{flag} needs a value ({_tname(tp)})")
        d[sec][name] = _from_cli(raw, tp, flag)
    return Config(**{sec: SECTIONS[sec](**d[sec]) for sec in SECTIONS})


# ------------------------------------------------------------------------------- writing
def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(v)  # a JSON string is a valid TOML basic string


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (readable back with ``--config``)."""
    lines = []
    for sec, values in cfg.to_dict().items():
        lines.append(f"[{sec}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)


def help_text() -> str:
    out = ["usage: python -m cgdp.train [--config FILE|PRESET] [--key value ...]",
           "",
           "With no arguments, trains the default job (a small CNN on the bundled digits).",
           f"Presets: {', '.join(presets())}.  Other flags: --list-models, --list-presets, --print-config.",
           "Every option can also be written --section.key; --resume alone continues OUT/checkpoint.pt.", ""]
    defaults = Config().to_dict()
    for sec, cls in SECTIONS.items():
        out.append(f"[{sec}]")
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            flag = "--model" if f"{sec}.{f.name}" == "model.name" else f"--{f.name}"
            out.append(f"  {flag:<20} {docs.get(f.name, '')} (default: {defaults[sec][f.name]!r})")
        out.append("")
    return "\n".join(out)
