"""The default job end to end: a real accuracy on the bundled digits after a short run, and the
files ``--out`` promises (metrics.jsonl with Table 3 phases and Table 4 chunks, config, summary)."""
from __future__ import annotations

import json
import tomllib

import pytest

from cgdp.cli.config import Config
from cgdp.cli.train import main

PHASES = ("forward_s", "backward_s", "exposed_comm_s", "update_s", "step_s")


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("default")
    # the embedded default job, shortened from 300 to 150 steps (~97 % there; 99.7 % at 300)
    rc = main(["--steps", "150", "--out", str(out), "--profile_every", "40", "--progress", "lines"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rc, out, rows


def test_default_job_reaches_real_accuracy(default_run):
    rc, _, rows = default_run
    assert rc == 0
    final = rows[-1]
    assert final["final"] is True and final["step"] == 150
    assert final["eval_accuracy"] >= 0.90, final  # 10 classes: chance is 0.1
    steps = [r for r in rows if r["kind"] == "step"]
    assert steps[-1]["loss"] < 0.5 * steps[0]["loss"]


def test_metrics_file_format(default_run):
    _, out, rows = default_run
    assert rows[0]["kind"] == "config" and rows[0]["devices"] == ["cpu:0", "cpu:1"]
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 151))
    for r in steps:
        assert r["loss"] > 0 and r["samples_per_s"] > 0 and all(r[k] >= 0 for k in PHASES)
        assert r["forward_s"] + r["backward_s"] <= r["step_s"] * 1.01
    profiles = [r for r in rows if r["kind"] == "profile"]
    assert [p["step"] for p in profiles] == [40, 80, 120]
    for p in profiles:
        layers = sorted(i for c in p["chunks"] for i in c["layers"])
        assert layers == list(range(4))  # digits_cnn: conv1, conv2, fc1, fc2
        assert all(c["d2h_s"] > 0 and c["acc_s"] > 0 and c["h2d_s"] > 0 for c in p["chunks"])
        assert sum(p["layer_bytes"]) == 38_282 * 4  # float32 gradients of every parameter
        assert sum(c["bytes"] for c in p["chunks"]) >= 38_282 * 4  # (chunks may be padded for alignment)
    resolved = tomllib.loads((out / "config.toml").read_text())
    assert Config.from_dict(resolved).to_dict() == rows[0]["config"]
    expected = Config().to_dict()
    expected["train"]["steps"], expected["run"]["out"] = 150, str(out)
    expected["run"]["profile_every"], expected["run"]["progress"] = 40, "lines"
    assert rows[0]["config"] == expected  # everything else is the default job
    summary = (out / "summary.md").read_text()
    assert "exposed comm. after backward" in summary and "accumulate (ms)" in summary
    assert (out / "checkpoint.pt").is_file()


def test_the_phase_columns_add_up_to_the_step(default_run):
    """Table 3's row: the four phases, "other" (said what it is) and "step", which they add up to."""
    _, out, _ = default_run
    summary = (out / "summary.md").read_text()
    head = "| forward | backward | exposed comm. after backward | update | other | step |"
    assert head in summary and "other: the rest of the step" in summary, summary
    row = summary.splitlines()[summary.splitlines().index(head) + 2]
    *parts, step = [float(v) for v in row.strip("|").split("|")]
    assert len(parts) == 5 and abs(sum(parts) - step) <= 0.003, row  # each figure rounded to 1 us


def test_without_out_the_run_says_that_nothing_was_saved(capsys):
    rc = main(["--steps", "2", "--progress", "off", "--plots", "false", "--profile_every", "0", "--chunks", "1"])
    printed = capsys.readouterr().out
    assert rc == 0 and "eval accuracy" in printed
    assert printed.splitlines()[-1] == ("nothing was saved (no --out): pass --out DIR to keep the trained model, a "
                                        "checkpoint to resume from, the metrics and the plots"), printed


def test_progress_lines_when_not_a_terminal(default_run, capsys):
    from io import StringIO

    from cgdp.cli.progress import Progress
    s = StringIO()
    p = Progress(100, mode="auto", stream=s)  # StringIO is not a tty: plain lines
    for i in range(1, 101):
        p.update(i, 0.5, 1000.0)
    p.close()
    lines = s.getvalue().splitlines()
    assert "\r" not in s.getvalue() and 5 <= len(lines) <= 22
    assert lines[-1].startswith("step 100/100  loss 0.5000  1,000 samples/s  ETA 0:00:00")

    class Tty(StringIO):
        def isatty(self):
            return True
    t = Tty()
    bar = Progress(10, mode="auto", stream=t)
    bar.update(10, 0.25, 50.0)
    bar.close()
    assert t.getvalue().startswith("\r[") and "#" in t.getvalue() and t.getvalue().endswith("\n")


def test_plots_are_optional(default_run, monkeypatch, tmp_path):
    import sys

    from cgdp.cli import report
    _, _, rows = default_run
    profile = next(r for r in rows if r["kind"] == "profile")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert "matplotlib is not installed" in report.write_plots(tmp_path, rows, profile)
    assert not (tmp_path / "summary.png").exists()
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    assert "written" in report.write_plots(tmp_path, rows, profile)
    assert (tmp_path / "summary.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("omp", [None, "3"])
def test_emulated_devices_share_the_cores_between_device_threads(monkeypatch, capsys, omp):
    """On CPU-emulated devices the command gives each device thread its share of the usable cores
    as torch's intra-op threads (every device thread ran a pool of all of them), restores the
    caller's setting at the end, and keeps OMP_NUM_THREADS when the user set it."""
    import torch
    import cgdp
    from cgdp.engine.core import threads as threads_mod
    if torch.cuda.is_available():
        pytest.skip("the choice is for CPU-emulated devices")
    monkeypatch.setattr(threads_mod, "usable_cores", lambda: 4)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    seen, real_step, before = [], cgdp.Trainer.step, torch.get_num_threads()

    def step(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_step(self, *args, **kwargs)
    monkeypatch.setattr(cgdp.Trainer, "step", step)
    assert main(["--steps", "2", "--chunks", "1", "--progress", "off", "--devices", "cpu:0,cpu:1"]) == 0
    capsys.readouterr()
    assert seen == ([2, 2] if omp is None else [before, before])
    assert torch.get_num_threads() == before
