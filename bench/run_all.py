"""Run every CPU benchmark and write the results pages, in one command.

    python bench/run_all.py            # full runs (about two minutes on 2 cores: 2 min 05 s in one run) → bench/results/*.md
    python bench/run_all.py --quick    # seconds; used by tests/test_bench_smoke.py

Writes ``accumulate.md`` (bench_accumulate.py), ``engine.md`` (bench_engine.py) and ``cpu.md``
(both, with the machine, the versions, every command and the targets) into ``--results``
(default bench/results/), plus the raw figures as json next to them. Each benchmark runs in its
own process (thread settings such as NUMBA_NUM_THREADS are per process) and checks its answers
before it times anything; a failed check fails this command.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from common import command_line, machine, machine_md  # noqa: E402


def run(args: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    print("+ python " + " ".join(os.path.relpath(a, ROOT) if a.startswith(ROOT) else a for a in args),
          flush=True)
    subprocess.run([sys.executable, *args], check=True, cwd=ROOT, env={**os.environ, **(env or {})})
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, a few rounds (smoke test)")
    ap.add_argument("--results", default=os.path.join(HERE, "results"), help="folder for the pages")
    args = ap.parse_args(argv)
    out = os.path.abspath(args.results)
    os.makedirs(out, exist_ok=True)
    q = ["--quick"] if args.quick else []
    cmd = command_line()
    info = machine()
    secs = {}
    secs["accumulate"] = run([os.path.join(HERE, "bench_accumulate.py"), *q,
                              "--md", os.path.join(out, "accumulate.md"),
                              "--json", os.path.join(out, "accumulate.json")])
    eng = [os.path.join(HERE, "bench_engine.py"), *q]
    if args.quick:
        eng += ["--models", "mlp", "--rounds", "1", "--steps", "2"]
    secs["engine"] = run([*eng, "--md", os.path.join(out, "engine.md"),
                          "--json", os.path.join(out, "engine.json")])
    parts = ["accumulate.md", "engine.md"]

    lines = ["# cgdp on this CPU machine (emulated devices)", "",
             f"Command: `{cmd}` (runs each benchmark below in its own process; {', '.join(f'{k} {v:.0f} s' for k, v in secs.items())}).",
             "", "Machine:", machine_md(info), "",
             "No GPU here: the devices are CPU-emulated (`cpu:0`, `cpu:1`); every copy is a real memory copy. "
             "The GPU measurements are in bench/gpu_all.py (see gpu_README.md).", "",
             "Other jobs share this machine, so each page compares its contenders in interleaved rounds "
             "of the same run: read the ratios; the absolute figures move with the load.", ""]
    for name in parts:
        with open(os.path.join(out, name)) as f:
            lines += [f.read().replace("\n## ", "\n### ").replace("## ", "### ", 1), ""]
    with open(os.path.join(out, "cpu.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(out, "run_all.json"), "w") as f:
        json.dump({"command": cmd, "machine": info, "seconds": secs}, f, indent=1)
    print(f"wrote {os.path.join(out, 'cpu.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
