"""``python -m cgdp.train``: the training command (it lives in :mod:`cgdp.cli.train`)."""
import sys

from cgdp.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
