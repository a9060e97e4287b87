"""Testing aids that run cgdp's real device code without the device: users never train on them.

May import ``cgdp.engine`` (the CUDA backend's runtime hook). ``cuda_sim``: :func:`simulated_cuda`
(an asynchronous runtime strict enough to check results); ``null_cuda``: :func:`null_cuda` (every
CUDA call a no-op, to count and time cgdp's own host work).
"""
from cgdp.testing.cuda_sim import SimulatedCuda, simulated_cuda
from cgdp.testing.null_cuda import NullCuda, null_cuda

__all__ = ["simulated_cuda", "SimulatedCuda", "null_cuda", "NullCuda"]
