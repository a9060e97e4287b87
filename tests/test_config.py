"""Config parsing: presets, overrides with type checks, and every user error (exit code 2, no traceback)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tomllib

import pytest

from cgdp.cli import config as C
from cgdp.cli.config import Config, ConfigError, load_file, parse_args, to_toml
from cgdp.cli.train import main, resolve_devices


def test_default_preset_is_the_embedded_default():
    assert load_file("default") == Config()


def test_paper_presets_use_table1_batches():
    want = {"alexnet": 256, "alexnet_caffe": 256, "googlenet": 64, "vgg16": 32, "resnet152": 12}
    for name, batch in want.items():
        cfg = load_file(name)
        assert cfg.model.name == name and cfg.train.batch == batch and cfg.data.dataset == "synthetic"


def test_every_field_has_a_docstring_and_a_unique_name():
    names = []
    for cls in C.SECTIONS.values():
        docs = C.field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
            names.append(f.name)
    assert len(names) == len(set(names))


def test_overrides_short_dotted_equals_and_hyphens():
    cfg, _ = parse_args(["--config", "default", "--lr", "0.1", "--train.batch=8", "--log-every", "5",
                         "--input_shape", "3x32x32", "--plots", "false", "--model", "mlp", "--devices", "3"])
    assert cfg.train.lr == 0.1 and isinstance(cfg.train.lr, float)
    assert cfg.train.batch == 8 and cfg.run.log_every == 5 and cfg.data.input_shape == [3, 32, 32]
    assert cfg.run.plots is False and cfg.model.name == "mlp" and cfg.train.devices == "3"


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg, _ = parse_args(["--lr", "0.2", "--out", str(tmp_path), "--resume", "--devices", "cpu:0,cpu:1"])
    assert cfg.run.resume == "auto"
    assert Config.from_dict(tomllib.loads(to_toml(cfg))) == cfg
    f = tmp_path / "job.toml"
    f.write_text(to_toml(cfg))
    assert parse_args(["--config", str(f)])[0] == cfg


def test_toml_spellings_are_normalised(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[train]\ndevices = ["cpu:0", "cpu:1"]\nchunks = 3\nlr = 1\n')
    cfg = load_file(str(f))
    assert cfg.train.devices == "cpu:0,cpu:1" and cfg.train.chunks == "3" and cfg.train.lr == 1.0


@pytest.mark.parametrize("argv, words", [
    (["--lrr", "1"], ["unknown option --lrr", "--lr"]),
    (["--learning-rate", "1"], ["Did you mean --lr"]),
    (["--lr", "fast"], ["--lr", "number", "'fast'"]),
    (["--steps", "1.5"], ["--steps", "integer"]),
    (["--plots", "maybe"], ["--plots", "true or false"]),
    (["--mode", "fast"], ["mode", "cgdp, typical, single"]),
    (["--model", "resnet"], ["unknown model", "resnet152"]),
    (["--config", "no_such_preset"], ["neither a config file nor a preset", "default"]),
    (["--config", "missing/file.toml"], ["does not exist"]),
    (["--resume"], ["--out"]),
    (["--checkpoint_every", "5"], ["--out"]),
    (["--shards", "/data"], ["--dataset shards"]),
    (["--dataset", "shards"], ["--shards DIR"]),
    (["--batch", "0"], ["batch", ">= 1"]),
    (["stray"], ["unexpected argument"]),
])
def test_cli_errors(argv, words):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("text, words", [
    ("[train]\nlearning_rate = 0.1\n", ["unknown key train.learning_rate", "train.lr"]),
    ("[training]\nlr = 0.1\n", ["unknown section [training]"]),
    ("[train]\nsteps = \"many\"\n", ["train.steps must be an integer", "'many'"]),
    ("[train]\nlr = true\n", ["train.lr must be a number"]),
    ("[train\nlr = 1\n", ["not valid TOML"]),
    ("train = 3\n", ["must be a table"]),
])
def test_toml_errors_name_the_file_and_key(tmp_path, text, words):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_file(str(f))
    assert "bad.toml" in str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_device_resolution():
    assert resolve_devices("auto", "cgdp", 0) == ["cpu:0", "cpu:1"]
    assert resolve_devices("auto", "cgdp", 4) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert resolve_devices("auto", "single", 0) == ["cpu:0"]
    assert resolve_devices("3", "cgdp", 0) == ["cpu:0", "cpu:1", "cpu:2"]
    assert resolve_devices("2", "cgdp", 4) == ["cuda:0", "cuda:1"]
    for spec, gpus, words in [("8", 4, "has 4"), ("cuda:0,cuda:1", 0, "no GPU"), ("cuda:2", 2, "cuda:0..cuda:1"),
                              ("gpu0", 0, "not a device name"), ("cpu:0,cuda:0", 1, "mix"),
                              ("cpu:0,cpu:0", 0, "twice")]:
        with pytest.raises(ConfigError, match=words):
            resolve_devices(spec, "cgdp", gpus)
    with pytest.raises(ConfigError, match="single"):
        resolve_devices("cpu:0,cpu:1", "single", 0)


def _run_main(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_main_errors_exit_2_before_training(capsys, tmp_path):
    bad_plan = tmp_path / "plan.json"
    bad_plan.write_text(json.dumps([[3, 2], [1]]))  # layer 0 missing
    cases = [
        (["--devices", "cuda:0,cuda:1"] if not _has_cuda() else ["--devices", "cuda:99"], "does not exist"),
        (["--chunks", str(tmp_path / "nope.json")], "no such plan file"),
        (["--chunks", str(bad_plan)], "leaves out layer(s) [0]"),
        (["--resume", str(tmp_path / "none.pt"), "--out", str(tmp_path / "o")], "no checkpoint"),
        (["--num_classes", "5"], "--num_classes 10"),
        (["--batch", "1000"], "larger than the training set"),
        (["--trace", str(tmp_path / "no" / "dir" / "t.json")], "does not exist"),
        (["--foo", "1"], "unknown option"),
    ]
    for argv, words in cases:
        rc, out, err = _run_main(capsys, argv + ["--progress", "off"])
        assert rc == 2, (argv, out, err)
        assert words in err and "Traceback" not in err and "step 1/" not in out + err, (argv, err)


def test_help_and_lists(capsys):
    assert _run_main(capsys, ["--help"])[:2][0] == 0
    rc, out, _ = _run_main(capsys, ["--list-models"])
    assert rc == 0 and "resnet152" in out and "digits_cnn" in out
    rc, out, _ = _run_main(capsys, ["--print-config", "--config", "googlenet"])
    assert rc == 0 and 'name = "googlenet"' in out and "batch = 64" in out and "step 1/" not in out


def test_cli_subprocess_clean_error():
    p = subprocess.run([sys.executable, "-m", "cgdp.train", "--steps", "ten"], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.strip() == "cgdp.train: error: --steps expects an integer, got 'ten'"


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()
