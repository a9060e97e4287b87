"""The cost of sending a chunk from a gradient hook, at G = 4 and 8 devices.

For every chunk of every device: the time the hook spends sending it (the stream's per-device ``done``: Python under
the GIL, on the thread that runs backward: on a GPU this is autograd's device thread, where it
delays the next kernels' issue) and the delay from the hook to the start of the chunk's first
copy. Measured on CPU-emulated devices (the Python part of the path; the copy itself is a host
memcpy), median over all chunks of the timed steps. With ``--simulated``, on a simulated CUDA
runtime (cgdp.testing), so the CUDA backend's own ``send`` is timed, and the runtime calls it
makes per chunk and segment are counted. With ``--cuda``, G replicas on the real ``cuda:0``.

    PYTHONPATH=. python bench/send_overhead.py [--simulated | --cuda] [--devices 4,8]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import cgdp  # noqa: E402
from cgdp.engine.core import stream as stream_mod  # noqa: E402
from cgdp.testing import inside


def model(layers: int = 16, width: int = 256) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def measure(g: int, simulated: bool, steps: int, segment_bytes: int, cuda: bool = False) -> dict:
    calls: list[tuple[int, int, float, float]] = []
    real = stream_mod.GradientStream._chunk_done

    def timed_chunk_done(self, j, dev):  # what device j's hooks call on a complete chunk, timed
        done = real(self, j, dev)

        def timed(c):
            t0 = time.perf_counter()
            done(c)
            calls.append((j, c, t0, time.perf_counter()))
        return timed
    stream_mod.GradientStream._chunk_done = timed_chunk_done
    sim = None
    try:
        ctx = contextlib.nullcontext()
        if simulated:
            from cgdp.testing import simulated_cuda
            ctx = simulated_cuda(1, max_delay_s=0.0)
        with ctx as sim:
            shared = simulated or cuda
            devices = ["cuda:0"] * g if shared else [f"cpu:{i}" for i in range(g)]
            x, y = torch.randn(8 * g, 256), torch.randint(0, 256, (8 * g,))
            with cgdp.Trainer(model(), lambda p: torch.optim.SGD(p, lr=1e-3), devices, chunks=1,
                              segment_bytes=segment_bytes, **({"share_devices": True} if shared else {})) as tr:
                for _ in range(2):
                    tr.step(x, y, F.cross_entropy)
                in_send, delay = [], []
                before = dict(sim.counts) if sim else {}
                for _ in range(steps):
                    calls.clear()
                    tr.trace_next()
                    tr.step(x, y, F.cross_entropy)
                    starts: dict[tuple[str, str], float] = {}
                    for dev, stream, name, t_a, _ in tr._timing.events:  # host clock, absolute
                        if stream == "d2h":
                            key = (dev, name)
                            starts[key] = min(starts.get(key, float("inf")), t_a)
                    for j, c, a, b in calls:
                        in_send.append(b - a)
                        s = starts.get((devices[j], f"chunk {c}"))
                        if s is not None and not shared:  # (CUDA copies: device clock)
                            delay.append(s - a)
                lay = inside(tr).stream.layout
                counts = {k: (sim.counts[k] - before.get(k, 0)) / steps for k in sim.counts} if sim else {}
                return {"G": g, "chunks": len(lay.plan), "segments": len(lay.segments),
                        "in_send_us": 1e6 * statistics.median(in_send),
                        "hook_to_copy_us": 1e6 * statistics.median(delay) if delay else None,
                        "per_step_runtime_calls": counts}
    finally:
        stream_mod.GradientStream._chunk_done = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--simulated", action="store_true")
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--devices", default="4,8")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--segment-bytes", type=int, default=64 << 10)
    args = ap.parse_args()
    for g in (int(v) for v in args.devices.split(",")):
        r = measure(g, args.simulated, args.steps, args.segment_bytes, args.cuda)
        print(r, flush=True)


if __name__ == "__main__":
    main()
