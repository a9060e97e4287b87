"""Crafted checkpoints: a valid checksum around hostile or mismatched content.

A proper run saves a checkpoint at step 2; each case changes one thing in it (a key removed or
added, a tensor of another shape or dtype, a value of another type or out of range, a container
cut short or grown, a NaN, the header's step), writes it back with a correct checksum, and
resumes. Every case must end in one of two ways: a one-line error with exit code 2 before
anything is written, or a resume bitwise equal to the proper one (a change that means nothing for
the run, such as float32 weights stored exactly as float64). Cases are generated from the
checkpoint's own structure, in a fixed order with a fixed seed, so the suite runs the same ones
every time; most are refused in milliseconds, before any trainer is built.
"""
from __future__ import annotations

import io
import random
import shutil

import pytest
import torch

from cgdp.cli import checkpoint
from cgdp.cli.train import main

RUN = ["--steps", "4", "--progress", "off", "--plots", "false", "--profile_every", "0", "--batch", "16"]
RESUME = ["--resume", "--stop_after", "1"]  # one step, whatever length a crafted config claims
CASES = 300


def _walk(obj, path=()):
    """(path, value) of every container and leaf; long tuples (a generator state) are leaves."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, path + (k,))
    elif isinstance(obj, (list, tuple)) and len(obj) <= 16:
        for i, v in enumerate(obj):
            yield from _walk(v, path + (i,))


def _set(obj, path, value):
    """A copy of ``obj`` with the value at ``path`` replaced (or deleted when value is _DELETE)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        out = dict(obj)
        if rest or value is not _DELETE:
            out[head] = _set(obj[head], rest, value)
        else:
            del out[head]
        return out
    items = list(obj)
    items[head] = _set(obj[head], rest, value)
    return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)


_DELETE = object()


def _variants(v):
    """(name, new value) for one value, by its kind."""
    if isinstance(v, torch.Tensor):
        out = [("as list", v.tolist()), ("None", None), ("empty", v.new_empty(0))]
        if v.dim() >= 1 and v.numel() > 1:
            out += [("flattened" if v.dim() > 1 else "cut", v.reshape(-1)[:-1] if v.dim() == 1 else v.reshape(-1)),
                    ("one more row", torch.cat([v, v[:1]]))]
        if v.dim() == 0:
            out.append(("with a dimension", v.reshape(1)))
        if v.is_floating_point():
            nan = v.clone()
            nan.view(-1)[0] = float("nan")
            out += [("float64 (exact)", v.double()), ("float16", v.half()), ("bfloat16", v.bfloat16()),
                    ("int64", v.long()), ("NaN", nan)]
        else:
            out += [("float32", v.float()), ("int32", v.int()) if v.dtype != torch.int32 else ("int64", v.long())]
        return out
    if isinstance(v, bool):
        return [("flipped", not v), ("int", int(v)), ("str", str(v))]
    if isinstance(v, int):
        return [("+1", v + 1), ("-1", v - 1), ("negative", -7), ("huge", 2 ** 62), ("float", float(v)),
                ("bool", True), ("str", str(v)), ("None", None)]
    if isinstance(v, float):
        return [("nan", float("nan")), ("inf", float("inf")), ("-1", -1.0), ("x2", v * 2 + 1e-3), ("int", int(v)),
                ("str", str(v)), ("None", None)]
    if isinstance(v, str):
        return [("empty", ""), ("other", v + "x"), ("int", 3), ("None", None)]
    if v is None:
        return [("0", 0), ("str", "x"), ("list", []), ("dict", {})]
    if isinstance(v, dict):
        return [("extra key", {**v, "extra": 1}), ("empty", {}), ("list", list(v.values()))]
    if isinstance(v, (list, tuple)):
        out = [("empty", type(v)()), ("dict", dict(enumerate(v)))]
        if len(v):
            out += [("one less", type(v)(list(v)[:-1])), ("one more", type(v)(list(v) + [list(v)[-1]])),
                    ("as " + ("tuple" if isinstance(v, list) else "list"),
                     tuple(v) if isinstance(v, list) else list(v))]
        return out
    return [("None", None)]


