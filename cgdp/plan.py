"""``python -m cgdp.plan``: the planning command (it lives in :mod:`cgdp.cli.plan`)."""
import sys

from cgdp.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
