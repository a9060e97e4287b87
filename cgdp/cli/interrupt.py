"""Ctrl-C during ``python -m cgdp.train``: the first stops the run cleanly, a second at once.

:class:`GracefulStop` replaces the SIGINT handler of the main thread for the length of the loop;
the loop checks ``requested`` after every step. What the first Ctrl-C promises depends on the run:
with ``--out`` the step is finished and a checkpoint saved; without one there is nothing to save,
and the message says so instead of promising a checkpoint.
"""
from __future__ import annotations

import signal
import sys
import threading


class GracefulStop:
    """Ctrl-C in a one-process run: the first finishes the current step, saves a checkpoint (when the
    run has an ``--out``) and stops; a second raises ``KeyboardInterrupt`` at once. (With MPI every
    rank would have to stop at the same step, so there Ctrl-C keeps its default meaning.)"""

    def __init__(self, enabled: bool, saves: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.saves = saves
        self.requested = False

    def __enter__(self) -> "GracefulStop":
        if self.enabled:
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        then = ("saving a checkpoint" if self.saves else
                "nothing is saved: this run has no --out")
        print(f"\ninterrupted: stopping after this step, {then} (Ctrl-C again to stop at once)",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            signal.signal(signal.SIGINT, self._old)
