"""``python -m cgdp.train`` where one rank gets extra arguments: ``cli_per_rank.py RANK "EXTRA" ARGS...``.

The rank comes from the launcher's environment (MPI is not initialised here: the CLI must do
that itself, before anything can fail), so the bad rank fails exactly where a typo would."""
import os
import sys

from cgdp.cli.train import main

rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
who, extra, args = int(sys.argv[1]), sys.argv[2].split(), sys.argv[3:]
code = main(args + (extra if rank == who else []))
print(f"rank {rank} exit {code}", flush=True)
sys.exit(code)
