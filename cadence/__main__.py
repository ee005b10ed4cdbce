"""``python -m cadence``: the ``cadence`` command line."""

import sys

from cadence.cli import main

if __name__ == "__main__":
    sys.exit(main())
