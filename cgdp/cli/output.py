"""The files a run writes in ``--out`` besides its checkpoint, and what a full disk does to them.

:func:`used_out` says why a new run may not write in an ``--out`` that holds an earlier run's files
(or a ``model.pt`` of the user's own), before anything there is changed.

``metrics.jsonl`` (:class:`Metrics`) is appended to, one JSON line per event, flushed as written:
a line cut by a crash or a full disk is left on a line of its own, and the resumed run starts on
the next one (:func:`resume_row` names the lines it supersedes). ``config.toml`` and
``summary.md`` are replaced atomically (:func:`write_text`: a temporary file in the same
directory, fsynced, renamed over the old one), so a full disk leaves the previous file whole.

Every write that fails (ENOSPC, EDQUOT, EFBIG, EROFS, EACCES...) is an :class:`OutputError`:
one line naming the file, what happened and what is intact (``python -m cgdp.train`` exits with
2), never a traceback. Nothing written before is lost: earlier metrics lines stay, the last
checkpoint stays (:mod:`cgdp.cli.checkpoint` writes it the same atomic way).
"""
from __future__ import annotations

import errno
import json
import math
import os
import pathlib
import tempfile
from typing import Any

METRICS = "metrics.jsonl"
RUN_FILES = ("checkpoint.pt", METRICS)
"""Files whose presence marks ``--out`` as holding a run (refused without --resume or --overwrite)."""
MODEL_FILE = "model.pt"
"""The trained model's state_dict, written at the end of a run with --out (``torch.load`` reads it);
one found alone in ``--out`` is refused without --overwrite too."""


class OutputError(RuntimeError):
    """A result file could not be written; the message says what is intact and what to do."""


def used_out(out: pathlib.Path) -> str | None:
    """Why a new run (no --resume, no --overwrite) may not write in ``out``, or None."""
    held = [f for f in RUN_FILES if (out / f).exists()]
    if held:
        go_on = (f"continue it with --out {out} --resume, " if "checkpoint.pt" in held else
                 "it has no checkpoint to continue from (it stopped before saving one); ")
        return (f"--out {out} already holds a run ({', '.join(held)}); {go_on}"
                f"choose a new --out, or pass --overwrite to replace it")
    model = out / MODEL_FILE
    if model.exists() or model.is_symlink():  # a user's own model, say a pretrained one
        return (f"--out {out} holds a {MODEL_FILE} but no run (no checkpoint.pt or metrics.jsonl), and this run "
                f"would replace it with its trained model at the end; choose a new --out, or pass --overwrite "
                f"to replace it")
    return None


def disk_error(e: OSError, path: pathlib.Path, kept: str) -> OutputError:
    """The one-line message for a failed write of ``path``; ``kept``: what is intact."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = f"the disk is full (no space left on the device of {path.parent})"
        fix = "free some space (or choose another --out)"
    elif e.errno == errno.ELOOP:  # opened with O_NOFOLLOW
        what = "it is a symbolic link, and cgdp.train does not write through links"
        fix = "remove the link (or choose another --out)"
    elif e.errno == errno.EFBIG:
        what = "the file would exceed the largest file this process may write (ulimit -f)"
        fix = "raise the limit (or choose another --out)"
    else:
        what = e.strerror or str(e)
        fix = "check that the directory is writable (or choose another --out)"
    return OutputError(f"cannot write {path}: {what}; {kept}. To continue, {fix}")


def write_text(path: pathlib.Path, text: str, kept: str) -> None:
    """Replace ``path`` with ``text`` atomically; :class:`OutputError` (the old file intact) if not."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            pathlib.Path(tmp).unlink(missing_ok=True)
        raise disk_error(e, path, kept) from None
    except BaseException:
        if tmp is not None:
            pathlib.Path(tmp).unlink(missing_ok=True)
        raise


class Metrics:
    """``metrics.jsonl``: one JSON object per line, flushed as written (NaN becomes null).
    ``kept()`` says what survives a failed write (set by the training loop: the last checkpoint)."""

    def __init__(self, out: pathlib.Path | None, append: bool):
        self.rows: list[dict] = []
        self.path = out / METRICS if out is not None else None
        self.kept = lambda: "the lines written before are intact"
        self.f = None
        if self.path is None:
            return
        try:
            cut = append and self.path.exists() and self.path.stat().st_size and not _ends_with_newline(self.path)
            flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
            # never through a link planted in --out: it would write (or empty) a file elsewhere
            self.f = os.fdopen(os.open(self.path, flags | getattr(os, "O_NOFOLLOW", 0), 0o644), "w")
            if cut:
                self.f.write("\n")  # a crash cut the last line: start on a line of our own
                self.f.flush()
        except OSError as e:
            self.close()
            raise disk_error(e, self.path, self.kept()) from None

    def write(self, row: dict) -> None:
        self.rows.append(row)
        if self.f is not None:
            try:
                self.f.write(json.dumps(_finite(row)) + "\n")
                self.f.flush()
            except OSError as e:
                self.close()
                raise disk_error(e, self.path, self.kept()) from None

    def close(self) -> None:
        f, self.f = self.f, None
        if f is not None:
            try:
                f.close()
            except OSError:  # the unflushed rest of a line that already failed
                pass

    def __enter__(self) -> "Metrics":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ends_with_newline(path: pathlib.Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _finite(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def read_rows(path: pathlib.Path) -> list[dict]:
    """The JSON objects of ``path`` (lines cut by a crash are skipped); [] if there is no file."""
    rows = []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return rows
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by the crash
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def resume_row(out: pathlib.Path | None, start: int) -> dict:
    """The metrics line that marks a resume: step lines after ``start`` already in the file were
    written by the run that crashed after its checkpoint, and are superseded by the lines below."""
    rows = read_rows(out / METRICS) if out is not None else []
    redone = [int(r["step"]) for r in rows if r.get("kind") == "step" and isinstance(r.get("step"), int)
              and r["step"] > start]
    note = f"resumed from the checkpoint at step {start}"
    if redone:
        note += (f"; the step lines {min(redone)}..{max(redone)} above were written after that checkpoint "
                 f"and are superseded by the lines below")
    return {"kind": "resume", "step": start, "superseded": [min(redone), max(redone)] if redone else None,
            "note": note}


def earlier_steps(path: pathlib.Path, start: int) -> list[dict]:
    """The step lines of the runs before a resume at ``start`` that still hold (each step's last
    line up to ``start``, superseded lines dropped): the first part of a resumed run's loss curve."""
    steps: dict[int, dict] = {}
    for r in read_rows(path):
        if r.get("kind") == "step" and isinstance(r.get("step"), int) and isinstance(r.get("loss"), (int, float)):
            steps[r["step"]] = r
    return [steps[k] for k in sorted(steps) if k <= start]
