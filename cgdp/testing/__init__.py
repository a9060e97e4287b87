"""Testing aids that run cgdp's real device code without the device: users never train on them.

May import ``cgdp.engine`` (the CUDA backend's runtime hook). ``cuda_sim``: :func:`simulated_cuda`.
``netns`` (imported only when used): hosts emulated by network namespaces, and MPI jobs across them.
"""
from cgdp.testing.cuda_sim import SimulatedCuda, simulated_cuda

__all__ = ["simulated_cuda", "SimulatedCuda"]
