"""cgdp: CPU-GPU data parallel training for PyTorch.

Gradients stream to host memory during backward, host threads average them across devices and
send them back while the devices keep computing, and every device updates its own replica.
The parts: :mod:`cgdp.engine` (the data path of a step, ``Trainer``), :mod:`cgdp.planning`
(chunk plans, cost model, simulator, tuners), :mod:`cgdp.comm` (MPI), :mod:`cgdp.cli` (the
``python -m cgdp.train`` and ``python -m cgdp.plan`` commands).
"""
from cgdp import testing
from cgdp.engine.core.accumulate import accumulate
from cgdp.engine.dataparallel.dataparallel import DataParallel
from cgdp.engine.trainer.trainer import NonFiniteGradientError, Trainer
from cgdp.planning.chunks import paper_plan
from cgdp.planning.costmodel import cgdp_backward_time, typical_backward_time
from cgdp.planning.tuner import PaperChunkSearch

__all__ = ["Trainer", "DataParallel", "accumulate", "paper_plan", "PaperChunkSearch", "cgdp_backward_time",
           "typical_backward_time", "NonFiniteGradientError"]
__version__ = "0.1.0"
