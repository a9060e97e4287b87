"""cgdp: CPU-GPU data parallel training for PyTorch.

Gradients stream to host memory during backward, host threads average them across devices and
send them back while the devices keep computing, and every device updates its own replica.
See README.md and the modules, which follow the data path: ``hooks`` → ``chunks``/``flatgrad`` →
``backend`` (streams) → ``host`` (slots, ``accumulate``, copy back) → ``trainer`` (update).
"""
from cgdp.accumulate import accumulate
from cgdp.chunks import paper_plan
from cgdp.costmodel import cgdp_backward_time, typical_backward_time
from cgdp.trainer import NonFiniteGradientError, Trainer
from cgdp.tuner import PaperChunkSearch

__all__ = ["Trainer", "accumulate", "paper_plan", "PaperChunkSearch", "cgdp_backward_time",
           "typical_backward_time", "NonFiniteGradientError"]
__version__ = "0.1.0"
