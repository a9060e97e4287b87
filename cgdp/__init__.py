"""cgdp: CPU-GPU data parallel training for PyTorch.

Gradients stream to host memory during backward, host threads average them across devices and
send them back while the devices keep computing, and every device updates its own replica.
The parts: :mod:`cgdp.engine` (the data path of a step, ``Trainer``), :mod:`cgdp.planning`
(chunk plans, cost model, simulator, tuners), :mod:`cgdp.comm` (MPI), :mod:`cgdp.cli` (the
``python -m cgdp.train`` and ``python -m cgdp.plan`` commands).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from cgdp import testing
from cgdp.engine.core.accumulate import accumulate
from cgdp.engine.dataparallel.dataparallel import DataParallel
from cgdp.engine.trainer.trainer import NonFiniteGradientError, Trainer
from cgdp.planning.chunks import paper_plan
from cgdp.planning.costmodel import cgdp_backward_time, typical_backward_time
from cgdp.planning.tuner import PaperChunkSearch



def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read the checkpoint of a ``python -m cgdp.train --out DIR`` run (``DIR/checkpoint.pt``, or
    ``DIR``): its SHA-256 is checked and nothing but tensors and plain data is loaded. Returns a dict
    with ``"model"`` (the model's ``state_dict``), ``"optimizer"``, ``"step"``, ``"config"`` (the
    resolved config) and the rest of what the run saved to resume; ``CheckpointError`` says what is
    wrong with a file that is not one. ``DIR/model.pt`` (the trained model alone) is a plain
    ``torch.save`` file: ``torch.load(path, weights_only=True)`` reads it."""
    from cgdp.cli.checkpoint import read  # the command's module: imported only when asked for
    return read(path)


__all__ = ["Trainer", "DataParallel", "accumulate", "paper_plan", "PaperChunkSearch", "cgdp_backward_time",
           "typical_backward_time", "NonFiniteGradientError", "load_checkpoint", "testing"]
__version__ = "0.2.0"

if TYPE_CHECKING:
    import os
    from typing import Any
