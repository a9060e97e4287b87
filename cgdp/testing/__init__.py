"""Testing aids that run cgdp's real device code without the device: users never train on them.

May import ``cgdp.engine`` (the CUDA backend's runtime hook). ``cuda_sim``: :func:`simulated_cuda`,
the strict simulated CUDA runtime beneath ``TorchCuda`` (``fake_cuda``: its ``torch.cuda``;
``page_locked``: its registered host memory and CUDA-library calls); ``side_stream``:
:class:`SideStream`, a model part on a stream of its own; ``stream_check``: the stream-ordering
checker the simulator and the first GPU run share. ``null_cuda``: :func:`null_cuda`, a runtime
object whose every CUDA call is a no-op, to count and time cgdp's own host work. ``netns``
(imported only when used): hosts emulated by network namespaces, and MPI jobs across them.
``inside``: :func:`inside`, the one documented look inside an engine that tests may take.
"""
from cgdp.testing.cuda_sim import SimulatedCuda, simulated_cuda
from cgdp.testing.inside import Inside, inside
from cgdp.testing.null_cuda import NullCuda, null_cuda
from cgdp.testing.side_stream import SideStream

__all__ = ["simulated_cuda", "SimulatedCuda", "SideStream", "null_cuda", "NullCuda", "inside", "Inside"]
