"""``python -m cgdp.gloo_check``: the gloo network check (it lives in :mod:`cgdp.cli.mpi_check`)."""
import sys

from cgdp.cli.mpi_check import main

if __name__ == "__main__":
    sys.exit(main(backend="gloo"))