def cases(state):
    out = []
    for path, v in _walk(state):
        where = "/".join(map(str, path)) or "(top)"
        if path and isinstance(path[-1], str):
            out.append((f"{where}: deleted", path, _DELETE))
        for name, new in _variants(v):
            out.append((f"{where}: {name}", path, new))
    return out


def spread(every, n):
    """About ``n`` cases, as many from each part of the checkpoint (the first three keys of the
    path: a tuner's long history must not crowd out the model and optimizer), in a fixed order."""
    groups: dict = {}
    for case in every:
        groups.setdefault(tuple(map(str, case[1][:3])), []).append(case)
    rng = random.Random(19)
    for g in groups.values():
        rng.shuffle(g)
    cap = 1
    while sum(min(len(g), cap + 1) for g in groups.values()) <= n:
        cap += 1
    return [case for g in groups.values() for case in g[:cap]]


@pytest.fixture(scope="module")
def proper(tmp_path_factory):
    """A run stopped at step 2 (its directory), and the final trainer state of its proper resume."""
    base = tmp_path_factory.mktemp("proper")
    assert main([*RUN, "--out", str(base / "run"), "--stop_after", "2"]) == 0
    ref = base / "ref"
    shutil.copytree(base / "run", ref)
    assert main([*RUN, "--out", str(ref), *RESUME]) == 0
    return base / "run", checkpoint.load(ref / "checkpoint.pt")["trainer"]


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_crafted_checkpoints_are_refused_or_resume_exactly(proper, tmp_path, capsys):
    run, want = proper
    raw = (run / "checkpoint.pt").read_bytes()
    state, meta = checkpoint.load_with_meta(run / "checkpoint.pt")
    chosen = spread(cases(state), CASES)
    chosen += [("header: step + 1", "meta", {"step": meta["step"] + 1}), ("header: no step", "meta", {}),
               ("unchanged", (), state)]
    outcomes = {"refused": 0, "resumed": 0}
    bad = []
    for i, (name, path, new) in enumerate(chosen):
        out = tmp_path / f"c{i}"
        out.mkdir()
        shutil.copy(run / "metrics.jsonl", out / "metrics.jsonl")
        if path == "meta":
            crafted, head = state, new
        else:
            crafted, head = _set(state, path, new), meta
        buf = io.BytesIO()
        torch.save(crafted, buf)
        (out / "checkpoint.pt").write_bytes(checkpoint.encode(buf.getvalue(), head) + buf.getvalue())
        before = (out / "metrics.jsonl").read_bytes()
        try:
            rc = main([*RUN, "--out", str(out), *RESUME])
        except BaseException as e:  # noqa: BLE001 - a traceback is the failure this test looks for
            bad.append(f"{name}: raised {type(e).__name__}: {e}")
            continue
        finally:
            cap = capsys.readouterr()
        err = [line for line in cap.err.splitlines() if line.strip()]
        if rc == 2:
            outcomes["refused"] += 1
            if len(err) != 1 or not err[0].startswith("cgdp.train: error: ") or "Traceback" in cap.err:
                bad.append(f"{name}: exit 2 but not one line: {cap.err[-500:]!r}")
            elif (out / "metrics.jsonl").read_bytes() != before or (out / "config.toml").exists():
                bad.append(f"{name}: refused after writing to --out")
        elif rc == 0:
            outcomes["resumed"] += 1
            got = checkpoint.load(out / "checkpoint.pt")["trainer"]
            if not (_equal(got["model"], want["model"]) and _equal(got["optimizer"]["state"],
                                                                   want["optimizer"]["state"])):
                bad.append(f"{name}: resumed to other parameters than the proper resume")
        else:
            bad.append(f"{name}: exit code {rc}: {cap.err[-300:]!r}")
        shutil.rmtree(out)
    print(outcomes)
    assert not bad, f"{len(bad)} of {len(chosen)} crafted checkpoints:\n" + "\n".join(bad)
    assert len(chosen) >= 200 and outcomes["refused"] >= 150 and outcomes["resumed"] >= 1, outcomes
    assert raw == (run / "checkpoint.pt").read_bytes()
