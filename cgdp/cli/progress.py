"""Training progress on the console: a bar on a terminal, plain lines everywhere else.

``Progress.update`` is called once per step from the training loop; it does no work beyond a
time check unless something is printed (a bar at most ten times a second; a line every ~5 % of
the run or every 10 s, whichever comes first), so it costs nothing next to a step. The ETA is the
remaining steps times the mean step time of this run so far.
"""
from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO


def _hms(seconds: float) -> str:
    s = int(max(seconds, 0) + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    def __init__(self, total: int, start: int = 0, mode: str = "auto", stream: TextIO | None = None):
        self.stream = stream if stream is not None else sys.stderr
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "lines"
        self.mode, self.total, self.start = mode, total, start
        self.t0 = time.perf_counter()
        self._last_print = 0.0
        self._every = max(1, (total - start) // 20)
        self._drawn = False

    def line(self, step: int, loss: float, samples_per_s: float) -> str:
        done = step - self.start
        eta = (time.perf_counter() - self.t0) / done * (self.total - step) if done else 0.0
        return (f"step {step}/{self.total}  loss {loss:.4f}  {samples_per_s:,.0f} samples/s  "
                f"ETA {_hms(eta)}")

    def update(self, step: int, loss: float, samples_per_s: float) -> None:
        if self.mode == "off":
            return
        now = time.perf_counter()
        last = step == self.total
        if self.mode == "bar":
            if now - self._last_print < 0.1 and not last:
                return
            width = shutil.get_terminal_size((80, 20)).columns
            text = self.line(step, loss, samples_per_s)
            bar_w = max(width - len(text) - 4, 10)
            filled = int(bar_w * step / max(self.total, 1))
            self.stream.write(f"\r[{'#' * filled}{'.' * (bar_w - filled)}] {text}"[:width - 1])
            self._drawn = True
        else:
            if not (last or step == self.start + 1 or (step - self.start) % self._every == 0
                    or now - self._last_print >= 10.0):
                return
            self.stream.write(self.line(step, loss, samples_per_s) + "\n")
        self.stream.flush()
        self._last_print = now

    def note(self, text: str) -> None:
        """Print a message (an eval result) without breaking the bar."""
        if self.mode == "off":
            return
        if self._drawn:
            self.stream.write("\n")
            self._drawn = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
