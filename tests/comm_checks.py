"""Checks of a comm's blocking collectives, shared by the MPI and gloo scripts (every rank calls)."""
import numpy as np


def check_small_collectives(comm) -> None:
    """allreduce_small, broadcast_object and check_same (which must name the rank that differs)."""
    rank, size = comm.rank, comm.size
    assert comm.allreduce_small(np.array([rank + 1.0, 5.0])).tolist() == [size * (size + 1) / 2, 5.0 * size]
    assert comm.broadcast_object({"plan": [[1], [0]]} if rank == 0 else None) == {"plan": [[1], [0]]}
    comm.check_same({"layers": "fc1:10;fc2:3", "devices_per_rank": "2"})
    try:
        comm.check_same({"layers": "fc1:10;fc2:3", "devices_per_rank": str(2 + rank)})
        raise AssertionError("check_same accepted different signatures")
    except RuntimeError as exc:
        assert "rank 1" in str(exc) and "devices_per_rank" in str(exc), exc
