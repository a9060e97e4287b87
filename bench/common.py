"""What every cgdp benchmark shares: the machine it ran on, interleaved timing, markdown tables.

Timing rule (SPEC "Measuring"): check the answer first, warm up, then time every variant of one
comparison in the same rounds, interleaved (round r runs A, B, C, ... once each), and report the
median over rounds. Other jobs share these machines; interleaving spreads their noise over all
variants alike, so the ratios between variants are what to read, not the absolute figures.
"""
from __future__ import annotations

import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from typing import Callable, Mapping, Sequence


def command_line() -> str:
    """The command that produced a figure, as a user would type it (from the repository root)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [os.path.relpath(a, root) if os.path.isabs(a) and a.startswith(root + os.sep) else a
            for a in sys.argv]
    return "python " + " ".join(shlex.quote(a) for a in argv)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, str]:
    """Machine and library versions, as they go in every results page."""
    import numba
    import numpy as np
    import psutil
    import torch
    info = {
        "cpu": f"{cpu_name()}, {psutil.cpu_count(logical=False)} cores / "
               f"{psutil.cpu_count()} threads",
        "memory": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "numba": f"{numba.__version__} (threading layer {_numba_layer()}, "
                 f"{numba.config.NUMBA_NUM_THREADS} threads)",
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    if torch.cuda.is_available():
        info["gpu"] = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        info["cuda"] = str(torch.version.cuda)
    else:
        info["gpu"] = "none (devices are CPU-emulated)"
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)), timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5,
                               cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        if rev:
            info["cgdp revision"] = rev + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def _numba_layer() -> str:
    import numba
    import numpy as np
    from numba import njit, prange

    @njit(parallel=True)
    def touch(a):  # the threading layer is only chosen at the first parallel launch
        for i in prange(a.shape[0]):
            a[i] += 1.0
    touch(np.zeros(4))
    try:
        return numba.threading_layer()
    except ValueError:
        return "unknown"


def machine_md(info: Mapping[str, str] | None = None) -> str:
    info = machine() if info is None else info
    return "\n".join(f"- {k}: {v}" for k, v in info.items())


def interleaved(fns: Mapping[str, Callable[[], object]], rounds: int, warmup: int = 2,
                budget_s: float | None = None) -> dict[str, list[float]]:
    """Seconds per call of every ``fns[name]``, measured in interleaved rounds after ``warmup``
    calls each. ``budget_s`` stops early (after at least 3 rounds) when the time is spent."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    t_start = time.perf_counter()
    for r in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        if budget_s is not None and r >= 2 and time.perf_counter() - t_start > budget_s:
            break
    return times


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(out)


def fmt(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None or x != x else f"{x:.{digits}f}"


def write_results(md: str, results: object, info: Mapping[str, str], cmd: str,
                  md_path: str | None, json_path: str | None) -> None:
    """The markdown page to ``md_path`` (printed if none) and the raw results to ``json_path``."""
    import json
    if md_path:
        with open(md_path, "w") as f:
            f.write(md)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"machine": info, "command": cmd, "results": results}, f, indent=1, default=str)
    if not md_path:
        print(md)
