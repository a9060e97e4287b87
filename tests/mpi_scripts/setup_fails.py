"""A rank whose communicator set-up fails: it must end the job, not wait at exit.

``mpiexec -n 2 python setup_fails.py TIMEOUT``: rank 1 never builds its comm (as if its link were
cut during start-up) and sleeps 60 s; rank 0's ``MPIComm(timeout_s=TIMEOUT)`` raises
``TimeoutError`` while duplicating the communicator, and the error leaves the script. The job
must end within a few seconds of that (rank 0 aborts it), not when rank 1 wakes up, nor never
(``MPI_Finalize`` at exit with a set-up collective pending).
"""
import sys
import time

from mpi4py import MPI

from cgdp.comm.mpi import MPIComm

timeout_s = float(sys.argv[1])
if MPI.COMM_WORLD.rank == 1:
    time.sleep(60)
    sys.exit(0)
print(f"rank 0 builds its comm at {time.time():.3f}", flush=True)
MPIComm(timeout_s=timeout_s)
print("rank 0 built a comm alone: wrong", flush=True)
