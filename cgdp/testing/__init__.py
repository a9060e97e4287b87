"""Testing aids that run cgdp's real device code without the device: users never train on them.

May import ``cgdp.engine`` (the CUDA backend's runtime hook). ``cuda_sim``: :func:`simulated_cuda`,
the strict simulated CUDA runtime beneath ``TorchCuda`` (``fake_cuda``: its ``torch.cuda``), and
:class:`SideStream`, a model part on a stream of its own; ``stream_check``: the stream-ordering
checker the simulator and the first GPU run share.
"""
from cgdp.testing.cuda_sim import SideStream, SimulatedCuda, simulated_cuda

__all__ = ["simulated_cuda", "SimulatedCuda", "SideStream"]
